// The ground truth is only as good as its own tests. The float64 reference is checked against
// (1) central finite differences of L = Σ dO∘O for its backward, with the error bound estimated
// by Richardson extrapolation rather than chosen by hand, (2) closed forms for the forward (zero
// queries give the mean of the visible values and LSE = log(#visible), which checks every mask
// against an independent hand-written predicate), and (3) its low-precision twin converging to it.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <string>

#include "core/score_mod.h"
#include "test_util.h"

namespace flare::test {
namespace {

// L(x) = Σ dO ∘ O(x) for the problem as currently stored.
double loss(const Problem& pr) {
  const AttentionParams p = pr.forward_params();
  const cpu::RefForward f = cpu::reference_forward(p, cpu::RefPrecision::kFloat64);
  const std::vector<double> dout = pr.read_packed(pr.dout);
  double l = 0;
  for (size_t i = 0; i < dout.size(); ++i) l += dout[i] * f.o[i];
  return l;
}

// Checks d L / d x[e] for every element e of `t` (which is one of q, k, v of `pr`) against the
// analytic gradient `grad` (packed order, same as read_packed(t)).
void check_gradient(Problem& pr, HostTensor& t, const std::vector<double>& grad, const char* name) {
  // Walk the tensor in packed logical order, as read_packed does.
  std::vector<int64_t> offsets;
  const TensorView& v = t.view;
  if (v.ndim == 3) {
    for (int64_t r = 0; r < v.shape[0]; ++r)
      for (int64_t h = 0; h < v.shape[1]; ++h)
        for (int64_t c = 0; c < v.shape[2]; ++c)
          offsets.push_back(r * v.stride[0] + h * v.stride[1] + c);
  } else {
    for (int64_t b = 0; b < v.shape[0]; ++b)
      for (int64_t r = 0; r < v.shape[1]; ++r)
        for (int64_t h = 0; h < v.shape[2]; ++h)
          for (int64_t c = 0; c < v.shape[3]; ++c)
            offsets.push_back(b * v.stride[0] + r * v.stride[1] + h * v.stride[2] + c);
  }
  ASSERT_EQ(offsets.size(), grad.size());
  auto* data = reinterpret_cast<float*>(t.bytes.data());
  // Central difference using the actually stored (fp32) perturbed values, so storage rounding
  // of x ± h does not pollute the quotient.
  auto central = [&](int64_t off, float h) {
    const float x = data[off];
    data[off] = x + h;
    const float xp = data[off];
    const double lp = loss(pr);
    data[off] = x - h;
    const float xm = data[off];
    const double lm = loss(pr);
    data[off] = x;
    return (lp - lm) / (static_cast<double>(xp) - xm);
  };
  for (size_t e = 0; e < offsets.size(); ++e) {
    const double coarse = central(offsets[e], 1.0f / 64);
    const double fine = central(offsets[e], 1.0f / 128);
    // Truncation error is O(h²): fine's error ≈ |coarse − fine| / 3. Allow that estimate (×3 for
    // safety, i.e. |coarse − fine|) plus float64 round-off of the loss differences.
    const double bound = std::fabs(coarse - fine) + 1e-9 * (1.0 + std::fabs(fine));
    EXPECT_LE(std::fabs(grad[e] - fine), bound)
        << name << "[" << e << "]: analytic " << grad[e] << " vs finite difference " << fine
        << " (coarse " << coarse << ")";
  }
}

struct GradCase {
  const char* name;
  std::function<void(ProblemSpec&)> setup;
};

class ReferenceGradient : public ::testing::TestWithParam<GradCase> {};

TEST_P(ReferenceGradient, MatchesFiniteDifferences) {
  ProblemSpec spec;
  spec.batch = 2;
  spec.seqlen_q = 5;
  spec.seqlen_k = 6;
  spec.heads_q = 2;
  spec.heads_kv = 1;
  spec.head_dim = 3;
  spec.seed = test_seed();
  GetParam().setup(spec);
  SCOPED_TRACE(spec.describe());
  Problem pr = make_problem(spec);
  const AttentionParams p = pr.backward_params();
  const cpu::RefBackward g = cpu::reference_backward(p, cpu::RefPrecision::kFloat64);
  check_gradient(pr, pr.q, g.dq, "dQ");
  check_gradient(pr, pr.k, g.dk, "dK");
  check_gradient(pr, pr.v, g.dv, "dV");
}

INSTANTIATE_TEST_SUITE_P(
    Features, ReferenceGradient,
    ::testing::Values(GradCase{"plain", [](ProblemSpec&) {}},
                      GradCase{"causal", [](ProblemSpec& s) { s.options.causal = true; }},
                      GradCase{"causal_sq_gt_sk",
                               [](ProblemSpec& s) {
                                 s.seqlen_q = 7;
                                 s.seqlen_k = 4;
                                 s.options.causal = true;
                               }},
                      GradCase{"window",
                               [](ProblemSpec& s) {
                                 s.options.window_left = 2;
                                 s.options.window_right = 1;
                               }},
                      GradCase{"softcap",
                               [](ProblemSpec& s) {
                                 s.options.softcap = 1.5f;
                                 s.magnitude = 2.0f;
                               }},
                      GradCase{"alibi",
                               [](ProblemSpec& s) {
                                 s.alibi = true;
                                 s.alibi_per_batch = true;
                               }},
                      GradCase{"dropout",
                               [](ProblemSpec& s) {
                                 s.options.dropout_p = 0.3f;
                                 s.options.dropout_seed = 7;
                               }},
                      GradCase{"scale", [](ProblemSpec& s) { s.options.softmax_scale = 0.9f; }},
                      GradCase{"varlen",
                               [](ProblemSpec& s) {
                                 s.varlen_q = {3, 0, 4};
                                 s.varlen_k = {2, 5, 3};
                                 s.options.causal = true;
                               }},
                      GradCase{"padded",
                               [](ProblemSpec& s) {
                                 s.pad = 3;
                                 s.heads_kv = 2;
                               }}),
    [](const ::testing::TestParamInfo<GradCase>& c) { return std::string(c.param.name); });

// Predicate written independently of score_mod.h: bottom-right aligned causal / window.
bool visible(int i, int j, int sq, int sk, const AttentionOptions& o) {
  const int pos = i + sk - sq;
  if (o.causal && j > pos) return false;
  if (o.window_left >= 0 && j < pos - o.window_left) return false;
  if (o.window_right >= 0 && j > pos + o.window_right) return false;
  return true;
}

struct MaskCase {
  const char* name;
  int sq, sk;
  AttentionOptions options;
};

class ReferenceMask : public ::testing::TestWithParam<MaskCase> {};

// With q = 0 every visible score is 0: O_i is the mean of the visible v_j and LSE_i = log(n_i).
TEST_P(ReferenceMask, ZeroQueriesAverageVisibleValues) {
  const MaskCase& mc = GetParam();
  ProblemSpec spec;
  spec.seqlen_q = mc.sq;
  spec.seqlen_k = mc.sk;
  spec.heads_q = 1;
  spec.heads_kv = 1;
  spec.head_dim = 4;
  spec.options = mc.options;
  spec.seed = test_seed();
  Problem pr = make_problem(spec);
  std::fill(pr.q.bytes.begin(), pr.q.bytes.end(), 0);
  const cpu::RefForward f =
      cpu::reference_forward(pr.forward_params(), cpu::RefPrecision::kFloat64);
  for (int i = 0; i < mc.sq; ++i) {
    int n = 0;
    double mean[4] = {0, 0, 0, 0};
    for (int j = 0; j < mc.sk; ++j) {
      if (!visible(i, j, mc.sq, mc.sk, mc.options)) continue;
      ++n;
      for (int c = 0; c < 4; ++c) mean[c] += pr.v.get({0, j, 0, c});
    }
    if (n == 0) {
      EXPECT_EQ(f.lse[i], -INFINITY) << "row " << i;
      for (int c = 0; c < 4; ++c) EXPECT_EQ(f.o[i * 4 + c], 0.0) << "row " << i;
      continue;
    }
    EXPECT_NEAR(f.lse[i], std::log(static_cast<double>(n)), 1e-12) << "row " << i;
    for (int c = 0; c < 4; ++c) EXPECT_NEAR(f.o[i * 4 + c], mean[c] / n, 1e-12) << "row " << i;
  }
}

AttentionOptions opts(bool causal, int left, int right) {
  AttentionOptions o;
  o.causal = causal;
  o.window_left = left;
  o.window_right = right;
  return o;
}

INSTANTIATE_TEST_SUITE_P(Masks, ReferenceMask,
                         ::testing::Values(MaskCase{"full", 7, 9, opts(false, -1, -1)},
                                           MaskCase{"causal_square", 8, 8, opts(true, -1, -1)},
                                           MaskCase{"causal_sq_lt_sk", 4, 9, opts(true, -1, -1)},
                                           MaskCase{"causal_sq_gt_sk", 9, 4, opts(true, -1, -1)},
                                           MaskCase{"window_left", 9, 9, opts(false, 2, -1)},
                                           MaskCase{"window_right", 9, 9, opts(false, -1, 1)},
                                           MaskCase{"window_both", 6, 11, opts(false, 1, 2)},
                                           MaskCase{"window_zero", 5, 5, opts(false, 0, 0)},
                                           MaskCase{"causal_window", 10, 7, opts(true, 3, -1)},
                                           MaskCase{"window_outside", 3, 12, opts(false, 0, -1)}),
                         [](const ::testing::TestParamInfo<MaskCase>& c) {
                           return std::string(c.param.name);
                         });

// A single visible key: O = z·v, LSE = that key's (modified) score.
TEST(Reference, SingleKeyClosedForm) {
  ProblemSpec spec;
  spec.seqlen_q = 3;
  spec.seqlen_k = 1;
  spec.heads_q = 2;
  spec.heads_kv = 1;
  spec.head_dim = 5;
  spec.alibi = true;
  spec.options.softcap = 2.0f;
  spec.seed = test_seed();
  Problem pr = make_problem(spec);
  const AttentionParams p = pr.forward_params();
  const cpu::RefForward f = cpu::reference_forward(p, cpu::RefPrecision::kFloat64);
  for (int h = 0; h < 2; ++h) {
    const double slope = reinterpret_cast<const float*>(pr.alibi.bytes.data())[h];
    for (int i = 0; i < 3; ++i) {
      double t = 0;
      for (int c = 0; c < 5; ++c) t += double(pr.q.get({0, i, h, c})) * pr.k.get({0, 0, 0, c});
      t *= p.scale;
      const double s = 2.0 * std::tanh(t / 2.0) - slope * std::abs(i + 1 - 3 - 0);
      EXPECT_NEAR(f.lse[h * 3 + i], s, 1e-6);
      for (int c = 0; c < 5; ++c)
        EXPECT_NEAR(f.o[(i * 2 + h) * 5 + c], pr.v.get({0, 0, 0, c}), 1e-12);
    }
  }
}

// The low-precision twin is close to the truth for fp32 inputs (so the tolerance rule's budget
// is meaningful) and further from it for bf16 than for fp16.
TEST(Reference, LowPrecisionErrorOrdering) {
  double err[3] = {0, 0, 0};
  const DType dtypes[3] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
  for (int t = 0; t < 3; ++t) {
    ProblemSpec spec;
    spec.seqlen_q = spec.seqlen_k = 64;
    spec.head_dim = 32;
    spec.dtype = dtypes[t];
    spec.seed = test_seed();
    Problem pr = make_problem(spec);
    const AttentionParams p = pr.forward_params();
    const cpu::RefForward a = cpu::reference_forward(p, cpu::RefPrecision::kFloat64);
    const cpu::RefForward b = cpu::reference_forward(p, cpu::RefPrecision::kLowPrecision);
    for (size_t i = 0; i < a.o.size(); ++i) err[t] = std::max(err[t], std::fabs(a.o[i] - b.o[i]));
  }
  EXPECT_LT(err[0], 1e-5);
  EXPECT_GT(err[0], 0.0);
  EXPECT_LT(err[1], err[2]);
}

// The reversed naive backward (test_util.h's NaiveBackward) is a second realisation of the same
// rounding: it differs from the in-order one somewhere, both stay near the truth, and the
// forward ignores the order.
TEST(Reference, ReversedLowPrecisionBackwardIsAnotherRealisation) {
  ProblemSpec spec;
  spec.seqlen_q = spec.seqlen_k = 64;
  spec.head_dim = 32;
  spec.options.softcap = 5.0f;
  spec.seed = test_seed();
  Problem pr = make_problem(spec);
  const Status s = attention_forward(pr.q.view, pr.k.view, pr.v.view, pr.o.view, pr.lse.view,
                                     pr.options, pr.varlen);
  ASSERT_TRUE(s.ok()) << s.to_string();
  const AttentionParams fp = pr.forward_params();
  EXPECT_EQ(cpu::reference_forward(fp, cpu::RefPrecision::kLowPrecision).o,
            cpu::reference_forward(fp, cpu::RefPrecision::kLowPrecisionReversed).o);
  const AttentionParams bp = pr.backward_params();
  const cpu::RefBackward truth = cpu::reference_backward(bp, cpu::RefPrecision::kFloat64);
  const NaiveBackward naive = naive_backward(bp);
  const std::vector<double>* in_order[3] = {&naive.in_order.dq, &naive.in_order.dk,
                                            &naive.in_order.dv};
  const std::vector<double>* reversed[3] = {&naive.reversed.dq, &naive.reversed.dk,
                                            &naive.reversed.dv};
  const std::vector<double>* exact[3] = {&truth.dq, &truth.dk, &truth.dv};
  for (int g = 0; g < 3; ++g) {
    SCOPED_TRACE(g);
    EXPECT_NE(*in_order[g], *reversed[g]);
    const double scale = max_abs(*exact[g]);
    EXPECT_LT(naive_error(*in_order[g], *exact[g]), 1e-5 * scale);
    EXPECT_LT(naive_error(*reversed[g], *exact[g]), 1e-5 * scale);
  }
}

// ElementMask (the GPU kernels' per-element mask) against visible_keys, the one definition: every
// (fragment start, element offset) over small shapes and every window kind, keys past len_k
// included.
TEST(ElementMask, AgreesWithVisibleKeys) {
  for (int len_q : {1, 2, 5, 9})
    for (int len_k : {1, 3, 6, 11})
      for (int left : {-1, 0, 1, 3})
        for (int right : {-1, 0, 2})
          for (int row0 = 0; row0 < len_q; ++row0)
            for (int key0 = 0; key0 < len_k + 2; ++key0) {
              const ElementMask mask(key0 - key0 / 2, key0 / 2, row0, len_q, len_k, left, right);
              for (int dr = 0; row0 + dr < len_q; ++dr)
                for (int dk = 0; dk < 12; ++dk) {
                  const KeyRange keys = visible_keys(row0 + dr, len_q, len_k, left, right);
                  const int key = key0 + dk;
                  EXPECT_EQ(mask.masked(dk, dr), !(key >= keys.lo && key < keys.hi))
                      << "len_q " << len_q << " len_k " << len_k << " window (" << left << ", "
                      << right << ") row " << row0 + dr << " key " << key;
                }
            }
}

// ScoreMods (the GPU kernels' softcap and ALiBi, on raw scores with the softmax scale folded into
// their constants) against attention.h's definition on the scaled score, in double:
// scale·mods(raw) = c·tanh(scale·raw / c) − slope·|rel|, the bias's |rel| being alibi_bias's
// distance for the element ElementMask::rel names. fp32 rounds the folded constants, the products
// and tanhf once each: a few ulps of the terms' magnitude.
TEST(ScoreMods, RawUnitsAgreeWithTheScaledDefinition) {
  static const float slopes[1] = {};
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  for (float scale : {0.0883883f, 0.125f, 1.0f, 3.7f})
    for (float cap : {0.0f, 0.5f, 5.0f, 30.0f})
      for (float slope : {0.0f, 0.0625f, 2.0f}) {
        AttentionParams p;
        p.scale = scale;
        p.softcap = cap;
        p.alibi_slopes = slope > 0.0f ? slopes : nullptr;
        const ScoreMods mods(p, slope);
        EXPECT_EQ(mods.capped, cap > 0.0f);
        EXPECT_EQ(mods.alibi, slope > 0.0f);
        for (int n = 0; n < 2000; ++n) {
          const float raw = unit(rng) * (n % 3 == 0 ? 1e3f : 8.0f);
          const int len_q = 1 + n % 37, len_k = 1 + (n * 7) % 53;
          const int row = n % len_q, key = (n * 3) % len_k;
          const ElementMask mask(key, 0, row, len_q, len_k, -1, -1);
          float x = mods.capped ? mods.cap(raw) : raw;
          if (mods.alibi) x = mods.bias(x, static_cast<float>(mask.rel(0, 0)));
          double want = static_cast<double>(scale) * raw;
          if (cap > 0.0f) want = cap * std::tanh(want / cap);
          if (slope > 0.0f) want += alibi_bias(slope, row, key, len_q, len_k);
          const double magnitude = std::fabs(want) + std::fabs(alibi_bias(slope, row, key, len_q,
                                                                          len_k)) + 1e-30;
          EXPECT_NEAR(static_cast<double>(scale) * x, want, 8 * 0x1p-24 * magnitude)
              << "scale " << scale << " cap " << cap << " slope " << slope << " raw " << raw
              << " row " << row << " key " << key;
        }
        // The cap holds infinite scores at ±c and keeps NaN.
        if (cap > 0.0f) {
          EXPECT_NEAR(scale * mods.cap(std::numeric_limits<float>::infinity()), cap, 4e-7 * cap);
          EXPECT_TRUE(std::isnan(mods.cap(std::numeric_limits<float>::quiet_NaN())));
        }
      }
}

// modified_score (the element-wise kernels' softcap and ALiBi on the scaled score) against
// attention.h's definition in double, and its softcap factor against 1 − tanh²: fp32 rounds 1/c,
// the product and tanhf once each. Without a cap the score passes through with the bias added
// and the factor is exactly 1; NaN stays NaN and an infinite score is held at ±c.
TEST(ScoreMods, ElementwiseAgreesWithTheDefinition) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  for (float cap : {0.0f, 0.5f, 5.0f, 30.0f})
    for (float bias : {0.0f, -0.75f, -300.0f}) {
      const float inverse = cap > 0.0f ? 1.0f / cap : 0.0f;
      for (int n = 0; n < 2000; ++n) {
        const float t = unit(rng) * (n % 3 == 0 ? 1e3f : 8.0f);
        float factor = -1.0f;
        const float got = modified_score(t, cap, inverse, bias, &factor);
        if (cap == 0.0f) {
          EXPECT_EQ(got, t + bias);
          EXPECT_EQ(factor, 1.0f);
          continue;
        }
        const double th = std::tanh(static_cast<double>(t) / cap);
        const double want = cap * th + bias;
        EXPECT_NEAR(got, want, 8 * 0x1p-24 * (cap + std::fabs(bias)))
            << "cap " << cap << " bias " << bias << " t " << t;
        EXPECT_NEAR(factor, 1.0 - th * th, 8 * 0x1p-24) << "cap " << cap << " t " << t;
        EXPECT_EQ(modified_score(t, cap, inverse, bias), got);  // the factor is optional
      }
      EXPECT_TRUE(std::isnan(modified_score(std::numeric_limits<float>::quiet_NaN(), cap,
                                            inverse, bias)));
      if (cap > 0.0f) {
        EXPECT_NEAR(modified_score(-std::numeric_limits<float>::infinity(), cap, inverse, 0.0f),
                    -cap, 4e-7 * cap);
      }
    }
}

// rows_seeing, tile_sees_all and keys_seen (the backward kernels' walk, boundary tests and
// deterministic turns) against visible_keys row by row, windows up to INT_MAX included (the
// bounds' sums pass 2^31 there).
TEST(TileMask, RowsSeeingAgreeWithVisibleKeys) {
  constexpr int kHuge = std::numeric_limits<int>::max();
  for (int len_q : {1, 2, 5, 9})
    for (int len_k : {1, 3, 6, 11})
      for (int left : {-1, 0, 1, 3, kHuge - 1, kHuge})
        for (int right : {-1, 0, 2, kHuge})
          for (int key0 = 0; key0 < len_k; ++key0)
            for (int key_end = key0 + 1; key_end <= len_k + 2; ++key_end) {
              const auto sees = [&](int row, int key) {
                const KeyRange keys = visible_keys(row, len_q, len_k, left, right);
                return key >= keys.lo && key < keys.hi;
              };
              const std::string at = "len_q " + std::to_string(len_q) + " len_k " +
                                     std::to_string(len_k) + " window (" + std::to_string(left) +
                                     ", " + std::to_string(right) + ") keys [" +
                                     std::to_string(key0) + ", " + std::to_string(key_end) + ")";
              if (key_end <= len_k) {
                const RowRange rows = rows_seeing(key0, key_end, len_q, len_k, left, right);
                for (int row = 0; row < len_q; ++row) {
                  bool any = false;
                  for (int key = key0; key < key_end; ++key) any = any || sees(row, key);
                  EXPECT_EQ(row >= rows.lo && row < rows.hi, any) << at << " row " << row;
                }
              }
              for (int row0 = 0; row0 < len_q; ++row0)
                for (int row_end = row0 + 1; row_end <= len_q; ++row_end) {
                  bool every = true;
                  for (int row = row0; row < row_end; ++row)
                    for (int key = key0; key < key_end; ++key) every = every && sees(row, key);
                  EXPECT_EQ(tile_sees_all(row0, row_end, key0, key_end, len_q, len_k, left, right),
                            every)
                      << at << " rows [" << row0 << ", " << row_end << ")";
                  if (key0 == 0 && key_end == 1) {  // once per row range
                    const KeyRange seen = keys_seen(row0, row_end, len_q, len_k, left, right);
                    for (int key = 0; key < len_k; ++key) {
                      bool any = false;
                      for (int row = row0; row < row_end; ++row) any = any || sees(row, key);
                      EXPECT_EQ(key >= seen.lo && key < seen.hi, any)
                          << at << " rows [" << row0 << ", " << row_end << ") key " << key;
                    }
                  }
                }
            }
}

}  // namespace
}  // namespace flare::test
