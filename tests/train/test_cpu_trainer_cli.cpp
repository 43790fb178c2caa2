// test_cpu_trainer_cli.cpp — the flare-train program as a user meets it: --help, every bad flag
// or config answered with exit status 2 and a message naming the flag, nothing written; and a
// 20-step CPU run of gpt-tiny and llama-tiny on a tiny shard written here, then sampling from its
// checkpoint.
//
// The binary is <build>/apps/train/flare-train (apps/train/app.cmake), found from this test's own
// path (<build>/tests/train/…), or from $FLARE_TRAIN_BIN.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "test_cpu_trainer_util.h"
#include "train/core/model_config.h"

namespace flare::train {
namespace {

namespace fs = std::filesystem;
using test::ScratchDir;

std::string binary() {
  if (const char* env = std::getenv("FLARE_TRAIN_BIN")) return env;
  const fs::path self = fs::read_symlink("/proc/self/exe");
  return (self.parent_path().parent_path().parent_path() / "apps" / "train" / "flare-train").string();
}

struct Result {
  int status = -1;
  std::string output;  // stdout and stderr together
};

// Runs flare-train with `args` in `cwd` (shell-quoted by the caller where needed).
Result run(const std::string& args, const std::string& cwd) {
  const std::string command = "cd '" + cwd + "' && '" + binary() + "' " + args + " 2>&1";
  Result r;
  FILE* pipe = popen(command.c_str(), "r");
  if (!pipe) return r;
  std::array<char, 4096> buf;
  size_t n = 0;
  while ((n = std::fread(buf.data(), 1, buf.size(), pipe)) > 0) r.output.append(buf.data(), n);
  const int raw = pclose(pipe);
  r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  return r;
}

class TrainerCli : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(fs::exists(binary())) << binary() << " is not built (target flare_train_app)";
    test::write_cycle_shards(dir_, 300, 2048);
    // The shards under prepare_data.py's names so --data finds them.
    fs::rename(dir_.file("train_000000.bin"), dir_.file("cyc_train_000000.bin"));
    fs::rename(dir_.file("train_000001.bin"), dir_.file("cyc_train_000001.bin"));
    fs::rename(dir_.file("val_000000.bin"), dir_.file("cyc_val_000000.bin"));
    work_ = dir_.file("work");
    fs::create_directories(work_);
  }

  // Nothing but what the test put there: a rejected command writes no checkpoint or log.
  void expect_nothing_written() {
    EXPECT_TRUE(fs::is_empty(work_)) << "a rejected command wrote into its working directory";
  }

  std::string base() const { return "--device cpu --data '" + dir_.path().string() + "' "; }

  ScratchDir dir_;
  std::string work_;
};

TEST_F(TrainerCli, HelpListsEveryFlag) {
  const Result r = run("--help", work_);
  EXPECT_EQ(r.status, 0) << r.output;
  for (const char* flag : {"--model", "--data", "--batch", "--seq", "--steps", "--lr", "--device",
                           "--grad-accum", "--recompute", "--eval-every", "--ckpt-every", "--resume",
                           "--log", "--peak-tflops", "--no-checkpoint", "--n-layer", "--head-dim", "--vocab",
                           "--zero", "--cp", "--bucket-mb"}) {
    EXPECT_NE(r.output.find(flag), std::string::npos) << flag << " missing from --help";
  }
  EXPECT_EQ(run("sample --help", work_).status, 0);
  const Result models = run("models", work_);
  EXPECT_EQ(models.status, 0);
  EXPECT_NE(models.output.find("gpt3-2.7b"), std::string::npos) << models.output;
  expect_nothing_written();
}

