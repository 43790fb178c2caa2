// test_dist_attention.cpp — context-parallel attention on in-process ranks against the float64
// single-device reference, under the tolerance rule of docs/architecture.md (test_util.h).
//
// Each case builds one global problem, shards q, k, v and dout to the ranks, runs the forward and
// backward on every rank at once (one thread per rank), gathers o, lse, dq, dk and dv back into
// the global tensors (poisoned with NaN first: every element must be written) and checks them as
// the single-device tests check a backend (setup shared with the GPU tests: test_dist_util.h). Also: configs that disagree across ranks, local
// tensors that do not fit the plan, a rank that never joins, and options not supported yet.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "flare/dist.h"
#include "test_dist_util.h"
#include "test_util.h"

namespace flare::test {
namespace {

using dist::Communicator;
using dist::ContextParallelAttention;
using dist::ContextParallelConfig;
using dist::Strategy;
using Clock = std::chrono::steady_clock;

constexpr int kTimeoutMs = 60000;  // a correct run never waits for it

void run_case(const CpCase& c) {
  SCOPED_TRACE(describe(c));
  Problem pr = problem_of(c);
  std::vector<Local> locals = make_locals(c, pr);
  auto comms = in_process_group(c.world, kTimeoutMs);
  const auto t0 = Clock::now();
  const std::vector<Status> st = run_ranks_forward_backward(c, comms, locals);
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  for (int r = 0; r < c.world; ++r) ASSERT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r].to_string();
  gather_outputs(c, locals, &pr);
  expect_matches_reference(pr);
  ::testing::Test::RecordProperty("ring_ms", std::to_string(ms));
}

// ---- every strategy × rank count × mask, forward and backward ----------------------------------

class Grid : public ::testing::TestWithParam<CpGridParam> {};

// Sequence lengths not divisible by the ranks (nor by 2·ranks): uneven chunks everywhere. GQA
// 2:1 (all-to-all: as many K/V heads as ranks, since each rank takes whole heads).
TEST_P(Grid, MatchesSingleDeviceReference) {
  CpCase c;
  c.world = GetParam().world;
  c.causal = GetParam().causal;
  c.seqlen = 5 * c.world + 3;
  run_case(with_strategy(c, GetParam().strategy));
}

INSTANTIATE_TEST_SUITE_P(Dist, Grid,
                         ::testing::ValuesIn(cp_grid({Strategy::kRing, Strategy::kZigzag,
                                                      Strategy::kAllToAll})),
                         cp_grid_name);

// ---- features ----------------------------------------------------------------------------------

TEST(ContextParallel, HeadDims) {
  for (int d : {40, 80}) {
    CpCase c;
    c.world = 3;
    c.head_dim = d;
    c.seqlen = 20;
    run_case(c);
  }
}

TEST(ContextParallel, HalfPrecision) {
  for (DType dt : {DType::kBFloat16, DType::kFloat16})
    for (Strategy st : {Strategy::kRing, Strategy::kZigzag, Strategy::kAllToAll}) {
      CpCase c;
      c.world = 4;
      c.dtype = dt;
      c.seqlen = 40;
      run_case(with_strategy(c, st));
    }
}

TEST(ContextParallel, MultiQueryAttention) {
  CpCase c;
  c.world = 4;
  c.heads_q = 8;
  c.heads_kv = 1;
  c.seqlen = 32;
  c.head_dim = 40;
  run_case(c);
}

TEST(ContextParallel, SoftcapAndStridedLocals) {
  CpCase c;
  c.world = 3;
  c.softcap = 5.0f;
  c.pad = 3;
  c.dtype = DType::kBFloat16;
  run_case(c);
}

// Sliding windows under the ring and zigzag: each block call gets the window its global rows
// see, blocks the window hides are skipped. Left only, right only, both, and with causal, over
// lengths not divisible by the ranks and windows narrower than a chunk (several steps skip every
// call) and wider than one.
struct WindowParam {
  Strategy strategy;
  int world;
};

class Windows : public ::testing::TestWithParam<WindowParam> {};

TEST_P(Windows, MatchSingleDeviceReference) {
  struct Band {
    int left, right;
    bool causal;
  };
  for (const Band& b : {Band{5, -1, false}, Band{-1, 4, false}, Band{6, 3, false},
                        Band{7, -1, true}, Band{0, 0, false}, Band{2, 9, true}}) {
    CpCase c;
    c.strategy = GetParam().strategy;
    c.world = GetParam().world;
    c.seqlen = 6 * c.world + 5;
    c.batch = 1;
    c.window_left = b.left;
    c.window_right = b.right;
    c.causal = b.causal;
    run_case(c);
  }
}

std::vector<WindowParam> window_grid() {
  std::vector<WindowParam> g;
  for (Strategy st : {Strategy::kRing, Strategy::kZigzag})
    for (int world : {2, 3, 4, 8}) g.push_back({st, world});
  return g;
}

INSTANTIATE_TEST_SUITE_P(Dist, Windows, ::testing::ValuesIn(window_grid()),
                         [](const ::testing::TestParamInfo<WindowParam>& i) {
                           return std::string(dist::strategy_name(i.param.strategy)) + "_" +
                                  std::to_string(i.param.world) + "ranks";
                         });

// Windows with GQA, bf16, a batch of two and padded local tensors (K/V packed before travelling).
TEST(ContextParallel, WindowsHalfPrecisionAndStridedLocals) {
  for (Strategy st : {Strategy::kRing, Strategy::kZigzag}) {
    CpCase c;
    c.strategy = st;
    c.world = 3;
    c.seqlen = 40;
    c.dtype = DType::kBFloat16;
    c.window_left = 9;
    c.causal = true;
    c.pad = 2;
    run_case(c);
  }
}

// All-to-all runs one call over the whole sequence, so windows are the single-device ones.
TEST(ContextParallel, AllToAllSlidingWindowAndMqaHeads) {
  CpCase c;
  c.strategy = Strategy::kAllToAll;
  c.world = 2;
  c.seqlen = 33;
  c.window_left = 5;
  c.window_right = 2;
  c.causal = false;
  run_case(c);
  c.window_right = -1;
  c.causal = true;
  c.heads_q = 8;
  run_case(c);
}

// Fewer rows than chunks: some ranks hold nothing and some chunks are empty.
TEST(ContextParallel, FewerRowsThanChunks) {
  for (Strategy st : {Strategy::kRing, Strategy::kZigzag, Strategy::kAllToAll}) {
    CpCase c;
    c.world = 4;
    c.seqlen = 5;
    run_case(with_strategy(c, st));
  }
}

TEST(ContextParallel, OneRank) {
  CpCase c;
  c.world = 1;
  run_case(c);
}

// The counters of take_timing on the host path: every exchange and byte the plan implies (times
// are measured on CUDA devices only).
TEST(ContextParallel, TimingCountsTheRingsTraffic) {
  for (Strategy st : {Strategy::kRing, Strategy::kZigzag}) {
    CpCase c;
    c.strategy = st;
    c.world = 3;
    c.dtype = DType::kBFloat16;
    c.seqlen = 29;
    SCOPED_TRACE(describe(c));
    const Problem pr = problem_of(c);
    std::vector<Local> locals = make_locals(c, pr);
    std::vector<dist::CpTiming> timing(static_cast<size_t>(c.world));
    auto comms = in_process_group(c.world, kTimeoutMs);
    const std::vector<Status> result = run_ranks(comms, [&](Communicator& comm) -> Status {
      std::unique_ptr<ContextParallelAttention> cp;
      FLARE_RETURN_IF_ERROR(ContextParallelAttention::create(&comm, config_of(c), &cp));
      FLARE_RETURN_IF_ERROR(cp->set_timing(true));
      FLARE_RETURN_IF_ERROR(forward_backward(*cp, locals[comm.rank()]));
      return cp->take_timing(&timing[comm.rank()]);
    });
    for (int r = 0; r < c.world; ++r) {
      ASSERT_TRUE(result[r].ok()) << "rank " << r << ": " << result[r].to_string();
      const RingTraffic want = expected_ring_traffic(c, r);
      EXPECT_EQ(timing[r].calls, 2) << "rank " << r;
      EXPECT_EQ(timing[r].exchanges, want.exchanges) << "rank " << r;
      EXPECT_EQ(timing[r].bytes_sent, want.bytes) << "rank " << r;
      EXPECT_EQ(timing[r].comm_ms, 0.0) << "rank " << r;
    }
  }
}

// ---- errors ------------------------------------------------------------------------------------

TEST(ContextParallelErrors, ConfigsThatDisagreeFailOnEveryRank) {
  auto comms = in_process_group(3, kTimeoutMs);
  const std::vector<Status> st = run_ranks(comms, [](Communicator& comm) -> Status {
    CpCase c;
    c.world = 3;
    ContextParallelConfig cfg = config_of(c);
    if (comm.rank() == 2) cfg.heads_q = 8;
    std::unique_ptr<ContextParallelAttention> cp;
    return ContextParallelAttention::create(&comm, cfg, &cp);
  });
  for (const Status& s : st) {
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(has(s, "heads_q: rank 2 has 8, rank 0 has 4")) << s.message();
  }
}

// A rank whose tensors do not fit the plan says why; the others, waiting for it in the ring, fail
// at the timeout naming it.
TEST(ContextParallelErrors, LocalShapeMismatch) {
  const int timeout_ms = 300;
  CpCase c;
  c.world = 3;
  Problem pr = problem_of(c);
  std::vector<Local> locals = make_locals(c, pr);
  HostTensor short_q = HostTensor::make(c.dtype, {c.batch, 7, c.heads_q, c.head_dim});
  auto comms = in_process_group(c.world, timeout_ms);
  const auto t0 = Clock::now();
  const std::vector<Status> st = run_ranks(comms, [&](Communicator& comm) -> Status {
    std::unique_ptr<ContextParallelAttention> cp;
    FLARE_RETURN_IF_ERROR(ContextParallelAttention::create(&comm, config_of(c), &cp));
    Local& l = locals[comm.rank()];
    const TensorView q = comm.rank() == 1 ? short_q.view : l.q.view;
    return cp->forward(q, l.k.view, l.v.view, l.o.view, l.lse.view);
  });
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  EXPECT_EQ(st[1].code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(has(st[1], "q: shape (2, 7, 4, 64) must be") && has(st[1], "(2, 8, 4, 64)"))
      << st[1].message();
  // Rank 2 receives from rank 1 in the ring; rank 0, from rank 2, which has failed by then.
  EXPECT_EQ(st[2].code(), StatusCode::kDeviceError) << st[2].to_string();
  EXPECT_TRUE(has(st[2], "from rank 1 within 300 ms")) << st[2].message();
  EXPECT_EQ(st[0].code(), StatusCode::kDeviceError) << st[0].to_string();
  EXPECT_LT(ms, 10.0 * timeout_ms);
}

// A rank that never joins: the others fail within the timeout, naming it.
TEST(ContextParallelErrors, RankThatNeverJoins) {
  const int timeout_ms = 250;
  auto comms = in_process_group(4, timeout_ms);
  const auto t0 = Clock::now();
  const std::vector<Status> st = run_ranks(comms, [](Communicator& comm) -> Status {
    if (comm.rank() == 3) return {};  // never calls in
    CpCase c;
    c.world = 4;
    std::unique_ptr<ContextParallelAttention> cp;
    return ContextParallelAttention::create(&comm, config_of(c), &cp);
  });
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(st[r].code(), StatusCode::kDeviceError);
    EXPECT_TRUE(has(st[r], "host_all_gather") && has(st[r], "rank 3") && has(st[r], "250 ms"))
        << st[r].message();
  }
  EXPECT_GE(ms, 0.9 * timeout_ms);
  EXPECT_LT(ms, timeout_ms + 3000.0);
}

TEST(ContextParallelErrors, UnsupportedOptionsAndBadConfigs) {
  auto comms = in_process_group(1, kTimeoutMs);
  auto create = [&](const ContextParallelConfig& cfg) {
    std::unique_ptr<ContextParallelAttention> cp;
    return ContextParallelAttention::create(comms[0].get(), cfg, &cp);
  };
  const ContextParallelConfig good = config_of(CpCase{});
  ContextParallelConfig cfg = good;
  cfg.attention.window_left = -2;
  EXPECT_TRUE(has(create(cfg), "config.attention.window_left: must be >= -1")) << create(cfg).message();
  cfg = good;
  cfg.attention.window_right = -3;
  EXPECT_TRUE(has(create(cfg), "config.attention.window_right")) << create(cfg).message();
  cfg = good;
  cfg.attention.dropout_p = 0.1f;
  EXPECT_EQ(create(cfg).code(), StatusCode::kUnsupported);
  float slopes[4] = {};
  cfg = good;
  cfg.attention.alibi_slopes = TensorView::contiguous(slopes, DType::kFloat32, {4});
  EXPECT_TRUE(has(create(cfg), "ALiBi"));
  for (Strategy st : {Strategy::kRing, Strategy::kZigzag, Strategy::kAllToAll}) {
    cfg = good;
    cfg.attention.window_left = 4;
    cfg.strategy = st;
    EXPECT_TRUE(create(cfg).ok()) << create(cfg).to_string();
  }
  cfg = good;
  cfg.heads_kv = 3;
  EXPECT_TRUE(has(create(cfg), "config.heads_kv")) << create(cfg).message();
  cfg = good;
  cfg.seqlen = 0;
  EXPECT_TRUE(has(create(cfg), "config.seqlen")) << create(cfg).message();
  cfg = good;
  cfg.strategy = static_cast<Strategy>(7);
  EXPECT_TRUE(has(create(cfg), "config.strategy")) << create(cfg).message();
  std::unique_ptr<ContextParallelAttention> cp;
  EXPECT_TRUE(has(ContextParallelAttention::create(nullptr, good, &cp), "comm"));
  EXPECT_TRUE(create(good).ok());
}

// All-to-all hands out whole heads: K/V heads that do not divide among the ranks are refused, not
// copied.
TEST(ContextParallelErrors, AllToAllNeedsHeadsDivisibleByRanks) {
  auto comms = in_process_group(4, kTimeoutMs);
  const std::vector<Status> st = run_ranks(comms, [](Communicator& comm) -> Status {
    CpCase c;
    c.strategy = Strategy::kAllToAll;
    c.world = 4;
    c.heads_q = 8;
    c.heads_kv = 2;
    std::unique_ptr<ContextParallelAttention> cp;
    return ContextParallelAttention::create(&comm, config_of(c), &cp);
  });
  for (const Status& s : st) {
    EXPECT_EQ(s.code(), StatusCode::kUnsupported);
    EXPECT_TRUE(has(s, "heads_kv = 2 to be multiples of 4")) << s.message();
  }
}

TEST(ContextParallelErrors, WrongDtypeIsNamed) {
  CpCase c;
  c.world = 1;
  auto comms = in_process_group(1, kTimeoutMs);
  std::unique_ptr<ContextParallelAttention> cp;
  ASSERT_TRUE(ContextParallelAttention::create(comms[0].get(), config_of(c), &cp).ok());
  HostTensor q = HostTensor::make(DType::kBFloat16, {2, 24, 4, 64});
  HostTensor k = HostTensor::make(DType::kFloat32, {2, 24, 2, 64});
  HostTensor o = HostTensor::make(DType::kFloat32, {2, 24, 4, 64});
  HostTensor lse = HostTensor::make(DType::kFloat32, {2, 4, 24});
  const Status s = cp->forward(q.view, k.view, k.view, o.view, lse.view);
  EXPECT_TRUE(has(s, "q: dtype bfloat16 differs from the plan's float32")) << s.message();
}

}  // namespace
}  // namespace flare::test
