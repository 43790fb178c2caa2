// test_dist_layout.cpp — the pure parts of context parallelism: sequence shards (contiguous and
// zigzag), the ring step planner against the definition of the causal mask, shard / unshard, and
// the (O, LSE) merge.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>
#include <string>
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

// The masks the planner is checked under: none, causal, and sliding windows (left only, right
// only, both, with causal, the diagonal alone, wider than the sequence).
std::vector<dist::MaskBand> bands() {
  return {{-1, -1}, {-1, 0}, {2, -1}, {-1, 3}, {3, 2}, {4, 0}, {0, 0}, {0, 5}, {100, 100}};
}

std::string band_name(const dist::MaskBand& b) {
  return "band=(" + std::to_string(b.left) + "," + std::to_string(b.right) + ")";
}

bool in_band(const dist::MaskBand& b, int64_t q, int64_t k) {
  return (b.left < 0 || k >= q - b.left) && (b.right < 0 || k <= q + b.right);
}

// Whether the single-device call of task t (attention.h: bottom-right aligned within each of its
// sequences) sees key j of a sequence of q_len rows and k_len keys from row i.
bool call_sees(const dist::BlockTask& t, int64_t i, int64_t j, int64_t q_len, int64_t k_len) {
  const int64_t pos = i + k_len - q_len;
  return (t.window_left < 0 || j >= pos - t.window_left) &&
         (t.window_right < 0 || j <= pos + t.window_right);
}

// Global row of a local row, or -1.
int64_t global_row(const SequenceShard& sh, int64_t local) {
  for (int c = 0; c < sh.count; ++c)
    if (local >= sh.chunk[c].local_begin && local < sh.chunk[c].local_begin + sh.chunk[c].length)
      return sh.chunk[c].global_begin + local - sh.chunk[c].local_begin;
  return -1;
}

// The ring plan covers exactly the visible (query, key) pairs, each once, and every call is a mask
// the single-device API computes exactly: its window, applied bottom-right within the call, must
// select exactly the pairs of the global band. Windows are never below -1.
TEST(RingStepTasks, CoverTheMaskExactlyOnce) {
  for (Strategy st : {Strategy::kRing, Strategy::kZigzag})
    for (const dist::MaskBand& band : bands())
      for (int n = 1; n <= 8; ++n)
        for (int64_t s : {1, 3, 16, 21, 40}) {
          SCOPED_TRACE(::testing::Message() << dist::strategy_name(st) << " " << band_name(band)
                                            << " n=" << n << " s=" << s);
          std::vector<SequenceShard> shards;
          for (int r = 0; r < n; ++r) shards.push_back(shard_of(st, s, n, r));
          std::vector<int> seen(static_cast<size_t>(s * s), 0);
          for (int r = 0; r < n; ++r)
            for (int step = 0; step < n; ++step) {
              const int src = ((r - step) % n + n) % n;
              for (const dist::BlockTask& t :
                   dist::ring_step_tasks(shards[r], shards[src], band, src == r)) {
                ASSERT_GT(t.q_len, 0);
                ASSERT_GT(t.k_len, 0);
                ASSERT_GE(t.window_left, -1);
                ASSERT_GE(t.window_right, -1);
                ASSERT_TRUE(t.segments.empty());
                ASSERT_LE(t.q_begin + t.q_len, shards[r].length);
                ASSERT_LE(t.k_begin + t.k_len, shards[src].length);
                for (int64_t i = 0; i < t.q_len; ++i)
                  for (int64_t j = 0; j < t.k_len; ++j) {
                    const int64_t gq = global_row(shards[r], t.q_begin + i);
                    const int64_t gk = global_row(shards[src], t.k_begin + j);
                    ASSERT_TRUE(gq >= 0 && gk >= 0);
                    if (call_sees(t, i, j, t.q_len, t.k_len)) ++seen[gq * s + gk];
                    else ASSERT_FALSE(in_band(band, gq, gk)) << "pair (" << gq << ", " << gk << ") hidden";
                  }
              }
            }
          for (int64_t i = 0; i < s; ++i)
            for (int64_t j = 0; j < s; ++j)
              ASSERT_EQ(seen[i * s + j], in_band(band, i, j) ? 1 : 0)
                  << "pair (" << i << ", " << j << ")";
        }
}

