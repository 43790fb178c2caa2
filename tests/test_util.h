// test_util.h — shared machinery for flare's tests: host tensors with random contents, NaN
// poisoning, problem construction (fixed length or varlen, any layout), and the tolerance
// rule (docs/architecture.md, "Tolerance rule").
//
// Tolerance rule: for each output separately,
//   max|fast − ref| ≤ 2 · max|naive − ref| + floor,
// where ref is the float64 reference, naive is the reference computed in the fast path's precision
// (cpu::RefPrecision::kLowPrecision) and floor is the rounding noise at the reference's magnitude:
//   floor = (2 · unit_roundoff(dtype) + unit_roundoff(fp32) · sqrt(n)) · max|ref|,
// two roundings in the dtype — of the probabilities before P·V and of the stored result — plus
// the random-walk noise of an fp32 accumulation of length n (every fast path accumulates in
// fp32; n is the longest reduction behind the output). The naive kernel rounds P too, but where
// a row's softmax is one-hot its P is exactly 1 and that rounding costs it nothing, while a
// kernel that exponentiates with the scale folded into exp2 (FlashAttention's trick) gets
// P = 2^(±ulp) for the same key and pays it. For fp16/bf16 the first term dominates; for fp32 inputs the second keeps
// the comparison of two equally valid fp32 summation orders from being a coin toss.
// Nothing here is tuned per test.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/backends.h"
#include "core/numeric.h"
#include "core/params.h"
#include "flare/attention.h"

namespace flare::test {

// A dense host tensor that owns its bytes; view() may describe a strided sub-view of it.
struct HostTensor {
  std::vector<unsigned char> bytes;
  TensorView view;

  // Contiguous tensor of `shape`.
  static HostTensor make(DType dtype, std::vector<int64_t> shape) {
    HostTensor t;
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    t.bytes.assign(static_cast<size_t>(std::max<int64_t>(n, 1)) * dtype_size(dtype), 0);
    t.view.data = t.bytes.data();
    t.view.dtype = dtype;
    t.view.ndim = static_cast<int>(shape.size());
    int64_t st = 1;
    for (int i = t.view.ndim - 1; i >= 0; --i) {
      t.view.shape[i] = shape[i];
      t.view.stride[i] = st;
      st *= shape[i];
    }
    return t;
  }
  // Padded layout: the row (token) dimension gets `pad` extra elements of stride, so strides are
  // not those of a contiguous tensor (exercises the stride handling of every backend).
  static HostTensor make_padded(DType dtype, std::vector<int64_t> shape, int64_t pad) {
    const int nd = static_cast<int>(shape.size());
    std::vector<int64_t> alloc = shape;
    alloc[nd - 1] += pad;  // pad the innermost row; last stride stays 1
    HostTensor t = make(dtype, alloc);
    t.view.shape[nd - 1] = shape[nd - 1];
    return t;
  }

  int64_t offset(const int64_t* idx) const {
    int64_t o = 0;
    for (int i = 0; i < view.ndim; ++i) o += idx[i] * view.stride[i];
    return o;
  }
  float get(std::initializer_list<int64_t> idx) const {
    return load_as_float(view.data, offset(idx.begin()), view.dtype);
  }
  void set(std::initializer_list<int64_t> idx, float x) {
    store_from_float(view.data, offset(idx.begin()), view.dtype, x);
  }
  // Fill the whole allocation (padding too) with N(0, sigma²) values rounded to the dtype.
  void fill_normal(std::mt19937_64& rng, float sigma = 1.0f) {
    std::normal_distribution<float> dist(0.0f, sigma);
    const int64_t n = static_cast<int64_t>(bytes.size() / dtype_size(view.dtype));
    for (int64_t i = 0; i < n; ++i) store_from_float(bytes.data(), i, view.dtype, dist(rng));
  }
  void poison() {
    const int64_t n = static_cast<int64_t>(bytes.size() / dtype_size(view.dtype));
    for (int64_t i = 0; i < n; ++i)
      store_from_float(bytes.data(), i, view.dtype, std::numeric_limits<float>::quiet_NaN());
  }
};

// Whether every element of `t`, padding included, still holds poison()'s NaN: a call that must
// be rejected is made on poisoned outputs, and writes none of them.
inline bool all_nan(const HostTensor& t) {
  const int64_t n = static_cast<int64_t>(t.bytes.size() / dtype_size(t.view.dtype));
  for (int64_t i = 0; i < n; ++i)
    if (!std::isnan(load_as_float(t.bytes.data(), i, t.view.dtype))) return false;
  return true;
}

// One attention problem: sizes, options and all host tensors.
struct ProblemSpec {
  int batch = 1;
  int seqlen_q = 16;
  int seqlen_k = 16;
  int heads_q = 2;
  int heads_kv = 2;
  int head_dim = 32;
  DType dtype = DType::kFloat32;
  std::vector<int> varlen_q;  // non-empty → varlen with these per-sequence lengths
  std::vector<int> varlen_k;
  bool alibi = false;
  bool alibi_per_batch = false;
  int64_t pad = 0;            // extra row stride (non-contiguous layouts)
  float magnitude = 1.0f;     // std-dev of q and k entries
  AttentionOptions options;
  uint64_t seed = 1;
  std::string describe() const;
};

struct Problem {
  ProblemSpec spec;
  HostTensor q, k, v, o, lse, dout, dq, dk, dv;
  HostTensor cu_q, cu_k, alibi;
  AttentionOptions options;  // spec.options with alibi_slopes set
  VarlenArgs varlen;
  bool is_varlen() const { return !spec.varlen_q.empty(); }

