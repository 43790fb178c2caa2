// reference.cpp — the ground truth: naive attention that materialises every score row.
//
// Straight from the definition in flare/attention.h, one (batch, query head) at a time:
//   t_ij = scale · q_i·k_j;  s_ij = softcap ? cap·tanh(t_ij/cap) : t_ij;  s_ij += alibi(i, j);
//   keys outside visible_keys(i), or in a block the block mask turns off (block_mask.h), are
//   dropped; P = softmax_j(s); LSE_i = log Σ_j exp(s_ij);
//   O_i = Σ_j P_ij·z_ij·v_j with z_ij = keep_ij / (1 − p) from the shared Philox mask.
// Backward, with D_i = dO_i·O_i (= Σ_j P_ij dP_ij):
//   dV_j = Σ_i P_ij z_ij dO_i;  dP_ij = z_ij dO_i·v_j;  dS_ij = P_ij (dP_ij − D_i);
//   dT_ij = dS_ij · (1 − tanh²(t_ij/cap)) [softcap only];  dQ_i = scale Σ_j dT_ij k_j;
//   dK_j = scale Σ_i dT_ij q_i   (summed over the query heads that share a kv head).
//
// Two precisions share the code. kFloat64 accumulates everything in double: that is the truth
// the tests compare against, and its backward is checked against central finite differences.
// kLowPrecision is the "naive kernel in the fast path's precision" of the tolerance rule
// (docs/architecture.md, "Tolerance rule"): scores and softmax in float, P (and dS) rounded to
// the input dtype before the products with V (and K, Q), as a tensor-core kernel does, and O, dQ,
// dK, dV rounded to the input dtype as the fast path stores them (LSE stays fp32, as the API
// returns it). Its distance from kFloat64 is the error budget.
// Memory is O(s_k) per query row, time O(s_q·s_k·d): meant for tests and small demos.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/backends.h"
#include "core/block_mask.h"
#include "core/numeric.h"
#include "core/philox.h"
#include "core/score_mod.h"
#include "cpu/head_location.h"
#include "cpu/key_rows.h"

namespace flare::cpu {
namespace {

// Dense copies of one head's rows, converted to T.
template <typename T>
std::vector<T> load_rows(const void* base, DType dtype, int64_t head_offset, int64_t row_stride,
                         int64_t rows, int d) {
  std::vector<T> out(static_cast<size_t>(rows) * d);
  for (int64_t r = 0; r < rows; ++r)
    for (int c = 0; c < d; ++c)
      out[r * d + c] = static_cast<T>(load_as_float(base, head_offset + r * row_stride + c, dtype));
  return out;
}

// Dense copies of one (sequence, kv head)'s keys and values, found through `keys` (key_rows.h).
template <typename T>
void load_keys(const AttentionParams& p, const KeyRows& keys, const HeadLocation& at,
               std::vector<T>* k, std::vector<T>* v) {
  const int d = p.head_dim, len = at.seq.len_k;
  k->assign(static_cast<size_t>(len) * d, T(0));
  v->assign(static_cast<size_t>(len) * d, T(0));
  for (int j = 0; j < len;) {
    const KeyRun run = key_run(p, keys, at, 0, j, len);
    for (int r = 0; r < run.n; ++r)
      for (int c = 0; c < d; ++c) {
        const size_t e = static_cast<size_t>(run.r0 + r) * d + c;
        (*k)[e] = static_cast<T>(load_as_float(p.k, run.k + r * run.k_stride + c, p.dtype));
        (*v)[e] = static_cast<T>(load_as_float(p.v, run.v + r * run.v_stride + c, p.dtype));
      }
    j += run.n;
  }
}

template <typename T>
T dot(const T* a, const T* b, int d) {
  T s = 0;
  for (int c = 0; c < d; ++c) s += a[c] * b[c];
  return s;
}

// The same dot product summed from the last term to the first.
template <typename T>
T dot_reversed(const T* a, const T* b, int d) {
  T s = 0;
  for (int c = d - 1; c >= 0; --c) s += a[c] * b[c];
  return s;
}

// Everything about one query row that the forward computes and the backward reuses.
template <typename T>
struct RowScores {
  int lo = 0, hi = 0;       // visible keys [lo, hi)
  std::vector<T> t;         // scaled raw scores (before softcap), index j − lo
  std::vector<T> prob;      // softmax probabilities P_ij (before dropout)
  std::vector<T> drop;      // z_ij: 0 or 1/(1−p)
  std::vector<char> on;     // whether the block mask keeps key j (all 1 when dense)
  T lse = 0;
};

template <typename T>
struct Head {
  const AttentionParams& p;
  int b, h;
  SequenceInfo seq;
  std::vector<T> q, k, v;   // (len_q, d), (len_k, d), (len_k, d)
  float slope;

