// fwd_tiles.h — tiles of the sm90 (Hopper) forward kernels and which problems they take.
//
// Host code without CUDA: the dispatch and the tests ask forward_supported() before choosing them.
// A head-dim bucket has a row for each kernel that runs it (fwd_kernel.cuh): the persistent
// kernel for calls of at most max_keys keys, one CTA per query tile beyond. A row gives
// kBlockM = 64 query rows per consumer warpgroup, kBlockN keys per step, the number of consumer
// warpgroups (one producer warpgroup beside them issues the TMA loads) and the K/V pipeline depth.
// O costs d/2 fp32 registers per consumer thread and S kBlockN/2, under the 240 (two consumers)
// or 160 (three) that setmaxnreg gives them.
//   d 64:        192×128, 3 consumers: O 32 + S 64 registers.
//   d 80 and 96: 128×128, 2 consumers (O 40 / 48 + S 64) in the persistent kernel; 192×128,
//                3 consumers beyond.
//   d 128:       128×128, 2 consumers: O 64 + S 64.
//   d 192:       128×64,  2 consumers (O 96 + S 32) in the persistent kernel; 128×96, 2 consumers,
//                overlapped (O 96 + S 48) beyond.
//   d 256:       128×64,  2 consumers: O 128 + S 32.
// Block masks (core/block_mask.h) are taken where the tile's rows lie in one mask row block
// (kMaskTileMultiple = 128 rows). A 192-row tile can span two, and the code to skip a step for
// one consumer warpgroup only cost the dense d 64 forward 12-18% on an H100 (A/B in one call), so
// block-sparse calls that would run a 192-row tile run the sm80 kernel.
#pragma once

#include <climits>
#include <cstdint>

#include "core/block_mask.h"
#include "core/params.h"
#include "cuda/sm90/layout_check.h"