  // Validated params for the forward or backward pass (fails the test if rejected).
  AttentionParams forward_params() const;
  AttentionParams backward_params() const;
  // Outputs read back in packed logical order (matching cpu::RefForward / RefBackward).
  std::vector<double> read_o() const { return read_packed(o); }
  std::vector<double> read_lse() const;
  std::vector<double> read_dq() const { return read_packed(dq); }
  std::vector<double> read_dk() const { return read_packed(dk); }
  std::vector<double> read_dv() const { return read_packed(dv); }
  std::vector<double> read_packed(const HostTensor& t) const;
};

Problem make_problem(const ProblemSpec& spec);

// Seed for this run: FLARE_TEST_SEED from the environment, else a fresh one. Printed by the
// checks on failure so any failure can be replayed.
uint64_t test_seed();

// The tolerance rule for one output; adds a gtest failure naming the output and the numbers.
// Positions where ref is −inf (LSE of fully masked rows) must be exactly −inf in `fast`.
// `reduction_length` is n above (max(d, s_k, s_q · heads_q/heads_kv)).
::testing::AssertionResult within_tolerance(const std::string& name, const std::vector<double>& fast,
                                            const std::vector<double>& ref,
                                            const std::vector<double>& naive, DType dtype,
                                            int64_t reduction_length = 1);
// The same rule with the naive kernel's error given: max|naive − ref| over the finite entries.
::testing::AssertionResult within_tolerance(const std::string& name, const std::vector<double>& fast,
                                            const std::vector<double>& ref, double naive_err,
                                            DType dtype, int64_t reduction_length = 1);
double naive_error(const std::vector<double>& naive, const std::vector<double>& ref);

// n for a problem: the longest reduction behind any output.
int64_t reduction_length(const AttentionParams& p);

double max_abs(const std::vector<double>& x);

// Checks dQ, dK and dV of `pr` (read back from its tensors) against the references. Where the
// exact gradient is at or below the noise of its own fp32 evaluation — every softmax row one-hot
// (a single visible key, or scores hundreds apart), so dS = P·(dP − D) is a difference of two
// equal fp32 dot products — the tolerance rule has a bound of ~0 that no kernel forming dP and D
// as separate sums can meet. There the check is that rounding bound itself: dP and D are d-term
// fp32 dot products of values bounded by max|dO| and max|V|, each within γ_d·d·max|dO|·max|V|
// (γ_d ≈ d·2^-24), so |dS| ≤ 2·d²·2^-24·max|dO|·max|V|·dropout_scale, and a gradient summing
// `terms` such dS·scale·x is bounded by terms·scale·|dS|·max|x|.
// The naive backward of the tolerance rule in both of its summation orders (cpu::RefPrecision):
// a gradient's budget is the larger of their two errors. Where a few summed terms decide the
// largest errors (dK/dV of one query row, dS = P·(dP − D) cancelling), one realisation against
// another is close to a coin toss (fast / naive above 2 on 9 of 300 seeds of a decoding shape);
// two realisations make the budget a steadier estimate of the same rounding.
struct NaiveBackward {
  cpu::RefBackward in_order, reversed;
};
NaiveBackward naive_backward(const AttentionParams& bp);
// Each gradient's naive error: the larger of the two realisations' max|naive − ref|.
struct GradientErrors {
  double dq, dk, dv;
};
GradientErrors gradient_errors(const NaiveBackward& naive, const cpu::RefBackward& ref);

void expect_gradients_match(const Problem& pr, const AttentionParams& bp,
                            const cpu::RefBackward& ref, const NaiveBackward& naive);

// Checks O and LSE of `pr` (read back from its tensors) against the float64 and low-precision
// references of its forward problem under the tolerance rule.
void expect_forward_matches(const Problem& pr);
// The same check against references already computed from pr's inputs (neither forward reference
// reads an output, so one pair serves every result of the same inputs).
void expect_forward_matches(const Problem& pr, const cpu::RefForward& ref,
                            const cpu::RefForward& naive);

// Runs forward (and backward if `backward`) with the given backend on freshly poisoned outputs and
// checks every output against the float64 reference under the tolerance rule.
void check_against_reference(const ProblemSpec& spec, bool backward);

// ---- inputs holding NaN or ±Inf ------------------------------------------------------------------
// The checks above, for inputs with non-finite entries: every output must have the reference's
// non-finite pattern (same_nonfinite_pattern), and its finite entries pass the tolerance rule over
// the finite entries alone, with expect_gradients_match's noise bound taken from the finite input
// values.

// NaN exactly where ref has NaN, the same signed infinity where ref has one, finite elsewhere.
::testing::AssertionResult same_nonfinite_pattern(const std::string& name,
                                                  const std::vector<double>& fast,
                                                  const std::vector<double>& ref);
double max_abs_finite(const std::vector<double>& x);

// The naive kernel's error on each output of a problem without its injected value (its "finite
// twin": same seed, nothing injected). Where the injected value reaches, the naive kernel gives no
// finite sample, so measuring its error on the injected problem would shrink the budget by
// dropping the rows that carried the largest rounding; the twin measures the rounding of the same
// data, as the tolerance rule intends.
struct NaiveErrors {
  double o, lse, dq, dk, dv;
};
NaiveErrors naive_errors(Problem& finite_twin);  // runs the twin's forward (CPU)

// `budget` null: the naive error is measured on the finite entries of the problem itself.
void expect_forward_matches_nonfinite(const Problem& pr, const NaiveErrors* budget = nullptr);
void expect_gradients_match_nonfinite(const Problem& pr, const AttentionParams& bp,
                                      const cpu::RefBackward& ref, const NaiveBackward& naive,
                                      const NaiveErrors* budget = nullptr);

}  // namespace flare::test