  Head(const AttentionParams& params, int batch, int head, const KeyRows& keys = KeyRows{})
      : p(params), b(batch), h(head) {
    const HeadLocation at = locate_head(p, b, h);
    seq = at.seq;
    q = load_rows<T>(p.q, p.dtype, at.q, p.q_row_stride, seq.len_q, p.head_dim);
    load_keys(p, keys, at, &k, &v);
    slope = at.slope;
  }

  // `stored_lse`, when given, replaces the row's own log-sum-exp in P = exp(s − LSE): the
  // low-precision backward takes P from the forward's saved LSE, as every fast backward must.
  RowScores<T> scores(int i, const T* stored_lse = nullptr) const {
    RowScores<T> r;
    const KeyRange range = visible_keys(i, seq.len_q, seq.len_k, p.window_left, p.window_right);
    r.lo = range.lo;
    r.hi = range.hi;
    const int n = r.hi - r.lo;
    r.t.resize(n);
    r.prob.resize(n);
    r.drop.resize(n);
    r.on.resize(n);
    bool any = false;
    for (int jj = 0; jj < n; ++jj) any |= (r.on[jj] = block_allows(p, b, h, i, r.lo + jj));
    if (!any) {
      r.lse = -std::numeric_limits<T>::infinity();
      return r;
    }
    const int d = p.head_dim;
    T m = -std::numeric_limits<T>::infinity();
    std::vector<T> s(n);
    for (int jj = 0; jj < n; ++jj) {
      if (!r.on[jj]) continue;  // never read: a masked block's K may hold anything
      const int j = r.lo + jj;
      const T t = static_cast<T>(p.scale) * dot(&q[i * d], &k[j * d], d);
      T sj = t;
      if (p.softcap > 0.0f) sj = static_cast<T>(p.softcap) * std::tanh(t / static_cast<T>(p.softcap));
      if (p.alibi_slopes) sj += static_cast<T>(alibi_bias(slope, i, j, seq.len_q, seq.len_k));
      r.t[jj] = t;
      s[jj] = sj;
      if (sj > m) m = sj;
    }
    T sum = 0;
    for (int jj = 0; jj < n; ++jj)
      if (r.on[jj]) sum += std::exp(s[jj] - m);
    r.lse = stored_lse ? *stored_lse : m + std::log(sum);
    const uint32_t bh = static_cast<uint32_t>(b * p.heads_q + h);
    for (int jj = 0; jj < n; ++jj) {
      if (!r.on[jj]) continue;  // prob and drop stay 0
      r.prob[jj] = std::exp(s[jj] - r.lse);
      const bool keep = p.dropout_p == 0.0f ||
                        dropout_keep(p.seed, p.offset, bh, static_cast<uint32_t>(i),
                                     static_cast<uint32_t>(r.lo + jj), p.dropout_p);
      r.drop[jj] = keep ? static_cast<T>(p.dropout_scale) : T(0);
    }
    return r;
  }

