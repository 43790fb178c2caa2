// layout_check.h — whether tensors suit the sm90 kernels' TMA loads (host code without CUDA).
#pragma once

#include <cstdint>
#include <initializer_list>

#include "core/params.h"

namespace flare::cuda::sm90 {

inline bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

// A tensor dimension: its stride in 2-byte elements and its extent.
struct StrideExtent {
  int64_t stride;
  int64_t extent;
};

// TMA takes strides in whole 16-byte units below 2^40 bytes, and a zero stride only where the
// extent is 1 (the tensor maps substitute one there).
inline bool strides_fit_tma(std::initializer_list<StrideExtent> dims) {
  for (const StrideExtent& d : dims) {
    if (d.stride % 8 != 0 || d.stride < 0 || d.stride >= (int64_t{1} << 38)) return false;
    if (d.stride == 0 && d.extent > 1) return false;
  }
  return true;
}

// The row and batch extents of a call's tensor maps: (seqlen, batch) per sequence, or for a
// packed batch every sequence's rows in one extent and a batch of one (its rows are found by
// cu_seqlens, its batch stride is 0).
struct TmaRows {
  int64_t q, k, batch;
};
inline TmaRows tma_rows(const AttentionParams& p) {
  if (p.is_varlen()) return {p.total_q, p.total_k, 1};
  return {p.seqlen_q, p.seqlen_k, p.batch};
}

// Whether a packed batch suits the sm90 kernels (fixed-length batches always do): its rows fit
// the maps' int32 row coordinates, and it has no block mask (the kernels' packed walks read none).
inline bool packed_batch_fits(const AttentionParams& p) {
  return !p.is_varlen() ||
         (p.block_mask == nullptr && p.total_q < INT32_MAX && p.total_k < INT32_MAX);
}

}  // namespace flare::cuda::sm90
