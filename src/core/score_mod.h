// score_mod.h — the definition of which keys a query sees and how its scores are modified.
//
// Written once for host and device so the CPU reference, the CPU flash backend and the CUDA
// kernels cannot disagree. Convention (FlashAttention ≥ 2.1): with s_q != s_k the mask is aligned
// to the bottom-right corner, i.e. query row i sits at key position i + s_k − s_q.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/host_device.h"
#include "core/params.h"

namespace flare {

// Key range [lo, hi) that query row `row` may see, clamped to [0, len_k). Empty when lo >= hi.
struct KeyRange {
  int lo;
  int hi;
};

FLARE_HD KeyRange visible_keys(int row, int len_q, int len_k, int window_left, int window_right) {
  const int64_t pos = static_cast<int64_t>(row) + len_k - len_q;  // aligned key position
  int64_t lo = 0, hi = len_k;
  if (window_left >= 0) lo = pos - window_left > 0 ? pos - window_left : 0;
  if (window_right >= 0) hi = pos + window_right + 1 < len_k ? pos + window_right + 1 : len_k;
  if (hi < lo) hi = lo;
  if (lo > len_k) lo = hi = len_k;
  if (hi < 0) lo = hi = 0;
  return {static_cast<int>(lo), static_cast<int>(hi)};
}

// Query rows as ranges [lo, hi), empty when hi ≤ lo.
struct RowRange {
  int lo;
  int hi;
};

// A window side capped at other_len − 1: wider bounds nothing more (the sequence it reaches across
// is other_len long), and capped, the sums below stay within 32 bits for any window with lengths
// at most 2^30.
FLARE_HD int capped_window(int window, int other_len) {
  return window < other_len ? window : other_len - 1;
}

// The rows whose window reaches key `right_key` on its right side and key `left_key` on its left:
// i + len_k − len_q + right ≥ right_key and i + len_k − len_q − left ≤ left_key, each side only
// where bounded (visible_keys' two sides, solved for the row); both keys in [0, len_k). 32-bit,
// with capped windows: no 64-bit registers are needed.
FLARE_HD RowRange rows_reaching(int right_key, int left_key, int len_q, int len_k, int window_left,
                                int window_right) {
  const int diag = len_k - len_q;
  int lo = 0, hi = len_q;
  if (window_right >= 0) {
    const int first = right_key - diag - capped_window(window_right, len_q);
    lo = first > 0 ? first : 0;
  }
  if (window_left >= 0) {
    const int end = left_key + 1 - diag + capped_window(window_left, len_k);
    hi = end < len_q ? end : len_q;
  }
  return {lo, hi > lo ? hi : lo};
}

// Query rows that see at least one key of [key0, key_end) (key_end ≤ len_k): the rows a backward
// key block walks.
FLARE_HD RowRange rows_seeing(int key0, int key_end, int len_q, int len_k, int window_left,
                              int window_right) {
  return rows_reaching(key0, key_end - 1, len_q, len_k, window_left, window_right);
}

// Keys that some row of [row0, row_end) sees (row_end ≤ len_q): the union of visible_keys over
// those rows, one range (a row's keys move by one from row to row, and rows that see none come
// first, where their keys would lie before key 0). 32-bit, windows capped as in rows_reaching.
FLARE_HD KeyRange keys_seen(int row0, int row_end, int len_q, int len_k, int window_left,
                            int window_right) {
  const int diag = len_k - len_q;
  int lo = 0, hi = len_k;
  if (window_left >= 0) {
    const int first = row0 + diag - capped_window(window_left, len_k);
    lo = first > 0 ? first : 0;
  }
  if (window_right >= 0) {
    const int end = row_end + diag + capped_window(window_right, len_q);
    hi = end < len_k ? end : len_k;
  }
  return {lo, hi > lo ? hi : lo};
}

// Whether every row of [row0, row_end) sees every key of [key0, key_end): the tiles that need no
// per-element mask. Per step in the backward kernels, so 32-bit and from the arguments alone (a
// range held across their loops costs registers there); windows capped as in rows_reaching.
FLARE_HD bool tile_sees_all(int row0, int row_end, int key0, int key_end, int len_q, int len_k,
                            int window_left, int window_right) {
  const int diag = len_k - len_q;
  return key_end <= len_k &&
         (window_left < 0 || key0 >= row_end - 1 + diag - capped_window(window_left, len_k)) &&
         (window_right < 0 || key_end - 1 <= row0 + diag + capped_window(window_right, len_q));
}

// visible_keys per element, as the GPU kernels test their score fragments on boundary steps. A
// thread's fragment starts at key key0 = block_key + lane_key (the step's first key and the
// thread's offset from it) and query row row0; an element at compile-time offsets
// (key0 + dk, row0 + dr) is masked iff dk ≥ room (the key is past len_k) or rel0 + dk − dr lies
// outside [lo, hi] (rel = key − the row's aligned key position; a side is INT_MIN / INT_MAX where
// unbounded). Two registers per thread for the whole mask and one compare per bound
// per element. 32-bit: the library caps sequence lengths at 2^30, so the differences stay within
// ±2^31.
struct ElementMask {
  int room, rel0, lo, hi;

