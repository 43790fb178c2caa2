// nonfinite_fixup.cuh — exact recomputation of the output rows a CUDA kernel finished as ±Inf or
// NaN, so that non-finite inputs propagate as in the float64 reference and masked keys never
// reach a visible row.
//
// Why. A tensor-core product multiplies every pair of its tile. Inside a tile that is only partly
// visible, a masked pair enters as an exact zero (P = 0, dS = 0), and 0·x = 0 for finite x but
// 0·Inf and 0·NaN are NaN: a key that row i cannot see, whose V (forward) or whose pairing with an
// infinite dO (backward: dP = dO·Vᵀ, dS = P∘(dP − D)) holds ±Inf/NaN, turns row i's O, dQ, dK or
// dV into NaN while the reference (src/cpu/reference.cpp) never visits the pair. Probing every
// partly masked tile for such values inside the key loops is exact but costs the finite common
// case up to 20% (bench/results/2026-11-27-h100-bb18381/nonfinite-kernels-ab.txt).
//
// The fix after the fact. Such pollution always shows in the finished output: NaN never cancels
// in an accumulation and survives every rescale, so a polluted row is non-finite. The kernels
// therefore only test, in their epilogues, whether an output element they hold in registers is
// non-finite (one FMA per element: x·0 + acc is NaN exactly when x is ±Inf or NaN). The functions
// below re-read the stored rows and recompute every row that is non-finite from the inputs in
// fp32, one row (or key) at a time, visiting only the pairs the mask admits, with the reference's
// formulas and its treatment of non-finite values (a NaN score is skipped by the row max and
// reaches the row through the sum; a row whose visible scores are all −inf gets
// exp(−inf − −inf) = NaN). Rows that are non-finite in the reference are recomputed too and come
// out as the reference has them. The mask, ALiBi and dropout are core/score_mod.h's and
// core/philox.h's, shared with every backend. Slow (scalar fp32, dot products by warp shuffles),
// and run only where an output is non-finite.
//
// Where they run, so that a finite call pays only the epilogue's test: in kernels of their own,
// launched after the forward (src/cuda/fwd_fixup.cu, under windows) and after the backward's
// convert step (sm80/bwd_prepost.cu, under masks or ragged blocks); the sm90 forward without
// dropout or block mask recomputes its own marked rows (forward_fix_marked_rows: the one-CTA
// kernel after its tile, the persistent kernel's last CTA after every tile is written), which
// saves the fixup kernel's launch (host time) and its pass over the LSE. The main kernels only mark
// what needs recomputing — the forward a row's LSE as NaN, the backward and convert kernels a
// flag in the workspace — so that the fixup kernels find it cheaply. A call from the main kernels
// was measured and is not free: with the fixup code in it (called or inlined), ptxas capped the
// sm80 d 32 forward kernels at 168 registers and spilled (the grouped one had 209, no spill), the
// skewed d 128 backward spilled on sm_90a, the sm90 forward's dropout kernels spilled, and a
// callee's registers count against its caller (convert: 38 → 80-100). The sm90 forward's other
// kernels keep their registers (128 at d 64, 168 at d 80-256) and spill nothing with the code,
// but inside the persistent kernel's tile loop it cost the loop its uniform registers (wgmma
// descriptors computed on the vector path: 5-7% slower at d 64 and 128, H200).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "core/block_mask.h"
#include "core/numeric.h"
#include "core/params.h"
#include "core/philox.h"
#include "core/score_mod.h"
#include "cuda/fwd_fixup.h"

namespace flare::cuda {

// Columns of a head_dim row a lane owns in the warp-cooperative functions: c = lane + 32·k.
inline constexpr int kFixupColsPerLane = 8;  // head_dim ≤ 256

// Accumulates x·0 into acc: acc becomes NaN exactly when x is ±Inf or NaN, and stays 0 otherwise
// (overflow cannot raise a false alarm, as a sum of the values could).
__device__ __forceinline__ float nonfinite_probe(float acc, float x) { return fmaf(x, 0.0f, acc); }

// Whether a probe accumulated with nonfinite_probe saw a non-finite value.
__device__ __forceinline__ bool probe_found(float acc) { return acc != acc; }

// How a forward kernel finishes a row, in one place for every forward: given the row's sum of
// weights l (over its four lanes) and its max in log2 units, the factor its output is scaled by
// (numerator / l) and its LSE. A row with no positive sum that sees every key (no window, no
// block mask) is NaN, as 0/0 is in the reference; one that sees no key gets O = 0 and LSE = −inf.
// Where a row may have met a hidden key's V (rows_may_meet_hidden_keys, fwd_fixup.h), a row whose
// output came out non-finite (probe, nonfinite_probe over its elements) gets LSE = NaN, which
// marks it for the fixup kernel (fwd_fixup.cu) to recompute.
struct FinishedRow {
  bool marks, every_key_visible;

