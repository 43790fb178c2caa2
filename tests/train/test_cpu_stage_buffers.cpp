// test_cpu_stage_buffers.cpp — where sharded gradients (ZeRO-2) live during a backward
// (train/dist/stage_buffers.h), walked as the CUDA data-parallel step walks it: begin(), then
// activate(s + 1) after each stage s. For GPT and LLaMA layouts (tied and untied heads) and
// several bucket targets: every parameter of a stage being written maps inside that stage's buffer
// at its offset from the stage's start, and inside the buffer's length; two live stages never share
// a buffer; a stage retired or not yet begun has no address; the last stage (the embeddings) stays
// live from the start, as a tied head writes it at stage 0.
#include <gtest/gtest.h>

#include <array>
#include <map>
#include <string>
#include <vector>

#include "train/core/model_config.h"
#include "train/dist/dp_plan.h"
#include "train/dist/stage_buffers.h"

namespace flare::train::dp {
namespace {

size_t sz(int64_t n) { return static_cast<size_t>(n); }

struct Buffers {
  std::array<std::vector<float>, kGradientRing> ring;
  std::vector<float> last;
  std::array<float*, kGradientRing> ring_ptrs{};

  explicit Buffers(const DpPlan& plan) {
    for (int k = 0; k < kGradientRing; ++k) {
      ring[sz(k)].resize(sz(longest_ring_stage(plan)) + 1);  // +1: never a zero-length vector
      ring_ptrs[sz(k)] = ring[sz(k)].data();
    }
    last.resize(sz(plan.stage_size(static_cast<int64_t>(plan.stage_begin.size()) - 1)) + 1);
  }
  // The buffer `p` points into and its length in floats, or {-1, 0}.
  std::pair<int, int64_t> owner(const float* p) const {
    for (int k = 0; k < kGradientRing; ++k) {
      if (p >= ring[sz(k)].data() && p < ring[sz(k)].data() + ring[sz(k)].size()) return {k, static_cast<int64_t>(ring[sz(k)].size()) - 1};
    }
    if (p >= last.data() && p < last.data() + last.size()) return {kGradientRing, static_cast<int64_t>(last.size()) - 1};
    return {-1, 0};
  }
};

void walk_backward(const ModelConfig& c, int64_t bucket_bytes) {
  const ParameterLayout layout = parameter_layout(c);
  DpPlan plan;
  ASSERT_TRUE(make_dp_plan(layout, c.n_layer, 2, bucket_bytes, &plan, true).ok());
  Buffers b(plan);
  StageBuffers stages;
  stages.init(plan, b.ring_ptrs, b.last.data());
  const int64_t last = stages.last_stage();
  ASSERT_EQ(last, backward_stage_count(c.n_layer) - 1);
  EXPECT_EQ(stages.begin(), b.last.data());

  // Whether stage s is live after stage `current` began.
  auto live = [&](int64_t s, int64_t current) {
    return s == last || (s <= current && s > current - kGradientRing);
  };
  for (int64_t current = 0; current < last; ++current) {
    SCOPED_TRACE(testing::Message() << "stage " << current << " being written");
    if (current > 0) EXPECT_NE(stages.activate(current), nullptr);
    else EXPECT_EQ(stages.activate(0), b.ring_ptrs[0]);
    std::map<int, int64_t> holder;  // buffer → the live stage in it
    for (int64_t s = 0; s <= last; ++s) {
      float* buffer = stages.buffer(s);
      if (!live(s, current)) {
        EXPECT_EQ(buffer, nullptr) << "stage " << s;
        continue;
      }
      ASSERT_NE(buffer, nullptr) << "stage " << s;
      const int id = b.owner(buffer).first;
      ASSERT_GE(id, 0) << "stage " << s << " points outside every buffer";
      EXPECT_TRUE(holder.emplace(id, s).second) << "stages " << holder[id] << " and " << s << " share buffer " << id;
    }
    for (const ParamSpec& p : layout.params) {
      const int64_t s = backward_stage(p, c.n_layer);
      float* first = stages.at(p.offset);
      if (!live(s, current)) {
        EXPECT_EQ(first, nullptr) << p.name;
        continue;
      }
      ASSERT_EQ(first, stages.buffer(s) + (p.offset - plan.stage_begin[sz(s)])) << p.name;
      const auto [id, length] = b.owner(first);
      ASSERT_GE(id, 0) << p.name;
      EXPECT_LE(first + p.numel, (id < kGradientRing ? b.ring[sz(id)].data() : b.last.data()) + length)
          << p.name << " runs past its stage's buffer";
    }
  }
  EXPECT_EQ(stages.at(-1), nullptr);
  EXPECT_EQ(stages.at(layout.total), nullptr);
  // A new backward retires every stage but the last.
  stages.begin();
  for (int64_t s = 0; s < last; ++s) EXPECT_EQ(stages.buffer(s), nullptr) << "stage " << s;
  EXPECT_EQ(stages.buffer(last), b.last.data());
}

// LLaMA-2 7B's structure (untied head, no position embedding) at a size the test can allocate.
ModelConfig small_untied_llama() {
  ModelConfig c;
  EXPECT_TRUE(model_preset("llama2-7b", &c).ok());
  c.n_layer = 5;
  c.d_model = 256;
  c.n_head = c.n_kv_head = 4;
  c.head_dim = 64;
  c.ffn_hidden = 688;
  c.vocab_size = 1000;
  c.padded_vocab = padded_vocab_size(c.vocab_size);
  EXPECT_FALSE(c.tied_embeddings);
  EXPECT_TRUE(validate_model_config(c).ok());
  return c;
}

TEST(StageBuffers, EveryParameterOfALiveStageMapsInsideItsBuffer) {
  std::vector<ModelConfig> configs = {small_untied_llama()};
  for (const char* name : {"gpt-tiny", "llama-tiny", "gpt2"}) {
    ModelConfig c;
    ASSERT_TRUE(model_preset(name, &c).ok());
    configs.push_back(c);
  }
  for (const ModelConfig& c : configs) {
    for (int64_t bytes : {int64_t{4096}, kDefaultBucketBytes}) {
      SCOPED_TRACE(testing::Message() << c.name << " (" << c.n_layer << " layers), bucket_bytes " << bytes);
      walk_backward(c, bytes);
      if (HasFatalFailure()) return;
    }
  }
}

}  // namespace
}  // namespace flare::train::dp
