// test_cpu_dp_trainer.cpp — data parallel on the CPU backend: N in-process ranks (one thread and
// one Trainer each) against one rank on the same global batch, with and without gradient
// accumulation; a one-rank communicator against none (bit for bit); checkpoints of a sharded
// state, resumed at the same world size (bit for bit) and at another one; and a dead peer during a
// checkpoint.
//
// Tolerance: dp_test_util.h (docs/architecture.md's rule against one-rank regroupings of the same
// global batch, the floor fp32 rounding at the reference's magnitude). Three naive regroupings (B
// with N times the micro-batches, one sequence per micro-batch, and the N ranks each with one
// sequence per micro-batch) and sequences of 40 tokens: with 32, a batch split in halves fell on
// the CPU kernels' own split of the rows, the naive sums came out bit for bit the reference's and
// the noise estimate was degenerate (one element differed where the ranks' strided split changed
// 65k). The one-rank regroupings can still come out nearly bit for bit the reference's for a model
// (llama-tiny on 2 ranks: m within 5e-10 where the ranks' sum of per-rank gradients differs by
// 1e-8), since they add every micro-batch into one gradient while the ranks add whole per-rank
// gradients; the third regrouping has the ranks' structure, so the estimate sees that sum's
// rounding too; it runs the code under test, so it must first meet the one-rank rule on every loss
// and gradient norm. AdamW's eps is 1 in these runs: with 1e-8, an element whose gradient is near
// zero moves by lr · g / (|g| + eps), which turns a last-bit difference of g into up to lr of
// weight, so the final weights measured where reordering noise happened to land rather than the
// gradient arithmetic; with eps 1 the update is about lr · m̂, and m and v carry the step's
// gradients themselves.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "dp_test_util.h"
#include "flare/dist.h"
#include "test_cpu_trainer_util.h"
#include "train/core/checkpoint.h"
#include "train/loop/trainer.h"

namespace flare::train {
namespace {

using test::RunResult;
using test::ScratchDir;
namespace fs = std::filesystem;

size_t sz(int64_t n) { return static_cast<size_t>(n); }

// Runs fn(rank, comm) on `world` threads over one in-process group (comm null when world is 0:
// a run without a communicator) and returns the statuses.
std::vector<Status> run_ranks(int world, int timeout_ms,
                              const std::function<Status(int, dist::Communicator*)>& fn) {
  if (world == 0) return {fn(0, nullptr)};
  std::vector<std::unique_ptr<dist::Communicator>> comms;
  dist::CommOptions co;
  co.timeout_ms = timeout_ms;
  EXPECT_TRUE(dist::make_in_process_group(world, co, &comms).ok());
  std::vector<Status> status(sz(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] { status[sz(r)] = fn(r, comms[sz(r)].get()); });
  }
  for (std::thread& t : threads) t.join();
  return status;
}

void expect_all_ok(const std::vector<Status>& status) {
  for (size_t r = 0; r < status.size(); ++r) EXPECT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r].to_string();
}

// Trains `o` from its start (or resume) to `until` steps on `world` ranks (0: no communicator);
// rank 0's losses and final state come back, and every rank's losses must agree.
RunResult train(TrainerOptions o, int world, int64_t until) {
  RunResult out;
  std::vector<std::vector<double>> losses(sz(std::max(world, 1)));
  const auto status = run_ranks(world, 60000, [&](int rank, dist::Communicator* comm) {
    TrainerOptions mine = o;
    mine.backend.comm = comm;
    return test::train_rank(mine, rank, until, &losses[sz(rank)], &out);
  });
  expect_all_ok(status);
  out.losses = losses[0];
  for (size_t r = 1; r < losses.size(); ++r) EXPECT_EQ(losses[r], losses[0]) << "rank " << r << "'s losses";
  return out;
}

TrainerOptions run_options(const ScratchDir& dir, int64_t batch, int64_t accum, int64_t steps) {
  TrainerOptions o = test::tiny_run(dir, "gpt-tiny", steps);
  o.train.batch = batch;
  o.train.seq = 40;  // see the file's comment
  o.train.eps = 1.0;  // see the file's comment
  o.train.grad_accum = accum;
  o.train.eval_every = 0;
  o.backend.bucket_bytes = 16 << 10;  // several buckets even for the tiny model
  return o;
}

// A run compared against the one-rank reference (see the file's comment): no clipping, since the
// clip factor is the fp32 rounding of a double norm whose sum the ranks order differently, and a
// last-bit flip of it scales every gradient by one ulp (the norms are compared instead).
TrainerOptions comparison_options(const ScratchDir& dir, int64_t batch, int64_t accum, int64_t steps) {
  TrainerOptions o = run_options(dir, batch, accum, steps);
  o.train.grad_clip = 0.0;
  return o;
}