// A narrow window hides most blocks of a long ring: those give no call at all.
TEST(RingStepTasks, BlocksTheWindowHidesAreSkipped) {
  const int n = 8;
  const int64_t s = 160;  // 16 chunks of 10 rows
  for (Strategy st : {Strategy::kRing, Strategy::kZigzag}) {
    int empty_steps = 0;
    for (int r = 0; r < n; ++r)
      for (int step = 0; step < n; ++step) {
        const int src = ((r - step) % n + n) % n;
        if (dist::ring_step_tasks(shard_of(st, s, n, r), shard_of(st, s, n, src), {4, 0}, src == r)
                .empty())
          ++empty_steps;
      }
    // Causal with a window of 4: a rank's queries see at most the chunk before each of theirs.
    EXPECT_GE(empty_steps, n * n - 3 * n) << dist::strategy_name(st);
  }
}

// The ring stops after the last step that holds a visible block. Contiguous shards of 20 rows,
// causal with a window of 4: every rank sees the rank before it, so 2 steps; a window of 25
// reaches two ranks back, 3 steps. Zigzag pairs chunk i with 15 − i, whose keys arrive at the
// last step, and windows open to the right reach the next rank's keys there too: all 8.
TEST(VisibleRingSteps, StopAfterTheLastVisibleBlock) {
  const int n = 8;
  const int64_t s = 160;
  auto every_shard = [&](Strategy st) {
    std::vector<SequenceShard> shards;
    for (int r = 0; r < n; ++r) shards.push_back(shard_of(st, s, n, r));
    return shards;
  };
  const std::vector<SequenceShard> ring = every_shard(Strategy::kRing);
  EXPECT_EQ(dist::visible_ring_steps(ring, {4, 0}), 2);
  EXPECT_EQ(dist::visible_ring_steps(ring, {25, 0}), 3);
  EXPECT_EQ(dist::visible_ring_steps(ring, {0, 0}), 1);  // each row sees itself only
  EXPECT_EQ(dist::visible_ring_steps(ring, {-1, 0}), n);
  EXPECT_EQ(dist::visible_ring_steps(ring, {4, 1}), n);
  EXPECT_EQ(dist::visible_ring_steps(ring, {-1, -1}), n);
  EXPECT_EQ(dist::visible_ring_steps(every_shard(Strategy::kZigzag), {4, 0}), n);
  // Packed: the longest reach of any sequence decides.
  std::vector<dist::VarlenShard> packed(n);
  const std::vector<int32_t> cu = {0, 40, 160};
  for (int r = 0; r < n; ++r)
    ASSERT_TRUE(dist::varlen_shard(Strategy::kRing, cu, n, r, &packed[static_cast<size_t>(r)]).ok());
  EXPECT_EQ(dist::visible_ring_steps(packed, {-1, 0}), n);
  EXPECT_EQ(dist::visible_ring_steps(packed, {0, 0}), 1);
}

