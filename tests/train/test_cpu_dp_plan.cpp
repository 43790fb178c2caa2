// test_cpu_dp_plan.cpp — the data-parallel plan (dp_plan.h): buckets tile the flat buffer in
// backward order with non-decreasing ready stages, every rank's slices are aligned and balanced,
// shards partition the buffer exactly, shard_layout lists exactly the parameter elements, and the
// transfer lists of both collectives pair up between ranks.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <set>
#include <tuple>
#include <vector>

#include "train/core/model_config.h"
#include "train/dist/dp_plan.h"

namespace flare::train::dp {
namespace {

size_t sz(int64_t n) { return static_cast<size_t>(n); }

ModelConfig preset(const char* name) {
  ModelConfig c;
  EXPECT_TRUE(model_preset(name, &c).ok());
  return c;
}

DpPlan plan_for(const ModelConfig& c, int world, int64_t bucket_bytes) {
  DpPlan plan;
  const Status s = make_dp_plan(parameter_layout(c), c.n_layer, world, bucket_bytes, &plan);
  EXPECT_TRUE(s.ok()) << s.to_string();
  return plan;
}

TEST(DpPlan, BackwardStagesFollowTheBackward) {
  const ModelConfig c = preset("gpt-tiny");
  const ParameterLayout layout = parameter_layout(c);
  const int64_t L = c.n_layer;
  EXPECT_EQ(backward_stage_count(L), L + 2);
  EXPECT_EQ(backward_stage(*layout.find("final_norm.weight"), L), 0);
  EXPECT_EQ(backward_stage(*layout.find("layers.0.attn.qkv.weight"), L), L);
  EXPECT_EQ(backward_stage(*layout.find("layers." + std::to_string(L - 1) + ".mlp_norm.weight"), L), 1);
  EXPECT_EQ(backward_stage(*layout.find("embed.weight"), L), L + 1);  // tied: final only at the end
  EXPECT_EQ(backward_stage(*layout.find("pos_embed.weight"), L), L + 1);
  const ModelConfig llama = preset("llama-tiny");
  EXPECT_EQ(backward_stage(*parameter_layout(llama).find("head.weight"), llama.n_layer), 0);
}

// Buckets tile [0, total) from the top down, start at tensor offsets, hold whole tensors, reach
// the target (all but the last), and their stages never decrease and cover their tensors.
void check_buckets(const ModelConfig& c, const DpPlan& plan) {
  const ParameterLayout layout = parameter_layout(c);
  std::set<int64_t> offsets;
  for (const ParamSpec& p : layout.params) offsets.insert(p.offset);
  int64_t end = layout.total, stage = 0;
  for (size_t k = 0; k < plan.buckets.size(); ++k) {
    const Bucket& b = plan.buckets[k];
    EXPECT_EQ(b.end, end) << "bucket " << k;
    EXPECT_LT(b.begin, b.end) << "bucket " << k;
    EXPECT_TRUE(offsets.count(b.begin)) << "bucket " << k << " does not start at a tensor";
    EXPECT_GE(b.ready_stage, stage) << "bucket " << k;
    // Only the last bucket, or one that ends a stage when buckets stay in their stage, may be short.
    const bool ends_stage = plan.stage_buckets && b.begin == plan.stage_begin[sz(b.ready_stage)];
    if (k + 1 < plan.buckets.size() && !ends_stage) {
      EXPECT_GE((b.end - b.begin) * 4, plan.bucket_bytes) << "bucket " << k << " closed early";
    }
    for (const ParamSpec& p : layout.params) {
      if (p.offset >= b.begin && p.offset < b.end) {
        EXPECT_LE(p.offset + p.numel, b.end) << p.name << " straddles two buckets";
        EXPECT_LE(backward_stage(p, c.n_layer), b.ready_stage) << p.name << " reduced too early";
      }
    }
    stage = b.ready_stage;
    end = b.begin;
  }
  EXPECT_EQ(end, 0);
}

TEST(DpPlan, BucketsTileTheBufferInBackwardOrder) {
  for (const char* name : {"gpt-tiny", "llama-tiny", "gpt2", "llama3.2-1b"}) {
    const ModelConfig c = preset(name);
    for (int64_t bytes : {int64_t{1}, int64_t{4096}, int64_t{1} << 20, kDefaultBucketBytes,
                          int64_t{1} << 40}) {
      SCOPED_TRACE(testing::Message() << name << ", bucket_bytes " << bytes);
      const DpPlan plan = plan_for(c, 3, bytes);
      check_buckets(c, plan);
    }
  }
  // One byte: every tensor its own bucket; a huge target: one bucket.
  const ModelConfig c = preset("gpt-tiny");
  EXPECT_EQ(plan_for(c, 2, 1).buckets.size(), parameter_layout(c).params.size());
  EXPECT_EQ(plan_for(c, 2, int64_t{1} << 40).buckets.size(), 1u);
}

// The stages tile the buffer in backward order (stage 0 on top), each the union of its tensors'
// slots; with stage_buckets every bucket lies in one stage, ready at that stage, and the buckets
// still tile the buffer as check_buckets wants.
TEST(DpPlan, StageRangesTileTheBufferAndStageBucketsStayInside) {
  for (const char* name : {"gpt-tiny", "llama-tiny", "gpt2", "llama3.2-1b", "llama2-7b"}) {
    const ModelConfig c = preset(name);
    const ParameterLayout layout = parameter_layout(c);
    for (int64_t bytes : {int64_t{1}, int64_t{4096}, kDefaultBucketBytes, int64_t{1} << 40}) {
      SCOPED_TRACE(testing::Message() << name << ", bucket_bytes " << bytes);
      DpPlan plan;
      ASSERT_TRUE(make_dp_plan(layout, c.n_layer, 3, bytes, &plan, true).ok());
      const auto stages = sz(backward_stage_count(c.n_layer));
      ASSERT_EQ(plan.stage_begin.size(), stages);
      EXPECT_EQ(plan.stage_end[0], layout.total);
      EXPECT_EQ(plan.stage_begin[stages - 1], 0);
      for (size_t s = 0; s + 1 < stages; ++s) EXPECT_EQ(plan.stage_begin[s], plan.stage_end[s + 1]) << "stage " << s;
      for (const ParamSpec& p : layout.params) {
        const auto s = sz(backward_stage(p, c.n_layer));
        EXPECT_GE(p.offset, plan.stage_begin[s]) << p.name;
        EXPECT_LE(p.offset + p.numel, plan.stage_end[s]) << p.name;
      }
      check_buckets(c, plan);
      for (const Bucket& b : plan.buckets) {
        const auto s = sz(b.ready_stage);
        EXPECT_GE(b.begin, plan.stage_begin[s]);
        EXPECT_LE(b.end, plan.stage_end[s]);
      }
    }
  }
  // A huge target: one bucket per non-empty stage.
  const ModelConfig c = preset("gpt-tiny");
  DpPlan plan;
  ASSERT_TRUE(make_dp_plan(parameter_layout(c), c.n_layer, 2, int64_t{1} << 40, &plan, true).ok());
  EXPECT_EQ(plan.buckets.size(), sz(backward_stage_count(c.n_layer)));
}

// A layout whose stage is split in two is refused, naming the tensor.
TEST(DpPlan, StageThatIsNotOneRangeIsRefused) {
  ParameterLayout layout = parameter_layout(preset("gpt-tiny"));
  std::swap(layout.params[1].name, layout.params[2].name);  // pos_embed (last stage) moves up into layer 0
  std::vector<int64_t> begin, end;
  const Status s = backward_stage_ranges(layout, preset("gpt-tiny").n_layer, &begin, &end);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("not one contiguous range"), std::string::npos) << s.to_string();
}

// Slices: aligned starts, a contiguous cover of the bucket in rank order (so, with the buckets
// tiling the buffer, every element has one owner), lengths differing by at most one unit; shard
// offsets dense; the shard lengths add up to the buffer.
TEST(DpPlan, SlicesAreAlignedBalancedAndPartitionTheBuffer) {
  for (const char* name : {"gpt-tiny", "llama-tiny", "gpt2"}) {
    const ModelConfig c = preset(name);
    const int64_t total = parameter_layout(c).total;
    for (int world : {1, 2, 3, 4, 7, 8}) {
      for (int64_t bytes : {int64_t{512}, int64_t{1} << 16, kDefaultBucketBytes}) {
        SCOPED_TRACE(testing::Message() << name << ", world " << world << ", bucket_bytes " << bytes);
        const DpPlan plan = plan_for(c, world, bytes);
        ASSERT_EQ(plan.shard_elements.size(), sz(world));
        std::vector<int64_t> filled(sz(world), 0);
        // Shards take the slices in flat order: the last bucket first.
        for (auto it = plan.buckets.rbegin(); it != plan.buckets.rend(); ++it) {
          const Bucket& b = *it;
          ASSERT_EQ(b.slice_begin.size(), sz(world) + 1);
          EXPECT_EQ(b.slice_begin.front(), b.begin);
          EXPECT_EQ(b.slice_begin.back(), b.end);
          int64_t shortest = b.end - b.begin, longest = 0;
          for (int r = 0; r < world; ++r) {
            const int64_t lo = b.slice_begin[sz(r)], hi = b.slice_begin[sz(r) + 1];
            ASSERT_LE(lo, hi);
            if (hi > lo) {
              EXPECT_EQ(lo % kParamAlignment, 0) << "rank " << r;
            }
            EXPECT_EQ(b.shard_offset[sz(r)], filled[sz(r)]);
            filled[sz(r)] += hi - lo;
            EXPECT_LE(hi - lo, plan.max_slice);
            if (hi != b.end) {  // the last slice may be a partial unit
              shortest = std::min(shortest, hi - lo);
              longest = std::max(longest, hi - lo);
            }
          }
          if (longest > 0) {
            EXPECT_LE(longest - shortest, kParamAlignment);
          }
        }
        EXPECT_EQ(filled, plan.shard_elements);
        const int64_t sum = std::accumulate(filled.begin(), filled.end(), int64_t{0});
        EXPECT_EQ(sum, total);
      }
    }
  }
}

// With one rank the shard is the flat buffer and its layout the model's.
TEST(DpPlan, OneRankShardIsTheFlatBuffer) {
  const ModelConfig c = preset("llama-tiny");
  const ParameterLayout layout = parameter_layout(c);
  const DpPlan plan = plan_for(c, 1, 4096);
  for (const Bucket& b : plan.buckets) EXPECT_EQ(b.shard_offset[0], b.begin);
  const ParameterLayout sl = shard_layout(layout, plan, 0);
  ASSERT_EQ(sl.params.size(), layout.params.size());
  EXPECT_EQ(sl.total, layout.total);
  for (size_t i = 0; i < sl.params.size(); ++i) {
    EXPECT_EQ(sl.params[i].name, layout.params[i].name);
    EXPECT_EQ(sl.params[i].offset, layout.params[i].offset);
    EXPECT_EQ(sl.params[i].numel, layout.params[i].numel);
  }
}

// shard_layout lists each parameter element of the shard once, at the element's shard position,
// with its tensor's weight decay; gaps are not listed.
TEST(DpPlan, ShardLayoutListsExactlyTheParameterElements) {
  const ModelConfig c = preset("gpt-tiny");
  const ParameterLayout layout = parameter_layout(c);
  const int world = 3;
  const DpPlan plan = plan_for(c, world, 2048);
  // Flat buffer of element ids; the shards of it carry each id to its shard position.
  std::vector<int64_t> ids(sz(layout.total));
  std::iota(ids.begin(), ids.end(), int64_t{0});
  int64_t listed = 0;
  for (int r = 0; r < world; ++r) {
    std::vector<int64_t> shard(sz(plan.shard_size(r)), -1);
    full_to_shard(plan, r, ids.data(), shard.data(), sizeof(int64_t));
    const ParameterLayout sl = shard_layout(layout, plan, r);
    EXPECT_EQ(sl.total, plan.shard_size(r));
    for (size_t i = 1; i < sl.params.size(); ++i) EXPECT_LE(sl.params[i - 1].offset, sl.params[i].offset);
    for (const ParamSpec& piece : sl.params) {
      const ParamSpec* p = layout.find(piece.name);
      ASSERT_NE(p, nullptr) << piece.name;
      EXPECT_EQ(piece.weight_decay, p->weight_decay);
      for (int64_t i = 0; i < piece.numel; ++i) {
        const int64_t flat = shard[sz(piece.offset + i)];
        EXPECT_GE(flat, p->offset) << piece.name;
        EXPECT_LT(flat, p->offset + p->numel) << piece.name;
      }
      listed += piece.numel;
    }
    // Round trip: the shard goes back to where it came from.
    std::vector<int64_t> back(sz(layout.total), -1);
    shard_to_full(plan, r, shard.data(), back.data(), sizeof(int64_t));
    for (const Bucket& b : plan.buckets) {
      for (int64_t i = b.slice_begin[sz(r)]; i < b.slice_begin[sz(r) + 1]; ++i) EXPECT_EQ(back[sz(i)], i);
    }
  }
  int64_t params = 0;
  for (const ParamSpec& p : layout.params) params += p.numel;
  EXPECT_EQ(listed, params);
}

// Every send of one rank's transfer list meets a receive of the same size on its peer, and a
// reduce-scatter receive lands in the slot staging_slot() names.
TEST(DpPlan, TransfersPairUpBetweenRanks) {
  const ModelConfig c = preset("llama-tiny");
  for (int world : {2, 3, 5}) {
    const DpPlan plan = plan_for(c, world, 4096);
    const int64_t e = 4;
    std::vector<std::vector<char>> grads(sz(world), std::vector<char>(sz(plan.total * e)));
    std::vector<std::vector<char>> staging(sz(world), std::vector<char>(sz((world - 1) * plan.max_slice * e)));
    for (const Bucket& b : plan.buckets) {
      // (from, to) → bytes of sends and of receives.
      std::map<std::pair<int, int>, int64_t> sent, received;
      for (int r = 0; r < world; ++r) {
        for (const dist::Transfer& t : reduce_scatter_transfers(plan, b, r, grads[sz(r)].data(),
                                                                staging[sz(r)].data(), e)) {
          EXPECT_GT(t.bytes, 0);
          if (t.kind == dist::Transfer::Kind::kSend) {
            sent[{r, t.peer}] += t.bytes;
            const auto* base = grads[sz(r)].data();
            EXPECT_EQ(static_cast<const char*>(t.data) - base, b.slice_begin[sz(t.peer)] * e);
          } else {
            received[{t.peer, r}] += t.bytes;
            const auto* base = staging[sz(r)].data();
            EXPECT_EQ(static_cast<const char*>(t.data) - base, staging_slot(t.peer, r) * plan.max_slice * e);
            EXPECT_EQ(t.bytes, b.slice_size(r) * e);
          }
        }
      }
      EXPECT_EQ(sent, received);
      sent.clear();
      received.clear();
      for (int r = 0; r < world; ++r) {
        std::vector<char> shard(sz(plan.shard_size(r) * e + 1));
        for (const dist::Transfer& t : all_gather_transfers(plan, b, r, shard.data(), grads[sz(r)].data(), e)) {
          if (t.kind == dist::Transfer::Kind::kSend) {
            sent[{r, t.peer}] += t.bytes;
            EXPECT_EQ(t.bytes, b.slice_size(r) * e);
          } else {
            received[{t.peer, r}] += t.bytes;
            EXPECT_EQ(static_cast<const char*>(t.data) - grads[sz(r)].data(), b.slice_begin[sz(t.peer)] * e);
          }
        }
      }
      EXPECT_EQ(sent, received);
    }
  }
}

TEST(DpPlan, RejectsBadArguments) {
  const ModelConfig c = preset("gpt-tiny");
  const ParameterLayout layout = parameter_layout(c);
  DpPlan plan;
  Status s = make_dp_plan(layout, c.n_layer, 0, 1024, &plan);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("world"), std::string::npos) << s.message();
  s = make_dp_plan(layout, c.n_layer, 2, 0, &plan);
  EXPECT_NE(s.message().find("bucket_bytes"), std::string::npos) << s.message();
  ParameterLayout bad = layout;
  bad.params[1].offset += 1;
  s = make_dp_plan(bad, c.n_layer, 2, 1024, &plan);
  EXPECT_NE(s.message().find("aligned"), std::string::npos) << s.message();
  EXPECT_FALSE(make_dp_plan(ParameterLayout{}, c.n_layer, 2, 1024, &plan).ok());
}

}  // namespace
}  // namespace flare::train::dp
