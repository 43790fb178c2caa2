// The CPU AdamW reference (src/train/core/adamw.h) against a hand-computed step and against
// torch.optim.AdamW's documented algorithm evaluated in double.
#include "train/core/adamw.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/numeric.h"
#include "train/core/split_master.h"

namespace flare::train {
namespace {

// Two tensors with a gap between them: a decayed (8, 8) matrix at 0 and an undecayed bias of 5
// at 128, as the real layout's alignment would place them after a 72-element tensor.
ParameterLayout small_layout() {
  ParameterLayout layout;
  ParamSpec w;
  w.name = "w";
  w.shape = {8, 8};
  w.numel = 64;
  w.offset = 0;
  w.weight_decay = true;
  ParamSpec b;
  b.name = "b";
  b.shape = {5};
  b.numel = 5;
  b.offset = 128;
  layout.params = {w, b};
  layout.total = 192;
  return layout;
}

TEST(AdamW, OneStepByHand) {
  ParameterLayout layout;
  ParamSpec p;
  p.name = "p";
  p.shape = {2};
  p.numel = 2;
  p.weight_decay = true;
  layout.params = {p};
  layout.total = 2;
  std::vector<float> grads = {0.5f, -2.0f}, master = {1.0f, -3.0f}, m(2, 0.0f), v(2, 0.0f);
  std::vector<uint16_t> weights(2);
  AdamWStep s;
  s.lr = 0.1;
  s.beta1 = 0.9;
  s.beta2 = 0.999;
  s.eps = 1e-8;
  s.weight_decay = 0.1;
  ASSERT_TRUE(adamw_step(layout, s, grads.data(), master.data(), m.data(), v.data(), weights.data()).ok());
  // t = 1: m̂ = g and v̂ = g², so the step is lr·g/(|g| + eps) ≈ lr·sign(g), after decay by 0.99.
  EXPECT_NEAR(master[0], 0.99 * 1.0 - 0.1 * 0.5 / (0.5 + 1e-8), 1e-7);
  EXPECT_NEAR(master[1], 0.99 * -3.0 + 0.1 * 2.0 / (2.0 + 1e-8), 3e-7);
  EXPECT_FLOAT_EQ(m[0], 0.05f);
  EXPECT_FLOAT_EQ(v[1], 0.004f);
  EXPECT_EQ(weights[0], float_to_bf16(master[0]));
  EXPECT_EQ(weights[1], float_to_bf16(master[1]));
}

// torch.optim.AdamW (documentation's algorithm, amsgrad off, maximize off) in double.
struct TorchAdamW {
  std::vector<double> p, m, v;
  void step(const ParameterLayout& layout, const AdamWStep& s, const std::vector<float>& g) {
    for (const ParamSpec& spec : layout.params) {
      for (int64_t i = spec.offset; i < spec.offset + spec.numel; ++i) {
        const double gi = static_cast<double>(g[i]) * s.grad_scale;
        if (spec.weight_decay) p[i] -= s.lr * s.weight_decay * p[i];
        m[i] = s.beta1 * m[i] + (1 - s.beta1) * gi;
        v[i] = s.beta2 * v[i] + (1 - s.beta2) * gi * gi;
        const double m_hat = m[i] / (1 - std::pow(s.beta1, s.t));
        const double v_hat = v[i] / (1 - std::pow(s.beta2, s.t));
        p[i] -= s.lr * m_hat / (std::sqrt(v_hat) + s.eps);
      }
    }
  }
};

TEST(AdamW, TenStepsMatchTorchFormulaInDouble) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);

  const ParameterLayout layout = small_layout();
  const float kGap = 12345.0f;  // the gap must never change
  std::vector<float> master(layout.total, kGap), m(layout.total, kGap), v(layout.total, kGap);
  std::vector<uint16_t> weights(layout.total, 0xffff);
  TorchAdamW ref{std::vector<double>(layout.total), std::vector<double>(layout.total),
                 std::vector<double>(layout.total)};
  for (const ParamSpec& p : layout.params) {
    for (int64_t i = p.offset; i < p.offset + p.numel; ++i) {
      master[i] = normal(rng);
      m[i] = v[i] = 0.0f;
      ref.p[i] = master[i];
    }
  }

  AdamWStep s;
  s.beta1 = 0.9;
  s.beta2 = 0.95;
  s.eps = 1e-8;
  s.weight_decay = 0.1;
  const int kSteps = 10;
  for (int step = 1; step <= kSteps; ++step) {
    std::vector<float> grads(layout.total, 0.0f);
    for (const ParamSpec& p : layout.params)
      for (int64_t i = p.offset; i < p.offset + p.numel; ++i) grads[i] = normal(rng) * 3.0f;
    s.t = step;
    s.lr = 1e-2 * step;
    s.grad_scale = clip_scale(gradient_norm(layout, grads.data()), 1.0);
    ASSERT_TRUE(adamw_step(layout, s, grads.data(), master.data(), m.data(), v.data(), weights.data()).ok());
    ref.step(layout, s, grads);
  }
  // Each fp32 step rounds a handful of operations on values of size |p| and lr: the error grows
  // by at most ~8 units of 2^-24 of (|p| + lr) per step.
  for (const ParamSpec& p : layout.params) {
    for (int64_t i = p.offset; i < p.offset + p.numel; ++i) {
      const double bound = kSteps * 8.0 * std::ldexp(std::abs(ref.p[i]) + 0.1, -24);
      EXPECT_NEAR(master[i], ref.p[i], bound) << p.name << " element " << i - p.offset;
      EXPECT_EQ(weights[i], float_to_bf16(master[i]));
    }
  }
  for (int64_t i = 64; i < 128; ++i) {
    EXPECT_EQ(master[i], kGap);
    EXPECT_EQ(m[i], kGap);
    EXPECT_EQ(weights[i], 0xffff);
  }
}

