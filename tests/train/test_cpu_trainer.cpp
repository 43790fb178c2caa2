// test_cpu_trainer.cpp — the training loop on the CPU backend: a tiny model learns, a resumed run
// equals a straight run bit for bit, checkpoints and the JSON log are written where and when the
// config says, bad configurations are rejected before anything is written; plus the pieces the
// loop is made of (initialisation, the peak table, the report's forms, sampling).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include "test_cpu_trainer_util.h"
#include "train/core/checkpoint.h"
#include "train/loop/init.h"
#include "train/loop/sample.h"
#include "train/loop/trainer.h"

namespace flare::train {
namespace {

using test::ScratchDir;
namespace fs = std::filesystem;

std::unique_ptr<Trainer> make_trainer(const TrainerOptions& o) {
  std::unique_ptr<Trainer> t;
  const Status s = Trainer::create(o, &t);
  EXPECT_TRUE(s.ok()) << s.to_string();
  return t;
}

std::vector<float> state_of(Trainer& t, int which) {
  const int64_t n = parameter_layout(t.options().model).total;
  std::vector<float> a(static_cast<size_t>(n)), b(a.size()), c(a.size());
  EXPECT_TRUE(t.backend().get_state(a.data(), b.data(), c.data()).ok());
  return which == 0 ? a : which == 1 ? b : c;
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// ---- A tiny model learns --------------------------------------------------------------------------

class TrainerLearns : public ::testing::TestWithParam<const char*> {};

TEST_P(TrainerLearns, LossFallsOnALearnableStream) {
  ScratchDir dir;
  test::write_cycle_shards(dir, 300);
  TrainerOptions o = test::tiny_run(dir, GetParam(), 30);
  o.train.eval_every = 10;
  auto t = make_trainer(o);
  ASSERT_TRUE(t);
  std::vector<StepReport> reports;
  const Status s = t->run(30, [&](const StepReport& r) { reports.push_back(r); });
  ASSERT_TRUE(s.ok()) << s.to_string();
  ASSERT_EQ(reports.size(), 30u);
  // The stream is a fixed cycle: from log(300) = 5.7 a bigram model gets far below; the bound
  // only asks for a clear fall, far above what noise in 30 steps could fake.
  const double first = reports[0].loss;
  const double last = (reports[27].loss + reports[28].loss + reports[29].loss) / 3;
  EXPECT_NEAR(first, std::log(300.0), 0.5) << "the initial loss of a random model";
  EXPECT_LT(last, first - 2.0) << "first " << first << ", last three " << last;
  // Validation ran at steps 10, 20 and 30 and fell too (the validation shard is the same cycle).
  int evals = 0;
  for (const StepReport& r : reports) {
    EXPECT_EQ(r.has_val, r.step % 10 == 0) << "step " << r.step;
    evals += r.has_val;
    EXPECT_TRUE(std::isfinite(r.grad_norm));
    EXPECT_GT(r.tokens_per_s, 0);
    EXPECT_EQ(r.mfu, 0.0) << "no peak is known for the CPU";
  }
  EXPECT_EQ(evals, 3);
  EXPECT_LT(reports[29].val_loss, reports[9].val_loss);
}

INSTANTIATE_TEST_SUITE_P(Presets, TrainerLearns, ::testing::Values("gpt-tiny", "llama-tiny"));

// ---- Resume is bitwise ----------------------------------------------------------------------------

class TrainerResume : public ::testing::TestWithParam<const char*> {};

// N steps, checkpoint, a new trainer resumed from it, N more steps == 2N steps straight: master
// weights, m and v bit for bit, and the same losses step by step. Accumulation over two
// micro-batches and evaluation in between are on, so the loader position and the eval pass's
// independence from it are covered too.
TEST_P(TrainerResume, NStepsSaveResumeNStepsEqualsTwoNSteps) {
  constexpr int64_t kN = 4;
  ScratchDir dir;
  test::write_cycle_shards(dir, 300, 1500);  // a few windows per shard, so epochs turn over
  TrainerOptions o = test::tiny_run(dir, GetParam(), 2 * kN);
  o.train.grad_accum = 2;
  o.train.eval_every = 3;
  o.train.checkpoint_dir = dir.file("ckpt");

  std::vector<double> straight_losses, resumed_losses;
  auto straight = make_trainer(o);
  ASSERT_TRUE(straight);
  ASSERT_TRUE(straight->run(2 * kN, [&](const StepReport& r) { straight_losses.push_back(r.loss); }).ok());

  TrainerOptions first_half = o;
  first_half.train.checkpoint_dir = dir.file("ckpt_half");
  auto half = make_trainer(first_half);
  ASSERT_TRUE(half);
  ASSERT_TRUE(half->run(kN, [&](const StepReport& r) { resumed_losses.push_back(r.loss); }).ok());
  const std::string path = half->checkpoint_path(kN);
  ASSERT_TRUE(half->save_checkpoint(path).ok());
  half.reset();

  TrainerOptions second_half = first_half;
  second_half.resume_from = path;
  auto resumed = make_trainer(second_half);
  ASSERT_TRUE(resumed);
  EXPECT_EQ(resumed->step(), kN);
  ASSERT_TRUE(resumed->run(2 * kN, [&](const StepReport& r) { resumed_losses.push_back(r.loss); }).ok());

  ASSERT_EQ(straight_losses.size(), resumed_losses.size());
  for (size_t i = 0; i < straight_losses.size(); ++i) {
    EXPECT_EQ(straight_losses[i], resumed_losses[i]) << "step " << i + 1;
  }
  for (int which = 0; which < 3; ++which) {
    EXPECT_TRUE(bitwise_equal(state_of(*straight, which), state_of(*resumed, which)))
        << (which == 0 ? "master" : which == 1 ? "m" : "v") << " differs";
  }
  // Both runs wrote their final checkpoint; the files' states agree too.
  const int64_t n = parameter_layout(o.model).total;
  std::vector<float> a(static_cast<size_t>(n)), b(a.size()), ma(a.size()), mb(a.size()), va(a.size()),
      vb(a.size());
  CheckpointMeta meta_a, meta_b;
  ASSERT_TRUE(load_checkpoint(straight->checkpoint_path(2 * kN), o.model, &meta_a, a.data(), ma.data(),
                              va.data(), n).ok());
  ASSERT_TRUE(load_checkpoint(resumed->checkpoint_path(2 * kN), o.model, &meta_b, b.data(), mb.data(),
                              vb.data(), n).ok());
  EXPECT_TRUE(bitwise_equal(a, b));
  EXPECT_EQ(meta_a.step, 2 * kN);
  EXPECT_EQ(meta_a.loader_state, meta_b.loader_state);
}

INSTANTIATE_TEST_SUITE_P(Presets, TrainerResume, ::testing::Values("gpt-tiny", "llama-tiny"));

// The same seed gives the same run; another seed another.
TEST(Trainer, RunsAreReproducibleAndSeeded) {
  ScratchDir dir;
  test::write_cycle_shards(dir, 300);
  TrainerOptions o = test::tiny_run(dir, "gpt-tiny", 3);
  auto a = make_trainer(o), b = make_trainer(o);
  o.train.seed = 8;
  auto c = make_trainer(o);
  for (auto* t : {a.get(), b.get(), c.get()}) ASSERT_TRUE(t->run(3, nullptr).ok());
  EXPECT_TRUE(bitwise_equal(state_of(*a, 0), state_of(*b, 0)));
  EXPECT_FALSE(bitwise_equal(state_of(*a, 0), state_of(*c, 0)));
}

// ---- Checkpoints and the log ----------------------------------------------------------------------

TEST(Trainer, CheckpointsEveryKStepsAndAtTheEndAndLogsOneObjectPerStep) {
  ScratchDir dir;
  test::write_cycle_shards(dir, 300);
  TrainerOptions o = test::tiny_run(dir, "llama-tiny", 5);
  o.train.ckpt_every = 2;
  o.train.eval_every = 4;
  o.train.checkpoint_dir = dir.file("ck");
  o.log_path = dir.file("log.jsonl");
  auto t = make_trainer(o);
  ASSERT_TRUE(t);
  std::vector<StepReport> reports;
  ASSERT_TRUE(t->run(5, [&](const StepReport& r) { reports.push_back(r); }).ok());
  for (int64_t step = 1; step <= 5; ++step) {
    const bool expected = step == 2 || step == 4 || step == 5;
    EXPECT_EQ(fs::exists(t->checkpoint_path(step)), expected) << "step " << step;
    EXPECT_EQ(reports[static_cast<size_t>(step - 1)].checkpoint.empty(), !expected);
  }
  CheckpointMeta meta;
  ASSERT_TRUE(read_checkpoint_meta(t->checkpoint_path(4), &meta).ok());
  EXPECT_EQ(meta.step, 4);
  EXPECT_EQ(meta.model.name, "llama-tiny");

  std::ifstream log(o.log_path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(log, line);) lines.push_back(line);
  ASSERT_EQ(lines.size(), 5u);
  for (size_t i = 0; i < lines.size(); ++i) {
    EXPECT_EQ(lines[i], step_json(reports[i]));
    EXPECT_EQ(lines[i].front(), '{');
    EXPECT_EQ(lines[i].back(), '}');
    EXPECT_NE(lines[i].find("\"step\": " + std::to_string(i + 1) + ","), std::string::npos) << lines[i];
  }
  EXPECT_NE(lines[3].find("\"val_loss\": "), std::string::npos);
  EXPECT_EQ(lines[2].find("\"val_loss\""), std::string::npos);
}

// ---- Rejected configurations write nothing --------------------------------------------------------

TEST(Trainer, BadConfigurationsAreRejectedNamingTheFieldAndWriteNothing) {
  ScratchDir dir;
  test::write_cycle_shards(dir, 300);
  const TrainerOptions good = test::tiny_run(dir, "gpt-tiny", 4);
  struct Case {
    const char* field;
    std::function<void(TrainerOptions&)> change;
  };
  const std::vector<Case> cases = {
      {"batch", [](TrainerOptions& o) { o.train.batch = 0; }},
      {"seq", [](TrainerOptions& o) { o.train.seq = o.model.max_seq + 1; }},
      {"warmup", [](TrainerOptions& o) { o.train.warmup = 5; }},
      {"n_kv_head", [](TrainerOptions& o) { o.model.n_kv_head = 3; }},
      {"train_data", [&](TrainerOptions& o) { o.train.train_data = dir.file("none_*.bin"); }},
      {"train_data", [](TrainerOptions& o) { o.train.train_data.clear(); }},
      {"val_data", [](TrainerOptions& o) { o.train.eval_every = 2; o.train.val_data.clear(); }},
      {"train_data", [](TrainerOptions& o) { o.train.batch = 300; }},  // fewer windows than a batch
      {"eval_batches", [](TrainerOptions& o) { o.eval_batches = 0; }},
      {"peak_flops", [](TrainerOptions& o) { o.peak_flops = -1; }},
      {"bf16_grads", [](TrainerOptions& o) { o.train.bf16_grads = true; }},  // a CUDA option
  };
  for (const Case& c : cases) {
    TrainerOptions o = good;
    o.log_path = dir.file("log.jsonl");
    c.change(o);
    std::unique_ptr<Trainer> t;
    const Status s = Trainer::create(o, &t);
    EXPECT_FALSE(s.ok()) << c.field;
    EXPECT_EQ(s.message().rfind(c.field, 0), 0u) << "expected the message to start with " << c.field
                                                 << ": " << s.message();
    EXPECT_FALSE(t);
    EXPECT_FALSE(fs::exists(o.log_path)) << c.field;
  }
}

TEST(Trainer, ResumeRejectsAnotherModelsCheckpoint) {
  ScratchDir dir;
  test::write_cycle_shards(dir, 300);
  TrainerOptions o = test::tiny_run(dir, "gpt-tiny", 2);
  o.train.checkpoint_dir = dir.file("ck");
  auto t = make_trainer(o);
  ASSERT_TRUE(t->run(2, nullptr).ok());
  TrainerOptions other = test::tiny_run(dir, "llama-tiny", 4);
  other.resume_from = t->checkpoint_path(2);
  other.log_path = dir.file("log.jsonl");
  std::unique_ptr<Trainer> r;
  const Status s = Trainer::create(other, &r);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("family"), std::string::npos) << s.message();
  EXPECT_FALSE(fs::exists(other.log_path));
  // A run asked for fewer steps than the checkpoint has done.
  TrainerOptions shorter = test::tiny_run(dir, "gpt-tiny", 1);
  shorter.train.warmup = 0;
  shorter.resume_from = t->checkpoint_path(2);
  const Status s2 = Trainer::create(shorter, &r);
  EXPECT_EQ(s2.message().rfind("steps", 0), 0u) << s2.message();
}

// ---- Pieces ---------------------------------------------------------------------------------------

TEST(InitParameters, SeededNormalsWithTheLayoutsStdOnesAndZeros) {
  ModelConfig c;
  ASSERT_TRUE(model_preset("gpt-tiny", &c).ok());
  const ParameterLayout layout = parameter_layout(c);
  std::vector<float> a(static_cast<size_t>(layout.total), -1.0f), b(a.size()), other(a.size());
  init_parameters(layout, 1, a.data());
  init_parameters(layout, 1, b.data());
  init_parameters(layout, 2, other.data());
  EXPECT_TRUE(bitwise_equal(a, b));
  EXPECT_FALSE(bitwise_equal(a, other));
  for (const ParamSpec& p : layout.params) {
    const float* w = a.data() + p.offset;
    if (p.init_std == 0) {
      for (int64_t j = 0; j < p.numel; ++j) ASSERT_EQ(w[j], p.init_ones ? 1.0f : 0.0f) << p.name;
      continue;
    }
    double sum = 0, sq = 0;
    for (int64_t j = 0; j < p.numel; ++j) {
      sum += w[j];
      sq += double(w[j]) * w[j];
    }
    const double n = static_cast<double>(p.numel);
    const double mean = sum / n, std = std::sqrt(sq / n - mean * mean);
    // Sampling error of n normals: the mean within 5 σ/√n, the std within 5 σ/√(2n).
    EXPECT_NEAR(mean, 0.0, 5 * p.init_std / std::sqrt(n)) << p.name;
    EXPECT_NEAR(std, p.init_std, 5 * p.init_std / std::sqrt(2 * n)) << p.name;
  }
}

TEST(InitParameters, ValuesArePinned) {
  // The same elements tests/python/test_train_reference.py pins for the Python reimplementation:
  // a resumed or re-run experiment depends on these bits never changing.
  ModelConfig c;
  ASSERT_TRUE(model_preset("gpt-tiny", &c).ok());
  const ParameterLayout layout = parameter_layout(c);
  std::vector<float> w(static_cast<size_t>(layout.total));
  init_parameters(layout, 1337, w.data());
  const std::pair<size_t, double> pinned[] = {{0, -0.0029651618096977472}, {1, 0.00833622645586729},
                                              {2, -0.023231495171785355}, {3, -0.010514670051634312},
                                              {12345, -0.04148602485656738}, {24583, -0.00013238287647254765}};
  for (const auto& [offset, value] : pinned) EXPECT_EQ(w[offset], static_cast<float>(value)) << offset;
}

TEST(InitParameters, AParameterInsideAPairOfDrawsTakesItsHalf) {
  // Elements 2k and 2k+1 share one Philox call; parameters that start or end at odd offsets must
  // each take their own elements' halves: the same bits as one parameter over the whole range.
  ParameterLayout whole, split;
  whole.total = split.total = 12;
  whole.params.push_back({.name = "w", .shape = {11}, .offset = 1, .numel = 11, .init_std = 0.5});
  split.params.push_back({.name = "a", .shape = {3}, .offset = 1, .numel = 3, .init_std = 0.5});
  split.params.push_back({.name = "b", .shape = {5}, .offset = 4, .numel = 5, .init_std = 0.5});
  split.params.push_back({.name = "c", .shape = {3}, .offset = 9, .numel = 3, .init_std = 0.5});
  std::vector<float> a(12, -1.0f), b(12, -1.0f);
  init_parameters(whole, 7, a.data());
  init_parameters(split, 7, b.data());
  EXPECT_TRUE(bitwise_equal(a, b));
  EXPECT_EQ(a[0], 0.0f);  // the gap before the first parameter
}

TEST(PeakFlops, TableKeyedByDeviceName) {
  EXPECT_EQ(peak_bf16_flops("NVIDIA H100 80GB HBM3"), 989e12);
  EXPECT_EQ(peak_bf16_flops("NVIDIA H100 PCIe"), 756e12);
  EXPECT_EQ(peak_bf16_flops("NVIDIA H100 NVL"), 835e12);
  EXPECT_EQ(peak_bf16_flops("NVIDIA H200"), 989e12);
  EXPECT_EQ(peak_bf16_flops("NVIDIA A100-SXM4-80GB"), 312e12);
  EXPECT_EQ(peak_bf16_flops("cpu"), 0.0);
  EXPECT_EQ(peak_bf16_flops("Some Future GPU"), 0.0);
}

TEST(StepReport, LineAndJson) {
  StepReport r;
  r.step = 12;
  r.steps = 1000;
  r.loss = 7.12345;
  r.lr = 6e-4;
  r.grad_norm = 1.234;
  r.step_ms = 123.4;
  r.tokens_per_s = 1234567.4;
  r.mfu = 0.412;
  r.memory_bytes = int64_t{3} << 30;
  EXPECT_EQ(format_step(r), "step     12/1000 | loss 7.1235 | lr 6.00e-04 | norm 1.234 | 123.4 ms | "
                            "1,234,567 tok/s | MFU 41.2% | mem 3.00 GiB");
  r.has_val = true;
  r.val_loss = 7.0;
  r.checkpoint = "ck/step_000012.ckpt";
  EXPECT_EQ(step_json(r), "{\"step\": 12, \"steps\": 1000, \"loss\": 7.12345, \"lr\": 0.0006, "
                          "\"grad_norm\": 1.234, \"step_ms\": 123.4, \"tokens_per_s\": 1234567.4, "
                          "\"mfu\": 0.412, \"memory_bytes\": 3221225472, \"val_loss\": 7, "
                          "\"checkpoint\": \"ck/step_000012.ckpt\"}");
  r.loss = NAN;
  EXPECT_NE(step_json(r).find("\"loss\": null"), std::string::npos) << "JSON has no NaN";
}

TEST(Sample, GreedyContinuesALearnedCycleAndTopKIsSeeded) {
  ScratchDir dir;
  test::write_cycle_shards(dir, 300);
  TrainerOptions o = test::tiny_run(dir, "gpt-tiny", 60);
  auto t = make_trainer(o);
  ASSERT_TRUE(t->run(60, nullptr).ok());
  std::vector<float> master = state_of(*t, 0);
  const std::vector<int32_t> cycle = test::cycle_tokens(40, 300);
  std::vector<int32_t> out;
  SampleOptions s;
  s.tokens = 8;
  ASSERT_TRUE(sample_tokens(o.model, master.data(), std::span(cycle.data(), 16), s, &out).ok());
  ASSERT_EQ(out.size(), 8u);
  // 60 steps on the cycle teach the model its successor function.
  int right = 0;
  for (size_t i = 0; i < out.size(); ++i) right += out[i] == cycle[16 + i];
  EXPECT_GE(right, 6) << "greedy continuation should follow the cycle";

  s.top_k = 5;
  s.seed = 3;
  std::vector<int32_t> x, y;
  ASSERT_TRUE(sample_tokens(o.model, master.data(), std::span(cycle.data(), 4), s, &x).ok());
  ASSERT_TRUE(sample_tokens(o.model, master.data(), std::span(cycle.data(), 4), s, &y).ok());
  EXPECT_EQ(x, y);

  const std::vector<int32_t> bad = {300};
  EXPECT_EQ(sample_tokens(o.model, master.data(), bad, s, &x).message().rfind("prompt", 0), 0u);
  s.tokens = o.model.max_seq;
  EXPECT_EQ(sample_tokens(o.model, master.data(), std::span(cycle.data(), 4), s, &x).message().rfind("tokens", 0), 0u);
}

}  // namespace
}  // namespace flare::train
