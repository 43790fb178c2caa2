// Training-run rules and the memory estimate (src/train/core/train_config.h).
#include "train/core/train_config.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

namespace flare::train {
namespace {

ModelConfig preset(const std::string& name) {
  ModelConfig c;
  EXPECT_TRUE(model_preset(name, &c).ok());
  return c;
}

void expect_rejected(const TrainConfig& t, const ModelConfig& m, const std::string& field) {
  Status s = validate_train_config(t, m);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << field;
  EXPECT_NE(s.message().find(field), std::string::npos) << s.message();
}

TEST(TrainConfig, DefaultsAreValidForGpt2) {
  Status s = validate_train_config(TrainConfig{}, preset("gpt2"));
  EXPECT_TRUE(s.ok()) << s.to_string();
}

TEST(TrainConfig, EachRuleNamesItsField) {
  const ModelConfig m = preset("gpt2");
  const TrainConfig ok;
  TrainConfig t;
  t = ok; t.batch = 0; expect_rejected(t, m, "batch");
  t = ok; t.seq = 1025; expect_rejected(t, m, "seq: 1025 must be in [1, max_seq = 1024]");
  t = ok; t.seq = 0; expect_rejected(t, m, "seq");
  t = ok; t.grad_accum = 0; expect_rejected(t, m, "grad_accum");
  t = ok; t.bf16_grads = true; t.grad_accum = 2; expect_rejected(t, m, "bf16_grads: needs grad_accum = 1");
  t = ok; t.bf16_grads = true; t.shard_gradients = true; expect_rejected(t, m, "bf16_grads: not with shard_gradients");
  t = ok; t.bf16_grads = true; EXPECT_TRUE(validate_train_config(t, m).ok());
  t = ok; t.steps = 0; expect_rejected(t, m, "steps");
  t = ok; t.lr = 0; expect_rejected(t, m, "lr");
  t = ok; t.lr = NAN; expect_rejected(t, m, "lr");
  t = ok; t.min_lr = 1e-3; expect_rejected(t, m, "min_lr");
  t = ok; t.min_lr = -1; expect_rejected(t, m, "min_lr");
  t = ok; t.warmup = 1001; expect_rejected(t, m, "warmup");
  t = ok; t.warmup = -1; expect_rejected(t, m, "warmup");
  t = ok; t.weight_decay = -0.1; expect_rejected(t, m, "weight_decay");
  t = ok; t.beta1 = 1; expect_rejected(t, m, "beta1");
  t = ok; t.beta2 = -0.5; expect_rejected(t, m, "beta2");
  t = ok; t.eps = 0; expect_rejected(t, m, "eps");
  t = ok; t.grad_clip = -1; expect_rejected(t, m, "grad_clip");
  t = ok; t.eval_every = -1; expect_rejected(t, m, "eval_every");
  t = ok; t.ckpt_every = -2; expect_rejected(t, m, "ckpt_every");
  t = ok; t.eval_every = 10; expect_rejected(t, m, "val_data");
  t = ok; t.ckpt_every = 10; expect_rejected(t, m, "checkpoint_dir");
  ModelConfig bad = m;
  bad.n_layer = 0;
  expect_rejected(ok, bad, "n_layer");
}

TEST(TrainConfig, MemoryEstimateByHand) {
  const ModelConfig m = preset("gpt-tiny");  // d 64, 4 heads of 16, ffn 256, 2 layers, vocab 384
  TrainConfig t;
  t.batch = 2;
  t.seq = 32;
  const int64_t n = parameter_layout(m).total;
  const int64_t tokens = 64;
  // Per token per layer: bf16 4·64 + 192 + 64 + 2·256 = 1024 elements; fp32 4 heads + 4 stats.
  const int64_t layer = tokens * (2 * 1024 + 4 * 8);
  const int64_t input = tokens * 64 * 2;

  MemoryEstimate e = estimate_training_memory(t, m);
  EXPECT_EQ(e.weights, 2 * n);
  EXPECT_EQ(e.master, 2 * n);
  EXPECT_EQ(e.adam, 8 * n);
  EXPECT_EQ(e.grads, 4 * n);
  EXPECT_EQ(e.activations, 2 * layer + 2 * input);
  EXPECT_EQ(e.logits, tokens * 384 * 2);
  EXPECT_EQ(e.workspace, layer);
  EXPECT_EQ(e.total, 16 * n + 3 * layer + 2 * input + tokens * 384 * 2);

  t.recompute = true;
  MemoryEstimate r = estimate_training_memory(t, m);
  EXPECT_EQ(r.activations, 2 * input + layer + 2 * input);
  t.bf16_grads = true;
  EXPECT_EQ(estimate_training_memory(t, m).grads, 2 * n);
}

TEST(TrainConfig, LlamaSevenBDoesNotFitOneH100WithoutSharding) {
  // 16 bytes per parameter of state alone: 6.74e9 · 16 ≈ 100 GiB.
  TrainConfig t;
  t.batch = 1;
  t.seq = 4096;
  const MemoryEstimate e = estimate_training_memory(t, preset("llama2-7b"));
  EXPECT_GT(e.weights + e.master + e.adam + e.grads, int64_t{80} << 30);
  Status s = check_fits(e, int64_t{80} << 30);
  EXPECT_EQ(s.code(), StatusCode::kOutOfMemory);
  EXPECT_NE(s.message().find("recompute"), std::string::npos);
  // gpt2 at batch 8 · 1024 fits in 80 GiB.
  EXPECT_TRUE(check_fits(estimate_training_memory(TrainConfig{}, preset("gpt2")), int64_t{80} << 30).ok());
}

// ZeRO-1 on N ranks: the master's low halves, m and v of a 1/N shard; weights and gradients whole; the shard's
// reduced gradient and bf16 update (6 bytes per parameter / N) and one bucket's staging added.
TEST(TrainConfig, DataParallelShardsTheOptimizerState) {
  TrainConfig t;
  t.batch = 1;
  t.seq = 1024;
  const ModelConfig m = preset("llama2-7b");
  const int64_t n = parameter_layout(m).total, shard = (n + 3) / 4;
  const MemoryEstimate one = estimate_training_memory(t, m);
  const MemoryEstimate four = estimate_training_memory(t, m, 4);
  EXPECT_EQ(one.dp_buffers, 0);
  EXPECT_EQ(four.weights, 2 * n);
  EXPECT_EQ(four.grads, 4 * n);
  EXPECT_EQ(four.master, 2 * shard);
  EXPECT_EQ(four.adam, 8 * shard);
  EXPECT_GT(four.dp_buffers, 6 * shard);  // and the staging
  EXPECT_EQ(four.activations, one.activations);
  // 6 + 16/4 bytes of state per parameter: about 63 GiB for 7B, against 100 GiB alone.
  EXPECT_LT(four.weights + four.master + four.adam + four.grads + four.dp_buffers, int64_t{64} << 30);
  EXPECT_GT(one.weights + one.master + one.adam + one.grads, int64_t{99} << 30);
  EXPECT_NE(check_fits(four, 1).message().find("data-parallel buffers"), std::string::npos);
}

// ZeRO-2: the gradient shrinks to the stages held (kGradientStagesHeld of the largest stage but
// the last, and the last, the embeddings); the rest of the estimate is ZeRO-1's. LLaMA-2 7B: a
// layer is 202 M parameters, the token embedding 131 M.
TEST(TrainConfig, ShardedGradientsHoldOnlyTheStagesInFlight) {
  TrainConfig t;
  t.batch = 1;
  t.seq = 1024;
  const ModelConfig m = preset("llama2-7b");
  const MemoryEstimate zero1 = estimate_training_memory(t, m, 4);
  t.shard_gradients = true;
  const MemoryEstimate zero2 = estimate_training_memory(t, m, 4);
  const int64_t layer = (m.n_head + 2 * m.n_kv_head) * m.head_dim * m.d_model  // qkv
                        + m.d_model * m.n_head * m.head_dim                     // out
                        + 3 * m.d_model * m.ffn_hidden + 2 * m.d_model;         // gate_up, down, norms
  EXPECT_EQ(zero2.grads, 4 * (kGradientStagesHeld * std::max(layer, m.padded_vocab * m.d_model + m.d_model) +
                              m.padded_vocab * m.d_model));
  EXPECT_EQ(zero2.total - zero2.grads, zero1.total - zero1.grads);
  EXPECT_LT(zero2.grads, zero1.grads / 8);
  // One rank has nothing to shard over: the whole gradient.
  EXPECT_EQ(estimate_training_memory(t, m, 1).grads, zero1.grads);
}

}  // namespace
}  // namespace flare::train
