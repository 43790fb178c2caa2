// Tests of the CPU operators (src/train/cpu/ops.h).
//
// Forward: the float instantiation (what the models run, and what the CUDA kernels are compared
// with) against the operator's formula written out directly in double, under the fp32 floor of
// the tolerance rule (tests/test_util.h): (2·u + u·sqrt(n)) · max|ref|, n the longest sum behind
// an output.
// Backward: the double instantiation against central finite differences of the scalar
// L = Σ dy · y, dy random, with respect to every input and parameter, extrapolated from steps h
// and h/2 (Richardson: (4·D(h/2) − D(h)) / 3 cancels the h² term of the truncation error). With
// h = 1e-5 the rounding error u_64 · Σ|terms of L| / h stays below 1e-9 for these sizes and the
// remaining h⁴ term below it too, even where inputs make the derivatives large (a layer norm of
// two nearly equal values: its third derivative grows as 1/σ³, and the plain central difference
// erred by 3.6e-7 on 2 seeds in 400); kFdTolerance leaves a factor 100 over that, while a wrong
// formula errs by O(|grad|).
// Written outputs are poisoned with NaN before the call; accumulated ones start from random values
// and the test checks the increment.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <numbers>
#include <random>
#include <string>
#include <vector>

#include "test_util.h"
#include "train/cpu/ops.h"

