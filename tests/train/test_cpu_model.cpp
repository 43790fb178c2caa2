// Tests of the CPU model (src/train/cpu/model.h): the gradient of the whole model against finite
// differences, for both families, GQA/MQA, tied and untied heads, RoPE with and without LLaMA-3
// scaling, batches with ignored targets; bitwise reproducibility; the loss going down under AdamW;
// and the errors the model reports.
//
// The finite differences run on the fp32 model itself, so their error is derived, per checked
// parameter, from two measured quantities (nothing is tuned):
//   ε_L — the loss's own rounding noise: |L(θ + δ·e_i) − L(θ)| with δ a few ulps of θ_i, where
//         the true change g_i·δ is far below one ulp of L; the largest over a sample.
//   fd(h) = (L(θ + h·e_i) − L(θ − h·e_i)) / 2h has rounding error ≤ ε_L / h and truncation error
//         c·h², which fd(2h) − fd(h) = 3·c·h² measures (up to 1.5·ε_L / h of its own rounding).
// So |fd(h) − g| ≤ ε_L/h + (|fd(2h) − fd(h)| + 1.5·ε_L/h) / 3, and the test allows twice that
// (the factor 2 of the tolerance rule, DESIGN.md). A wrong gradient errs by O(|g|); the test also
// requires that most checked gradients are far above their bound, so it cannot pass vacuously.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "test_util.h"
#include "train/core/adamw.h"
#include "train/core/model_config.h"
#include "train/cpu/model.h"

namespace flare::train::cpu {
namespace {

constexpr double kFdStep = 1e-2;  // parameters are O(0.1..1), see init_parameters

std::mt19937_64& rng() {
  static std::mt19937_64 r(test::test_seed());
  return r;
}

// Parameters: matrices and embeddings normal(0, std_scale·init_std); norm weights 1 and biases 0,
// each plus normal(0, spread). The gradient checks use std_scale 10 so the tiny model's gradients
// stand well above fp32 noise, and spread 0.1 so the norms are not the special case of identity.
std::vector<float> init_parameters(const ParameterLayout& layout, double std_scale,
                                   float spread = 0.0f) {
  std::vector<float> p(static_cast<size_t>(layout.total), 0.0f);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const ParamSpec& s : layout.params) {
    for (int64_t i = 0; i < s.numel; ++i) {
      const float z = normal(rng());
      float& x = p[static_cast<size_t>(s.offset + i)];
      if (s.init_std > 0) {
        x = static_cast<float>(std_scale * s.init_std) * z;
      } else {
        x = (s.init_ones ? 1.0f : 0.0f) + spread * z;
      }
    }
  }
  return p;
}

// Random tokens, and targets with some entries ignored (−1).
struct Batch {
  std::vector<int32_t> tokens, targets;
};

Batch random_batch(const ModelConfig& c, int64_t B, int64_t T, int ignored) {
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(c.vocab_size - 1));
  Batch b;
  for (int64_t i = 0; i < B * T; ++i) {
    b.tokens.push_back(tok(rng()));
    b.targets.push_back(tok(rng()));
  }
  for (int i = 0; i < ignored; ++i) b.targets[static_cast<size_t>((7 * i + 3) % (B * T))] = -1;
  return b;
}

double loss_at(CpuModel& m, const std::vector<float>& params, const Batch& b) {
  ClassifierResult r;
  const Status s = m.forward(params.data(), b.tokens.data(), b.targets.data(), &r);
  EXPECT_TRUE(s.ok()) << s.to_string();
  return r.mean_loss;
}

// Indices to check: per tensor, `per_tensor` random elements; for the embedding and head, half of
// them in rows the batch uses (the other rows' gradient is zero, padding rows included).
std::vector<int64_t> pick_parameters(const ParameterLayout& layout, const Batch& b,
                                     int64_t d_model, int per_tensor) {
  std::vector<int64_t> picked;
  for (const ParamSpec& s : layout.params) {
    std::uniform_int_distribution<int64_t> any(0, s.numel - 1);
    const bool vocab_rows = s.name == "embed.weight" || s.name == "head.weight";
    for (int k = 0; k < per_tensor; ++k) {
      int64_t i = any(rng());
      if (vocab_rows && k % 2 == 0) {
        const auto& ids = s.name == "embed.weight" ? b.tokens : b.targets;
        const int32_t row = std::max(ids[static_cast<size_t>(any(rng())) % ids.size()], 0);
        i = row * d_model + any(rng()) % d_model;
      }
      picked.push_back(s.offset + i);
    }
  }
  return picked;
}

struct FdReport {
  int checked = 0, well_above_bound = 0;
  double worst_ratio = 0.0;  // max |fd − g| / bound
};