// ---- N ranks against one rank on the same global batch ----------------------------------------

struct DpCase {
  int world;
  int64_t accum;
  const char* preset;
};

class DataParallelMatchesOneRank : public ::testing::TestWithParam<DpCase> {};

TEST_P(DataParallelMatchesOneRank, LossesAndStateWithinReorderingNoise) {
  const DpCase c = GetParam();
  ScratchDir dir;
  test::write_cycle_shards(dir, 300);
  const int64_t B = 2, steps = 3;
  auto options = [&](int64_t batch, int64_t accum) {
    TrainerOptions o = comparison_options(dir, batch, accum, steps);
    EXPECT_TRUE(model_preset(c.preset, &o.model).ok());
    return o;
  };
  const RunResult ref = train(options(B * c.world, c.accum), 0, steps);
  std::vector<RunResult> naives = {train(options(B, c.accum * c.world), 0, steps),
                                   train(options(1, c.accum * c.world * B), 0, steps)};
  // The ranks' regrouping runs the data-parallel path itself, so before it measures noise it
  // must meet the one-rank rule where a systematic error would show (every step's loss and
  // gradient norm): a wrong scale or a lost rank cannot hide in its own noise estimate.
  const RunResult ranks_regrouped = train(options(1, c.accum * B), c.world, steps);
  test::expect_curves_within_reordering_noise(ranks_regrouped, ref, naives);
  naives.push_back(ranks_regrouped);
  const RunResult fast = train(options(B, c.accum), c.world, steps);
  test::expect_within_reordering_noise(fast, ref, naives);
}

