// Tests of the CPU model (src/train/cpu/model.h): the gradient of the whole model against finite
// differences, for both families, GQA/MQA, tied and untied heads, RoPE with and without LLaMA-3
// scaling, batches with ignored targets; bitwise reproducibility; the loss going down under AdamW;
// and the errors the model reports.
//
// The finite differences run on the fp32 model itself, so their error is derived, per checked
// parameter, from measured quantities (nothing is tuned):
//   σ_T — the loss's rounding noise along the parameters of tensor T. Along θ_i the fp32 loss is
//         the exact L plus an error e made of the rounding staircases of every value θ_i
//         reaches. Most step every few ulps of θ_i and look white, but a value that moves slowly
//         with θ_i (a logit whose input in column i is near 0) steps about once per h, a sawtooth
//         that fd(h) sees in full and a probe far below h does not. So the noise is sampled at
//         the finite differences' own scale: the loss at θ + k·h·e_i, k = −3..3, gives three
//         fourth differences (centred on −h, 0, h), divided by √54, √34, √54 so that each has
//         mean square at least σ² (the smooth remainder h⁴·L'''' and e₀, the error of L(θ) that
//         every draw shares, only add to it). σ_T is the rms of the draws of T's parameters that
//         move the loss at all; where the noise differs between elements (a head row a target
//         selects, against one none does) it is at least the largest σ over √(elements checked).
//   ε_L = z·σ_T/√2, z = 4: fd(h)'s rounding (e(θ + h) − e(θ − h))/2h has standard deviation
//         σ/(√2·h) and exceeds ε_L/h with probability 6e-5 (a run checks ~350 parameters).
//         (Before, ε_L was the loss moved by a 4-ulp nudge, which re-rounds only part of the
//         values: at seed 1795864035418329325 fd(h) missed by 2.5 of that ε_L/h, while g stood
//         within 2e-7 of the derivative extrapolated from 64 step pairs, 1% of the bound.)
//   fd(h) = (L(θ + h·e_i) − L(θ − h·e_i)) / 2h has rounding error ≤ ε_L / h and truncation error
//         c·h², which fd(2h) − fd(h) = 3·c·h² measures (up to 1.5·ε_L / h of its own rounding).
//   ε_g = z·σ_g,T — the analytic gradient's own fp32 rounding, measured the same way: σ_g,T from
//         the spread of g under moves of every parameter that re-round every value (see
//         gradient_noise). It adds to the bound: at most 7% of ε_L/h, except in an untied head
//         (13–37% at three seeds), whose loss noise is the smallest (σ_T ~ 1e-9).
// So |fd(h) − g| ≤ ε_L/h + (|fd(2h) − fd(h)| + 1.5·ε_L/h) / 3 + ε_g, and the test allows twice that
// (the factor 2 of the tolerance rule, docs/architecture.md; it also covers the spread of the σ
// estimates). A wrong gradient errs by O(|g|); the test also requires that most checked gradients
// are far above their bound, so it cannot pass vacuously.
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
constexpr double kNoiseZ = 4.0;  // z of the file comment

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
  double largest_eps = 0.0;  // max ε_L over the tensors
};

// One checked parameter: its finite differences and its three draws of the loss's noise (file
// comment).
struct Probe {
  int64_t index = 0;  // into the flat buffer
  size_t tensor = 0;  // into layout().params
  double fd1 = 0.0, fd2 = 0.0;
  double draws[3] = {};  // mean square ≥ σ_T²
  bool moves_loss = false;
};

Probe probe_parameter(CpuModel& model, std::vector<float>& params, const Batch& batch,
                      double loss0, int64_t index) {
  Probe pr;
  pr.index = index;
  const std::vector<ParamSpec>& specs = model.layout().params;
  while (index >= specs[pr.tensor].offset + specs[pr.tensor].numel) ++pr.tensor;
  float& p = params[static_cast<size_t>(index)];
  const float saved = p;
  // loss[k + 3] and taken[k + 3]: the loss with θ_i at saved + k·h as fp32 rounds it, k = −3..3,
  // and the move fp32 made.
  double loss[7], taken[7];
  for (int k = -3; k <= 3; ++k) {
    p = static_cast<float>(saved + k * kFdStep);
    taken[k + 3] = static_cast<double>(p) - saved;
    loss[k + 3] = k == 0 ? loss0 : loss_at(model, params, batch);
    pr.moves_loss = pr.moves_loss || loss[k + 3] != loss0;
  }
  p = saved;
  pr.fd1 = (loss[4] - loss[2]) / (taken[4] - taken[2]);
  pr.fd2 = (loss[5] - loss[1]) / (taken[5] - taken[1]);
  // Fourth differences centred on −h, 0, h, with the linear term taken out along the moves fp32
  // made (they differ from k·h by up to half an ulp of θ_i). The one centred on 0 has variance
  // 34·σ² + 36·e₀², the others 54·σ² + 16·e₀².
  auto fourth = [&](int c) {
    constexpr double w[5] = {1, -4, 6, -4, 1};
    double sum = 0.0;
    for (int j = 0; j < 5; ++j) sum += w[j] * (loss[c + j] - pr.fd1 * taken[c + j]);
    return sum;
  };
  pr.draws[0] = fourth(0) / std::sqrt(54.0);
  pr.draws[1] = fourth(1) / std::sqrt(34.0);
  pr.draws[2] = fourth(2) / std::sqrt(54.0);
  return pr;
}