  __device__ FinishedRow(const AttentionParams& p, int len_k)
      : marks(rows_may_meet_hidden_keys(p)),
        every_key_visible(!p.has_window() && p.block_mask == nullptr && len_k > 0) {}

  __device__ float scale(float l, float numerator) const {
    return l > 0.0f ? numerator / l : every_key_visible ? NAN : 0.0f;
  }
  __device__ float lse(float l, float max_log2, float probe) const {
    return marks && probe_found(probe) ? NAN
           : l > 0.0f                  ? lse_from_log2(max_log2, l)
           : every_key_visible         ? NAN
                                       : -INFINITY;
  }
};

namespace fixup_detail {

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int delta = 16; delta > 0; delta >>= 1) x += __shfl_xor_sync(0xffffffffu, x, delta);
  return x;
}

// One head_dim row held by a warp: lane owns columns lane + 32·k (zero past head_dim).
struct WarpRow {
  float x[kFixupColsPerLane];

  __device__ __forceinline__ void load(const void* base, int64_t offset, DType dtype, int d,
                                       int lane) {
#pragma unroll
    for (int k = 0; k < kFixupColsPerLane; ++k) {
      const int c = lane + 32 * k;
      x[k] = c < d ? load_as_float(base, offset + c, dtype) : 0.0f;
    }
  }
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int k = 0; k < kFixupColsPerLane; ++k) x[k] = 0.0f;
  }
  // Σ_c x_c·(row at base + offset)_c, the same in every lane.
  __device__ __forceinline__ float dot(const void* base, int64_t offset, DType dtype, int d,
                                       int lane) const {
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < kFixupColsPerLane; ++k) {
      const int c = lane + 32 * k;
      if (c < d) s += x[k] * load_as_float(base, offset + c, dtype);
    }
    return warp_sum(s);
  }
  // x += w·(row at base + offset).
  __device__ __forceinline__ void add(float w, const void* base, int64_t offset, DType dtype, int d,
                                      int lane) {
#pragma unroll
    for (int k = 0; k < kFixupColsPerLane; ++k) {
      const int c = lane + 32 * k;
      if (c < d) x[k] += w * load_as_float(base, offset + c, dtype);
    }
  }
  // Whether any column in [c_begin, c_end) of the row at base + offset is ±Inf or NaN (every lane).
  static __device__ __forceinline__ bool stored_nonfinite(const void* base, int64_t offset,
                                                          DType dtype, int c_begin, int c_end,
                                                          int lane) {
    float probe = 0.0f;
    for (int c = c_begin + lane; c < c_end; c += 32)
      probe = nonfinite_probe(probe, load_as_float(base, offset + c, dtype));
    return __any_sync(0xffffffffu, probe_found(probe));
  }
  // Writes columns [c_begin, c_end) of x·scale to the row at base + offset.
  __device__ __forceinline__ void store(void* base, int64_t offset, DType dtype, float scale,
                                        int c_begin, int c_end, int lane) const {
#pragma unroll
    for (int k = 0; k < kFixupColsPerLane; ++k) {
      const int c = lane + 32 * k;
      if (c >= c_begin && c < c_end) store_from_float(base, offset + c, dtype, x[k] * scale);
    }
  }
};

// Element offsets of one (batch, head) of the tensors, rows counted within the sequence.
struct HeadRows {
  int64_t q, k, v, o, dout, dq, dk, dv;
};