// Packed batches: uneven, short and empty sequences. Each call's segments, bottom-right aligned
// one by one, must select exactly the pairs of one sequence inside the band, every such pair once.
TEST(VarlenStepTasks, CoverEverySequencesMaskExactlyOnce) {
  const std::vector<std::vector<int32_t>> packs = {
      {0, 13}, {0, 5, 5, 22, 23, 40}, {0, 0, 3, 3, 19}, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, {0, 33, 34, 70}};
  for (Strategy st : {Strategy::kRing, Strategy::kZigzag})
    for (const dist::MaskBand& band : bands())
      for (int n = 1; n <= 8; ++n)
        for (const std::vector<int32_t>& cu : packs) {
          SCOPED_TRACE(::testing::Message() << dist::strategy_name(st) << " " << band_name(band)
                                            << " n=" << n << " sequences=" << cu.size() - 1);
          const int64_t total = cu.back();
          auto sequence_of = [&](int64_t g) {
            size_t b = 0;
            while (cu[b + 1] <= g) ++b;
            return b;
          };
          std::vector<dist::VarlenShard> shards(static_cast<size_t>(n));
          for (int r = 0; r < n; ++r) ASSERT_TRUE(dist::varlen_shard(st, cu, n, r, &shards[r]).ok());
          auto global = [&](const dist::VarlenShard& sh, int64_t local) {
            for (const SequenceShard& seq : sh.sequences) {
              const int64_t g = global_row(seq, local);
              if (g >= 0) return g;
            }
            return int64_t{-1};
          };
          std::vector<int> seen(static_cast<size_t>(total * total), 0);
          for (int r = 0; r < n; ++r)
            for (int step = 0; step < n; ++step) {
              const int src = ((r - step) % n + n) % n;
              for (const dist::BlockTask& t :
                   dist::varlen_step_tasks(shards[r], shards[src], band, src == r)) {
                ASSERT_FALSE(t.segments.empty());
                ASSERT_GE(t.window_left, -1);
                ASSERT_GE(t.window_right, -1);
                ASSERT_LE(t.q_begin + t.q_len, shards[r].length);
                ASSERT_LE(t.k_begin + t.k_len, shards[src].length);
                int64_t qo = 0, ko = 0;
                for (const dist::Segment& sg : t.segments) {
                  for (int64_t i = 0; i < sg.q_len; ++i)
                    for (int64_t j = 0; j < sg.k_len; ++j) {
                      if (!call_sees(t, i, j, sg.q_len, sg.k_len)) continue;
                      const int64_t gq = global(shards[r], t.q_begin + qo + i);
                      const int64_t gk = global(shards[src], t.k_begin + ko + j);
                      ASSERT_TRUE(gq >= 0 && gk >= 0);
                      ASSERT_EQ(sequence_of(gq), sequence_of(gk)) << "rows of two sequences meet";
                      const int64_t base = cu[sequence_of(gq)];
                      ASSERT_TRUE(in_band(band, gq - base, gk - base))
                          << "pair (" << gq << ", " << gk << ") outside the band";
                      ++seen[gq * total + gk];
                    }
                  qo += sg.q_len;
                  ko += sg.k_len;
                }
                ASSERT_EQ(qo, t.q_len);
                ASSERT_EQ(ko, t.k_len);
              }
            }
          for (int64_t i = 0; i < total; ++i)
            for (int64_t j = 0; j < total; ++j) {
              const bool want = sequence_of(i) == sequence_of(j) &&
                                in_band(band, i - cu[sequence_of(i)], j - cu[sequence_of(i)]);
              ASSERT_EQ(seen[i * total + j], want ? 1 : 0) << "pair (" << i << ", " << j << ")";
            }
        }
}

// Without a window, each step of a packed zigzag is one call over every sequence (a balanced ring
// step costs one kernel launch, whatever the number of sequences).
TEST(VarlenStepTasks, OneCallPerStepWithoutAWindow) {
  const std::vector<int32_t> cu = {0, 40, 41, 41, 100, 164};
  const int n = 4;
  for (const dist::MaskBand& band : {dist::MaskBand{-1, -1}, dist::MaskBand{-1, 0}})
    for (int r = 0; r < n; ++r)
      for (int src = 0; src < n; ++src) {
        dist::VarlenShard a, b;
        ASSERT_TRUE(dist::varlen_shard(Strategy::kZigzag, cu, n, r, &a).ok());
        ASSERT_TRUE(dist::varlen_shard(Strategy::kZigzag, cu, n, src, &b).ok());
        EXPECT_EQ(dist::varlen_step_tasks(a, b, band, src == r).size(), 1u)
            << band_name(band) << " rank " << r << " block of " << src;
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
             dist::ring_step_tasks(mine, shard_of(st, s, n, src), {-1, 0}, src == r)) {
          pairs[r] += t.causal() ? t.q_len * (t.q_len + 1) / 2 : t.q_len * t.k_len;
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