namespace flare::train::cpu {
namespace {

using Vec = std::vector<double>;

constexpr double kFdStep = 1e-5;
constexpr double kFdTolerance = 1e-7;  // relative to 1 + max|analytic gradient|, see above
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

std::mt19937_64& rng() {
  static std::mt19937_64 r(test::test_seed());
  return r;
}

// Normal values rounded to float, so the float operator and the double formula read the same
// inputs.
Vec randn(int64_t n, double sigma = 1.0) {
  std::normal_distribution<double> dist(0.0, sigma);
  Vec v(static_cast<size_t>(n));
  for (double& x : v) x = static_cast<float>(dist(rng()));
  return v;
}

std::vector<float> to_float(const Vec& v) { return {v.begin(), v.end()}; }
Vec to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

double dot(const Vec& a, const Vec& b) {
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

double max_abs(const Vec& v) {
  double m = 0.0;
  for (double x : v) m = std::max(m, std::abs(x));
  return m;
}

Vec minus(const Vec& a, const Vec& b) {
  Vec d(a.size());
  for (size_t i = 0; i < a.size(); ++i) d[i] = a[i] - b[i];
  return d;
}

// The tolerance rule in fp32: float result vs the formula in double, within twice the error of a
// naive float evaluation (where the test has one) plus the fp32 floor.
void expect_fp32_close(const std::string& name, const std::vector<float>& fast, const Vec& ref,
                       int64_t reduction_length, double naive_err = 0.0) {
  EXPECT_TRUE(test::within_tolerance(name, to_double(fast), ref, naive_err, DType::kFloat32,
                                     reduction_length));
}

// Central differences of loss() with respect to every entry of x (perturbed and restored in
// place), Richardson-extrapolated (see the top of the file), compared with the analytic gradient.
void expect_matches_fd(const std::string& name, Vec& x, const Vec& analytic,
                       const std::function<double()>& loss) {
  ASSERT_EQ(x.size(), analytic.size()) << name;
  const double tol = kFdTolerance * (1.0 + max_abs(analytic));
  for (size_t i = 0; i < x.size(); ++i) {
    const double saved = x[i];
    auto central = [&](double h) {
      x[i] = saved + h;
      const double up = loss();
      x[i] = saved - h;
      const double down = loss();
      x[i] = saved;
      return (up - down) / (2.0 * h);
    };
    const double fd = (4.0 * central(kFdStep / 2) - central(kFdStep)) / 3.0;
    ASSERT_NEAR(analytic[i], fd, tol) << name << "[" << i << "] seed=" << test::test_seed();
  }
}

void expect_all_finite(const std::string& name, const Vec& v) {
  for (size_t i = 0; i < v.size(); ++i)
    ASSERT_TRUE(std::isfinite(v[i])) << name << "[" << i << "] not written";
}

// ---- Linear -------------------------------------------------------------------------------------

struct MatmulCase {
  int64_t N, in, out;
  bool bias;
};

class MatmulTest : public ::testing::TestWithParam<MatmulCase> {};

TEST_P(MatmulTest, ForwardMatchesFormula) {
  const auto [N, in, out, has_bias] = GetParam();
  const Vec x = randn(N * in), w = randn(out * in), b = randn(out);
  Vec ref(static_cast<size_t>(N * out));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < out; ++o) {
      double s = has_bias ? b[o] : 0.0;
      for (int64_t i = 0; i < in; ++i) s += x[n * in + i] * w[o * in + i];
      ref[n * out + o] = s;
    }
  const auto xf = to_float(x), wf = to_float(w), bf = to_float(b);
  // The naive evaluation, the formula in float in order: a sum that cancels (a product near −b)
  // loses bits that the floor, scaled by the small result, cannot cover.
  Vec naive(ref.size());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < out; ++o) {
      float s = has_bias ? bf[o] : 0.0f;
      for (int64_t i = 0; i < in; ++i) s += xf[n * in + i] * wf[o * in + i];
      naive[n * out + o] = s;
    }
  std::vector<float> y(ref.size(), std::numeric_limits<float>::quiet_NaN());
  matmul_forward(xf.data(), wf.data(), has_bias ? bf.data() : nullptr, y.data(), N, in, out);
  expect_fp32_close("y", y, ref, in + 1, max_abs(minus(naive, ref)));
}

TEST_P(MatmulTest, BackwardMatchesFiniteDifferences) {
  const auto [N, in, out, has_bias] = GetParam();
  Vec x = randn(N * in), w = randn(out * in), b = randn(out);
  const Vec dy = randn(N * out);
  auto loss = [&] {
    Vec y(static_cast<size_t>(N * out));
    matmul_forward(x.data(), w.data(), has_bias ? b.data() : nullptr, y.data(), N, in, out);
    return dot(dy, y);
  };
  Vec dx(x.size(), kNaN);
  const Vec dw0 = randn(out * in), db0 = randn(out);
  Vec dw = dw0, db = db0;
  matmul_backward(dy.data(), x.data(), w.data(), dx.data(), dw.data(),
                  has_bias ? db.data() : nullptr, N, in, out);
  expect_all_finite("dx", dx);
  expect_matches_fd("dx", x, dx, loss);
  expect_matches_fd("dweight", w, minus(dw, dw0), loss);
  if (has_bias) expect_matches_fd("dbias", b, minus(db, db0), loss);
}

INSTANTIATE_TEST_SUITE_P(Sizes, MatmulTest,
                         ::testing::Values(MatmulCase{1, 1, 1, true}, MatmulCase{1, 13, 7, true},
                                           MatmulCase{5, 9, 11, false},
                                           MatmulCase{7, 16, 3, true},
                                           MatmulCase{9, 33, 5, true}));

// ---- Norms --------------------------------------------------------------------------------------

struct NormCase {
  int64_t N, C;
};

class NormTest : public ::testing::TestWithParam<NormCase> {};

constexpr double kEps = 1e-5;

TEST_P(NormTest, LayerNormForwardMatchesFormula) {
  const auto [N, C] = GetParam();
  const Vec x = randn(N * C, 3.0), w = randn(C), b = randn(C);
  Vec ref(x.size());
  for (int64_t n = 0; n < N; ++n) {
    double m = 0.0, v = 0.0;
    for (int64_t c = 0; c < C; ++c) m += x[n * C + c] / static_cast<double>(C);
    for (int64_t c = 0; c < C; ++c) v += std::pow(x[n * C + c] - m, 2) / static_cast<double>(C);
    for (int64_t c = 0; c < C; ++c)
      ref[n * C + c] = (x[n * C + c] - m) / std::sqrt(v + kEps) * w[c] + b[c];
  }
  const auto xf = to_float(x), wf = to_float(w), bf = to_float(b);
  std::vector<float> y(x.size(), std::numeric_limits<float>::quiet_NaN()), mean(N), rstd(N);
  layernorm_forward(xf.data(), wf.data(), bf.data(), y.data(), mean.data(), rstd.data(), N, C,
                    kEps);
  expect_fp32_close("y", y, ref, C);
}

TEST_P(NormTest, LayerNormBackwardMatchesFiniteDifferences) {
  const auto [N, C] = GetParam();
  Vec x = randn(N * C, 3.0), w = randn(C), b = randn(C);
  const Vec dy = randn(N * C);
  Vec mean(N), rstd(N);
  auto loss = [&] {
    Vec y(x.size());
    layernorm_forward(x.data(), w.data(), b.data(), y.data(), mean.data(), rstd.data(), N, C, kEps);
    return dot(dy, y);
  };
  loss();  // fills mean and rstd for the backward
  const Vec dx0 = randn(N * C), dw0 = randn(C), db0 = randn(C);
  Vec dx = dx0, dw = dw0, db = db0;
  layernorm_backward(dy.data(), x.data(), w.data(), mean.data(), rstd.data(), dx.data(),
                     dw.data(), db.data(), N, C);
  expect_matches_fd("dx", x, minus(dx, dx0), loss);
  expect_matches_fd("dweight", w, minus(dw, dw0), loss);
  expect_matches_fd("dbias", b, minus(db, db0), loss);
}

TEST_P(NormTest, RmsNormForwardMatchesFormula) {
  const auto [N, C] = GetParam();
  const Vec x = randn(N * C, 3.0), w = randn(C);
  Vec ref(x.size());
  for (int64_t n = 0; n < N; ++n) {
    double ms = 0.0;
    for (int64_t c = 0; c < C; ++c) ms += x[n * C + c] * x[n * C + c] / static_cast<double>(C);
    for (int64_t c = 0; c < C; ++c) ref[n * C + c] = x[n * C + c] / std::sqrt(ms + kEps) * w[c];
  }
  const auto xf = to_float(x), wf = to_float(w);
  std::vector<float> y(x.size(), std::numeric_limits<float>::quiet_NaN()), rstd(N);
  rmsnorm_forward(xf.data(), wf.data(), y.data(), rstd.data(), N, C, kEps);
  expect_fp32_close("y", y, ref, C);
}

TEST_P(NormTest, RmsNormBackwardMatchesFiniteDifferences) {
  const auto [N, C] = GetParam();
  Vec x = randn(N * C, 3.0), w = randn(C);
  const Vec dy = randn(N * C);
  Vec rstd(N);
  auto loss = [&] {
    Vec y(x.size());
    rmsnorm_forward(x.data(), w.data(), y.data(), rstd.data(), N, C, kEps);
    return dot(dy, y);
  };
  loss();
  const Vec dx0 = randn(N * C), dw0 = randn(C);
  Vec dx = dx0, dw = dw0;
  rmsnorm_backward(dy.data(), x.data(), w.data(), rstd.data(), dx.data(), dw.data(), N, C);
  expect_matches_fd("dx", x, minus(dx, dx0), loss);
  expect_matches_fd("dweight", w, minus(dw, dw0), loss);
}

INSTANTIATE_TEST_SUITE_P(Sizes, NormTest,
                         ::testing::Values(NormCase{1, 2}, NormCase{1, 7}, NormCase{3, 33},
                                           NormCase{6, 64}));

// ---- GELU and SwiGLU ----------------------------------------------------------------------------

TEST(Gelu, ForwardMatchesFormula) {
  const int64_t n = 101;
  const Vec x = randn(n, 3.0);
  Vec ref(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double v = x[i];
    const double u = std::sqrt(2.0 / std::numbers::pi) * (v + 0.044715 * v * v * v);
    ref[i] = 0.5 * v * (1.0 + std::tanh(u));
  }
  auto y = to_float(x);  // in place
  gelu_forward(y.data(), y.data(), n);
  expect_fp32_close("y", y, ref, 1);
}

TEST(Gelu, BackwardMatchesFiniteDifferences) {
  const int64_t n = 37;
  Vec x = randn(n, 3.0);
  const Vec dy = randn(n);
  auto loss = [&] {
    Vec y(x.size());
    gelu_forward(x.data(), y.data(), n);
    return dot(dy, y);
  };
  Vec dx = dy;  // in place
  gelu_backward(dx.data(), x.data(), dx.data(), n);
  expect_matches_fd("dx", x, dx, loss);
}

TEST(SwiGlu, ForwardMatchesFormula) {
  const int64_t N = 3, ffn = 11;
  const Vec gu = randn(N * 2 * ffn, 3.0);
  Vec ref(static_cast<size_t>(N * ffn));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < ffn; ++j) {
      const double g = gu[n * 2 * ffn + j], u = gu[n * 2 * ffn + ffn + j];
      ref[n * ffn + j] = g / (1.0 + std::exp(-g)) * u;
    }
  const auto guf = to_float(gu);
  std::vector<float> out(ref.size(), std::numeric_limits<float>::quiet_NaN());
  swiglu_forward(guf.data(), out.data(), N, ffn);
  expect_fp32_close("out", out, ref, 1);
}