__device__ __forceinline__ HeadRows head_rows(const AttentionParams& p, int b, int h,
                                              const SequenceInfo& seq) {
  const int hk = h / p.head_group;
  HeadRows r;
  r.q = b * p.q_batch_stride + seq.q_row0 * p.q_row_stride + h * p.q_head_stride;
  r.k = b * p.k_batch_stride + seq.k_row0 * p.k_row_stride + hk * p.k_head_stride;
  r.v = b * p.v_batch_stride + seq.k_row0 * p.v_row_stride + hk * p.v_head_stride;
  r.o = b * p.o_batch_stride + seq.q_row0 * p.o_row_stride + h * p.o_head_stride;
  r.dout = b * p.do_batch_stride + seq.q_row0 * p.do_row_stride + h * p.do_head_stride;
  r.dq = b * p.dq_batch_stride + seq.q_row0 * p.dq_row_stride + h * p.dq_head_stride;
  r.dk = b * p.dk_batch_stride + seq.k_row0 * p.dk_row_stride + hk * p.dk_head_stride;
  r.dv = b * p.dv_batch_stride + seq.k_row0 * p.dv_row_stride + hk * p.dv_head_stride;
  return r;
}

// The score of pair (i, j) as the reference forms it: scale·q_i·k_j, softcapped, plus ALiBi
// (modified_score; *dtanh, where given, the softcap's chain-rule factor).
__device__ __forceinline__ float score(const AttentionParams& p, float qk, float slope, int i,
                                       int j, const SequenceInfo& seq, float* dtanh = nullptr) {
  return modified_score(p.scale * qk, p.softcap, p.softcap > 0.0f ? 1.0f / p.softcap : 0.0f,
                        p.alibi_slopes ? alibi_bias(slope, i, j, seq.len_q, seq.len_k) : 0.0f,
                        dtanh);
}

// z_ij: 0 or 1/(1 − p) from the shared Philox mask (1 without dropout).
__device__ __forceinline__ float dropout_factor(const AttentionParams& p, int b, int h, int i,
                                                int j) {
  if (p.dropout_p == 0.0f) return 1.0f;
  const uint32_t bh = static_cast<uint32_t>(b * p.heads_q + h);
  return dropout_keep(p.seed, p.offset, bh, static_cast<uint32_t>(i), static_cast<uint32_t>(j),
                      p.dropout_p)
             ? p.dropout_scale
             : 0.0f;
}

// The stored LSE of row i of (b, h) (natural log, the forward's output).
__device__ __forceinline__ float stored_lse(const AttentionParams& p, int b, int h,
                                            const SequenceInfo& seq, int i) {
  return p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + seq.q_row0 + i];
}

// dS_ij of the backward (dT_ij under softcap) for a visible pair, with P from the stored LSE:
// P = exp(s − LSE), dP = z·dO_i·v_j, dS = P·(dP − D_i)·(1 − tanh²(t/cap)). Also returns P·z.
__device__ __forceinline__ float pair_gradient(const AttentionParams& p, const WarpRow& q_i,
                                               const WarpRow& do_i, const HeadRows& hr, int b,
                                               int h, const SequenceInfo& seq, float slope,
                                               float lse, float dsum, int i, int j, int lane,
                                               float* pz) {
  const int d = p.head_dim;
  const float qk = q_i.dot(p.k, hr.k + int64_t{j} * p.k_row_stride, p.dtype, d, lane);
  float dtanh;
  const float s = score(p, qk, slope, i, j, seq, &dtanh);
  const float prob = expf(s - lse);
  const float z = dropout_factor(p, b, h, i, j);
  *pz = prob * z;
  const float dp = z * do_i.dot(p.v, hr.v + int64_t{j} * p.v_row_stride, p.dtype, d, lane);
  return prob * (dp - dsum) * dtanh;
}

}  // namespace fixup_detail

