// block_mask.h — how a backend reads the block mask of block-sparse attention.
//
// Written once for host and device, like score_mod.h, so every backend agrees on which blocks
// are on. A (row, key) pair is visible iff its block is on here AND visible_keys() keeps it.
// Rows and keys count from the start of their own sequence (varlen included).
#pragma once

#include <cstdint>

#include "core/host_device.h"
#include "core/params.h"

namespace flare {

// Whether mask block (row_block, col_block) of sequence b, query head h is on; always true for
// dense attention.
FLARE_HD bool block_on(const AttentionParams& p, int b, int h, int row_block, int col_block) {
  if (p.block_mask == nullptr) return true;
  const int64_t at = b * p.mask_batch_stride + h * p.mask_head_stride +
                     row_block * p.mask_row_stride + col_block * p.mask_col_stride;
  return p.block_mask_int32 ? static_cast<const int32_t*>(p.block_mask)[at] != 0
                            : static_cast<const uint8_t*>(p.block_mask)[at] != 0;
}

// Whether query row i may meet key j as far as the block mask is concerned.
FLARE_HD bool block_allows(const AttentionParams& p, int b, int h, int i, int j) {
  return p.block_mask == nullptr || block_on(p, b, h, i / p.block_m, j / p.block_n);
}

// ---- tile walks of the CUDA kernels ----------------------------------------------------------
// A kernel tile lies inside one mask block when its size divides the block's (the CUDA kernels
// take block_m and block_n multiples of kMaskTileMultiple, which every kernel tile divides), so a
// tile is wholly on or wholly off and an off tile is skipped without reading its K/V or Q/dO.
// These walks return the next tile that is on; for dense attention every tile is.

// Block sizes the CUDA kernels take: multiples of this (their tiles are 32–192 rows, 32–128 keys).
inline constexpr int kMaskTileMultiple = 128;

// The first key tile n' in [n, n_end) (tiles of tile_n keys from the sequence start) that is on
// for some mask row block in [row_block_lo, row_block_hi], or n_end. Reads one mask entry per
// block passed, not per tile.
FLARE_HD int next_key_tile_on(const AttentionParams& p, int b, int h, int row_block_lo,
                              int row_block_hi, int n, int n_end, int tile_n) {
  if (p.block_mask == nullptr) return n;
  const int per_block = p.block_n / tile_n;
  for (; n < n_end; n = (n / per_block + 1) * per_block)
    for (int r = row_block_lo; r <= row_block_hi; ++r)
      if (block_on(p, b, h, r, n / per_block)) return n;
  return n_end;
}

// The first query tile m' in [m, m_end) (tiles of tile_m rows from the sequence start) that is on
// for mask column block col_block of query head h, or m_end.
FLARE_HD int next_query_tile_on(const AttentionParams& p, int b, int h, int col_block, int m,
                                int m_end, int tile_m) {
  if (p.block_mask == nullptr) return m;
  const int per_block = p.block_m / tile_m;
  for (; m < m_end; m = (m / per_block + 1) * per_block)
    if (block_on(p, b, h, m / per_block, col_block)) return m;
  return m_end;
}

// Whether some key of [lo, hi) sits in a block that is on for query row i (the window is the
// caller's: [lo, hi) is visible_keys(i)).
FLARE_HD bool row_sees_a_key(const AttentionParams& p, int b, int h, int i, int lo, int hi) {
  if (lo >= hi) return false;
  if (p.block_mask == nullptr) return true;
  for (int c = lo / p.block_n; c <= (hi - 1) / p.block_n; ++c)
    if (block_on(p, b, h, i / p.block_m, c)) return true;
  return false;
}

}  // namespace flare
