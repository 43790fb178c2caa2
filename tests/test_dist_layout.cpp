// test_dist_layout.cpp — the pure parts of context parallelism: sequence shards (contiguous and
// zigzag), the ring step planner against the definition of the causal mask, shard / unshard, and
// the (O, LSE) merge.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>
#include <vector>

#include "dist/layout.h"
#include "dist/merge.h"
#include "flare/dist.h"
#include "test_util.h"

namespace flare::test {
namespace {

using dist::SequenceShard;
using dist::Strategy;

SequenceShard shard_of(Strategy st, int64_t s, int n, int r) {
  SequenceShard sh;
  const Status status = dist::sequence_shard(st, s, n, r, &sh);
  EXPECT_TRUE(status.ok()) << status.to_string();
  return sh;
}

// Every global row is held by exactly one rank, local rows are numbered densely in chunk order,
// and chunk lengths differ by at most one.
TEST(SequenceShard, EveryRowOnceChunksEven) {
  for (Strategy st : {Strategy::kRing, Strategy::kZigzag, Strategy::kAllToAll})
    for (int n = 1; n <= 8; ++n)
      for (int64_t s : {0, 1, 5, 7, 16, 33, 64, 101}) {
        SCOPED_TRACE(::testing::Message() << dist::strategy_name(st) << " n=" << n << " s=" << s);
        std::vector<int> owner(static_cast<size_t>(s), -1);
        int64_t min_len = s, max_len = 0;
        for (int r = 0; r < n; ++r) {
          const SequenceShard sh = shard_of(st, s, n, r);
          ASSERT_EQ(sh.count, st == Strategy::kZigzag ? 2 : 1);
          int64_t local = 0;
          for (int c = 0; c < sh.count; ++c) {
            EXPECT_EQ(sh.chunk[c].local_begin, local);
            local += sh.chunk[c].length;
            min_len = std::min(min_len, sh.chunk[c].length);
            max_len = std::max(max_len, sh.chunk[c].length);
            for (int64_t i = 0; i < sh.chunk[c].length; ++i) {
              const int64_t g = sh.chunk[c].global_begin + i;
              ASSERT_TRUE(g >= 0 && g < s);
              EXPECT_EQ(owner[g], -1) << "row " << g << " held twice";
              owner[g] = r;
            }
          }
          EXPECT_EQ(sh.length, local);
        }
        for (int64_t g = 0; g < s; ++g) EXPECT_GE(owner[g], 0) << "row " << g << " held by none";
        if (s > 0) {
          EXPECT_LE(max_len - min_len, 1);
        }
      }
}

TEST(SequenceShard, ZigzagPairsChunkIWithTwoNMinusOneMinusI) {
  // 16 rows, 4 ranks: 8 chunks of 2; rank 1 holds chunks 1 and 6.
  const SequenceShard sh = shard_of(Strategy::kZigzag, 16, 4, 1);
  EXPECT_EQ(sh.chunk[0].global_begin, 2);
  EXPECT_EQ(sh.chunk[1].global_begin, 12);
  EXPECT_EQ(sh.length, 4);
  // 10 rows over 2 ranks: 4 chunks of 3, 3, 2, 2: rank 0 holds rows 0-2 and 8-9.
  const SequenceShard a = shard_of(Strategy::kZigzag, 10, 2, 0);
  EXPECT_EQ(a.chunk[0].length, 3);
  EXPECT_EQ(a.chunk[1].global_begin, 8);
  EXPECT_EQ(a.chunk[1].length, 2);
}

TEST(SequenceShard, BadArguments) {
  SequenceShard sh;
  EXPECT_NE(dist::sequence_shard(Strategy::kRing, -1, 2, 0, &sh).message().find("seqlen"),
            std::string::npos);
  EXPECT_NE(dist::sequence_shard(Strategy::kRing, 8, 0, 0, &sh).message().find("size"),
            std::string::npos);
  EXPECT_NE(dist::sequence_shard(Strategy::kRing, 8, 2, 2, &sh).message().find("rank"),
            std::string::npos);
  EXPECT_NE(dist::sequence_shard(static_cast<Strategy>(5), 8, 2, 0, &sh).message().find("strategy"),
            std::string::npos);
}

// The ring plan covers exactly the visible (query, key) pairs, each once, and every call is a
// mask the single-device API computes exactly: for causal calls the global positions of the
// rows and keys must make bottom-right alignment the global causal mask.
TEST(RingStepTasks, CoverTheMaskExactlyOnce) {
  for (Strategy st : {Strategy::kRing, Strategy::kZigzag})
    for (bool causal : {false, true})
      for (int n = 1; n <= 8; ++n)
        for (int64_t s : {1, 3, 16, 21, 40}) {
          SCOPED_TRACE(::testing::Message() << dist::strategy_name(st) << " causal=" << causal
                                            << " n=" << n << " s=" << s);
          std::vector<SequenceShard> shards;
          for (int r = 0; r < n; ++r) shards.push_back(shard_of(st, s, n, r));
          auto global = [](const SequenceShard& sh, int64_t local) {
            for (int c = 0; c < sh.count; ++c)
              if (local >= sh.chunk[c].local_begin &&
                  local < sh.chunk[c].local_begin + sh.chunk[c].length)
                return sh.chunk[c].global_begin + local - sh.chunk[c].local_begin;
            return int64_t{-1};
          };
          std::vector<int> seen(static_cast<size_t>(s * s), 0);
          for (int r = 0; r < n; ++r)
            for (int step = 0; step < n; ++step) {
              const int src = ((r - step) % n + n) % n;
              for (const dist::BlockTask& t :
                   dist::ring_step_tasks(shards[r], shards[src], causal, src == r)) {
                ASSERT_GT(t.q_len, 0);
                ASSERT_GT(t.k_len, 0);
                ASSERT_LE(t.q_begin + t.q_len, shards[r].length);
                ASSERT_LE(t.k_begin + t.k_len, shards[src].length);
                for (int64_t i = 0; i < t.q_len; ++i)
                  for (int64_t j = 0; j < t.k_len; ++j) {
                    // attention.h: bottom-right causal keeps j <= i + s_k - s_q.
                    if (t.causal && j > i + t.k_len - t.q_len) continue;
                    const int64_t gq = global(shards[r], t.q_begin + i);
                    const int64_t gk = global(shards[src], t.k_begin + j);
                    ASSERT_TRUE(gq >= 0 && gk >= 0);
                    ++seen[gq * s + gk];
                  }
              }
            }
          for (int64_t i = 0; i < s; ++i)
            for (int64_t j = 0; j < s; ++j)
              ASSERT_EQ(seen[i * s + j], (!causal || j <= i) ? 1 : 0)
                  << "pair (" << i << ", " << j << ")";
        }
}

// Under zigzag every rank attends the same number of causal pairs (up to the rows that uneven
// chunks add), at every step after the first the same block shape; the contiguous ring does not.
TEST(RingStepTasks, ZigzagBalancesCausalWork) {
  const int n = 4;
  const int64_t s = 64;
  auto work = [&](Strategy st) {
    std::vector<int64_t> pairs(n, 0);
    for (int r = 0; r < n; ++r) {
      const SequenceShard mine = shard_of(st, s, n, r);
      for (int step = 0; step < n; ++step) {
        const int src = ((r - step) % n + n) % n;
        for (const dist::BlockTask& t :
             dist::ring_step_tasks(mine, shard_of(st, s, n, src), true, src == r)) {
          pairs[r] += t.causal ? t.q_len * (t.q_len + 1) / 2 : t.q_len * t.k_len;
          if (st == Strategy::kZigzag && step > 0) {
            EXPECT_EQ(t.q_len * t.k_len, (s / (2 * n)) * (s / n));
          }
        }
      }
    }
    return pairs;
  };
  const std::vector<int64_t> zig = work(Strategy::kZigzag);
  for (int r = 1; r < n; ++r) EXPECT_EQ(zig[r], zig[0]);
  const std::vector<int64_t> ring = work(Strategy::kRing);
  EXPECT_GT(ring[n - 1], 3 * ring[0]);
}

TEST(ShardSequence, RoundTripAndErrors) {
  std::mt19937_64 rng(test_seed());
  for (Strategy st : {Strategy::kRing, Strategy::kZigzag})
    for (int n : {1, 3, 4}) {
      const int64_t b = 2, s = 11, h = 3, d = 5;
      HostTensor full = HostTensor::make(DType::kBFloat16, {b, s, h, d});
      full.fill_normal(rng);
      HostTensor back = HostTensor::make(DType::kBFloat16, {b, s, h, d});
      HostTensor lse = HostTensor::make(DType::kFloat32, {b, h, s});
      lse.fill_normal(rng);
      HostTensor lse_back = HostTensor::make(DType::kFloat32, {b, h, s});
      for (int r = 0; r < n; ++r) {
        const int64_t len = shard_of(st, s, n, r).length;
        HostTensor local = HostTensor::make_padded(DType::kBFloat16, {b, len, h, d}, 3);
        ASSERT_TRUE(dist::shard_sequence(full.view, 1, st, n, r, local.view).ok());
        ASSERT_TRUE(dist::unshard_sequence(local.view, 1, st, n, r, back.view).ok());
        HostTensor local_lse = HostTensor::make(DType::kFloat32, {b, h, len});
        ASSERT_TRUE(dist::shard_sequence(lse.view, 2, st, n, r, local_lse.view).ok());
        ASSERT_TRUE(dist::unshard_sequence(local_lse.view, 2, st, n, r, lse_back.view).ok());
      }
      EXPECT_EQ(full.bytes, back.bytes);
      EXPECT_EQ(lse.bytes, lse_back.bytes);
    }
  HostTensor full = HostTensor::make(DType::kFloat32, {1, 8, 2, 4});
  HostTensor wrong_rows = HostTensor::make(DType::kFloat32, {1, 3, 2, 4});
  Status s = dist::shard_sequence(full.view, 1, Strategy::kZigzag, 2, 0, wrong_rows.view);
  EXPECT_NE(s.message().find("rank 0 of 2 holds 4 of 8 rows"), std::string::npos) << s.message();
  HostTensor wrong_heads = HostTensor::make(DType::kFloat32, {1, 4, 3, 4});
  s = dist::shard_sequence(full.view, 1, Strategy::kZigzag, 2, 0, wrong_heads.view);
  EXPECT_NE(s.message().find("dimension 2"), std::string::npos) << s.message();
  HostTensor wrong_dtype = HostTensor::make(DType::kFloat16, {1, 4, 2, 4});
  s = dist::shard_sequence(full.view, 1, Strategy::kZigzag, 2, 0, wrong_dtype.view);
  EXPECT_NE(s.message().find("dtype"), std::string::npos) << s.message();
  s = dist::shard_sequence(full.view, 4, Strategy::kZigzag, 2, 0, full.view);
  EXPECT_NE(s.message().find("seq_dim"), std::string::npos) << s.message();
}

// ---- the (O, LSE) merge ----------------------------------------------------------------------

TEST(Merge, MatchesTheLogSumExpDefinition) {
  std::mt19937_64 rng(test_seed());
  std::uniform_real_distribution<float> u(-30.0f, 30.0f);
  for (int i = 0; i < 1000; ++i) {
    const float a = u(rng), b = u(rng);
    const dist::MergeWeights w = dist::merge_weights(a, b);
    const double lse = std::log(std::exp(double{a}) + std::exp(double{b}));
    EXPECT_NEAR(w.lse, lse, 4e-7 * std::max(1.0, std::fabs(lse)));
    EXPECT_NEAR(w.a, std::exp(a - lse), 1e-6);
    EXPECT_NEAR(w.b, std::exp(b - lse), 1e-6);
    EXPECT_NEAR(w.a + w.b, 1.0, 1e-6);
  }
}

TEST(Merge, EmptyBlocksAndExtremes) {
  const float inf = INFINITY;
  dist::MergeWeights w = dist::merge_weights(-inf, -inf);  // neither block sees a key
  EXPECT_EQ(w.lse, -inf);
  EXPECT_EQ(w.a, 0.0f);
  EXPECT_EQ(w.b, 0.0f);
  w = dist::merge_weights(-inf, 2.5f);  // only the new block
  EXPECT_EQ(w.lse, 2.5f);
  EXPECT_EQ(w.a, 0.0f);
  EXPECT_EQ(w.b, 1.0f);
  w = dist::merge_weights(1e4f, -1e4f);  // no overflow, no underflow to NaN
  EXPECT_EQ(w.lse, 1e4f);
  EXPECT_EQ(w.a, 1.0f);
  EXPECT_EQ(w.b, 0.0f);
  w = dist::merge_weights(3.0f, 3.0f);
  EXPECT_FLOAT_EQ(w.lse, 3.0f + std::log(2.0f));
  EXPECT_EQ(w.a, 0.5f);
}

}  // namespace
}  // namespace flare::test