// Forward: row i of (batch b, query head h), its index within the sequence, recomputed and
// rewritten (O and LSE). Called by a whole warp.
__device__ __forceinline__ void forward_recompute_row(const AttentionParams& p, int b, int h,
                                                      int i) {
  using namespace fixup_detail;
  const int lane = threadIdx.x & 31, d = p.head_dim;
  const SequenceInfo seq = sequence_info(p, b);
  const HeadRows hr = head_rows(p, b, h, seq);
  const float slope = alibi_slope(p, b, h);
  const KeyRange keys = visible_keys(i, seq.len_q, seq.len_k, p.window_left, p.window_right);
  WarpRow q_i, o_i;
  q_i.load(p.q, hr.q + int64_t{i} * p.q_row_stride, p.dtype, d, lane);
  o_i.zero();
  float lse = -INFINITY;
  if (row_sees_a_key(p, b, h, i, keys.lo, keys.hi)) {
    // The reference's row max skips NaN scores (s > m is false); they reach the row through the
    // sum. Keys in blocks the block mask turns off are not visited.
    float m = -INFINITY;
    for (int j = keys.lo; j < keys.hi; ++j) {
      if (!block_allows(p, b, h, i, j)) continue;
      const float qk = q_i.dot(p.k, hr.k + int64_t{j} * p.k_row_stride, p.dtype, d, lane);
      const float s = score(p, qk, slope, i, j, seq);
      if (s > m) m = s;
    }
    float sum = 0.0f;
    for (int j = keys.lo; j < keys.hi; ++j) {
      if (!block_allows(p, b, h, i, j)) continue;
      const float qk = q_i.dot(p.k, hr.k + int64_t{j} * p.k_row_stride, p.dtype, d, lane);
      sum += expf(score(p, qk, slope, i, j, seq) - m);
    }
    lse = m + logf(sum);
    for (int j = keys.lo; j < keys.hi; ++j) {
      if (!block_allows(p, b, h, i, j)) continue;
      const float qk = q_i.dot(p.k, hr.k + int64_t{j} * p.k_row_stride, p.dtype, d, lane);
      const float w =
          expf(score(p, qk, slope, i, j, seq) - lse) * dropout_factor(p, b, h, i, j);
      o_i.add(w, p.v, hr.v + int64_t{j} * p.v_row_stride, p.dtype, d, lane);
    }
  }
  o_i.store(p.o, hr.o + int64_t{i} * p.o_row_stride, p.dtype, 1.0f, 0, d, lane);
  if (lane == 0) p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + seq.q_row0 + i] = lse;
}

// Whether row i of (b, h), which the forward finished with a non-finite LSE, needs recomputing:
// marked (NaN: its O came out non-finite), or ±inf although it sees a key. A row that sees no key
// keeps O = 0, LSE = −inf.
__device__ __forceinline__ bool forward_row_marked(const AttentionParams& p, int b, int h,
                                                   const SequenceInfo& seq, int i, float lse) {
  if (lse != lse) return true;
  const KeyRange keys = visible_keys(i, seq.len_q, seq.len_k, p.window_left, p.window_right);
  return row_sees_a_key(p, b, h, i, keys.lo, keys.hi);
}

// Rows [i0, i0 + rows) of (b, h), rows ≤ 32: each whose stored LSE is non-finite and that
// forward_row_marked picks is recomputed, one by one. Called by a whole warp, after every store of
// the rows' O and LSE.
__device__ __forceinline__ void forward_fix_marked_rows(const AttentionParams& p, int b, int h,
                                                        int i0, int rows) {
  const int lane = threadIdx.x & 31;
  const SequenceInfo seq = sequence_info(p, b);
  const int i = i0 + lane;
  bool marked = false;
  if (lane < rows && i < seq.len_q) {
    const float lse = fixup_detail::stored_lse(p, b, h, seq, i);
    marked = !(fabsf(lse) < INFINITY) && forward_row_marked(p, b, h, seq, i, lse);
  }
  for (uint32_t todo = __ballot_sync(0xffffffffu, marked); todo != 0; todo &= todo - 1)
    forward_recompute_row(p, b, h, i0 + __ffs(todo) - 1);
}

