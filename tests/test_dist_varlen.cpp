// test_dist_varlen.cpp — packed variable-length batches split across in-process ranks, against the
// float64 single-device reference of the whole pack under the tolerance rule (test_util.h).
//
// Every sequence of the pack is cut across the ranks on its own (zigzag: chunks r and 2n−1−r of
// each sequence; ring: its r-th chunk), so the packs hold sequences shorter than the chunk count,
// empty sequences and lengths not divisible by the ranks; some ranks hold no row of a sequence or
// none at all. Each case shards q, k, v and dout with shard_varlen, runs forward and backward on
// every rank at once, gathers o, lse, dq, dk and dv with unshard_varlen (poisoned with NaN first:
// every element must be written) and checks them as a single-device varlen call is checked. Also:
// sliding windows on packs, all-to-all over packs, the shard helpers alone, and the errors of
// packed configs.
#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "flare/dist.h"
#include "test_dist_util.h"
#include "test_dist_varlen_util.h"
#include "test_util.h"

namespace flare::test {
namespace {

using dist::Communicator;
using dist::ContextParallelAttention;
using dist::ContextParallelConfig;
using dist::Strategy;

constexpr int kTimeoutMs = 60000;  // a correct run never waits for it

void run_case(const VarlenCpCase& c) {
  SCOPED_TRACE(describe(c));
  Problem pr = make_problem(spec_of(c));
  std::vector<Local> locals = make_locals(c, pr);
  auto comms = in_process_group(c.world, kTimeoutMs);
  const std::vector<Status> st = run_ranks_forward_backward(c, comms, locals);
  for (int r = 0; r < c.world; ++r) ASSERT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r].to_string();
  gather_outputs(c, locals, &pr);
  expect_matches_reference(pr);
}

// A pack for `world` ranks: a long sequence not divisible by 2·world, an empty one, sequences
// shorter than the chunk count (1 row, 2·world − 1 rows), one divisible by the ranks, empty last.
std::vector<int> awkward_pack(int world) {
  return {6 * world + 1, 0, 1, 2 * world - 1, 4 * world, 3 * world + 2, 0};
}

// ---- every strategy × rank count × mask ----------------------------------------------------------

class VarlenGrid : public ::testing::TestWithParam<CpGridParam> {};

TEST_P(VarlenGrid, MatchesSingleDeviceReference) {
  VarlenCpCase c;
  c.strategy = GetParam().strategy;
  c.world = GetParam().world;
  c.causal = GetParam().causal;
  c.seqlens = awkward_pack(c.world);
  run_case(c);
}

INSTANTIATE_TEST_SUITE_P(Dist, VarlenGrid,
                         ::testing::ValuesIn(cp_grid({Strategy::kRing, Strategy::kZigzag})),
                         cp_grid_name);

// ---- features ------------------------------------------------------------------------------------

// Sliding windows on a pack: left only, right only, both, with causal; windows narrower than a
// chunk, so that sequences of one call get different windows and share calls only where equal.
TEST(ContextParallelVarlen, SlidingWindows) {
  struct Band {
    int left, right;
    bool causal;
  };
  for (Strategy st : {Strategy::kRing, Strategy::kZigzag})
    for (int world : {2, 3, 4, 8})
      for (const Band& b : {Band{4, -1, false}, Band{-1, 3, false}, Band{5, 2, false},
                            Band{6, -1, true}}) {
        VarlenCpCase c;
        c.strategy = st;
        c.world = world;
        c.seqlens = awkward_pack(world);
        c.window_left = b.left;
        c.window_right = b.right;
        c.causal = b.causal;
        run_case(c);
      }
}

TEST(ContextParallelVarlen, HalfPrecisionGqaAndSoftcap) {
  for (DType dt : {DType::kBFloat16, DType::kFloat16}) {
    VarlenCpCase c;
    c.world = 3;
    c.dtype = dt;
    c.heads_q = 8;
    c.heads_kv = 1;
    c.head_dim = 40;
    c.softcap = 4.0f;
    c.seqlens = {31, 2, 0, 17};
    run_case(c);
  }
}

// One sequence (a pack of one is the fixed-length problem in another layout), one rank, and a
// pack whose every sequence is shorter than the ranks.
TEST(ContextParallelVarlen, EdgePacks) {
  for (Strategy st : {Strategy::kRing, Strategy::kZigzag}) {
    VarlenCpCase c;
    c.strategy = st;
    c.world = 4;
    c.seqlens = {29};
    run_case(c);
    c.world = 1;
    c.seqlens = {5, 0, 9};
    run_case(c);
    c.world = 8;
    c.seqlens = {1, 3, 0, 2, 7};
    run_case(c);
  }
}

// All-to-all over packs: every rank's runs of every sequence are traded into the whole pack and
// back. Heads divisible by the ranks (GQA where they allow it), both masks, a sliding window,
// bf16, and the edge packs above.
TEST(ContextParallelVarlen, AllToAllPacks) {
  struct Shape {
    int world, heads_q, heads_kv;
  };
  for (const Shape& sh : {Shape{2, 4, 2}, Shape{4, 8, 4}, Shape{8, 8, 8}, Shape{1, 4, 2}})
    for (bool causal : {false, true}) {
      VarlenCpCase c;
      c.strategy = Strategy::kAllToAll;
      c.world = sh.world;
      c.heads_q = sh.heads_q;
      c.heads_kv = sh.heads_kv;
      c.causal = causal;
      c.seqlens = awkward_pack(sh.world);
      run_case(c);
      c.seqlens = {1, 3, 0, 2, 7};
      run_case(c);
    }
  VarlenCpCase c;
  c.strategy = Strategy::kAllToAll;
  c.world = 2;
  c.dtype = DType::kBFloat16;
  c.window_left = 5;
  c.window_right = 2;
  c.causal = false;
  c.seqlens = {31, 2, 0, 17};
  run_case(c);
}

// ---- the shard helpers ---------------------------------------------------------------------------

TEST(ShardVarlen, LayoutRoundTripAndErrors) {
  const std::vector<int32_t> cu = {0, 7, 7, 8, 21};
  for (Strategy st : {Strategy::kRing, Strategy::kZigzag})
    for (int n : {1, 2, 3, 8}) {
      SCOPED_TRACE(::testing::Message() << dist::strategy_name(st) << " n=" << n);
      std::mt19937_64 rng(test_seed());
      HostTensor full = HostTensor::make(DType::kBFloat16, {21, 3, 5});
      full.fill_normal(rng);
      HostTensor lse = HostTensor::make(DType::kFloat32, {3, 21});
      lse.fill_normal(rng);
      HostTensor back = HostTensor::make(DType::kBFloat16, {21, 3, 5});
      HostTensor lse_back = HostTensor::make(DType::kFloat32, {3, 21});
      int64_t rows = 0;
      for (int r = 0; r < n; ++r) {
        dist::VarlenShard sh;
        ASSERT_TRUE(dist::varlen_shard(st, cu, n, r, &sh).ok());
        ASSERT_EQ(sh.sequences.size(), 4u);
        ASSERT_EQ(sh.cu_seqlens.size(), 5u);
        // Each sequence's local rows are sequence_shard's of its length, packed in order.
        for (size_t i = 0; i < 4; ++i) {
          dist::SequenceShard one;
          ASSERT_TRUE(dist::sequence_shard(st, cu[i + 1] - cu[i], n, r, &one).ok());
          EXPECT_EQ(sh.cu_seqlens[i + 1] - sh.cu_seqlens[i], one.length);
          EXPECT_EQ(sh.sequences[i].chunk[0].global_begin, cu[i] + one.chunk[0].global_begin);
          EXPECT_EQ(sh.sequences[i].chunk[0].local_begin, sh.cu_seqlens[i]);
          EXPECT_LE(one.length, sh.max_seqlen);
        }
        rows += sh.length;
        HostTensor local = HostTensor::make(DType::kBFloat16, {sh.length, 3, 5});
        ASSERT_TRUE(dist::shard_varlen(full.view, 0, st, cu, n, r, local.view).ok());
        ASSERT_TRUE(dist::unshard_varlen(local.view, 0, st, cu, n, r, back.view).ok());
        HostTensor local_lse = HostTensor::make(DType::kFloat32, {3, sh.length});
        ASSERT_TRUE(dist::shard_varlen(lse.view, 1, st, cu, n, r, local_lse.view).ok());
        ASSERT_TRUE(dist::unshard_varlen(local_lse.view, 1, st, cu, n, r, lse_back.view).ok());
      }
      EXPECT_EQ(rows, 21);
      EXPECT_EQ(full.bytes, back.bytes);
      EXPECT_EQ(lse.bytes, lse_back.bytes);
    }
  dist::VarlenShard sh;
  EXPECT_TRUE(has(dist::varlen_shard(Strategy::kZigzag, {1, 4}, 2, 0, &sh), "cu_seqlens[0] must be 0"));
  EXPECT_TRUE(has(dist::varlen_shard(Strategy::kZigzag, {0, 4, 3}, 2, 0, &sh), "non-decreasing"));
  EXPECT_TRUE(has(dist::varlen_shard(Strategy::kZigzag, {}, 2, 0, &sh), "cu_seqlens: empty"));
  EXPECT_TRUE(has(dist::varlen_shard(Strategy::kZigzag, {0, 4}, 2, 2, &sh), "rank"));
  HostTensor full = HostTensor::make(DType::kFloat32, {10, 2, 4});
  HostTensor local = HostTensor::make(DType::kFloat32, {3, 2, 4});
  Status s = dist::shard_varlen(full.view, 0, Strategy::kZigzag, {0, 4, 8}, 2, 0, local.view);
  EXPECT_TRUE(has(s, "cu_seqlens ends at 8")) << s.message();
  s = dist::shard_varlen(full.view, 0, Strategy::kZigzag, {0, 4, 10}, 2, 0, local.view);
  EXPECT_TRUE(has(s, "rank 0 of 2 holds 5 of 10 rows")) << s.message();
  s = dist::shard_varlen(full.view, 3, Strategy::kZigzag, {0, 4, 10}, 2, 0, local.view);
  EXPECT_TRUE(has(s, "seq_dim")) << s.message();
}

// ---- errors --------------------------------------------------------------------------------------

TEST(ContextParallelVarlenErrors, BadPackedConfigs) {
  auto comms = in_process_group(1, kTimeoutMs);
  auto create = [&](const ContextParallelConfig& cfg) {
    std::unique_ptr<ContextParallelAttention> cp;
    return ContextParallelAttention::create(comms[0].get(), cfg, &cp);
  };
  const ContextParallelConfig good = config_of(VarlenCpCase{});
  ContextParallelConfig cfg = good;
  cfg.cu_seqlens = {0};
  EXPECT_TRUE(has(create(cfg), "config.cu_seqlens: 1 entries")) << create(cfg).message();
  cfg.cu_seqlens = {2, 5};
  EXPECT_TRUE(has(create(cfg), "config.cu_seqlens[0] must be 0")) << create(cfg).message();
  cfg.cu_seqlens = {0, 5, 4};
  EXPECT_TRUE(has(create(cfg), "non-decreasing")) << create(cfg).message();
  cfg.cu_seqlens = {0, 0, 0};
  EXPECT_TRUE(has(create(cfg), "every sequence is empty")) << create(cfg).message();
  cfg = good;
  cfg.batch = 2;
  EXPECT_TRUE(has(create(cfg), "config.batch: 2 must be 0 or the number of sequences")) << create(cfg).message();
  cfg = good;
  cfg.seqlen = 7;
  EXPECT_TRUE(has(create(cfg), "config.seqlen: 7")) << create(cfg).message();
  cfg = good;
  cfg.batch = 3;
  cfg.seqlen = 23;
  EXPECT_TRUE(create(cfg).ok()) << create(cfg).to_string();
  std::unique_ptr<ContextParallelAttention> cp;
  ASSERT_TRUE(ContextParallelAttention::create(comms[0].get(), good, &cp).ok());
  EXPECT_EQ(cp->config().batch, 3);
  EXPECT_EQ(cp->config().seqlen, 23);
  EXPECT_EQ(cp->varlen_shard().cu_seqlens, (std::vector<int32_t>{0, 9, 9, 23}));
  // Local tensors of the fixed-length layout are named with the packed one.
  HostTensor q = HostTensor::make(DType::kFloat32, {1, 23, 4, 64});
  HostTensor k = HostTensor::make(DType::kFloat32, {23, 2, 64});
  HostTensor lse = HostTensor::make(DType::kFloat32, {4, 23});
  const Status s = cp->forward(q.view, k.view, k.view, q.view, lse.view);
  EXPECT_TRUE(has(s, "q: shape (1, 23, 4, 64) must be (local rows, heads_q, head_dim) = (23, 4, 64)"))
      << s.message();
}

// Ranks that hold different packs fail alike, naming the first offset that differs.
TEST(ContextParallelVarlenErrors, PacksThatDisagreeFailOnEveryRank) {
  auto comms = in_process_group(3, kTimeoutMs);
  const std::vector<Status> st = run_ranks(comms, [](Communicator& comm) -> Status {
    VarlenCpCase c;
    c.world = 3;
    if (comm.rank() == 1) c.seqlens = {9, 1, 13};
    std::unique_ptr<ContextParallelAttention> cp;
    return ContextParallelAttention::create(&comm, config_of(c), &cp);
  });
  for (const Status& s : st) {
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(has(s, "cu_seqlens[2]: rank 1 has 10, rank 0 has 9")) << s.message();
  }
  // A different number of sequences is found by the config's own comparison.
  const std::vector<Status> count = run_ranks(comms, [](Communicator& comm) -> Status {
    VarlenCpCase c;
    c.world = 3;
    if (comm.rank() == 2) c.seqlens = {9, 14};
    std::unique_ptr<ContextParallelAttention> cp;
    return ContextParallelAttention::create(&comm, config_of(c), &cp);
  });
  for (const Status& s : count) EXPECT_TRUE(has(s, "ranks disagree on")) << s.message();
}

}  // namespace
}  // namespace flare::test
