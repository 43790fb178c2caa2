// fwd_tiles.h — tile sizes of the sm80 forward kernel, one row per compiled head-dim bucket.
//
// A head_dim d runs in the smallest bucket ≥ d (loads zero-fill the columns past d, stores mask
// them). Each row is (bucket, kBlockM queries per CTA, kBlockN keys per step, warps). The warps
// split the kBlockM queries; each warp's rows reuse every K/V fragment it loads from shared memory,
// so 32 rows per warp (two m16 fragments) halve the shared-memory traffic per MMA compared with
// 16. The register file bounds the rest: O costs rows·d/32 fp32 registers per thread and S costs
// rows·kBlockN/32, under the 255 a thread may hold, and a tile is only admitted without spills
// (ptxas -v, sm_80 and sm_90a, both dtypes).
//   d ≤ 96:   128×64, 4 warps. 128×128 (flash-attention's hdim64 choice) spills 120-236 bytes
//             here, and 3 CTAs/SM (__launch_bounds__ min 3) spills at every d.
//   d 128:    128×32, 4 warps. Measured on H100 80GB HBM3, bf16, standard grid, d=128:
//             272 TFLOP/s at s=16k non-causal vs 228 for 128×64 with 8 warps (16 rows each) and
//             250 for 64×64 with 4 warps; 128×64 with 4 warps spills (O 128 + S 64 registers).
//   d 192/256: 128×64, 8 warps — 16 rows per warp, since 32 rows would need 256 O registers;
//             bound by ldmatrix traffic (0.56 ldmatrix.x4 per MMA).
// Results behind these lines: bench/results/2026-11-26-h100-fwd-*.json, src/cuda/sm80/fwd_notes.md.
#pragma once

namespace flare::cuda::sm80 {

struct FwdTile {
  int head_dim;  // bucket
  int block_m;
  int block_n;
  int warps;
};

inline constexpr FwdTile kFwdTiles[] = {
    {32, 128, 64, 4},  {64, 128, 64, 4},  {96, 128, 64, 4},
    {128, 128, 32, 4}, {192, 128, 64, 8}, {256, 128, 64, 8},
};

// The tile of a compiled bucket; {0, ...} when the bucket is missing (a static_assert catches it).
constexpr FwdTile fwd_tile(int bucket) {
  for (const FwdTile& t : kFwdTiles)
    if (t.head_dim == bucket) return t;
  return {0, 0, 0, 0};
}

}  // namespace flare::cuda::sm80
