// test_gpu_dp.cpp — data parallel on the CUDA backend: one thread per GPU, each with its own NCCL
// communicator made from one unique id, one Trainer per rank; against one GPU on the same global
// batch (2 GPUs, and every visible GPU when there are more), with gradient accumulation, for a
// small GPT and a small LLaMA; context-parallel groups (alone and beside data parallelism) against
// one GPU likewise; sharded gradients (ZeRO-2) likewise; a checkpoint written by 2 GPUs resumed on 1 against a straight
// run; a one-rank communicator against none (bit for bit); the step's profile; the rank-ordered
// slice sum against the host.
//
// Tolerance: dp_test_util.h. The naive runs are one-GPU regroupings of the same global batch (batch
// B with N times the micro-batches; one sequence per micro-batch), so their distance to the
// reference is the reordering noise of bf16 activations and fp32 gradient sums at this problem;
// the data-parallel run differs from the reference by such regroupings only (each rank's
// micro-batches of B sequences, the ranks' sums added in rank order). As in the CPU tests, no
// clipping (a last-bit flip of the clip factor scales every gradient) and AdamW's eps is 1 (with
// 1e-8 an element whose gradient is near zero turns a last-bit difference into up to lr of
// weight).
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "dp_test_util.h"
#include "flare/dist.h"
#include "test_cpu_trainer_util.h"
#include "train/core/checkpoint.h"
#include "train/dist/dp_cuda.h"
#include "train/loop/trainer.h"
#include "train_gpu_test.h"

namespace flare::train {
namespace {

using test::RunResult;
using test::ScratchDir;

size_t sz(int64_t n) { return static_cast<size_t>(n); }

int visible_gpus() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

#define SKIP_WITHOUT_GPUS(count)                                                               \
  do {                                                                                         \
    if (!::flare::dist::nccl_built()) GTEST_SKIP() << "this build of flare has no NCCL";       \
    if (visible_gpus() < (count))                                                              \
      GTEST_SKIP() << "needs " << (count) << " CUDA device(s), found " << visible_gpus();     \
  } while (0)

// Runs `fn(rank, comm, cp_comm)` on `world` threads, thread r on CUDA device r with an NCCL
// communicator of the group (one unique id) and, when cp > 1, one of its context-parallel group,
// the `cp` consecutive ranks around it (a communicator of its own even when cp == world: the CUDA
// backend runs the two on different streams at once); world 0: one thread on device 0 without
// communicators.
std::vector<Status> run_ranks(int world, int cp,
                              const std::function<Status(int, dist::Communicator*, dist::Communicator*)>& fn) {
  if (world == 0) {
    cudaSetDevice(0);
    return {fn(0, nullptr, nullptr)};
  }
  std::vector<dist::NcclId> ids(cp > 1 ? sz(1 + world / cp) : 1);
  for (dist::NcclId& id : ids) {
    const Status made = dist::nccl_unique_id(&id);
    if (!made.ok()) return {made};
  }
  std::vector<Status> status(sz(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      cudaSetDevice(r);
      dist::CommOptions co;
      co.timeout_ms = 120000;
      std::unique_ptr<dist::Communicator> comm, group;
      Status& st = status[sz(r)];
      st = dist::make_nccl_communicator(ids[0], r, world, r, co, &comm);
      if (st.ok() && cp > 1) st = dist::make_nccl_communicator(ids[sz(1 + r / cp)], r % cp, cp, r, co, &group);
      if (st.ok()) st = fn(r, comm.get(), group.get());
    });
  }
  for (std::thread& t : threads) t.join();
  return status;
}

// Trains `o` to `until` steps on `world` GPUs (0: one GPU, no communicator) in context-parallel
// groups of `cp`; every rank's losses must agree; rank 0's results come back.
RunResult train(TrainerOptions o, int world, int64_t until, int cp = 1) {
  RunResult out;
  std::vector<std::vector<double>> losses(sz(std::max(world, 1)));
  const auto status = run_ranks(world, cp, [&](int rank, dist::Communicator* comm, dist::Communicator* cp_comm) {
    TrainerOptions mine = o;
    mine.backend.comm = comm;
    mine.backend.cp_comm = cp_comm;
    mine.backend.device_index = rank;
    return test::train_rank(mine, rank, until, &losses[sz(rank)], &out);
  });
  for (size_t r = 0; r < status.size(); ++r) EXPECT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r].to_string();
  out.losses = losses[0];
  for (size_t r = 1; r < losses.size(); ++r) EXPECT_EQ(losses[r], losses[0]) << "rank " << r << "'s losses";
  return out;
}