namespace flare::cuda::sm90 {

struct Fwd90Tile {
  int head_dim;  // bucket
  // The row runs calls of at most this many keys; a bucket's rows go in increasing max_keys, the
  // last INT_MAX. Persistent kernel against one CTA per tile, A/B on an H200, standard grid
  // (bench/results/2026-11-28-h200-f10d319/fwd90-persistent-ab.txt): d 64 and 128 1.03-1.20x
  // faster up to s 2048, even at 4096, up to 8% slower at s 8k-16k causal; d 256 (one Q buffer)
  // 2-21% slower from s 1024.
  int max_keys;
  bool persistent;  // the persistent kernel's row, else one CTA per query tile
  int block_m;
  int block_n;
  int consumers;  // warpgroups of 64 query rows
  int stages;     // K/V buffers
  // A step's softmax overlaps the previous step's P·V inside each warpgroup (fwd_kernel.cuh,
  // attend_steps). Measured on an H200, standard grid: d 128 overlapped 1.05-1.13x faster than
  // its steps one after another (bench/results/2026-11-28-h200x2-431abf7/fwd90-steps-ab.txt);
  // with every bucket overlapped (bench/results/2026-11-28-h200x2-eadc8a9/fwd90-overlap-ab.txt)
  // d 64 1-6% slower (three consumer warpgroups at 160 registers, whose drift already hides the
  // softmax) and d 256 even but for 5% slower at s 16k.
  bool overlap_steps;
};

// Rows in increasing head_dim (fwd90_bucket takes the first bucket that holds a head dim). A/Bs
// on an H200 (sm90/notes.md, "Buckets 80, 96 and 192"):
//   d 80/96: 192×128 with three consumers against 128×128 with two
//     (bench/results/2026-11-28-h200x2-49e5679/fwd90-d80-ab.txt): 1.07-1.18x faster from s 4096,
//     0.84-0.87x at s 512-1024 causal, where 192-row tiles leave more of the diagonal masked and
//     fewer tiles to balance.
//   d 192: 128×64 ran 1.15-1.23x the 256 bucket; the same tile in the persistent kernel
//     1.01-1.10x faster to s 1024 (0.96x at 2048 causal), 128×96 overlapped 1.04-1.09x from
//     s 4096 and even at 2048 (bench/results/2026-11-28-h200-85e1344/fwd90-d192-ab.txt); the two
//     rows together 1.01-1.11x the one 128×64 row, every cell
//     (bench/results/2026-11-29-h200-985d7e8/fwd90-d192-rows-ab.txt).
//   d 64: a persistent 128×128 row, overlapped, ran 0.84-0.89x non-causal
//     (bench/results/2026-11-28-h200x2-f493527/fwd90-d64-persistent-128-ab.txt).
inline constexpr Fwd90Tile kFwd90Tiles[] = {
    {64, 2048, true, 192, 128, 3, 2, false},    {64, INT_MAX, false, 192, 128, 3, 2, false},
    {80, 2048, true, 128, 128, 2, 2, true},     {80, INT_MAX, false, 192, 128, 3, 2, false},
    {96, 2048, true, 128, 128, 2, 2, true},     {96, INT_MAX, false, 192, 128, 3, 2, false},
    {128, 2048, true, 128, 128, 2, 2, true},    {128, INT_MAX, false, 128, 128, 2, 2, true},
    {192, 1024, true, 128, 64, 2, 2, false},    {192, INT_MAX, false, 128, 96, 2, 2, true},
    {256, INT_MAX, false, 128, 64, 2, 2, false},
};

// The row of a bucket's persistent kernel (`persistent`) or of its one-CTA kernel; a zero row
// where the bucket has none.
constexpr Fwd90Tile fwd90_tile(int bucket, bool persistent) {
  for (const Fwd90Tile& t : kFwd90Tiles)
    if (t.head_dim == bucket && t.persistent == persistent) return t;
  return {0, 0, false, 0, 0, 0, 0, false};
}

// Whether a row takes block masks: its tile in one mask row block.
constexpr bool fwd90_takes_block_mask(const Fwd90Tile& tile) {
  return kMaskTileMultiple % tile.block_m == 0;
}

// The sm90 bucket of a head_dim: the narrowest in kFwd90Tiles that holds it, else 0 (the sm80
// kernel runs). Columns past head_dim are zero-filled by TMA and computed at the bucket's width:
// the narrowest head dim of a bucket pays most (d 104 at 128: 23% more tensor-core work than
// needed; d 136 at 192: 41%; d 40 at 64: 60%).
// Head dims up to 32 stay on sm80, whose 32-wide bucket wastes nothing. The backward's buckets:
// bwd_tiles.h.
constexpr int fwd90_bucket(int head_dim) {
  if (head_dim <= 32) return 0;
  for (const Fwd90Tile& t : kFwd90Tiles)
    if (head_dim <= t.head_dim) return t.head_dim;
  return 0;
}

// The row that runs p: the first of its bucket that takes p's key count, or the persistent
// kernel's for packed variable-length batches (it draws only the tiles that hold rows, in any
// mix of lengths) and with `force_persistent` (DispatchOverrides::forward_ctas), where the bucket
// has one. A zero row for a head_dim no bucket holds.
inline Fwd90Tile fwd90_row(const AttentionParams& p, bool force_persistent = false) {
  const int bucket = fwd90_bucket(p.head_dim);
  if ((force_persistent || p.is_varlen()) && fwd90_tile(bucket, true).head_dim != 0)
    return fwd90_tile(bucket, true);
  if (p.is_varlen()) return {0, 0, false, 0, 0, 0, 0, false};
  for (const Fwd90Tile& t : kFwd90Tiles)
    if (t.head_dim == bucket && p.seqlen_k <= t.max_keys) return t;
  return {0, 0, false, 0, 0, 0, 0, false};
}

// Query tiles of a call (the persistent kernel's work, fwd_kernel.cuh's ForwardTiles): block_m
// rows of one head of one sequence each. Packed batches: at most ceil(len / block_m) per sequence
// and head, and Σ ceil(len_b / block_m) ≤ ceil(total_q / block_m) + batch, a bound the host knows
// without reading cu_seqlens (draws past the real count find no tile).
FLARE_HD int64_t fwd90_tile_count(const AttentionParams& p, int block_m) {
  int64_t per_head = (int64_t{p.seqlen_q} + block_m - 1) / block_m * p.batch;
  if (p.is_varlen()) {
    const int64_t bound = (p.total_q + block_m - 1) / block_m + p.batch;
    per_head = per_head < bound ? per_head : bound;
  }
  return per_head * p.heads_q;
}

// Whether the sm90 forward takes a problem (before asking the device): fixed-length batches with
// any causal or sliding-window mask, GQA/MQA and seqlen_q != seqlen_k, and packed
// variable-length batches (without a block mask) in the buckets with a persistent kernel (not
// d 193-256); softcap, ALiBi and dropout. TMA needs 16-byte aligned tensors and row, head and
// batch strides in whole 16-byte units (packed: rows of all sequences in one map, up to 2^31);
// the output is written in 16-byte chunks (head_dim a multiple of 8). Everything else runs the
// sm80 kernels. The tile is fwd90_row's.
inline bool forward_supported(const AttentionParams& p, bool force_persistent = false) {
  if (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16) return false;
  if (fwd90_bucket(p.head_dim) == 0 || p.head_dim % 8 != 0) return false;
  const Fwd90Tile tile = fwd90_row(p, force_persistent);
  if (tile.head_dim == 0) return false;
  if (!packed_batch_fits(p)) return false;
  if (p.batch > 65535 || p.seqlen_q <= 0 || p.seqlen_k <= 0) return false;
  // The persistent kernel numbers its tiles in int, and its counter runs a grid's width past the
  // last.
  if (fwd90_tile_count(p, tile.block_m) > INT_MAX / 2) return false;
  if (p.block_mask != nullptr && !fwd90_takes_block_mask(tile)) return false;
  if (!aligned16(p.q) || !aligned16(p.k) || !aligned16(p.v) || !aligned16(p.o)) return false;
  const TmaRows rows = tma_rows(p);
  return strides_fit_tma({{p.q_row_stride, rows.q},
                          {p.q_head_stride, p.heads_q},
                          {p.q_batch_stride, rows.batch},
                          {p.k_row_stride, rows.k},
                          {p.k_head_stride, p.heads_kv},
                          {p.k_batch_stride, rows.batch},
                          {p.v_row_stride, rows.k},
                          {p.v_head_stride, p.heads_kv},
                          {p.v_batch_stride, rows.batch},
                          {p.o_row_stride, rows.q},
                          {p.o_head_stride, p.heads_q},
                          {p.o_batch_stride, rows.batch}});
}

}  // namespace flare::cuda::sm90
