// decode_grid.h — the shape of the CUDA KV-cache decoding grid: the tile facts the kernels are
// built with (decode_kernel.cuh) and how many splits of the keys a call runs. Host code without
// CUDA, so the CPU tests can check the rules.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cuda/decode/decode_params.h"

namespace flare::cuda::decode {

// Head-dim buckets of the kernels: head_dim is zero-padded up to the bucket. 0: none fits.
constexpr int head_dim_bucket(int head_dim) {
  return head_dim <= 64 ? 64 : head_dim <= 128 ? 128 : head_dim <= 256 ? 256 : 0;
}
// Keys in one block a warp handles: 4 KiB of fp16/bf16 per K or V block (16 keys at least, one
// mma k-step of P·V), so that three CTAs fit on an SM up to head dim 128 (decode_kernel.cuh).
constexpr int keys_per_block(int bucket) { return 2048 / bucket > 16 ? 2048 / bucket : 16; }
// CTAs of the attention kernel one SM holds (shared memory and registers).
constexpr int ctas_per_sm(int bucket) { return bucket <= 128 ? 3 : 1; }
constexpr int kRowsPerTile = 16;  // packed query rows per CTA
constexpr int kWarpsPerCta = 4;   // each over every fourth key block of the CTA's range
constexpr int kMaxSplits = 128;

// Row tiles per (sequence, kv head): the s_q rows of each of the group's query heads, packed.
inline int64_t row_tiles(const DecodeParams& p) {
  return (static_cast<int64_t>(p.seqlen_q) * p.group + kRowsPerTile - 1) / kRowsPerTile;
}

// Splits of the key range. A call has (sequence · kv head) × row tiles CTAs before splitting, often
// far fewer than the SMs hold (b 1, 8 kv heads, one query row: 8 CTAs for 396 places on 132 SMs),
// so the keys are split. The splits of a call hold equal key ranges; its CTAs run in waves of
// `places` (SMs × CTAs per SM), a partial wave costing a whole one, and a CTA takes a fixed time
// plus one per key block its warps read. The fixed part (the Q tile, the first loads of the
// pipeline, the warps' combine, the writes and the merge's share) measured about six blocks a
// warp on an H200: split 3 ways, 128 sequences of 1024 keys at 8 kv heads ran 1.37x slower than
// unsplit (1024 CTAs in 2.6 waves), while 8 CTAs of 32k keys ran 1.3-1.4x faster in 48 splits (one
// wave) than in 50 (400 CTAs: a second wave). The count is the one of least modelled time, the
// fewest among equals, each split keeping 8+ key blocks (two a warp) of the longest sequence the
// cache holds. The caller's num_splits, when given, wins (at most kMaxSplits).
constexpr double kSplitFixedBlocks = 6.0;  // a CTA's fixed time, in key blocks per warp

inline int split_count(const DecodeParams& p, int sms) {
  if (p.num_splits > 0) return std::min(p.num_splits, kMaxSplits);
  const int bucket = head_dim_bucket(p.head_dim);
  const int64_t ctas = std::max<int64_t>(1, int64_t{p.batch} * p.heads_kv * row_tiles(p));
  const int64_t places = std::max<int64_t>(1, int64_t{ctas_per_sm(bucket)} * sms);
  const int64_t blocks = (p.capacity + keys_per_block(bucket) - 1) / keys_per_block(bucket);
  const int most = static_cast<int>(std::clamp<int64_t>(blocks / 8, 1, kMaxSplits));
  auto time = [&](int splits) {  // in key blocks per warp
    const int64_t waves = (ctas * splits + places - 1) / places;
    return static_cast<double>(waves) *
           (kSplitFixedBlocks + static_cast<double>(blocks) / (kWarpsPerCta * splits));
  };
  int best = 1;
  for (int s = 2; s <= most; ++s)
    if (time(s) < time(best)) best = s;
  return best;
}

}  // namespace flare::cuda::decode