// σ_g,T² per tensor (file comment): the mean square over the checked elements of T and over
// kGradientDraws pairs of √2·((g⁺ + g⁻)/2 − g), g± the gradient with every parameter moved by
// ±8 to 16 ulps (θ·(1 ± 2^-20), random signs). Such a move re-rounds every value of the forward and
// backward while the exact gradient moves only by its second-order term, which only adds to the
// mean square, as does the error of g itself, which every draw shares.
constexpr int kGradientDraws = 4;

std::vector<double> gradient_noise(CpuModel& model, const std::vector<float>& params,
                                   const std::vector<float>& grads, const Batch& batch,
                                   const std::vector<Probe>& probes) {
  const size_t n = params.size();
  std::vector<double> sum_sq(model.layout().params.size(), 0.0);
  std::vector<int> count(sum_sq.size(), 0);
  std::mt19937_64 signs(test::test_seed());  // its own stream: the checked elements stay those
                                             // the seed picked before this measurement existed
  std::vector<float> up(n), down(n), g_up(n), g_down(n);
  for (int k = 0; k < kGradientDraws; ++k) {
    for (size_t j = 0; j < n; ++j) {
      const double move = std::ldexp(static_cast<double>(params[j]), -20) *
                          ((signs() & 1) ? 1.0 : -1.0);
      up[j] = static_cast<float>(params[j] + move);
      down[j] = static_cast<float>(params[j] - move);
    }
    ClassifierResult r;
    std::fill(g_up.begin(), g_up.end(), 0.0f);
    std::fill(g_down.begin(), g_down.end(), 0.0f);
    EXPECT_TRUE(model.forward(up.data(), batch.tokens.data(), batch.targets.data(), &r).ok());
    EXPECT_TRUE(model.backward(up.data(), g_up.data()).ok());
    EXPECT_TRUE(model.forward(down.data(), batch.tokens.data(), batch.targets.data(), &r).ok());
    EXPECT_TRUE(model.backward(down.data(), g_down.data()).ok());
    for (const Probe& pr : probes) {
      if (!pr.moves_loss) continue;
      const size_t j = static_cast<size_t>(pr.index);
      const double draw =
          std::sqrt(2.0) * ((static_cast<double>(g_up[j]) + g_down[j]) / 2.0 - grads[j]);
      sum_sq[pr.tensor] += draw * draw;
      ++count[pr.tensor];
    }
  }
  for (size_t t = 0; t < sum_sq.size(); ++t) sum_sq[t] = count[t] > 0 ? sum_sq[t] / count[t] : 0;
  return sum_sq;
}

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

  const std::vector<ParamSpec>& specs = model->layout().params;
  std::vector<Probe> probes;
  for (int64_t idx : pick_parameters(model->layout(), batch, config.d_model, per_tensor))
    probes.push_back(probe_parameter(*model, params, batch, loss0, idx));
  // σ_T² per tensor: the mean square of its draws.
  std::vector<double> sum_sq(specs.size(), 0.0);
  std::vector<int> draws(specs.size(), 0);
  for (const Probe& pr : probes) {
    if (!pr.moves_loss) continue;
    for (double d : pr.draws) sum_sq[pr.tensor] += d * d;
    draws[pr.tensor] += 3;
  }

  const std::vector<double> grad_sq = gradient_noise(*model, params, grads, batch, probes);

  FdReport rep;
  for (const Probe& pr : probes) {
    const size_t t = pr.tensor;
    const double sigma = draws[t] > 0 ? std::sqrt(sum_sq[t] / draws[t]) : 0.0;
    const double eps_loss = kNoiseZ * sigma / std::sqrt(2.0);
    const double rounding = eps_loss / kFdStep;
    const double eps_grad = kNoiseZ * std::sqrt(grad_sq[t]);
    const double bound =
        2.0 * (rounding + (std::abs(pr.fd2 - pr.fd1) + 1.5 * rounding) / 3.0 + eps_grad);
    const double g = grads[static_cast<size_t>(pr.index)];
    ++rep.checked;
    rep.worst_ratio = std::max(rep.worst_ratio, std::abs(pr.fd1 - g) / bound);
    rep.largest_eps = std::max(rep.largest_eps, eps_loss);
    if (std::abs(g) > 10.0 * bound) ++rep.well_above_bound;
    ASSERT_LE(std::abs(pr.fd1 - g), bound)
        << specs[t].name << "[" << pr.index - specs[t].offset << "]: gradient " << g
        << ", finite difference " << pr.fd1 << " (2h: " << pr.fd2 << "), eps_loss " << eps_loss
        << " (sigma " << sigma << " from " << draws[t] << " draws), eps_grad " << eps_grad;
  }
  std::printf("%s: %d parameters checked, %d with |g| > 10x bound, worst |fd-g|/bound %.3f, "
              "largest eps_loss %.3g\n",
              config.name.c_str(), rep.checked, rep.well_above_bound, rep.worst_ratio,
              rep.largest_eps);
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