TEST_F(TrainerCli, BadFlagsAndConfigsNameTheFlagAndWriteNothing) {
  struct Case {
    std::string args;
    std::string expected;  // in the message
    int status = 2;        // 1: the command line was fine, the data was not
  };
  const std::string b = base();
  const std::vector<Case> cases = {
      {"--device cpu", "--model: required"},
      {b + "--model gpt-huge", "--model: unknown preset 'gpt-huge'"},
      {b + "--model gpt-tiny --bogus 3", "unknown flag --bogus"},
      {b + "--model gpt-tiny --batch", "--batch: missing value"},
      {b + "--model gpt-tiny --batch two", "--batch: 'two' is not an integer"},
      {b + "--model gpt-tiny --lr 1e-3x", "--lr: '1e-3x' is not a finite number"},
      {b + "--model gpt-tiny --batch 0", "--batch: 0 must be"},
      {b + "--model gpt-tiny --seq 65", "--seq: 65 must be in [1, max_seq = 64]"},
      {b + "--model gpt-tiny --steps 10 --warmup 11", "--warmup: 11 must be in [0, steps = 10]"},
      {b + "--model gpt-tiny --lr -1", "--lr: -1 must be finite and > 0"},
      {b + "--model gpt-tiny --min-lr 1 --lr 0.1", "--min-lr"},
      {b + "--model gpt-tiny --beta2 1", "--beta2: 1 must be in [0, 1)"},
      {b + "--model gpt-tiny --n-head 5", "--n-head"},
      {b + "--model llama-tiny --n-kv-head 3", "--n-kv-head"},
      // The shards hold ids up to 297: found when the first shard is read, before any step.
      {b + "--model gpt-tiny --vocab 100", "not below vocab_size = 100", 1},
      {b + "--model gpt-tiny --device tpu", "--device: 'tpu' must be cpu or cuda"},
      {b + "--model gpt-tiny --resume nowhere.ckpt", "--resume: no file 'nowhere.ckpt'"},
      {b + "--model gpt-tiny --val-data '" + dir_.file("nothing_*.bin") + "'", "--val-data: no shard"},
      {"--device cpu --model gpt-tiny --data '" + dir_.file("empty") + "'", "--data: no shard matches"},
      {"--device cpu --model gpt-tiny", "prepare_data.py --out data/pydoc"},  // the default corpus
      {b + "--model gpt-tiny stray", "unexpected argument 'stray'"},
      {b + "--model gpt-tiny --recompute=yes", "--recompute: takes no value"},
      {b + "--model gpt-tiny --no-checkpoint --ckpt-every 5", "--no-checkpoint: conflicts"},
      {b + "--model gpt-tiny --zero 3", "--zero: 3 must be"},
  };
  for (const Case& c : cases) {
    const Result r = run(c.args, work_);
    EXPECT_EQ(r.status, c.status) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.expected), std::string::npos) << c.args << "\nexpected: " << c.expected
                                                            << "\ngot: " << r.output;
    EXPECT_EQ(r.output.find("step  "), std::string::npos) << "no step may run: " << c.args;
    expect_nothing_written();
  }
}

// A launch environment that is partial, inconsistent or asks for what a launch cannot do is a
// usage error naming the variable or flag, before any rendezvous (so nothing waits for peers).
TEST_F(TrainerCli, BadLaunchEnvironmentsNameTheProblemAndWriteNothing) {
  struct Case {
    std::vector<std::pair<const char*, const char*>> env;
    std::string args;
    std::string expected;
  };
  const std::string b = base();
  const std::string cuda = "--device cuda --data '" + dir_.path().string() + "' --model gpt-tiny";
  const std::vector<Case> cases = {
      {{{"RANK", "1"}}, b + "--model gpt-tiny", "launch environment: "},
      {{{"LOCAL_RANK", "0"}}, b + "--model gpt-tiny", "set RANK and WORLD_SIZE"},
      {{{"RANK", "2"}, {"WORLD_SIZE", "2"}}, b + "--model gpt-tiny", "rank 2 must be below the world size 2"},
      {{{"RANK", "x"}, {"WORLD_SIZE", "2"}}, b + "--model gpt-tiny", "RANK=\"x\" is not a non-negative integer"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "2"}}, b + "--model gpt-tiny", "--device: a launch of 2 processes"},
      {{{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}}, b + "--model gpt-tiny",
       "--device: a launch of 2 processes"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "2"}}, cuda + " --device-index 1", "--device-index: under a launch"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "2"}}, cuda + " --dump-step out", "--dump-step: runs in one process"},
  };
  for (const Case& c : cases) {
    for (const auto& [name, value] : c.env) setenv(name, value, 1);
    const Result r = run(c.args, work_);
    for (const auto& [name, value] : c.env) unsetenv(name);
    EXPECT_EQ(r.status, 2) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.expected), std::string::npos) << c.args << "\nexpected: " << c.expected
                                                            << "\ngot: " << r.output;
    expect_nothing_written();
  }
}

class TrainerCliRun : public TrainerCli, public ::testing::WithParamInterface<const char*> {};

