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

}  // namespace flare