INSTANTIATE_TEST_SUITE_P(Cpu, DataParallelMatchesOneRank,
                         ::testing::Values(DpCase{2, 1, "gpt-tiny"}, DpCase{3, 1, "gpt-tiny"},
                                           DpCase{2, 2, "gpt-tiny"}, DpCase{3, 2, "llama-tiny"},
                                           DpCase{2, 1, "llama-tiny"}),
                         [](const ::testing::TestParamInfo<DpCase>& param_info) {
                           const DpCase& p = param_info.param;
                           std::string name = std::string(p.preset) + "_world" +
                                              std::to_string(p.world) + "_accum" +
                                              std::to_string(p.accum);
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

// A one-rank communicator takes the data-parallel code path, which must be the single-device
// step exactly.
TEST(DataParallel, OneRankCommunicatorIsTheSingleDeviceStepBitForBit) {
  ScratchDir dir;
  test::write_cycle_shards(dir, 300);
  const TrainerOptions o = run_options(dir, 2, 2, 3);
  const RunResult alone = train(o, 0, 3);
  const RunResult one = train(o, 1, 3);
  EXPECT_EQ(one.losses, alone.losses);
  EXPECT_EQ(0, std::memcmp(one.master.data(), alone.master.data(), one.master.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(one.v.data(), alone.v.data(), one.v.size() * sizeof(float)));
}

// ---- Checkpoints --------------------------------------------------------------------------------

// Rank 0 writes the usual format; the same world size resumes it bit for bit.
TEST(DataParallel, CheckpointOfShardsResumesBitForBit) {
  ScratchDir dir;
  test::write_cycle_shards(dir, 300);
  TrainerOptions o = run_options(dir, 2, 1, 4);
  o.train.checkpoint_dir = dir.file("ckpt");
  o.train.ckpt_every = 2;
  const RunResult straight = train(o, 2, 4);
  const std::string at2 = dir.file("ckpt/step_000002.ckpt");
  CheckpointMeta meta;
  ASSERT_TRUE(read_checkpoint_meta(at2, &meta).ok());
  EXPECT_EQ(meta.step, 2);

  TrainerOptions resumed = o;
  resumed.resume_from = at2;
  resumed.train.checkpoint_dir = dir.file("ckpt2");
  const RunResult rest = train(resumed, 2, 4);
  ASSERT_EQ(rest.losses.size(), 2u);
  EXPECT_EQ(rest.losses[0], straight.losses[2]);
  EXPECT_EQ(rest.losses[1], straight.losses[3]);
  EXPECT_EQ(0, std::memcmp(rest.master.data(), straight.master.data(), rest.master.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(rest.m.data(), straight.m.data(), rest.m.size() * sizeof(float)));
}

// 2 ranks of batch 3 for two steps, then 3 ranks of batch 2 (the same global batch of 6): within
// the reordering noise of one rank of batch 6 for four steps, the naive run being batch 2 with
// three micro-batches.
TEST(DataParallel, ResumesAtAnotherWorldSize) {
  ScratchDir dir;
  test::write_cycle_shards(dir, 300);
  const int64_t steps = 4;
  const RunResult ref = train(comparison_options(dir, 6, 1, steps), 0, steps);
  const std::vector<RunResult> naives = {train(comparison_options(dir, 2, 3, steps), 0, steps),
                                         train(comparison_options(dir, 1, 6, steps), 0, steps)};

  TrainerOptions first = comparison_options(dir, 3, 1, steps);
  first.train.checkpoint_dir = dir.file("ckpt");
  first.train.ckpt_every = 2;
  const RunResult head = train(first, 2, 2);
  TrainerOptions second = comparison_options(dir, 2, 1, steps);
  second.resume_from = dir.file("ckpt/step_000002.ckpt");
  RunResult fast = train(second, 3, steps);
  fast.losses.insert(fast.losses.begin(), head.losses.begin(), head.losses.end());
  fast.norms.insert(fast.norms.begin(), head.norms.begin(), head.norms.end());
  test::expect_within_reordering_noise(fast, ref, naives);
}

// A resumed world size whose batch split cannot continue at the saved data position is refused,
// naming the rule.
TEST(DataParallel, ResumeRejectsADataPositionOffTheNewBatchGrid) {
  ScratchDir dir;
  test::write_cycle_shards(dir, 300);
  TrainerOptions first = run_options(dir, 2, 1, 4);
  first.train.checkpoint_dir = dir.file("ckpt");
  first.train.ckpt_every = 1;
  train(first, 1, 1);  // 2 windows used
  TrainerOptions second = run_options(dir, 2, 1, 4);
  second.resume_from = dir.file("ckpt/step_000001.ckpt");
  const auto status = run_ranks(3, 60000, [&](int, dist::Communicator* comm) {
    TrainerOptions mine = second;
    mine.backend.comm = comm;
    std::unique_ptr<Trainer> t;
    return Trainer::create(mine, &t);
  });
  for (const Status& s : status) {
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.message().find("whole number of this loader's batches"), std::string::npos) << s.message();
  }
}

// A peer that never joins the checkpoint: rank 0's save fails within the timeout naming the
// silent rank, and the checkpoint written before stays whole.
TEST(DataParallel, DeadPeerDuringCheckpointIsAnErrorAndTheLastCheckpointStaysValid) {
  ScratchDir dir;
  test::write_cycle_shards(dir, 300);
  TrainerOptions o = run_options(dir, 2, 1, 2);
  o.train.checkpoint_dir = dir.file("ckpt");
  o.train.ckpt_every = 1;
  Status rank0_save;
  const auto status = run_ranks(2, 2000, [&](int rank, dist::Communicator* comm) {
    TrainerOptions mine = o;
    mine.backend.comm = comm;
    std::unique_ptr<Trainer> t;
    FLARE_RETURN_IF_ERROR(Trainer::create(mine, &t));
    FLARE_RETURN_IF_ERROR(t->run(1, nullptr));  // writes step_000001.ckpt
    if (rank == 0) rank0_save = t->save_checkpoint(dir.file("ckpt/late.ckpt"));  // rank 1 is gone
    return Status::ok_status();
  });
  expect_all_ok(status);
  ASSERT_FALSE(rank0_save.ok());
  EXPECT_NE(rank0_save.message().find("rank 1"), std::string::npos) << rank0_save.message();
  EXPECT_FALSE(fs::exists(dir.file("ckpt/late.ckpt")));
  CheckpointMeta meta;
  const Status read = read_checkpoint_meta(dir.file("ckpt/step_000001.ckpt"), &meta);
  EXPECT_TRUE(read.ok()) << read.to_string();
}

TEST(DataParallel, BadBucketSizeIsRejectedByName) {
  ScratchDir dir;
  test::write_cycle_shards(dir, 300);
  TrainerOptions o = run_options(dir, 2, 1, 2);
  o.backend.bucket_bytes = 0;
  const auto status = run_ranks(2, 60000, [&](int, dist::Communicator* comm) {
    TrainerOptions mine = o;
    mine.backend.comm = comm;
    std::unique_ptr<Trainer> t;
    return Trainer::create(mine, &t);
  });
  for (const Status& s : status) EXPECT_NE(s.message().find("bucket_bytes"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace flare::train
