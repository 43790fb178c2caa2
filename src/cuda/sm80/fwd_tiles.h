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
//   d 32, 96: 128×64, 4 warps. 3 CTAs/SM (__launch_bounds__ min 3) spills at every d.
//   d 64:     128×128, 4 warps on sm_90a (flash-attention's hdim64 choice; O 64 + S 128 = 192
//             registers, so the register-tight mode, which keeps it spill-free), 128×64 on sm_80
//             (v3 code; 128×128 spilled 120-236 bytes there before the register-tight mode).
//             H100 80GB HBM3, bf16, standard grid, A/B in one call: non-causal +9–17% at every
//             s (s=16k 304.4 vs 280.6 TFLOP/s), causal +3–13% from s=1k, −4% at s=512.
//   d 128:    128×64, 4 warps on sm_90a (register-tight mode, fwd_kernel.cuh: row statistics in
//             shared memory, P rounded early, stepped K/V pointers), 128×32 on sm_80 (the same
//             code spills 8 bytes there). H100 80GB HBM3, bf16, standard grid, A/B in one call:
//             s=16k non-causal 341.8 TFLOP/s vs 277.3 for 128×32 (+23%; +20–25% at every s,
//             fp16 likewise), causal +4.6% at s=512 and +13–19% from s=1k; torch-flash in the
//             same call 350.0. Before: 128×32 272 vs 228 for 128×64 with 8 warps (16 rows each)
//             and 250 for 64×64 with 4 warps.
//   d 192/256: 128×64, 8 warps — 16 rows per warp, since 32 rows would need 256 O registers.
//             Tried at d 256 on the H100 (fwd_notes.md, v5), all slower or equal: 64×64 with
//             4 warps and 2 CTAs/SM (flash-attention's H100 choice; register-tight, else it
//             spills) −16 to −23%; 128×128×8 (8 bytes of spill) −8 to −15%; the
//             register-tight mode at 128×64×8 −1%; K/V double-buffered ±1%. On sm_90a d 256
//             runs this tile with the pipelined step (fwd_kernel.cuh; K/V double-buffered,
//             202 KB of shared memory): +7 to +12% over the plain step.
// A bucket may also have a short-walk tile (kFwdShortTiles), which the launcher takes under causal
// or windowed masks where query rows see few keys on average (fwd_launch.h):
//   d 256:    64×64, 4 warps, two CTAs per SM (flash-attention's H100 choice), register-tight,
//             rows' maxima moved lazily, the short epilogue. Against the pipelined 128×64 tile on
//             the H100 (A/B in one call, bf16, standard grid): causal s = 512 / 1k / 2k / 4k
//             +13 / +6 / +2.5 / −2%; non-causal −4 to −11% at every s. Short key walks leave
//             each CTA's start and end exposed at one CTA per SM; two CTAs cover each other's.
// Results behind these lines: bench/results/2026-11-2[67]-h100-*/fwd-*.json,
// src/cuda/sm80/fwd_notes.md.
#pragma once

#include <algorithm>
#include <cstdint>

#include "core/params.h"
#include "core/score_mod.h"

namespace flare::cuda::sm80 {

struct FwdTile {
  int head_dim;  // bucket
  int block_m;
  int block_n;
  int warps;
  int block_n_sm80;  // key step of the sm_80–sm_89 code (its register allocation differs)
};

inline constexpr FwdTile kFwdTiles[] = {
    {32, 128, 64, 4, 64},  {64, 128, 128, 4, 64}, {96, 128, 64, 4, 64},
    {128, 128, 64, 4, 32}, {192, 128, 64, 8, 64}, {256, 128, 64, 8, 64},
};

inline constexpr FwdTile kFwdShortTiles[] = {
    {256, 64, 64, 4, 64},
};

// The tile of a compiled bucket (kShort: its short-walk tile); {0, ...} when the bucket has none
// (a static_assert catches a missing primary tile; has_short_fwd_tile asks for the other).
constexpr FwdTile fwd_tile(int bucket, bool short_walk = false) {
  if (short_walk) {
    for (const FwdTile& t : kFwdShortTiles)
      if (t.head_dim == bucket) return t;
  } else {
    for (const FwdTile& t : kFwdTiles)
      if (t.head_dim == bucket) return t;
  }
  return {0, 0, 0, 0, 0};
}
constexpr bool has_short_fwd_tile(int bucket) { return fwd_tile(bucket, true).head_dim == bucket; }

// The mean number of keys a query row sees, from 16 rows spread over the (longest) sequence.
inline int mean_visible_keys(const AttentionParams& p) {
  if (p.seqlen_q <= 0) return 0;
  constexpr int kSamples = 16;
  int64_t sum = 0;
  for (int i = 0; i < kSamples; ++i) {
    const int row = static_cast<int>(int64_t{p.seqlen_q - 1} * i / (kSamples - 1));
    const KeyRange r = visible_keys(row, p.seqlen_q, p.seqlen_k, p.window_left, p.window_right);
    sum += std::max(0, r.hi - r.lo);
  }
  return static_cast<int>(sum / kSamples);
}

// Where rows see at most this many keys on average under a causal or windowed mask, a bucket's
// short-walk tile runs (H100, d 256: causal s = 2k, a mean of 1024 keys, +2.1%; s = 4k, 2048, −1
// to −2%).
inline constexpr int kShortWalkKeys = 1536;

// Whether a problem in a bucket with a short-walk tile takes it (masks with short key walks).
inline bool takes_short_fwd_tile(const AttentionParams& p) {
  return p.has_window() && mean_visible_keys(p) <= kShortWalkKeys;
}

}  // namespace flare::cuda::sm80
