// loader.h — batches of token windows from a set of shards: shuffled by seed, split across ranks,
// and resumable from a few saved bytes.
//
// The unit is a window: T+1 consecutive tokens of one shard, giving T inputs and their T targets
// (the next token). A shard of N tokens holds (N − 1) / T windows, window w starting at token w·T
// (neighbours share one token, as in llm.c); windows never straddle two shards, and a shard
// shorter than T+1 tokens contributes none.
//
// An epoch visits the windows in one order: the shards in a permutation drawn from (seed, epoch),
// and inside each shard its windows in a permutation drawn from (seed, epoch, shard). With
// shuffle off (validation) both are the identity. The epoch's sequence is dealt round-robin over
// the ranks — position p goes to rank p mod world_size — and each rank's batch is its next B
// windows, so ranks never share a window and all ranks move through the shards together (each
// holds one shard in memory at a time). Every rank gets the same number of batches per epoch,
// floor(windows / (B · world_size)); the last windows of the sequence that do not fill a batch on
// every rank (fewer than B · world_size) are skipped that epoch, and others next epoch since the
// order changes. Everything is a function of (seed, epoch, batch), so the saved position is just
// those numbers plus a fingerprint of the configuration they are valid for.
//
// Token ids are checked against vocab_size each time a shard is loaded (read_shard).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "flare/status.h"
#include "train/data/shard.h"

namespace flare::train {

struct DataLoaderConfig {
  std::vector<std::string> shards;  // shard files, in this order (see expand_shard_pattern)
  int64_t batch_size = 0;           // B: windows per batch on each rank
  int64_t seq_len = 0;              // T: positions per window (a window reads T+1 tokens)
  int64_t vocab_size = 0;           // every token id must be below it
  bool shuffle = true;              // false: shards and windows in file order (validation)
  uint64_t seed = 0;                // drives both permutations; ignored without shuffle
  int rank = 0;                     // this process's rank in [0, world_size)
  int world_size = 1;               // ranks reading the same shards, each getting disjoint windows
};

// The files matching a glob pattern ("data/pydoc_train_*.bin"), sorted by name; an error if none.
Status expand_shard_pattern(const std::string& pattern, std::vector<std::string>* paths);

class DataLoader {
 public:
  // Checks the config and every shard's header (not yet the tokens: a shard's ids are checked
  // when it is loaded, in next_batch).
  static Status open(const DataLoaderConfig& config, DataLoader* loader);

  // Fills inputs and targets (B·T int32 each, row-major (B, T)) with the next batch of this
  // rank; targets[b, t] = inputs[b, t + 1] within a window. On error nothing is written and
  // the position does not move.
  Status next_batch(std::span<int32_t> inputs, std::span<int32_t> targets);

  // The position as opaque bytes for a checkpoint, and back. A restored loader yields exactly the
  // batches the saved one would have. The bytes hold (epoch, batch) and the configuration they
  // are valid for (seed, shuffle, B, T, world_size, the shards' sizes); restore rejects bytes
  // from a different configuration, naming the field. They do not hold the rank: all ranks are at
  // the same position, so any rank's bytes restore every rank. A position saved with another B or
  // world_size (a data-parallel run resumed on another number of ranks) is restored when the
  // windows it had used are a whole number of this loader's batches of B · world_size: the next
  // batches then hold the next windows of the same epoch sequence; otherwise it is rejected.
  std::vector<uint8_t> save_position() const;
  Status restore_position(std::span<const uint8_t> bytes);

  // Back to the first batch of epoch 0 (a validation pass starts here each time).
  void reset();

  int64_t epoch() const { return epoch_; }
  int64_t batch_in_epoch() const { return batch_; }
  int64_t batches_per_epoch() const { return batches_per_epoch_; }
  int64_t total_windows() const { return total_windows_; }
  const DataLoaderConfig& config() const { return config_; }

 private:
  void start_epoch(int64_t epoch);
  Status load_shard(int shard);
  uint64_t fingerprint() const;

  DataLoaderConfig config_;
  std::vector<int64_t> shard_windows_;  // windows in each shard, config order
  int64_t total_windows_ = 0;
  int64_t batches_per_epoch_ = 0;

  // Position: the next batch is batch_ of epoch_.
  int64_t epoch_ = 0;
  int64_t batch_ = 0;

  // This epoch's order: shard_order_[k] is the k-th shard visited, and its windows occupy
  // positions [order_start_[k], order_start_[k + 1]) of the epoch's sequence.
  std::vector<int> shard_order_;
  std::vector<int64_t> order_start_;

  // The shard in memory and this epoch's permutation of its windows.
  int loaded_shard_ = -1;
  int64_t loaded_epoch_ = -1;
  ShardTokens tokens_;
  std::vector<int64_t> window_order_;
};

}  // namespace flare::train
