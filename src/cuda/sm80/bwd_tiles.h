// bwd_tiles.h — tile shapes of the sm80 backward kernel, one row per compiled head-dim bucket.
//
// The backward keeps one key/value block (kBlockN rows of K and V) resident per CTA and walks the
// query blocks (kBlockM rows of Q, dO) that can see it. Each of its three product groups splits
// the CTA's warps over its own output tile:
//   Sᵀ, dPᵀ (kBlockN keys × kBlockM queries)  s_keys keys × the rest of the queries per warp
//   dK, dV  (kBlockN keys × d)                kv_keys keys × the rest of the columns per warp
//   dQ      (kBlockM queries × d)             dq_rows queries × the rest of the columns per warp
// A warp tile of 32 rows rather than 16 reads each B fragment from shared memory once for two
// MMAs: on the H100, where mma.sync issues faster than ldmatrix can feed 16-row tiles, shared-
// memory reads per MMA set the pace (ldmatrix.x4 per 16 MMAs, d 128: Sᵀ/dPᵀ 12 → 8, dK/dV 9 → 6,
// dQ 10 → 8 going from 16- to 32-row warp tiles). The register budget is set by the dK and dV
// accumulators a CTA carries across the whole walk: 2 · kBlockN·d / threads fp32 values per
// thread: 32 (d 32), 64 (d 64), 96 (d 96, d 192) or 128 (d 128, d 256). Every forward bucket has a
// backward bucket of the same width, so no head dim computes on more than 31 zero columns.
//   d ≤ 32:  kBlockM 128, kBlockN 128, 8 warps; the skewed steps where the device allows (195 KiB;
//            H100, A/B in one call: +2 to +6% from s = 2k, −3% at s = 512 causal), else Q/dO
//            double-buffered (114 KiB); 64-byte rows in 4-chunk swizzle groups (as d 96).
//   d ≤ 64:  kBlockM 128, kBlockN 128, 8 warps, Q/dO double-buffered (160 KiB).
//   d ≤ 96:  kBlockM 64, kBlockN 128, 8 warps; where the device allows (sm_90 code) the skewed
//            steps as d 128 (185.5 KiB; H100, A/B in one call: +2.5 to +4.3% from s = 1k), else
//            Q/dO double-buffered (129 KiB). dQ warp tiles of 16 queries × 48 columns. 12 chunks
//            per row: 4-chunk swizzle groups, copies on 192 threads.
//   d ≤ 128: kBlockM 64, kBlockN 128, 8 warps. Where the device allows (sm_90 code, 225.5 KiB of
//            its 227 KiB): three Q/dO buffers and two P/dS buffers, the skewed steps of
//            bwd_kernel.cuh (one barrier per step, the warp halves a phase apart). Else Q/dO
//            double-buffered (160 KiB: inside the A100's 163 KiB opt-in limit only because the
//            tiles are swizzled, not padded).
//   d ≤ 192: kBlockM 64, kBlockN 64, 8 warps, Q/dO double-buffered (161 KiB, inside the A100's
//            163 KiB). 24 chunks per row: tile copies run on 192 of the 256 threads.
//   d ≤ 256: kBlockM 64, kBlockN 64, 8 warps, Q/dO double-buffered (208 KiB) where the device
//            allows it (sm_90: 227 KiB), else one buffer (144 KiB; the A100's 163 KiB), where
//            each step waits for its own copy.
// The shapes (block sizes and warp splits) are FlashAttention-2's sm80 launch choices.
#pragma once

namespace flare::cuda::sm80 {

struct BwdTile {
  int head_dim;  // bucket
  int block_m;   // queries per step
  int block_n;   // keys per CTA
  int warps;
  int stages;      // Q/dO buffers (2: the next query block loads during this one; 3: skewed steps)
  int min_stages;  // the fallback where `stages` exceed the device's shared memory
  int s_keys;      // keys of a warp's Sᵀ/dPᵀ tile (16 or 32)
  int kv_keys;     // keys of a warp's dK/dV tile (16 or 32)
  int dq_rows;     // queries of a warp's dQ tile (16 or 32)
};

inline constexpr BwdTile kBwdTiles[] = {
    {32, 128, 128, 8, 3, 2, 32, 32, 32},
    {64, 128, 128, 8, 2, 2, 32, 32, 32},
    {96, 64, 128, 8, 3, 2, 32, 32, 16},
    {128, 64, 128, 8, 3, 2, 32, 32, 32},
    {192, 64, 64, 8, 2, 2, 32, 32, 32},
    {256, 64, 64, 8, 2, 1, 32, 32, 32},
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
  return {0, 0, 0, 0, 0, 0, 0, 0, 0};
}

// Dynamic shared memory of the main kernel (2-byte elements): K and V (kBlockN, d); Q and dO
// (stages, kBlockM, d); P and dS (kBlockN, kBlockM), twice with three stages; per query row, LSE
// and D (stages, kBlockM).
constexpr int bwd_smem_bytes(int bucket, int stages) {
  const BwdTile t = bwd_tile(bucket);
  const int pds_buffers = stages == 3 ? 2 : 1;  // the skewed steps double P and dS
  return 2 * (2 * t.block_n * bucket + 2 * stages * t.block_m * bucket +
              pds_buffers * 2 * t.block_n * t.block_m) +
         4 * 2 * stages * t.block_m;
}

}  // namespace flare::cuda::sm80
