// bwd_tiles.h — tile shapes of the sm80 backward kernel, one row per compiled head-dim bucket.
//
// The backward keeps one key/value block (kBlockN rows of K and V) resident per CTA and walks the
// query blocks (kBlockM rows of Q, dO) that can see it. Its register budget is set by the two
// accumulators a CTA carries across the whole walk, dK and dV, kBlockN·d fp32 values each. The
// warps split them into 16-key groups × column slices:
//   col_splits = warps / (kBlockN / 16)   warps sharing one 16-key group, each owning d/col_splits
//                                         columns of its dK and dV rows
// so a thread holds 2 · 16·(d/col_splits)/32 accumulator registers: 64 (d 64), 128 (d 128),
// 128 (d 256 with col_splits 2). The same warp computes Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ for its 16 keys
// and kBlockM/col_splits queries, 32 queries (16 + 16 registers) at a time where d > 64.
//   d ≤ 64:  kBlockM 64, kBlockN 128, 8 warps — Q/dO double-buffered.
//   d ≤ 128: kBlockM 64, kBlockN 128, 8 warps — FlashAttention-2's sm80 hdim128 shape
//            (Flash_bwd_kernel_traits<128, 64, 128, 8, ...>); Q/dO double-buffered: 160 KiB of
//            shared memory, inside the A100's 163 KiB opt-in limit.
//   d ≤ 256: kBlockM 64, kBlockN 64, 8 warps, 2 column splits; one Q/dO buffer (144 KiB) so the
//            A100 can run it too.
// Shapes follow flash-attention 2.x's launch templates. Measured with them on an H100 80GB HBM3
// (bf16, b=2, s=8k, 2048 hidden): d 128 216 TFLOP/s (causal 195; PyTorch's flash backward 297 and
// 275 in the same run), d 64 188 (causal 173), d 256 169 (causal 173); other shapes not yet tried.
#pragma once

namespace flare::cuda::sm80 {

struct BwdTile {
  int head_dim;    // bucket
  int block_m;     // queries per step
  int block_n;     // keys per CTA
  int warps;
  int col_splits;  // warps sharing one 16-key group of dK/dV
  int stages;      // Q/dO buffers (2: the next query block loads during this one)
};

inline constexpr BwdTile kBwdTiles[] = {
    {64, 64, 128, 8, 1, 2},
    {128, 64, 128, 8, 1, 2},
    {256, 64, 64, 8, 2, 1},
};

// The bucket serving head_dim d, or 0 when d exceeds every bucket.
constexpr int bwd_head_dim_bucket(int d) {
  for (const BwdTile& t : kBwdTiles)
    if (d <= t.head_dim) return t.head_dim;
  return 0;
}

constexpr BwdTile bwd_tile(int bucket) {
  for (const BwdTile& t : kBwdTiles)
    if (t.head_dim == bucket) return t;
  return {0, 0, 0, 0, 0, 0};
}

// Dynamic shared memory of the main kernel (2-byte elements): K and V (kBlockN, d); Q and dO
// (stages, kBlockM, d); P and dS (kBlockN, kBlockM); per query row, LSE and D (stages, kBlockM).
constexpr int bwd_smem_bytes(int bucket) {
  const BwdTile t = bwd_tile(bucket);
  return 2 * (2 * t.block_n * bucket + 2 * t.stages * t.block_m * bucket +
              2 * t.block_n * t.block_m) +
         4 * 2 * t.stages * t.block_m;
}

}  // namespace flare::cuda::sm80