  FLARE_HD ElementMask(int block_key, int lane_key, int row0, int len_q, int len_k, int window_left,
                       int window_right)
      : room(len_k - block_key - lane_key),
        rel0(block_key + lane_key - (row0 + len_k - len_q)),
        lo(window_left >= 0 ? -window_left : INT32_MIN),
        hi(window_right >= 0 ? window_right : INT32_MAX) {}

  // The element's key minus its row's aligned key position: ALiBi's distance, up to sign.
  FLARE_HD int rel(int dk, int dr) const { return rel0 + dk - dr; }

  FLARE_HD bool masked(int dk, int dr) const {
    const int r = rel(dk, dr);
    return dk >= room || r < lo || r > hi;
  }
};

// The score modifiers of one head, in the order of attention.h: softcap (c·tanh(x / c) on the
// scaled score x, off when c ≤ 0), then ALiBi (−slope·|rel|, off without slopes), with rel the
// key's offset from the row's aligned key position (ElementMask::rel). The kernels hold raw scores
// (q·k before the softmax scale) and leave them raw for the softmax's one FFMA with scale·log2(e),
// so the constants take the scale in and out once, here: raw ↦ (c / scale)·tanh(raw · scale / c)
// − (slope / scale)·|rel|. A division per element is a subroutine call in CUDA; and the sm90
// kernels run each modifier as a loop of its own over the tile, with no branch between elements.
struct ScoreMods {
  float cap_in, cap_out, slope_raw;
  bool capped, alibi;

  FLARE_HD ScoreMods(const AttentionParams& p, float slope)
      : cap_in(p.softcap > 0.0f ? p.scale / p.softcap : 0.0f),
        cap_out(p.softcap / p.scale),
        slope_raw(slope / p.scale),
        capped(p.softcap > 0.0f),
        alibi(p.alibi_slopes != nullptr) {}

  // tanh(scale·raw / c): the backward's softcap derivative is 1 − its square.
  FLARE_HD float tanh_of(float raw) const { return tanhf(raw * cap_in); }
  FLARE_HD float cap(float raw) const { return cap_out * tanh_of(raw); }
  // `rel` as a float: the kernels add their compile-time offsets to it in floating point, exact
  // below 2^24 (beyond, within an ulp of a bias of at least 2^24 slopes).
  FLARE_HD float bias(float raw, float rel) const { return raw - slope_raw * fabsf(rel); }
};

// The ALiBi bias for (row, col): −slope · |row + len_k − len_q − col|.
FLARE_HD float alibi_bias(float slope, int row, int col, int len_q, int len_k) {
  const int64_t dist = static_cast<int64_t>(row) + len_k - len_q - col;
  return -slope * static_cast<float>(dist < 0 ? -dist : dist);
}

// The score modifiers on one scaled score t = scale·q·k, element by element in the reference's
// order, for the kernels that form scores one at a time (the decoding kernel, the non-finite
// fix-ups, the sm80 backward): softcap c·tanh(t / c) for c > 0, with the caller's 1 / c (a
// division per element is a subroutine call in CUDA), then `bias` (alibi_bias, or 0 without
// ALiBi). *dtanh, where given, receives the softcap's chain-rule factor 1 − tanh² (1 without).
FLARE_HD float modified_score(float t, float softcap, float softcap_inverse, float bias,
                              float* dtanh = nullptr) {
  float s = t, factor = 1.0f;
  if (softcap > 0.0f) {
    const float th = tanhf(t * softcap_inverse);
    s = softcap * th;
    factor = 1.0f - th * th;
  }
  if (dtanh != nullptr) *dtanh = factor;
  return s + bias;
}

// Slope for (batch b, query head h), or 0 when ALiBi is off.
FLARE_HD float alibi_slope(const AttentionParams& p, int b, int h) {
  return p.alibi_slopes ? p.alibi_slopes[b * p.alibi_batch_stride + h] : 0.0f;
}

}  // namespace flare