void check_gradient(const ModelConfig& config, int64_t B, int64_t T, int per_tensor) {
  SCOPED_TRACE(config.name + " seed=" + std::to_string(test::test_seed()));
  std::unique_ptr<CpuModel> model;
  ASSERT_TRUE(CpuModel::create(config, B, T, &model).ok());
  std::vector<float> params = init_parameters(model->layout(), 10.0, 0.1f);
  const Batch batch = random_batch(config, B, T, 3);

  ClassifierResult r;
  ASSERT_TRUE(model->forward(params.data(), batch.tokens.data(), batch.targets.data(), &r).ok());
  ASSERT_EQ(r.n_valid, B * T - 3);
  const double loss0 = r.mean_loss;
  std::vector<float> grads(params.size(), 0.0f);
  const Status bs = model->backward(params.data(), grads.data());
  ASSERT_TRUE(bs.ok()) << bs.to_string();

  const std::vector<int64_t> picked = pick_parameters(model->layout(), batch, config.d_model,
                                                      per_tensor);
  // ε_L: the loss moved by a 4-ulp nudge of a parameter, far below the loss's own ulp in truth.
  double eps_loss = 0.0;
  for (size_t k = 0; k < picked.size(); k += 4) {
    float& p = params[static_cast<size_t>(picked[k])];
    const float saved = p;
    p = saved + 4.0f * std::abs(std::nextafter(saved, 2.0f * saved + 1.0f) - saved);
    eps_loss = std::max(eps_loss, std::abs(loss_at(*model, params, batch) - loss0));
    p = saved;
  }

  FdReport rep;
  for (int64_t idx : picked) {
    float& p = params[static_cast<size_t>(idx)];
    const float saved = p;
    auto fd = [&](double h) {
      p = static_cast<float>(saved + h);
      const double up = loss_at(*model, params, batch);
      p = static_cast<float>(saved - h);
      const double down = loss_at(*model, params, batch);
      const double step = static_cast<double>(static_cast<float>(saved + h)) -
                          static_cast<double>(static_cast<float>(saved - h));
      p = saved;
      return (up - down) / step;  // the step actually taken in fp32
    };
    const double fd1 = fd(kFdStep), fd2 = fd(2 * kFdStep);
    const double rounding = eps_loss / kFdStep;
    const double bound = 2.0 * (rounding + (std::abs(fd2 - fd1) + 1.5 * rounding) / 3.0);
    const double g = grads[static_cast<size_t>(idx)];
    ++rep.checked;
    rep.worst_ratio = std::max(rep.worst_ratio, std::abs(fd1 - g) / bound);
    if (std::abs(g) > 10.0 * bound) ++rep.well_above_bound;
    const ParamSpec* owner = nullptr;
    for (const ParamSpec& s : model->layout().params)
      if (idx >= s.offset && idx < s.offset + s.numel) owner = &s;
    ASSERT_LE(std::abs(fd1 - g), bound)
        << owner->name << "[" << idx - owner->offset << "]: gradient " << g
        << ", finite difference " << fd1 << " (2h: " << fd2 << "), eps_loss " << eps_loss;
  }
  std::printf("%s: %d parameters checked, %d with |g| > 10x bound, worst |fd-g|/bound %.3f, "
              "eps_loss %.3g\n",
              config.name.c_str(), rep.checked, rep.well_above_bound, rep.worst_ratio, eps_loss);
  // Most gradients must be far above their bound, or the check says little.
  EXPECT_GT(rep.well_above_bound, rep.checked / 2);
}

ModelConfig preset(const std::string& name) {
  ModelConfig c;
  EXPECT_TRUE(model_preset(name, &c).ok()) << name;
  return c;
}

TEST(CpuModel, GptTinyGradientMatchesFiniteDifferences) {
  check_gradient(preset("gpt-tiny"), 2, 16, 6);
}

TEST(CpuModel, LlamaTinyGqaGradientMatchesFiniteDifferences) {
  check_gradient(preset("llama-tiny"), 2, 16, 8);
}

// MQA (one K/V head), a tied head, LLaMA-3 RoPE scaling over a short original context (all three
// frequency bands present), odd sequence length and vocabulary.
TEST(CpuModel, LlamaMqaTiedScaledRopeGradientMatchesFiniteDifferences) {
  ModelConfig c = preset("llama-tiny");
  c.name = "llama-mqa-tied-rope3";
  c.n_layer = 1;
  c.n_kv_head = 1;
  c.tied_embeddings = true;
  c.vocab_size = 37;
  c.padded_vocab = padded_vocab_size(37);
  c.rope_scaling.enabled = true;
  c.rope_scaling.original_max_position = 16;
  check_gradient(c, 3, 7, 8);
}