// 20 steps on the CPU: a progress line per step, the loss falls, validation and the final
// checkpoint are there, the JSON log has 20 lines, and `sample` reads the checkpoint back.
TEST_P(TrainerCliRun, TwentyStepsThenSample) {
  const std::string model = GetParam();
  const Result r = run(base() + "--model " + model +
                           " --batch 2 --seq 32 --steps 20 --lr 1e-2 --warmup 2 --eval-every 10"
                           " --eval-batches 2 --ckpt-dir ck --log log.jsonl --sample 4",
                       work_);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("model " + model), std::string::npos) << r.output;
  for (int step = 1; step <= 20; ++step) {
    char line[32];
    std::snprintf(line, sizeof line, "step %6d/20 | loss ", step);
    EXPECT_NE(r.output.find(line), std::string::npos) << line << "\n" << r.output;
  }
  EXPECT_NE(r.output.find("| val "), std::string::npos);
  EXPECT_NE(r.output.find("saved ck/step_000020.ckpt"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("sample token ids (no tokenizer):"), std::string::npos) << r.output;
  // The loss of step 20 is well below that of step 1 on the cycle stream.
  auto loss_at = [&](int step) {
    char key[32];
    std::snprintf(key, sizeof key, "step %6d/20 | loss ", step);
    const size_t at = r.output.find(key);
    return at == std::string::npos ? 0.0 : std::stod(r.output.substr(at + std::strlen(key)));
  };
  EXPECT_LT(loss_at(20), loss_at(1) - 1.0) << r.output;
  EXPECT_TRUE(fs::exists(fs::path(work_) / "ck" / "step_000020.ckpt"));
  std::ifstream log(fs::path(work_) / "log.jsonl");
  int lines = 0;
  for (std::string line; std::getline(log, line);) lines += line.front() == '{' && line.back() == '}';
  EXPECT_EQ(lines, 20);

  const Result s = run("sample --checkpoint ck/step_000020.ckpt --tokens 5 --top-k 3 --seed 1 --data '" +
                           dir_.path().string() + "'",
                       work_);
  EXPECT_EQ(s.status, 0) << s.output;
  EXPECT_NE(s.output.find("step 20"), std::string::npos) << s.output;
  const Result bad = run("sample --checkpoint log.jsonl", work_);
  EXPECT_EQ(bad.status, 2) << bad.output;
  EXPECT_NE(bad.output.find("--checkpoint: "), std::string::npos) << bad.output;
}

INSTANTIATE_TEST_SUITE_P(Presets, TrainerCliRun, ::testing::Values("gpt-tiny", "llama-tiny"));

// --dump-step writes bench/train_compare.py's step dump; --init-weights reads a flat buffer back,
// and the same weights on the same batch give the same gradients bit for bit.
TEST_F(TrainerCli, StepDumpAndInitWeightsRoundTrip) {
  const Result r = run(base() + "--model llama-tiny --batch 2 --seq 16 --dump-step dump", work_);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(r.output.find("step  "), std::string::npos) << "a dump runs no optimizer step";
  const fs::path d = fs::path(work_) / "dump";
  ModelConfig c;
  ASSERT_TRUE(model_preset("llama-tiny", &c).ok());
  const auto n = static_cast<uintmax_t>(parameter_layout(c).total);
  EXPECT_EQ(fs::file_size(d / "weights.bin"), 4 * n);
  EXPECT_EQ(fs::file_size(d / "grads.bin"), 4 * n);
  EXPECT_EQ(fs::file_size(d / "tokens.bin"), 4u * 2 * 16);
  EXPECT_EQ(fs::file_size(d / "targets.bin"), 4u * 2 * 16);
  EXPECT_EQ(fs::file_size(d / "logits.bin"), 4u * 2 * 16 * static_cast<uintmax_t>(c.padded_vocab));
  std::ifstream json(d / "step.json");
  const std::string text((std::istreambuf_iterator<char>(json)), std::istreambuf_iterator<char>());
  for (const char* key : {"\"model\": {\"family\": \"llama\"", "\"batch\": 2", "\"seq\": 16",
                          "\"precision\": \"fp32\"", "\"n_kv_head\": 2", "\"loss\": "}) {
    EXPECT_NE(text.find(key), std::string::npos) << key << " in " << text;
  }

  // The dumped weights and batch, fed back: a second dump in the same directory reads
  // tokens.bin/targets.bin and starts from weights.bin.
  fs::copy_file(d / "grads.bin", fs::path(work_) / "grads_first.bin");
  const Result again = run(base() + "--model llama-tiny --batch 2 --seq 16 --seed 99 --init-weights dump/weights.bin "
                           "--dump-step dump", work_);
  ASSERT_EQ(again.status, 0) << again.output;
  const std::vector<uint8_t> a = test::read_bytes((fs::path(work_) / "grads_first.bin").string());
  const std::vector<uint8_t> b = test::read_bytes((d / "grads.bin").string());
  EXPECT_EQ(a, b) << "the same weights and batch must give the same gradients";

  const Result wrong = run(base() + "--model gpt-tiny --init-weights dump/weights.bin --dump-step d2", work_);
  EXPECT_EQ(wrong.status, 2) << wrong.output;
  EXPECT_NE(wrong.output.find("--init-weights: "), std::string::npos) << wrong.output;
  EXPECT_FALSE(fs::exists(fs::path(work_) / "d2"));
}

TEST_F(TrainerCli, SynthDataWritesShardsTheTrainerReads) {
  const Result r = run("synth-data --out synth --tokens 5000 --vocab 300", work_);
  ASSERT_EQ(r.status, 0) << r.output;
  const Result t = run("--device cpu --data synth --model gpt-tiny --batch 2 --seq 16 --steps 2 "
                       "--warmup 0 --ckpt-dir ck --sample 0",
                       work_);
  EXPECT_EQ(t.status, 0) << t.output;
  EXPECT_NE(t.output.find("step      2/2"), std::string::npos) << t.output;
}

}  // namespace
}  // namespace flare::train