TrainerOptions run_options(const ScratchDir& dir, const char* preset, int64_t batch, int64_t accum,
                           int64_t steps) {
  TrainerOptions o = test::tiny_run(dir, preset, steps);
  o.device = DeviceKind::kCuda;
  o.train.batch = batch;
  o.train.seq = 40;
  o.train.eps = 1.0;        // see the file's comment
  o.train.grad_clip = 0.0;  // see the file's comment
  o.train.grad_accum = accum;
  o.train.eval_every = 0;
  o.backend.bucket_bytes = 16 << 10;  // several buckets (and stages without one) even for tiny models
  return o;
}

// ---- N GPUs against one on the same global batch ------------------------------------------------

struct DpCase {
  const char* preset;
  int world;  // 0: every visible GPU (run only when there are more than 2)
};

class GpuDataParallel : public ::testing::TestWithParam<DpCase> {};

TEST_P(GpuDataParallel, MatchesOneGpuWithinReorderingNoise) {
  const DpCase c = GetParam();
  SKIP_WITHOUT_GPUS(2);
  const int world = c.world > 0 ? c.world : visible_gpus();
  if (c.world == 0 && world <= 2) GTEST_SKIP() << "every visible GPU: " << world << ", covered by the 2-GPU case";
  ScratchDir dir;
  test::write_cycle_shards(dir, 300, 8192);
  const int64_t B = 2, accum = 2, steps = 3;
  const RunResult ref = train(run_options(dir, c.preset, B * world, accum, steps), 0, steps);
  const std::vector<RunResult> naives = {train(run_options(dir, c.preset, B, accum * world, steps), 0, steps),
                                         train(run_options(dir, c.preset, 1, accum * world * B, steps), 0, steps)};
  const RunResult fast = train(run_options(dir, c.preset, B, accum, steps), world, steps);
  test::expect_within_reordering_noise(fast, ref, naives);

  // The step's profile: every part measured, communication counted.
  ASSERT_EQ(fast.reports.size(), sz(steps));
  for (const StepReport& r : fast.reports) {
    EXPECT_TRUE(r.timing.measured);
    EXPECT_EQ(r.world, world);
    EXPECT_GT(r.timing.fwd_ms, 0.0);
    EXPECT_GT(r.timing.bwd_ms, 0.0);
    EXPECT_GT(r.timing.comm_ms, 0.0);
    EXPECT_GE(r.timing.comm_exposed_ms, 0.0);
    EXPECT_GT(r.timing.optimizer_ms, 0.0);
    EXPECT_GT(r.timing.comm_bytes, 0);
    EXPECT_GE(r.peak_memory_bytes, r.memory_bytes);
    EXPECT_NE(step_json(r).find("\"comm_exposed_ms\": "), std::string::npos) << step_json(r);
  }
}