TEST(SwiGlu, BackwardMatchesFiniteDifferences) {
  for (const auto& [N, ffn] : {std::pair<int64_t, int64_t>{1, 1}, {4, 9}}) {
    Vec gu = randn(N * 2 * ffn, 3.0);
    const Vec dout = randn(N * ffn);
    auto loss = [&] {
      Vec out(static_cast<size_t>(N * ffn));
      swiglu_forward(gu.data(), out.data(), N, ffn);
      return dot(dout, out);
    };
    Vec dgu(gu.size(), kNaN);
    swiglu_backward(dout.data(), gu.data(), dgu.data(), N, ffn);
    expect_all_finite("dgate_up", dgu);
    expect_matches_fd("dgate_up", gu, dgu, loss);
  }
}

// ---- RoPE ---------------------------------------------------------------------------------------

// LLaMA-3 scaling of one inverse frequency, written as Hugging Face writes it (masks over the
// unscaled frequency, then the smooth blend over the medium band).
double llama3_inv_freq(double f, const RopeScaling& s) {
  const double wavelen = 2.0 * std::numbers::pi / f;
  const double low = static_cast<double>(s.original_max_position) / s.low_freq_factor;
  const double high = static_cast<double>(s.original_max_position) / s.high_freq_factor;
  const double scaled = wavelen > low ? f / s.factor : f;
  const double smooth = (static_cast<double>(s.original_max_position) / wavelen -
                         s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
  const double blended = (1.0 - smooth) * scaled / s.factor + smooth * scaled;
  const bool medium = !(wavelen < high) && !(wavelen > low);
  return medium ? blended : scaled;
}

TEST(Rope, TableMatchesFormulaWithAndWithoutLlama3Scaling) {
  const int64_t max_pos = 40, D = 64;
  RopeScaling scaling;
  scaling.enabled = true;
  scaling.factor = 8.0;
  scaling.original_max_position = 64;  // small, so all three bands appear at head_dim 64
  for (bool scaled : {false, true}) {
    scaling.enabled = scaled;
    std::vector<float> cos_t(max_pos * D / 2), sin_t(max_pos * D / 2);
    rope_table(cos_t.data(), sin_t.data(), max_pos, D, 500000.0, scaling);
    Vec ref_cos(cos_t.size()), ref_sin(sin_t.size());
    int bands[3] = {0, 0, 0};
    for (int64_t i = 0; i < D / 2; ++i) {
      const double f0 = 1.0 / std::pow(500000.0, 2.0 * static_cast<double>(i) / D);
      const double f = scaled ? llama3_inv_freq(f0, scaling) : f0;
      bands[f == f0 ? 0 : (std::abs(f - f0 / scaling.factor) < 1e-18 ? 2 : 1)]++;
      for (int64_t p = 0; p < max_pos; ++p) {
        ref_cos[p * D / 2 + i] = std::cos(static_cast<double>(p) * f);
        ref_sin[p * D / 2 + i] = std::sin(static_cast<double>(p) * f);
      }
    }
    if (scaled) {
      EXPECT_GT(bands[0], 0);  // kept (high frequency)
      EXPECT_GT(bands[1], 0);  // interpolated
      EXPECT_GT(bands[2], 0);  // divided by factor
    }
    expect_fp32_close("cos", cos_t, ref_cos, 1);
    expect_fp32_close("sin", sin_t, ref_sin, 1);
  }
}

struct RopeCase {
  int64_t B, T, n_head, n_kv, D;
};

class RopeTest : public ::testing::TestWithParam<RopeCase> {};

TEST_P(RopeTest, ForwardRotatesQAndKHeadsOnly) {
  const auto [B, T, H, K, D] = GetParam();
  const int64_t N = B * T, row = (H + 2 * K) * D;
  Vec cos_t(T * D / 2), sin_t(T * D / 2);
  rope_table(cos_t.data(), sin_t.data(), T, D, 10000.0, RopeScaling{});
  const Vec qkv = randn(N * row);
  Vec ref = qkv;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H + K; ++h)
      for (int64_t i = 0; i < D / 2; ++i) {
        const double angle = static_cast<double>(n % T) * std::pow(10000.0, -2.0 * i / D);
        const double a = qkv[n * row + h * D + i], b = qkv[n * row + h * D + i + D / 2];
        ref[n * row + h * D + i] = a * std::cos(angle) - b * std::sin(angle);
        ref[n * row + h * D + i + D / 2] = b * std::cos(angle) + a * std::sin(angle);
      }
  auto out = to_float(qkv);
  const auto cf = to_float(cos_t), sf = to_float(sin_t);
  rope_forward(out.data(), cf.data(), sf.data(), N, T, H, K, D);
  expect_fp32_close("qkv", out, ref, 2);
  for (int64_t n = 0; n < N; ++n)  // v is bit-identical
    for (int64_t j = (H + K) * D; j < row; ++j)
      ASSERT_EQ(out[n * row + j], static_cast<float>(qkv[n * row + j]));
}

