// key_rows.h — where the CPU backends find key j of a sequence: the key row locator.
//
// Attention reads a sequence's keys and values as rows [0, len_k) of one kv head. For a padded or
// packed (varlen) call they lie at one row stride from the sequence's first row (head_location.h's
// offsets). A KV cache (flare/kvcache.h) holds them elsewhere: a contiguous cache keeps sequence b
// in cache row cache_batch_idx[b], a paged one in the blocks block_table[b][j / page_size], row
// j % page_size. KeyRows describes either layout, and key_run cuts a range of keys into
// runs that lie at one row stride, so a tile load is one strided copy per run: one for the packed
// and the contiguous layouts, one per page crossed for a paged cache. The backends' forwards read
// K and V through it and nothing else, so the cache is read in place instead of first being
// gathered into a packed copy, and the loaded tiles (hence every sum) are the same bits either
// way. Plain host code, shared by every compiled instruction-set level.
#pragma once

#include <algorithm>
#include <cstdint>

#include "core/backends.h"
#include "core/params.h"
#include "cpu/head_location.h"

namespace flare::cpu {

// Key j of sequence b, kv head g: in K at element
//   page(b, j / page_size) · k_page_stride + (j % page_size) · k_row_stride + g · p.k_head_stride
// with page(b, n) = pages[b · pages_seq_stride + n · pages_stride]; in V likewise with the v
// strides. pages == nullptr: the params' own layout (p.k, p.k_row_stride, cu_seqlens_k).
struct KeyRows {
  const int32_t* pages = nullptr;
  int64_t pages_seq_stride = 0, pages_stride = 0;
  int64_t page_size = 0;  // rows per page; a contiguous cache is one page per sequence
  int64_t k_page_stride = 0, v_page_stride = 0;
  int64_t k_row_stride = 0, v_row_stride = 0;

  bool in_params() const { return pages == nullptr; }
};

// Keys [r0, r0 + n) of a range (relative to its first key), `stride` elements apart from k / v.
struct KeyRun {
  int r0 = 0, n = 0;
  int64_t k = 0, v = 0;                // element offsets of the run's first key in K and V
  int64_t k_stride = 0, v_stride = 0;  // between consecutive keys of the run
};

// The run of keys [j0, j1) that starts at key j (j0 <= j < j1): the rest of the range in the
// params' layout, the rest of j's page (or of the range) in a cache. Callers walk a range as
//   for (int j = j0; j < j1;) { const KeyRun run = key_run(p, keys, at, j0, j, j1); …; j += run.n; }
// a loop in their own code (not a callback), so the tile loads stay inline in the kernels.
inline KeyRun key_run(const AttentionParams& p, const KeyRows& keys, const HeadLocation& at, int j0,
                      int j, int j1) {
  if (keys.in_params())
    return KeyRun{j - j0, j1 - j, at.k + j * p.k_row_stride, at.v + j * p.v_row_stride,
                  p.k_row_stride, p.v_row_stride};
  const int kvh = at.h / p.head_group;
  const int64_t page_index = j / keys.page_size, row = j % keys.page_size;
  const int n = static_cast<int>(std::min<int64_t>(j1 - j, keys.page_size - row));
  const int64_t page = keys.pages[at.b * keys.pages_seq_stride + page_index * keys.pages_stride];
  return KeyRun{j - j0, n,
                page * keys.k_page_stride + row * keys.k_row_stride + kvh * p.k_head_stride,
                page * keys.v_page_stride + row * keys.v_row_stride + kvh * p.v_head_stride,
                keys.k_row_stride, keys.v_row_stride};
}

// The forwards with keys found through `keys` (the params' K/V pointers, head strides, lengths
// and everything else as usual). flash_forward(p) and reference_forward(p, precision) are these
// with KeyRows{}.
Status flash_forward(const AttentionParams& p, const KeyRows& keys);
RefForward reference_forward(const AttentionParams& p, const KeyRows& keys, RefPrecision precision);

}  // namespace flare::cpu