// Same inputs, same bits: the model's result does not depend on the thread count.
TEST(CpuModel, ForwardAndBackwardAreBitwiseReproducibleAcrossThreadCounts) {
  for (const char* name : {"gpt-tiny", "llama-tiny"}) {
    const ModelConfig c = preset(name);
    std::unique_ptr<CpuModel> m;
    ASSERT_TRUE(CpuModel::create(c, 2, 16, &m).ok());
    const std::vector<float> params = init_parameters(m->layout(), 10.0, 0.1f);
    const Batch b = random_batch(c, 2, 16, 1);
    auto run = [&](int threads, double* loss) {
      const int saved = omp_get_max_threads();
      omp_set_num_threads(threads);
      ClassifierResult r;
      std::vector<float> g(params.size(), 0.0f);
      EXPECT_TRUE(m->forward(params.data(), b.tokens.data(), b.targets.data(), &r).ok());
      EXPECT_TRUE(m->backward(params.data(), g.data()).ok());
      omp_set_num_threads(saved);
      *loss = r.mean_loss;
      return g;
    };
    double l1 = 0, l3 = 0;
    const std::vector<float> g1 = run(1, &l1), g3 = run(3, &l3);
    EXPECT_EQ(l1, l3) << name;
    EXPECT_TRUE(g1 == g3) << name;
  }
}

// 30 AdamW steps on one fixed batch: the model memorises it, so the loss must fall well below
// its start (log(vocab) for a fresh model). Timed, since the CPU model must stay quick.
TEST(CpuModel, LossGoesDownUnderAdamW) {
  for (const char* name : {"gpt-tiny", "llama-tiny"}) {
    const ModelConfig c = preset(name);
    std::unique_ptr<CpuModel> m;
    ASSERT_TRUE(CpuModel::create(c, 4, 32, &m).ok());
    const ParameterLayout& layout = m->layout();
    std::vector<float> params = init_parameters(layout, 1.0);  // the layout's own init
    const Batch b = random_batch(c, 4, 32, 5);
    std::vector<float> grads(params.size()), adam_m(params.size(), 0.0f);
    std::vector<float> adam_v(params.size(), 0.0f);

    const auto start = std::chrono::steady_clock::now();
    double first = 0.0, last = 0.0;
    for (int step = 1; step <= 30; ++step) {
      ClassifierResult r;
      ASSERT_TRUE(m->forward(params.data(), b.tokens.data(), b.targets.data(), &r).ok());
      std::fill(grads.begin(), grads.end(), 0.0f);
      ASSERT_TRUE(m->backward(params.data(), grads.data()).ok());
      AdamWStep s;
      s.t = step;
      s.lr = 1e-2;
      s.weight_decay = 0.0;
      ASSERT_TRUE(adamw_step(layout, s, grads.data(), params.data(), adam_m.data(), adam_v.data(),
                             nullptr).ok());
      if (step == 1) first = r.mean_loss;
      last = r.mean_loss;
    }
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() -
                                                                start).count();
    std::printf("%s: loss %.4f -> %.4f in 30 steps (B 4, T 32), %.1f ms/step\n", name, first, last,
                ms / 30);
    // A fresh model predicts uniformly: loss ≈ log(vocab_size).
    EXPECT_NEAR(first, std::log(static_cast<double>(c.vocab_size)), 0.1) << name;
    EXPECT_LT(last, 0.5 * first) << name;
  }
}

TEST(CpuModel, ReportsBadSizesTokensTargetsAndMissingForward) {
  const ModelConfig c = preset("gpt-tiny");
  std::unique_ptr<CpuModel> m;
  Status s = CpuModel::create(c, 1, c.max_seq + 1, &m);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("seq_len"), std::string::npos) << s.message();
  s = CpuModel::create(c, 0, 4, &m);
  EXPECT_NE(s.message().find("batch"), std::string::npos) << s.message();
  ModelConfig bad = c;
  bad.n_kv_head = 3;
  EXPECT_FALSE(CpuModel::create(bad, 1, 4, &m).ok());

  ASSERT_TRUE(CpuModel::create(c, 1, 4, &m).ok());
  const std::vector<float> params(static_cast<size_t>(m->layout().total), 0.01f);
  std::vector<float> grads(params.size(), 0.0f);
  s = m->backward(params.data(), grads.data());
  EXPECT_NE(s.message().find("forward"), std::string::npos) << s.message();
  const std::vector<int32_t> bad_tokens = {1, 2, static_cast<int32_t>(c.vocab_size), 3};
  const std::vector<int32_t> targets = {1, 2, 3, -1};
  ClassifierResult r;
  s = m->forward(params.data(), bad_tokens.data(), targets.data(), &r);
  EXPECT_NE(s.message().find("tokens[2]"), std::string::npos) << s.message();
  const std::vector<int32_t> tokens = {1, 2, 3, 4};
  const std::vector<int32_t> bad_targets = {1, -2, 3, 4};
  s = m->forward(params.data(), tokens.data(), bad_targets.data(), &r);
  EXPECT_NE(s.message().find("targets[1]"), std::string::npos) << s.message();
  EXPECT_FALSE(m->backward(params.data(), grads.data()).ok());
}

}  // namespace
}  // namespace flare::train::cpu