  // Rounds a probability-like operand of a matrix product to the input dtype (low precision).
  T operand(T x, bool low) const {
    return low ? static_cast<T>(round_to(p.dtype, static_cast<float>(x))) : x;
  }
};

template <typename T>
RefForward forward_impl(const AttentionParams& p, const KeyRows& keys, bool low) {
  RefForward out;
  const int d = p.head_dim;
  out.o.assign(static_cast<size_t>(p.total_q) * p.heads_q * d, 0.0);
  out.lse.assign(static_cast<size_t>(p.total_q) * p.heads_q, 0.0);
  for (int b = 0; b < p.batch; ++b) {
    for (int h = 0; h < p.heads_q; ++h) {
      Head<T> hd(p, b, h, keys);
      const int64_t row0 = packed_q_row0(p, b, hd.seq);
      for (int i = 0; i < hd.seq.len_q; ++i) {
        const RowScores<T> r = hd.scores(i);
        std::vector<T> acc(d, T(0));
        for (int jj = 0; jj < r.hi - r.lo; ++jj) {
          if (!r.on[jj]) continue;
          const T w = hd.operand(r.prob[jj] * r.drop[jj], low);
          const T* vj = &hd.v[(r.lo + jj) * d];
          for (int c = 0; c < d; ++c) acc[c] += w * vj[c];
        }
        const int64_t row = row0 + i;
        for (int c = 0; c < d; ++c)
          out.o[(row * p.heads_q + h) * d + c] = static_cast<double>(hd.operand(acc[c], low));
        out.lse[h * p.total_q + row] = static_cast<double>(r.lse);
      }
    }
  }
  return out;
}

// `reversed` (low precision only): every sum in the opposite order (RefPrecision).
template <typename T>
RefBackward backward_impl(const AttentionParams& p, bool low, bool reversed) {
  const auto product = reversed ? dot_reversed<T> : dot<T>;
  RefBackward out;
  const int d = p.head_dim;
  out.dq.assign(static_cast<size_t>(p.total_q) * p.heads_q * d, 0.0);
  out.dk.assign(static_cast<size_t>(p.total_k) * p.heads_kv * d, 0.0);
  out.dv.assign(static_cast<size_t>(p.total_k) * p.heads_kv * d, 0.0);
  for (int b = 0; b < p.batch; ++b) {
    for (int h = 0; h < p.heads_q; ++h) {
      Head<T> hd(p, b, h);
      const int kvh = h / p.head_group;
      const SequenceInfo& seq = hd.seq;
      const std::vector<T> dout =
          load_rows<T>(p.dout, p.dtype,
                       b * p.do_batch_stride + seq.q_row0 * p.do_row_stride + h * p.do_head_stride,
                       p.do_row_stride, seq.len_q, d);
      const int64_t qrow0 = packed_q_row0(p, b, seq);
      const int64_t krow0 = p.is_varlen() ? seq.k_row0 : int64_t{b} * p.seqlen_k;
      std::vector<T> dk(static_cast<size_t>(seq.len_k) * d, T(0));
      std::vector<T> dv(static_cast<size_t>(seq.len_k) * d, T(0));
      // The float64 truth recomputes O and LSE itself. The low-precision twin is a naive kernel
      // for the same function a fast backward computes, whose inputs include the forward's
      // stored O (for D_i = dO_i·O_i) and LSE (for P): it reads them too, so its error budget
      // measures the backward alone, not the forward's rounding a second time.
      std::vector<T> stored_o, stored_lse;
      if (low) {
        stored_o = load_rows<T>(p.o, p.dtype,
                                b * p.o_batch_stride + seq.q_row0 * p.o_row_stride + h * p.o_head_stride,
                                p.o_row_stride, seq.len_q, d);
        stored_lse.resize(seq.len_q);
        for (int i = 0; i < seq.len_q; ++i)
          stored_lse[i] = static_cast<T>(p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + seq.q_row0 + i]);
      }
      for (int step = 0; step < seq.len_q; ++step) {
        const int i = reversed ? seq.len_q - 1 - step : step;
        const RowScores<T> r = hd.scores(i, low ? &stored_lse[i] : nullptr);
        const int n = r.hi - r.lo;
        const T* doi = &dout[i * d];
        std::vector<T> o(d, T(0));
        if (low) {
          std::copy(&stored_o[i * d], &stored_o[i * d] + d, o.begin());
        } else {
          for (int jj = 0; jj < n; ++jj)
            for (int c = 0; c < d; ++c)
              if (r.on[jj]) o[c] += r.prob[jj] * r.drop[jj] * hd.v[(r.lo + jj) * d + c];
        }
        const T D = product(doi, o.data(), d);
        std::vector<T> dq(d, T(0));
        for (int key = 0; key < n; ++key) {
          const int jj = reversed ? n - 1 - key : key;
          if (!r.on[jj]) continue;
          const int j = r.lo + jj;
          const T pz = hd.operand(r.prob[jj] * r.drop[jj], low);
          for (int c = 0; c < d; ++c) dv[j * d + c] += pz * doi[c];
          const T dp = r.drop[jj] * product(doi, &hd.v[j * d], d);
          T ds = r.prob[jj] * (dp - D);
          if (p.softcap > 0.0f) {
            const T th = std::tanh(r.t[jj] / static_cast<T>(p.softcap));
            ds *= T(1) - th * th;
          }
          ds = hd.operand(ds, low);
          for (int c = 0; c < d; ++c) {
            dq[c] += ds * hd.k[j * d + c];
            dk[j * d + c] += ds * hd.q[i * d + c];
          }
        }
        for (int c = 0; c < d; ++c)
          out.dq[((qrow0 + i) * p.heads_q + h) * d + c] =
              static_cast<double>(hd.operand(static_cast<T>(p.scale) * dq[c], low));
      }
      for (int j = 0; j < seq.len_k; ++j)
        for (int c = 0; c < d; ++c) {
          out.dk[((krow0 + j) * p.heads_kv + kvh) * d + c] += static_cast<double>(p.scale * dk[j * d + c]);
          out.dv[((krow0 + j) * p.heads_kv + kvh) * d + c] += static_cast<double>(dv[j * d + c]);
        }
    }
  }
  if (low) {  // the fast path stores its gradients in the input dtype; so does the naive one
    for (double& x : out.dk) x = round_to(p.dtype, static_cast<float>(x));
    for (double& x : out.dv) x = round_to(p.dtype, static_cast<float>(x));
  }
  return out;
}

// Writes a packed (rows, heads, d) array into a strided user tensor.
void store_packed(const AttentionParams& p, const std::vector<double>& src, void* dst, int heads,
                  int64_t batch_stride, int64_t row_stride, int64_t head_stride, bool is_q) {
  const int d = p.head_dim;
  for (int b = 0; b < p.batch; ++b) {
    const SequenceInfo seq = sequence_info(p, b);
    const int64_t len = is_q ? seq.len_q : seq.len_k;
    const int64_t user_row0 = is_q ? seq.q_row0 : seq.k_row0;
    const int64_t packed_row0 = p.is_varlen() ? user_row0 : int64_t{b} * (is_q ? p.seqlen_q : p.seqlen_k);
    for (int64_t r = 0; r < len; ++r)
      for (int h = 0; h < heads; ++h)
        for (int c = 0; c < d; ++c)
          store_from_float(dst, b * batch_stride + (user_row0 + r) * row_stride + h * head_stride + c,
                           p.dtype, static_cast<float>(src[((packed_row0 + r) * heads + h) * d + c]));
  }
}

}  // namespace