// Backward, dK and dV: keys [key_begin, key_begin + keys) of (batch b, kv head hk), key indices
// within the sequence, columns [col_begin, col_end). Every key whose stored dK or dV is non-finite
// in those columns is recomputed there:
// dV_j = Σ P_ij z_ij dO_i, dK_j = scale Σ dS_ij q_i over the query heads of hk's group and the
// rows that see key j, with P from the stored LSE and D_i from `dsum` (the preprocess kernel's
// rowsum(dO∘O), indexed (h, packed row)). Called by a whole warp.
__device__ __forceinline__ void backward_fixup_keys(const AttentionParams& p, const float* dsum,
                                                    int b, int hk, int key_begin, int keys,
                                                    int col_begin, int col_end) {
  using namespace fixup_detail;
  const int lane = threadIdx.x & 31, d = p.head_dim;
  const SequenceInfo seq = sequence_info(p, b);
  const int64_t packed0 = packed_q_row0(p, b, seq);
  const int h0 = hk * p.head_group;
  const HeadRows kv = head_rows(p, b, h0, seq);
  for (int j = key_begin; j < key_begin + keys && j < seq.len_k; ++j) {
    const int64_t dk_off = kv.dk + int64_t{j} * p.dk_row_stride;
    const int64_t dv_off = kv.dv + int64_t{j} * p.dv_row_stride;
    const bool bad = WarpRow::stored_nonfinite(p.dk, dk_off, p.dtype, col_begin, col_end, lane) ||
                     WarpRow::stored_nonfinite(p.dv, dv_off, p.dtype, col_begin, col_end, lane);
    if (!bad) continue;
    WarpRow dk_j, dv_j;
    dk_j.zero();
    dv_j.zero();
    for (int h = h0; h < h0 + p.head_group; ++h) {
      const HeadRows hr = head_rows(p, b, h, seq);
      const float slope = alibi_slope(p, b, h);
      for (int i = 0; i < seq.len_q; ++i) {
        const KeyRange vis = visible_keys(i, seq.len_q, seq.len_k, p.window_left, p.window_right);
        if (j < vis.lo || j >= vis.hi || !block_allows(p, b, h, i, j)) continue;
        WarpRow q_i, do_i;
        q_i.load(p.q, hr.q + int64_t{i} * p.q_row_stride, p.dtype, d, lane);
        do_i.load(p.dout, hr.dout + int64_t{i} * p.do_row_stride, p.dtype, d, lane);
        float pz;
        const float ds =
            pair_gradient(p, q_i, do_i, hr, b, h, seq, slope, stored_lse(p, b, h, seq, i),
                          dsum[int64_t{h} * p.total_q + packed0 + i], i, j, lane, &pz);
#pragma unroll
        for (int k = 0; k < kFixupColsPerLane; ++k) {
          dv_j.x[k] += pz * do_i.x[k];
          dk_j.x[k] += ds * q_i.x[k];
        }
      }
    }
    dk_j.store(p.dk, dk_off, p.dtype, p.scale, col_begin, col_end, lane);
    dv_j.store(p.dv, dv_off, p.dtype, 1.0f, col_begin, col_end, lane);
  }
}

// Backward, dQ: the columns [c0, c0 + 8) ∩ [0, head_dim) of row i of (batch b, query head h),
// each thread on its own: dQ_i = scale Σ_j dS_ij k_j over the keys row i sees. Writes dq. Called
// from a kernel of its own (sm80/bwd_prepost.cu), so inlined; one column at a time, every dot
// product redone per column, which keeps the loop small.
__device__ __forceinline__ void backward_fixup_dq(const AttentionParams& p, const float* dsum,
                                                  int b, int h, int i, int c0) {
  const SequenceInfo seq = sequence_info(p, b);
  const KeyRange keys = visible_keys(i, seq.len_q, seq.len_k, p.window_left, p.window_right);
#pragma unroll 1
  for (int c = c0; c < c0 + 8 && c < p.head_dim; ++c) {
    float acc = 0.0f;
#pragma unroll 1
    for (int j = keys.lo; j < keys.hi; ++j) {
      if (!block_allows(p, b, h, i, j)) continue;
      const fixup_detail::HeadRows hr = fixup_detail::head_rows(p, b, h, seq);
      const int64_t q_off = hr.q + int64_t{i} * p.q_row_stride;
      const int64_t do_off = hr.dout + int64_t{i} * p.do_row_stride;
      const int64_t k_off = hr.k + int64_t{j} * p.k_row_stride;
      const int64_t v_off = hr.v + int64_t{j} * p.v_row_stride;
      float qk = 0.0f, dov = 0.0f;
#pragma unroll 1
      for (int e = 0; e < p.head_dim; ++e) {
        qk += load_as_float(p.q, q_off + e, p.dtype) * load_as_float(p.k, k_off + e, p.dtype);
        dov += load_as_float(p.dout, do_off + e, p.dtype) * load_as_float(p.v, v_off + e, p.dtype);
      }
      float dtanh;
      const float s = fixup_detail::score(p, qk, alibi_slope(p, b, h), i, j, seq, &dtanh);
      const float prob = expf(s - fixup_detail::stored_lse(p, b, h, seq, i));
      const float dp = fixup_detail::dropout_factor(p, b, h, i, j) * dov;
      const float ds =
          prob * (dp - dsum[int64_t{h} * p.total_q + packed_q_row0(p, b, seq) + i]) * dtanh;
      acc += ds * load_as_float(p.k, k_off + c, p.dtype);
    }
    store_from_float(
        p.dq, b * p.dq_batch_stride + (seq.q_row0 + i) * p.dq_row_stride + h * p.dq_head_stride + c,
        p.dtype, acc * p.scale);
  }
}

}  // namespace flare::cuda
