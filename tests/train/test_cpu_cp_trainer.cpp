// test_cpu_cp_trainer.cpp — context parallelism in the trainer on the CPU backend: groups of
// in-process ranks that share each sequence (the zigzag share per rank, flare's context-parallel
// attention between them), alone or beside data parallelism, against one rank on the same global
// batch; the rows and positions each rank holds; and the rules, each refused by name.
//
// Tolerance: dp_test_util.h's rule (docs/architecture.md: max|fast − ref| ≤ 2·max|naive − ref| +
// fp32 rounding at the reference's magnitude), against one rank on the same global batch. A
// context-parallel step regroups that rank's sums twice: each sequence's token losses and gradient
// contributions are added per rank, then across ranks — the naive runs of the data-parallel tests
// (one-rank regroupings of the batch) measure that noise — and each attention row's softmax sums
// come from per-block partials merged in fp32, a regrouping of the attention arithmetic whose noise
// those runs do not see: a third naive run measures it, the same one-rank step with attention
// computed exactly (float64, rounded once), whose distance from the reference is the fp32 flash
// attention's own rounding at this problem. Sequences of 40 tokens and AdamW eps 1, for the reasons
// test_cpu_dp_trainer.cpp gives.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "dp_test_util.h"
#include "flare/dist.h"
#include "test_cpu_trainer_util.h"
#include "train/cpu/model.h"
#include "train/loop/backend.h"
#include "train/loop/trainer.h"

namespace flare::train {
namespace {

using test::RunResult;
using test::ScratchDir;

size_t sz(int64_t n) { return static_cast<size_t>(n); }

// `world` ranks, one thread each: comm over all of them and cp_comm over each run of `cp`
// consecutive ranks (one communicator for both when cp == world and share is set).
struct Ranks {
  std::vector<std::unique_ptr<dist::Communicator>> all, groups;

  Ranks(int world, int cp, bool share = false) {
    EXPECT_TRUE(dist::make_in_process_group(world, {}, &all).ok());
    if (share) return;
    for (int g = 0; g < world / cp; ++g) {
      std::vector<std::unique_ptr<dist::Communicator>> group;
      EXPECT_TRUE(dist::make_in_process_group(cp, {}, &group).ok());
      for (auto& c : group) groups.push_back(std::move(c));
    }
  }
  dist::Communicator* comm(int r) const { return all[sz(r)].get(); }
  dist::Communicator* cp_comm(int r) const { return groups.empty() ? comm(r) : groups[sz(r)].get(); }