RefForward reference_forward(const AttentionParams& p, const KeyRows& keys,
                             RefPrecision precision) {
  return precision == RefPrecision::kFloat64 ? forward_impl<double>(p, keys, false)
                                             : forward_impl<float>(p, keys, true);
}

RefForward reference_forward(const AttentionParams& p, RefPrecision precision) {
  return reference_forward(p, KeyRows{}, precision);
}

RefBackward reference_backward(const AttentionParams& p, RefPrecision precision) {
  if (precision == RefPrecision::kFloat64) return backward_impl<double>(p, false, false);
  return backward_impl<float>(p, true, precision == RefPrecision::kLowPrecisionReversed);
}

void store_forward(const AttentionParams& p, const RefForward& r) {
  store_packed(p, r.o, p.o, p.heads_q, p.o_batch_stride, p.o_row_stride, p.o_head_stride, true);
  for (int b = 0; b < p.batch; ++b) {
    const SequenceInfo seq = sequence_info(p, b);
    const int64_t packed_row0 = packed_q_row0(p, b, seq);
    for (int h = 0; h < p.heads_q; ++h)
      for (int i = 0; i < seq.len_q; ++i)
        p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + seq.q_row0 + i] =
            static_cast<float>(r.lse[h * p.total_q + packed_row0 + i]);
  }
}

void store_backward(const AttentionParams& p, const RefBackward& r) {
  store_packed(p, r.dq, p.dq, p.heads_q, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride, true);
  store_packed(p, r.dk, p.dk, p.heads_kv, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride, false);
  store_packed(p, r.dv, p.dv, p.heads_kv, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride, false);
}

}  // namespace flare::cpu