TEST_P(RopeTest, BackwardMatchesFiniteDifferences) {
  const auto [B, T, H, K, D] = GetParam();
  const int64_t N = B * T, row = (H + 2 * K) * D;
  Vec cos_t(T * D / 2), sin_t(T * D / 2);
  RopeScaling scaling;
  scaling.enabled = true;
  scaling.original_max_position = 16;
  rope_table(cos_t.data(), sin_t.data(), T, D, 10000.0, scaling);
  Vec qkv = randn(N * row);
  const Vec dy = randn(N * row);
  auto loss = [&] {
    Vec y = qkv;
    rope_forward(y.data(), cos_t.data(), sin_t.data(), N, T, H, K, D);
    return dot(dy, y);
  };
  Vec d = dy;
  rope_backward(d.data(), cos_t.data(), sin_t.data(), N, T, H, K, D);
  expect_matches_fd("dqkv", qkv, d, loss);
}

INSTANTIATE_TEST_SUITE_P(Shapes, RopeTest,
                         ::testing::Values(RopeCase{1, 1, 1, 1, 2}, RopeCase{2, 5, 4, 2, 8},
                                           RopeCase{1, 7, 3, 1, 6}, RopeCase{2, 3, 2, 2, 16}));

// ---- Residual and embedding ---------------------------------------------------------------------