  std::vector<Status> run(const std::function<Status(int rank)>& fn) const {
    std::vector<Status> status(all.size());
    std::vector<std::thread> threads;
    for (size_t r = 0; r < all.size(); ++r) threads.emplace_back([&, r] { status[r] = fn(static_cast<int>(r)); });
    for (std::thread& t : threads) t.join();
    return status;
  }
};

void expect_all_ok(const std::vector<Status>& status) {
  for (size_t r = 0; r < status.size(); ++r) EXPECT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r].to_string();
}

// Trains `o` to `until` steps on `world` ranks in context-parallel groups of `cp` (world 0: one
// rank without communicators); rank 0's losses, norms, reports and final state come back, and
// every rank's losses must agree.
RunResult train(const TrainerOptions& o, int world, int cp, int64_t until, bool share = false) {
  RunResult out;
  if (world == 0) {
    expect_all_ok({test::train_rank(o, 0, until, &out.losses, &out)});
    return out;
  }
  const Ranks ranks(world, cp, share);
  std::vector<std::vector<double>> losses(sz(world));
  expect_all_ok(ranks.run([&](int r) {
    TrainerOptions mine = o;
    mine.backend.comm = ranks.comm(r);
    mine.backend.cp_comm = ranks.cp_comm(r);
    return test::train_rank(mine, r, until, &losses[sz(r)], &out);
  }));
  out.losses = losses[0];
  for (size_t r = 1; r < losses.size(); ++r) EXPECT_EQ(losses[r], losses[0]) << "rank " << r << "'s losses";
  return out;
}

// No clipping (see test_cpu_dp_trainer.cpp: the norms are compared instead); one validation pass
// at the end over two batches.
TrainerOptions run_options(const ScratchDir& dir, const char* preset, int64_t batch, int64_t accum,
                           int64_t steps) {
  TrainerOptions o = test::tiny_run(dir, preset, steps);
  EXPECT_TRUE(model_preset(preset, &o.model).ok());
  o.train.batch = batch;
  o.train.seq = 40;
  o.train.eps = 1.0;
  o.train.grad_accum = accum;
  o.train.grad_clip = 0.0;
  o.train.eval_every = steps;
  o.eval_batches = 2;
  o.backend.bucket_bytes = 16 << 10;
  return o;
}

// The validation loss of the last step, within the same rule as the training losses.
void expect_validation_within_noise(const RunResult& fast, const RunResult& ref,
                                    const std::vector<RunResult>& naives) {
  ASSERT_FALSE(fast.reports.empty());
  ASSERT_TRUE(fast.reports.back().has_val && ref.reports.back().has_val);
  const double want = ref.reports.back().val_loss;
  double noise = 0.0;
  for (const RunResult& n : naives) noise = std::max(noise, std::fabs(n.reports.back().val_loss - want));
  EXPECT_LE(std::fabs(fast.reports.back().val_loss - want), 2 * noise + 2 * test::kFp32Eps * std::fabs(want))
      << "validation loss: " << fast.reports.back().val_loss << " against " << want;
}

// ---- context-parallel groups against one rank on the same global batch ------------------------

struct CpCase {
  int world;
  int cp;
  int64_t accum;
  const char* preset;
};

class ContextParallelMatchesOneRank : public ::testing::TestWithParam<CpCase> {};

TEST_P(ContextParallelMatchesOneRank, LossesValidationAndStateWithinReorderingNoise) {
  const CpCase c = GetParam();
  ScratchDir dir;
  test::write_cycle_shards(dir, 300);
  const int64_t B = 2, steps = 3;
  const int dp = c.world / c.cp;
  auto options = [&](int64_t batch, int64_t accum) { return run_options(dir, c.preset, batch, accum, steps); };
  const RunResult ref = train(options(B * dp, c.accum), 0, 1, steps);
  TrainerOptions exact = options(B * dp, c.accum);
  exact.backend.attention_backend = flare::Backend::kReference;
  const std::vector<RunResult> naives = {train(options(B, c.accum * dp), 0, 1, steps),
                                         train(options(1, c.accum * dp * B), 0, 1, steps),
                                         train(exact, 0, 1, steps)};
  const RunResult fast = train(options(B, c.accum), c.world, c.cp, steps);
  test::expect_within_reordering_noise(fast, ref, naives);
  expect_validation_within_noise(fast, ref, naives);
}

INSTANTIATE_TEST_SUITE_P(Cpu, ContextParallelMatchesOneRank,
                         ::testing::Values(CpCase{2, 2, 1, "llama-tiny"}, CpCase{2, 2, 2, "gpt-tiny"},
                                           CpCase{4, 4, 1, "llama-tiny"}, CpCase{4, 2, 1, "gpt-tiny"},
                                           CpCase{4, 2, 1, "llama-tiny"}),
                         [](const ::testing::TestParamInfo<CpCase>& param_info) {
                           const CpCase& p = param_info.param;
                           std::string name = std::string(p.preset) + "_world" + std::to_string(p.world) +
                                              "_cp" + std::to_string(p.cp) + "_accum" + std::to_string(p.accum);
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

// One communicator may serve as both (every rank in one context-parallel group): the same run as
// with a separate group, bit for bit.
TEST(ContextParallel, OneCommunicatorForBothIsTheSameRun) {
  ScratchDir dir;
  test::write_cycle_shards(dir, 300);
  const TrainerOptions o = run_options(dir, "llama-tiny", 2, 1, 2);
  const RunResult separate = train(o, 2, 2, 2);
  const RunResult shared = train(o, 2, 2, 2, /*share=*/true);
  EXPECT_EQ(shared.losses, separate.losses);
  EXPECT_EQ(shared.master, separate.master);
}

// ---- the rows each rank holds -------------------------------------------------------------------

// Rank r of c holds chunks r and 2c − 1 − r of the sequence cut into 2c, in that order.
TEST(ContextParallel, EachRankHoldsItsZigzagChunksAtTheirPositions) {
  ModelConfig config;
  ASSERT_TRUE(model_preset("llama-tiny", &config).ok());
  const int cp = 2;
  const int64_t seq = 8;
  const Ranks ranks(cp, cp, /*share=*/true);
  std::vector<std::vector<int64_t>> positions(cp);
  std::vector<int64_t> rows(cp);
  expect_all_ok(ranks.run([&](int r) {
    std::unique_ptr<cpu::CpuModel> m;
    FLARE_RETURN_IF_ERROR(cpu::CpuModel::create(config, 1, seq, &m, ranks.comm(r)));
    positions[sz(r)] = m->positions();
    rows[sz(r)] = m->seq_len();
    return Status::ok_status();
  }));
  EXPECT_EQ(positions[0], (std::vector<int64_t>{0, 1, 6, 7}));
  EXPECT_EQ(positions[1], (std::vector<int64_t>{2, 3, 4, 5}));
  EXPECT_EQ(rows, (std::vector<int64_t>{4, 4}));
}

// ---- rules --------------------------------------------------------------------------------------

Status make_backend(const TrainerOptions& o, dist::Communicator* comm, dist::Communicator* cp_comm) {
  BackendOptions b = o.backend;
  b.comm = comm;
  b.cp_comm = cp_comm;
  std::unique_ptr<Backend> backend;
  return make_cpu_backend(o.model, o.train, b, &backend);
}

TEST(ContextParallel, SequenceNotAMultipleOfTwiceTheRanksIsRefusedByName) {
  ScratchDir dir;
  TrainerOptions o = run_options(dir, "gpt-tiny", 1, 1, 1);
  o.train.seq = 42;  // 2 ranks need a multiple of 4
  const Ranks ranks(2, 2, /*share=*/true);
  const std::vector<Status> status = ranks.run([&](int r) { return make_backend(o, ranks.comm(r), ranks.comm(r)); });
  for (const Status& s : status) {
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
    EXPECT_NE(s.message().find("seq_len = 42"), std::string::npos) << s.message();
  }
}

TEST(ContextParallel, GroupWithoutTheCommunicatorOfAllRanksIsRefusedByName) {
  ScratchDir dir;
  const TrainerOptions o = run_options(dir, "gpt-tiny", 1, 1, 1);
  const Ranks ranks(2, 2, /*share=*/true);
  const Status s = make_backend(o, nullptr, ranks.comm(0));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("cp_comm"), std::string::npos) << s.message();
}

// comm rank 1 of 4 belongs to group 0 as its rank 1; a group rank that says otherwise is refused.
TEST(ContextParallel, GroupThatIsNotConsecutiveRanksIsRefusedByName) {
  ScratchDir dir;
  const TrainerOptions o = run_options(dir, "gpt-tiny", 1, 1, 1);
  std::vector<std::unique_ptr<dist::Communicator>> all, group;
  ASSERT_TRUE(dist::make_in_process_group(4, {}, &all).ok());
  ASSERT_TRUE(dist::make_in_process_group(2, {}, &group).ok());
  const Status s = make_backend(o, all[1].get(), group[0].get());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("cp_comm"), std::string::npos) << s.message();
  int cp = 0;
  BackendOptions b;
  b.comm = all[2].get();
  b.cp_comm = group[0].get();
  ASSERT_TRUE(context_parallel_ranks(b, &cp).ok());
  EXPECT_EQ(cp, 2);
}

}  // namespace
}  // namespace flare::train