TEST(AdamW, UndecayedTensorsIgnoreWeightDecay) {
  const ParameterLayout layout = small_layout();
  std::vector<float> grads(layout.total, 0.0f), master(layout.total, 1.0f), m(layout.total, 0.0f),
      v(layout.total, 0.0f);
  AdamWStep s;
  s.lr = 0.5;
  s.weight_decay = 0.5;
  ASSERT_TRUE(adamw_step(layout, s, grads.data(), master.data(), m.data(), v.data(), nullptr).ok());
  EXPECT_FLOAT_EQ(master[0], 0.75f);   // decayed by 1 − 0.25, zero gradient
  EXPECT_FLOAT_EQ(master[128], 1.0f);  // the bias keeps its value
}

TEST(AdamW, GradientNormAndClipScale) {
  const ParameterLayout layout = small_layout();
  std::vector<float> grads(layout.total, 0.0f);
  grads[3] = 3.0f;
  grads[130] = 4.0f;
  grads[100] = 1000.0f;  // in the gap: not part of any tensor
  EXPECT_DOUBLE_EQ(gradient_norm(layout, grads.data()), 5.0);
  EXPECT_FLOAT_EQ(clip_scale(5.0, 1.0), static_cast<float>(1.0 / (5.0 + 1e-6)));
  EXPECT_EQ(clip_scale(0.5, 1.0), 1.0f);
  EXPECT_EQ(clip_scale(5.0, 0.0), 1.0f);
  grads[4] = NAN;
  EXPECT_TRUE(std::isnan(gradient_norm(layout, grads.data())));
  grads[4] = INFINITY;
  EXPECT_TRUE(std::isinf(gradient_norm(layout, grads.data())));
}

TEST(AdamW, RejectsBadArguments) {
  const ParameterLayout layout = small_layout();
  std::vector<float> b(layout.total, 0.0f);
  auto run = [&](AdamWStep s, const float* grads = nullptr) {
    return adamw_step(layout, s, grads ? grads : b.data(), b.data(), b.data(), b.data(), nullptr);
  };
  AdamWStep s;
  s.t = 0;
  EXPECT_NE(run(s).message().find("t = 0"), std::string::npos);
  s = {};
  s.lr = -1;
  EXPECT_NE(run(s).message().find("lr"), std::string::npos);
  s = {};
  s.beta1 = 1.0;
  EXPECT_NE(run(s).message().find("beta1"), std::string::npos);
  s = {};
  s.beta2 = -0.1;
  EXPECT_NE(run(s).message().find("beta2"), std::string::npos);
  s = {};
  s.eps = 0;
  EXPECT_NE(run(s).message().find("eps"), std::string::npos);
  s = {};
  s.weight_decay = NAN;
  EXPECT_NE(run(s).message().find("weight_decay"), std::string::npos);
  s = {};
  s.grad_scale = INFINITY;
  EXPECT_NE(run(s).message().find("grad_scale"), std::string::npos);
  EXPECT_FALSE(adamw_step(layout, {}, nullptr, b.data(), b.data(), b.data(), nullptr).ok());
}


// The split master (split_master.h): the weight half is the master rounded to nearest even, and
// the two halves give back the master bit for bit, except an exact tie, which moves one ulp
// towards the side it rounded to and keeps its weight.
TEST(SplitMaster, WeightIsTheRoundedMasterAndTheHalvesGiveItBack) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> any;
  auto check = [](uint32_t bits) {
    const float x = bits_float(bits);
    const SplitMaster h = split_master(x);
    const float back = join_master(h.weight, h.low);
    if (std::isnan(x)) {
      EXPECT_TRUE(std::isnan(back)) << std::hex << bits;
      return;
    }
    EXPECT_EQ(h.weight, float_to_bf16(x)) << std::hex << bits;
    EXPECT_NE(h.low, 0x8000u) << std::hex << bits;
    const uint32_t got = float_bits(back);
    if ((bits & 0xffffu) != 0x8000u) {
      EXPECT_EQ(got, bits) << std::hex << bits;
    } else {
      const bool rounded_up = (bits >> 16) & 1u;  // ties go to the even top half
      EXPECT_EQ(got, rounded_up ? bits + 1 : bits - 1) << std::hex << bits;
      EXPECT_EQ(float_to_bf16(back), h.weight) << std::hex << bits;
    }
    // Stored again, the master keeps every bit (resume from a checkpoint).
    const SplitMaster again = split_master(back);
    EXPECT_EQ(again.weight, h.weight);
    EXPECT_EQ(again.low, h.low);
  };
  for (int i = 0; i < 200000; ++i) check(any(rng));
  // Ties on both sides of rounding and of sign, rounding into the next binade, the largest
  // finite values (one rounds to inf), zeros, subnormals, infinities and NaNs.
  for (uint32_t top : {0x3f80u, 0x3f81u, 0xbf80u, 0xbf81u, 0x3fffu, 0x7f7fu, 0xff7fu, 0x0000u, 0x8000u, 0x0001u})
    for (uint32_t low : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) check(top << 16 | low);
  for (uint32_t bits : {0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00001u, 0x7f800001u, 0x7fff8000u}) check(bits);
  EXPECT_TRUE(std::isinf(join_master(split_master(INFINITY).weight, split_master(INFINITY).low)));
  const SplitMaster big = split_master(bits_float(0x7f7fffffu));  // rounds up to inf in bf16
  EXPECT_EQ(big.weight, 0x7f80u);
  EXPECT_EQ(float_bits(join_master(big.weight, big.low)), 0x7f7fffffu);
}

}  // namespace
}  // namespace flare::train