TEST(Residual, ForwardAddsAndBackwardAccumulates) {
  const int64_t n = 19;
  const Vec a = randn(n), b = randn(n), dy = randn(n);
  Vec y(n, kNaN);
  residual_forward(a.data(), b.data(), y.data(), n);
  const Vec da0 = randn(n), db0 = randn(n);
  Vec da = da0, db = db0;
  residual_backward(dy.data(), da.data(), db.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_EQ(y[i], a[i] + b[i]);
    EXPECT_EQ(da[i], da0[i] + dy[i]);
    EXPECT_EQ(db[i], db0[i] + dy[i]);
  }
}

TEST(Embedding, ForwardGathersAndBackwardMatchesFiniteDifferences) {
  const int64_t B = 2, T = 5, N = B * T, V = 7, Vp = 8, C = 3;
  const std::vector<int32_t> tokens = {3, 0, 6, 3, 3, 1, 6, 2, 0, 5};  // repeats share a row
  for (bool with_positions : {true, false}) {
    Vec wte = randn(Vp * C), wpe = randn(T * C);
    const Vec dout = randn(N * C);
    const double* pos = with_positions ? wpe.data() : nullptr;
    Vec out(N * C, kNaN);
    ASSERT_TRUE(embedding_forward(tokens.data(), wte.data(), pos, out.data(), N, T, V, C).ok());
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = 0; c < C; ++c)
        EXPECT_EQ(out[n * C + c],
                  wte[tokens[n] * C + c] + (with_positions ? wpe[(n % T) * C + c] : 0.0));
    auto loss = [&] {
      Vec y(N * C);
      const double* p = with_positions ? wpe.data() : nullptr;
      EXPECT_TRUE(embedding_forward(tokens.data(), wte.data(), p, y.data(), N, T, V, C).ok());
      return dot(dout, y);
    };
    const Vec dwte0 = randn(Vp * C), dwpe0 = randn(T * C);
    Vec dwte = dwte0, dwpe = dwpe0;
    embedding_backward(dout.data(), tokens.data(), dwte.data(),
                       with_positions ? dwpe.data() : nullptr, N, T, C);
    expect_matches_fd("dtoken_table", wte, minus(dwte, dwte0), loss);
    if (with_positions) {
      expect_matches_fd("dposition_table", wpe, minus(dwpe, dwpe0), loss);
    } else {
      EXPECT_EQ(dwpe, dwpe0);
    }
  }
}