INSTANTIATE_TEST_SUITE_P(Presets, GpuDataParallel,
                         ::testing::Values(DpCase{"gpt-tiny", 2}, DpCase{"llama-tiny", 2},
                                           DpCase{"gpt-tiny", 0}, DpCase{"llama-tiny", 0}),
                         [](const ::testing::TestParamInfo<DpCase>& param_info) {
                           std::string name = std::string(param_info.param.preset) + "_" +
                                              (param_info.param.world > 0 ? std::to_string(param_info.param.world) + "gpus"
                                                                    : std::string("all_gpus"));
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

// ---- Sharded gradients (ZeRO-2) -----------------------------------------------------------------

// The same rule as the data-parallel suite, with no rank holding the whole gradient: each stage's
// gradients in a ring buffer until their reduce-scatter, every micro-batch reduced and added to the
// shard (so the sums are regrouped once more: per micro-batch across ranks, then over micro-batches,
// which the naive runs' regroupings measure). Two and every visible GPU, with and without
// accumulation, a tied (gpt-tiny) and an untied (llama-tiny) head; the reduce-scatter's bytes grow
// with the micro-batches.
struct ShardCase {
  const char* preset;
  int world;  // 0: every visible GPU (run only when there are more than 2)
  int64_t accum;
};

class GpuShardedGradients : public ::testing::TestWithParam<ShardCase> {};

TEST_P(GpuShardedGradients, MatchesOneGpuWithinReorderingNoise) {
  const ShardCase c = GetParam();
  SKIP_WITHOUT_GPUS(2);
  const int world = c.world > 0 ? c.world : visible_gpus();
  if (c.world == 0 && world <= 2) GTEST_SKIP() << "every visible GPU: " << world << ", covered by the 2-GPU case";
  ScratchDir dir;
  test::write_cycle_shards(dir, 300, 8192);
  const int64_t B = 2, steps = 3;
  const RunResult ref = train(run_options(dir, c.preset, B * world, c.accum, steps), 0, steps);
  const std::vector<RunResult> naives = {train(run_options(dir, c.preset, B, c.accum * world, steps), 0, steps),
                                         train(run_options(dir, c.preset, 1, c.accum * world * B, steps), 0, steps)};
  TrainerOptions sharded = run_options(dir, c.preset, B, c.accum, steps);
  sharded.train.shard_gradients = true;
  const RunResult fast = train(sharded, world, steps);
  test::expect_within_reordering_noise(fast, ref, naives);

  const RunResult whole = train(run_options(dir, c.preset, B, c.accum, steps), world, steps);
  ASSERT_EQ(fast.reports.size(), sz(steps));
  ASSERT_EQ(whole.reports.size(), sz(steps));
  for (int64_t s = 0; s < steps; ++s) {
    const StepReport& r = fast.reports[sz(s)];
    EXPECT_TRUE(r.timing.measured);
    EXPECT_GT(r.timing.comm_ms, 0.0);
    if (c.accum == 1) {
      EXPECT_EQ(r.timing.comm_bytes, whole.reports[sz(s)].timing.comm_bytes);
    } else {
      EXPECT_GT(r.timing.comm_bytes, whole.reports[sz(s)].timing.comm_bytes);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Presets, GpuShardedGradients,
                         ::testing::Values(ShardCase{"gpt-tiny", 2, 1}, ShardCase{"llama-tiny", 2, 2},
                                           ShardCase{"gpt-tiny", 0, 2}, ShardCase{"llama-tiny", 0, 1}),
                         [](const ::testing::TestParamInfo<ShardCase>& param_info) {
                           const ShardCase& p = param_info.param;
                           std::string name = std::string(p.preset) + "_" +
                                              (p.world > 0 ? std::to_string(p.world) + "gpus" : std::string("all_gpus")) +
                                              "_accum" + std::to_string(p.accum);
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

// ---- Context parallel: groups of GPUs share each sequence -------------------------------------

// `cp` GPUs share each sequence (zigzag rows, flare's ring attention between them) in world / cp
// data-parallel groups. The one-GPU regroupings of the data-parallel suite cannot measure what
// context parallelism changes: each ring step's attention call stores its block of O in bf16 before
// the fp32 merge (as ring attention does; tests/test_dist_gpu_attention.cpp holds that attention to
// the float64 rule), so a few elements of O round another way than in one call, and that noise is
// bf16's, which a regrouped batch (bit-identical rows) does not show. So the reference is the
// float32 CPU trainer, on the same global batch from the same weights, and the naive is one GPU:
// docs/architecture.md's rule, max|fast − ref| ≤ 2·max|naive − ref| + fp32 rounding, for each
// quantity as one tensor — the loss over the steps, the gradient norm over the steps, the final
// weights, m and v. (A single step's loss is one draw of the rounding noise, too few elements for a
// max; the data-parallel tests can hold each step alone because their runs differ from the
// reference by regrouped fp32 sums only.)
void expect_as_close_as_one_gpu(const RunResult& fast, const RunResult& ref, const RunResult& naive) {
  struct Quantity {
    const char* name;
    std::vector<float> fast, ref, naive;
  };
  auto curves = [&](const char* name, std::vector<double> RunResult::*field) {
    auto f = [](const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); };
    return Quantity{name, f(fast.*field), f(ref.*field), f(naive.*field)};
  };
  const Quantity quantities[] = {curves("loss", &RunResult::losses), curves("gradient norm", &RunResult::norms),
                                 {"master", fast.master, ref.master, naive.master},
                                 {"m", fast.m, ref.m, naive.m},
                                 {"v", fast.v, ref.v, naive.v}};
  for (const Quantity& q : quantities) {
    ASSERT_EQ(q.fast.size(), q.ref.size()) << q.name;
    ASSERT_FALSE(q.ref.empty()) << q.name;
    const double noise = test::max_abs_diff(q.naive, q.ref);
    const double diff = test::max_abs_diff(q.fast, q.ref);
    EXPECT_LE(diff, 2 * noise + 2 * test::kFp32Eps * test::max_abs(q.ref))
        << q.name << ": max|cp - fp32| " << diff << ", max|one GPU - fp32| " << noise;
  }
}

struct CpCase {
  const char* preset;
  int world;  // 0: every visible GPU (run only when there are more than 2)
  int cp;     // 0: world
};

class GpuContextParallel : public ::testing::TestWithParam<CpCase> {};

TEST_P(GpuContextParallel, AsCloseToTheFp32TrainerAsOneGpu) {
  const CpCase c = GetParam();
  SKIP_WITHOUT_GPUS(std::max(c.world, 2));
  const int world = c.world > 0 ? c.world : visible_gpus();
  if (c.world == 0 && world <= 2) GTEST_SKIP() << "every visible GPU: " << world << ", covered by the 2-GPU case";
  const int cp = c.cp > 0 ? c.cp : world;
  const int dp = world / cp;
  ScratchDir dir;
  test::write_cycle_shards(dir, 300, 8192);
  const int64_t B = 2, accum = 1, steps = 6;
  TrainerOptions cpu = run_options(dir, c.preset, B * dp, accum, steps);
  cpu.device = DeviceKind::kCpu;
  RunResult ref;
  ASSERT_OK(test::train_rank(cpu, 0, steps, &ref.losses, &ref));
  const RunResult naive = train(run_options(dir, c.preset, B * dp, accum, steps), 0, steps);
  const RunResult fast = train(run_options(dir, c.preset, B, accum, steps), world, steps, cp);
  expect_as_close_as_one_gpu(fast, ref, naive);
  ASSERT_EQ(fast.reports.size(), sz(steps));
  for (const StepReport& r : fast.reports) {
    EXPECT_GT(r.timing.cp_comm_ms, 0.0);
    EXPECT_GT(r.timing.cp_comm_bytes, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Presets, GpuContextParallel,
                         ::testing::Values(CpCase{"llama-tiny", 2, 2}, CpCase{"gpt-tiny", 2, 2},
                                           CpCase{"llama-tiny", 0, 0}, CpCase{"llama-tiny", 4, 2}),
                         [](const ::testing::TestParamInfo<CpCase>& param_info) {
                           const CpCase& p = param_info.param;
                           std::string name = std::string(p.preset) + "_" +
                                              (p.world > 0 ? std::to_string(p.world) + "gpus" : std::string("all_gpus")) +
                                              "_cp" + (p.cp > 0 ? std::to_string(p.cp) : std::string("all"));
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

// ---- Checkpoints --------------------------------------------------------------------------------

// 2 GPUs of batch B for two steps, checkpoint (rank 0 writes it from the gathered shards), then
// 1 GPU of batch 2B (the same global batch) for two more: within the reordering noise of a
// straight one-GPU run of batch 2B.
TEST(GpuDataParallelCheckpoint, SavedOnTwoGpusResumesOnOne) {
  SKIP_WITHOUT_GPUS(2);
  for (const char* preset : {"gpt-tiny", "llama-tiny"}) {
    SCOPED_TRACE(preset);
    ScratchDir dir;
    test::write_cycle_shards(dir, 300, 8192);
    const int64_t B = 2, accum = 2, steps = 4;
    const RunResult ref = train(run_options(dir, preset, 2 * B, accum, steps), 0, steps);
    const std::vector<RunResult> naives = {train(run_options(dir, preset, B, 2 * accum, steps), 0, steps),
                                           train(run_options(dir, preset, 1, 2 * accum * B, steps), 0, steps)};
    TrainerOptions first = run_options(dir, preset, B, accum, steps);
    first.train.checkpoint_dir = dir.file("ckpt");
    first.train.ckpt_every = 2;
    const RunResult head = train(first, 2, 2);
    const std::string saved = dir.file("ckpt/step_000002.ckpt");
    CheckpointMeta meta;
    ASSERT_OK(read_checkpoint_meta(saved, &meta));
    EXPECT_EQ(meta.step, 2);
    TrainerOptions second = run_options(dir, preset, 2 * B, accum, steps);
    second.resume_from = saved;
    RunResult fast = train(second, 0, steps);
    ASSERT_EQ(fast.losses.size(), 2u);
    fast.losses.insert(fast.losses.begin(), head.losses.begin(), head.losses.end());
    fast.norms.insert(fast.norms.begin(), head.norms.begin(), head.norms.end());
    test::expect_within_reordering_noise(fast, ref, naives);
  }
}

// ---- One rank ---------------------------------------------------------------------------------

// A one-rank communicator takes no data-parallel path: the single-GPU step, bit for bit.
TEST(GpuDataParallelOneRank, IsTheSingleGpuStepBitForBit) {
  SKIP_WITHOUT_GPUS(1);
  ScratchDir dir;
  test::write_cycle_shards(dir, 300);
  const TrainerOptions o = run_options(dir, "llama-tiny", 2, 2, 3);
  const RunResult alone = train(o, 0, 3);
  const RunResult one = train(o, 1, 3);
  EXPECT_EQ(one.losses, alone.losses);
  ASSERT_EQ(one.master.size(), alone.master.size());
  EXPECT_EQ(0, std::memcmp(one.master.data(), alone.master.data(), one.master.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(one.v.data(), alone.v.data(), one.v.size() * sizeof(float)));
}

// ---- The rank-ordered sum -----------------------------------------------------------------------

// The kernel's sums are the host's, bit for bit, in rank order (the staging slots skip the rank's
// own), for every rank of 3 and a length that is no multiple of the block.
TEST(GpuDataParallelKernels, SlicesAddInRankOrder) {
  FLARE_SKIP_WITHOUT_CUDA();
  const int world = 3;
  const int64_t n = 1000, stride = 1024;
  std::mt19937 rng(11);
  std::normal_distribution<float> draw(0.0f, 1e3f);
  std::vector<float> own(sz(n)), staging(sz((world - 1) * stride));
  for (float& x : own) x = draw(rng);
  for (float& x : staging) x = draw(rng);
  float *d_own = nullptr, *d_staging = nullptr, *d_out = nullptr;
  ASSERT_CUDA(cudaMalloc(reinterpret_cast<void**>(&d_own), own.size() * 4));
  ASSERT_CUDA(cudaMalloc(reinterpret_cast<void**>(&d_staging), staging.size() * 4));
  ASSERT_CUDA(cudaMalloc(reinterpret_cast<void**>(&d_out), own.size() * 4));
  ASSERT_CUDA(cudaMemcpy(d_own, own.data(), own.size() * 4, cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemcpy(d_staging, staging.data(), staging.size() * 4, cudaMemcpyHostToDevice));
  for (int rank = 0; rank < world; ++rank) {
    ASSERT_CUDA(cudaMemset(d_out, 0xff, own.size() * 4));  // NaN: every element must be written
    ASSERT_OK(dp::sum_slices_in_rank_order(d_own, d_staging, stride, world, rank, n, d_out, nullptr));
    std::vector<float> got(own.size());
    ASSERT_CUDA(cudaMemcpy(got.data(), d_out, got.size() * 4, cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < n; ++i) {
      float want = 0.0f;
      for (int q = 0; q < world; ++q) {
        want += q == rank ? own[sz(i)] : staging[sz(dp::staging_slot(q, rank) * stride + i)];
      }
      ASSERT_EQ(std::memcmp(&got[sz(i)], &want, 4), 0) << "rank " << rank << ", element " << i;
    }
  }
  EXPECT_EQ(dp::sum_slices_in_rank_order(d_own, d_staging, stride, world, 3, n, d_out, nullptr).code(),
            StatusCode::kInvalidArgument);
  cudaFree(d_own);
  cudaFree(d_staging);
  cudaFree(d_out);
}

}  // namespace
}  // namespace flare::train
