// problem_cases.h — the words the attention tests write their cases in (test_cpu_flash.cpp,
// test_cpu_nonfinite.cpp, the block-sparse tests of the CPU, the C API and CUDA, the CUDA forward,
// backward and non-finite tests), so that one case reads as one line:
//   dropout(causal(fixed(1, 97, 97, 4, 1, 80, DType::kBFloat16)), 0.4f)
//
// Problems: fixed() and varlen() take their sizes in ProblemSpec's field order (batch, lengths,
// heads, head dim, dtype last and float32 unless named) and leave every other field at
// ProblemSpec's default, the seed included; each modifier switches on one feature of a copy.
// Block masks (flare/block_sparse.h): the (batch, heads_q) extent and the row and column blocks a
// problem's mask must cover, a mask tensor filled from a per-block predicate, random blocks at a
// density, and the C++ entry points called on a host problem.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "flare/block_sparse.h"
#include "test_util.h"

namespace flare::test::problem_cases {

// ---- problems ------------------------------------------------------------------------------------

inline ProblemSpec fixed(int batch, int seqlen_q, int seqlen_k, int heads_q, int heads_kv,
                         int head_dim, DType dtype = DType::kFloat32) {
  ProblemSpec s;
  s.batch = batch;
  s.seqlen_q = seqlen_q;
  s.seqlen_k = seqlen_k;
  s.heads_q = heads_q;
  s.heads_kv = heads_kv;
  s.head_dim = head_dim;
  s.dtype = dtype;
  return s;
}

// A packed batch of sequences of these lengths (batch and the fixed lengths are then unused).
inline ProblemSpec varlen(std::vector<int> lens_q, std::vector<int> lens_k, int heads_q,
                          int heads_kv, int head_dim, DType dtype = DType::kFloat32) {
  ProblemSpec s = fixed(1, 0, 0, heads_q, heads_kv, head_dim, dtype);
  s.varlen_q = std::move(lens_q);
  s.varlen_k = std::move(lens_k);
  return s;
}

inline ProblemSpec with_seed(ProblemSpec s, uint64_t seed) {
  s.seed = seed;
  return s;
}
// This run's seed (test_seed(): FLARE_TEST_SEED replays it).
inline ProblemSpec with_run_seed(ProblemSpec s) { return with_seed(std::move(s), test_seed()); }
inline ProblemSpec causal(ProblemSpec s) {
  s.options.causal = true;
  return s;
}
inline ProblemSpec window(ProblemSpec s, int left, int right) {
  s.options.window_left = left;
  s.options.window_right = right;
  return s;
}
inline ProblemSpec softcap(ProblemSpec s, float cap) {
  s.options.softcap = cap;
  return s;
}
// Slopes per query head, or per (sequence, query head).
inline ProblemSpec alibi(ProblemSpec s, bool per_batch = false) {
  s.alibi = true;
  s.alibi_per_batch = per_batch;
  return s;
}
inline ProblemSpec dropout(ProblemSpec s, float p) {
  s.options.dropout_p = p;
  return s;
}
inline ProblemSpec deterministic(ProblemSpec s) {
  s.options.deterministic = true;
  return s;
}
// `pad` extra elements of row stride: strides that are not a contiguous tensor's.
inline ProblemSpec padded(ProblemSpec s, int64_t pad) {
  s.pad = pad;
  return s;
}
// q and k drawn with standard deviation `m`.
inline ProblemSpec magnitude(ProblemSpec s, float m) {
  s.magnitude = m;
  return s;
}
// Both score modifiers where they bite: softcap 5 on magnitude-3 scores, and ALiBi slopes per
// (sequence, head).
inline ProblemSpec with_score_mods(ProblemSpec s) {
  return alibi(softcap(magnitude(std::move(s), 3.0f), 5.0f), true);
}

// ---- block masks ---------------------------------------------------------------------------------

// Whether block (r, c) of sequence b, query head h is on.
using BlockOn = std::function<bool(int b, int h, int r, int c)>;

inline bool every_block(int, int, int, int) { return true; }

// Each block on with probability `density`, drawn in the order the blocks are asked for.
inline BlockOn random_blocks(double density, uint64_t seed) {
  auto rng = std::make_shared<std::mt19937_64>(seed);
  return [rng, density](int, int, int, int) {
    return std::uniform_real_distribution<double>(0.0, 1.0)(*rng) < density;
  };
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline bool is_varlen(const ProblemSpec& s) { return !s.varlen_q.empty(); }
// The mask's batch extent: the sequences of the problem.
inline int batch_of(const ProblemSpec& s) {
  return is_varlen(s) ? static_cast<int>(s.varlen_q.size()) : s.batch;
}
// The mask's extent in rows and keys: the longest sequences (varlen) or the fixed lengths.
inline int max_len_q(const ProblemSpec& s) {
  return is_varlen(s) ? *std::max_element(s.varlen_q.begin(), s.varlen_q.end()) : s.seqlen_q;
}
inline int max_len_k(const ProblemSpec& s) {
  return is_varlen(s) ? *std::max_element(s.varlen_k.begin(), s.varlen_k.end()) : s.seqlen_k;
}

// A (mb, mh, rows, cols) mask of `dtype` whose entry (b, h, r, c) is on(b, h, r, c), calling `on`
// once per entry in row-major order. int32 entries that are on take several nonzero values, 256
// and 65536 among them (zero low byte: a kernel reading the mask as bytes would see them off).
// `strided`: a view of the even columns of a buffer twice as wide whose odd columns hold the
// opposite, so a kernel that ignores the column stride reads wrong blocks.
inline HostTensor fill_mask(int64_t mb, int64_t mh, int64_t rows, int64_t cols, DType dtype,
                            bool strided, const BlockOn& on) {
  const int64_t width = strided ? 2 * cols : cols;
  HostTensor t = HostTensor::make(dtype, {mb, mh, rows, width});
  auto put = [&](int64_t at, bool value, int64_t salt) {
    static constexpr int32_t kOnValues[] = {1, 7, -1, 256, 65536};
    if (dtype == DType::kInt32)
      reinterpret_cast<int32_t*>(t.bytes.data())[at] = value ? kOnValues[salt % 5] : 0;
    else
      t.bytes[static_cast<size_t>(at)] = value ? 1 : 0;
  };
  for (int64_t b = 0; b < mb; ++b)
    for (int64_t h = 0; h < mh; ++h)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          const bool value = on(static_cast<int>(b), static_cast<int>(h), static_cast<int>(r),
                                static_cast<int>(c));
          const int64_t at = ((b * mh + h) * rows + r) * width + (strided ? 2 * c : c);
          put(at, value, b + h + r + c);
          if (strided) put(at + 1, !value, b + h + r + c);
        }
  if (strided) {
    t.view.shape[3] = cols;
    t.view.stride[3] = 2;
  }
  return t;
}

// The spec's full (batch, heads_q, row blocks, column blocks) mask at block_m × block_n, each
// block on with probability `density`.
inline HostTensor random_mask(const ProblemSpec& spec, int block_m, int block_n, double density,
                              uint64_t seed, DType dtype = DType::kUInt8) {
  return fill_mask(batch_of(spec), spec.heads_q, ceil_div(max_len_q(spec), block_m),
                   ceil_div(max_len_k(spec), block_n), dtype, false,
                   random_blocks(density, seed));
}

// The C++ block-sparse entry points on a host problem's tensors, options and varlen arguments.
inline Status block_sparse_forward(Problem& pr, const BlockMask& m) {
  return block_sparse_attention_forward(pr.q.view, pr.k.view, pr.v.view, pr.o.view, pr.lse.view,
                                        m, pr.options, pr.varlen);
}
inline Status block_sparse_backward(Problem& pr, const BlockMask& m) {
  return block_sparse_attention_backward(pr.dout.view, pr.q.view, pr.k.view, pr.v.view,
                                         pr.o.view, pr.lse.view, pr.dq.view, pr.dk.view,
                                         pr.dv.view, m, pr.options, pr.varlen);
}

}  // namespace flare::test::problem_cases