TEST(Embedding, RejectsTokensOutsideTheVocabularyWritingNothing) {
  const std::vector<float> wte(8 * 2, 1.0f);
  for (int32_t bad : {-1, 7, 8}) {
    const std::vector<int32_t> tokens = {0, bad};
    std::vector<float> out(4, -3.0f);
    const Status s = embedding_forward<float>(tokens.data(), wte.data(), nullptr, out.data(), 2, 2,
                                              7, 2);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("tokens[1]"), std::string::npos) << s.message();
    for (float v : out) EXPECT_EQ(v, -3.0f);
  }
}

// ---- Classifier ---------------------------------------------------------------------------------

struct ClassifierCase {
  int64_t N, V, Vp;
};

class ClassifierTest : public ::testing::TestWithParam<ClassifierCase> {};

std::vector<int32_t> random_targets(int64_t N, int64_t V, bool with_ignored) {
  std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(V - 1));
  std::vector<int32_t> t(static_cast<size_t>(N));
  for (auto& x : t) x = pick(rng());
  if (with_ignored && N > 1) t[1] = -1;
  return t;
}

TEST_P(ClassifierTest, ForwardMatchesLogSoftmaxAndIgnoresPadding) {
  const auto [N, V, Vp] = GetParam();
  Vec logits = randn(N * Vp, 3.0);
  // Huge padding logits would dominate the softmax if the padding were counted.
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = V; j < Vp; ++j) logits[n * Vp + j] = 1e4;
  const auto targets = random_targets(N, V, true);
  Vec ref_loss(static_cast<size_t>(N), 0.0);
  double total = 0.0;
  int64_t valid = 0;
  for (int64_t n = 0; n < N; ++n) {
    if (targets[n] < 0) continue;
    double m = logits[n * Vp];
    for (int64_t j = 1; j < V; ++j) m = std::max(m, logits[n * Vp + j]);
    double sum = 0.0;
    for (int64_t j = 0; j < V; ++j) sum += std::exp(logits[n * Vp + j] - m);
    ref_loss[n] = std::log(sum) + m - logits[n * Vp + targets[n]];
    total += ref_loss[n];
    ++valid;
  }
  const auto lf = to_float(logits);
  std::vector<float> losses(N, std::numeric_limits<float>::quiet_NaN());
  std::vector<float> dlogits(N * Vp, std::numeric_limits<float>::quiet_NaN());
  ClassifierResult result;
  ASSERT_TRUE(classifier_forward_backward(lf.data(), targets.data(), losses.data(), dlogits.data(),
                                          &result, N, V, Vp).ok());
  EXPECT_EQ(result.n_valid, valid);
  expect_fp32_close("losses", losses, ref_loss, V);
  EXPECT_TRUE(test::within_tolerance("mean_loss", {result.mean_loss},
                                     {total / static_cast<double>(valid)}, 0.0, DType::kFloat32,
                                     N * V));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < Vp; ++j)
      if (j >= V || targets[n] < 0) {
        EXPECT_EQ(dlogits[n * Vp + j], 0.0f) << n << "," << j;
      }
}

