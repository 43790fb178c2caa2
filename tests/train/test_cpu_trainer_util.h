// test_cpu_trainer_util.h — what the trainer tests share: shards of a learnable token stream and
// a trainer configuration small enough to train in seconds on the CPU.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "test_cpu_data_util.h"
#include "train/core/model_config.h"
#include "train/data/shard.h"
#include "train/loop/trainer.h"

namespace flare::train::test {

// A stream a model learns within a few dozen steps: a fixed cycle through `period` distinct tokens
// (below `vocab`), so each token determines the next; a bigram is enough to drive the loss from
// log(vocab) towards 0.
inline std::vector<int32_t> cycle_tokens(int64_t count, int64_t vocab, int64_t period = 23) {
  std::vector<int32_t> tokens(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    tokens[static_cast<size_t>(i)] = static_cast<int32_t>((7 * (i % period) + 3) % vocab);
  }
  return tokens;
}

// Writes train_000000.bin, train_000001.bin and val_000000.bin of the cycle stream into `dir`.
inline void write_cycle_shards(const ScratchDir& dir, int64_t vocab, int64_t tokens_per_shard = 4096) {
  const std::vector<int32_t> tokens = cycle_tokens(tokens_per_shard, vocab);
  for (const char* name : {"train_000000.bin", "train_000001.bin", "val_000000.bin"}) {
    const Status s = write_shard(dir.file(name), tokens, vocab);
    ASSERT_TRUE(s.ok()) << s.to_string();
  }
}

// A CPU run of `preset` over the shards of write_cycle_shards.
inline TrainerOptions tiny_run(const ScratchDir& dir, const std::string& preset, int64_t steps) {
  TrainerOptions o;
  EXPECT_TRUE(model_preset(preset, &o.model).ok());
  o.device = DeviceKind::kCpu;
  TrainConfig& t = o.train;
  t.batch = 2;
  t.seq = 32;
  t.grad_accum = 1;
  t.steps = steps;
  t.lr = 1e-2;
  t.min_lr = 1e-3;
  t.warmup = 2;
  t.weight_decay = 0.1;
  t.grad_clip = 1.0;
  t.seed = 7;
  t.train_data = dir.file("train_*.bin");
  t.val_data = dir.file("val_*.bin");
  o.eval_batches = 2;
  return o;
}

}  // namespace flare::train::test
