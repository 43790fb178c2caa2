// fwd_tiles.h — tile sizes of the sm80 forward kernel, one row per compiled head-dim bucket.
//
// A head_dim d runs in the smallest bucket ≥ d (loads zero-fill the columns past d, stores mask
// them). Each row is (bucket, kBlockM queries per CTA, kBlockN keys per step, warps, the key step
// of the sm_80–sm_89 code). The warps split the kBlockM queries; each warp's rows reuse every K/V
// fragment it loads from shared memory, so 32 rows per warp (two m16 fragments) halve the
// shared-memory traffic per MMA compared with 16. The register file bounds the rest: O costs
// rows·d/32 fp32 registers per thread and S costs rows·kBlockN/32, under the 255 a thread may
// hold, and a tile is only admitted without spills (ptxas -v, sm_80 and sm_90a, both dtypes).
// The last column exists because ptxas allocates differently per arch: a tile that fits sm_90a
// may spill on sm_80, and the sm_80–sm_89 code then takes a shorter key step (same kBlockM and
// warps, so one launcher serves both; see FwdConfig).
//   d ≤ 96:   128×64, 4 warps. 128×128 (flash-attention's hdim64 choice) spills 120-236 bytes
//             here, and 3 CTAs/SM (__launch_bounds__ min 3) spills at every d.
//   d 128:    128×64, 4 warps on sm_90a (register-tight mode, fwd_kernel.cuh: row statistics in
//             shared memory, P rounded early, stepped K/V pointers), 128×32 on sm_80 (the same
//             code spills 8 bytes there). H100 80GB HBM3, bf16, standard grid, A/B in one call:
//             s=16k non-causal 341.8 TFLOP/s vs 277.3 for 128×32 (+23%; +20–25% at every s,
//             fp16 likewise), causal +4.6% at s=512 and +13–19% from s=1k; torch-flash in the
//             same call 350.0. Before: 128×32 272 vs 228 for 128×64 with 8 warps (16 rows each)
//             and 250 for 64×64 with 4 warps.
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
  int block_n_sm80;  // key step of the sm_80–sm_89 code (its register allocation differs)
};

inline constexpr FwdTile kFwdTiles[] = {
    {32, 128, 64, 4, 64},  {64, 128, 64, 4, 64},  {96, 128, 64, 4, 64},
    {128, 128, 64, 4, 32}, {192, 128, 64, 8, 64}, {256, 128, 64, 8, 64},
};

// The tile of a compiled bucket; {0, ...} when the bucket is missing (a static_assert catches it).
constexpr FwdTile fwd_tile(int bucket) {
  for (const FwdTile& t : kFwdTiles)
    if (t.head_dim == bucket) return t;
  return {0, 0, 0, 0, 0};
}

}  // namespace flare::cuda::sm80