TEST_P(ClassifierTest, BackwardMatchesFiniteDifferencesInPlace) {
  const auto [N, V, Vp] = GetParam();
  Vec logits = randn(N * Vp, 3.0);
  const auto targets = random_targets(N, V, true);
  auto loss = [&] {
    ClassifierResult r;
    EXPECT_TRUE(classifier_forward_backward<double>(logits.data(), targets.data(), nullptr,
                                                    nullptr, &r, N, V, Vp).ok());
    return r.mean_loss;
  };
  Vec d = logits;  // the gradient overwrites the logits
  ClassifierResult r;
  ASSERT_TRUE(classifier_forward_backward(d.data(), targets.data(), nullptr, d.data(), &r, N, V,
                                          Vp).ok());
  EXPECT_DOUBLE_EQ(r.mean_loss, loss());
  expect_matches_fd("dlogits", logits, d, loss);
}

INSTANTIATE_TEST_SUITE_P(Sizes, ClassifierTest,
                         ::testing::Values(ClassifierCase{1, 5, 5}, ClassifierCase{3, 7, 8},
                                           ClassifierCase{5, 33, 128}, ClassifierCase{4, 1, 3}));

TEST(Classifier, AllTargetsIgnoredGivesZeroLossAndGradient) {
  const int64_t N = 2, V = 3;
  const std::vector<float> logits = {1, 2, 3, 4, 5, 6};
  const std::vector<int32_t> targets = {-1, -1};
  std::vector<float> d(6, std::numeric_limits<float>::quiet_NaN());
  ClassifierResult r;
  ASSERT_TRUE(classifier_forward_backward(logits.data(), targets.data(), nullptr, d.data(), &r, N,
                                          V, V).ok());
  EXPECT_EQ(r.n_valid, 0);
  EXPECT_EQ(r.mean_loss, 0.0);
  for (float v : d) EXPECT_EQ(v, 0.0f);
}

TEST(Classifier, RejectsBadTargetsAndVocabWritingNothing) {
  const std::vector<float> logits(8, 0.5f);
  std::vector<float> d(8, -7.0f);
  ClassifierResult r;
  for (int32_t bad : {-2, 3, 4}) {
    const std::vector<int32_t> targets = {0, bad};
    const Status s = classifier_forward_backward(logits.data(), targets.data(), nullptr, d.data(),
                                                 &r, 2, 3, 4);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("targets[1]"), std::string::npos) << s.message();
  }
  const std::vector<int32_t> targets = {0, 1};
  const Status s = classifier_forward_backward(logits.data(), targets.data(), nullptr, d.data(), &r,
                                               2, 5, 4);
  EXPECT_NE(s.message().find("vocab_size"), std::string::npos) << s.message();
  for (float v : d) EXPECT_EQ(v, -7.0f);
}

}  // namespace
}  // namespace flare::train::cpu
