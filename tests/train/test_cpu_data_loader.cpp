// The window loader: every window once per epoch, targets are the next token, the order follows
// the seed, ranks get disjoint windows, a restored position continues exactly, and bad
// configurations, positions and shards are rejected by name.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <set>

#include "test_cpu_data_util.h"
#include "train/data/loader.h"

namespace flare::train {
namespace {

using test::ScratchDir;
using test::write_numbered_shards;

constexpr int64_t kVocab = 65536;
constexpr int64_t kT = 8;

// Shard sizes in windows of kT (+1 for the window's last target); `extra` tokens that do not
// make another window are added to some to check they are ignored.
std::vector<int64_t> sizes_for(const std::vector<int64_t>& windows, int64_t extra = 0) {
  std::vector<int64_t> sizes;
  for (size_t i = 0; i < windows.size(); ++i) {
    sizes.push_back(windows[i] * kT + 1 + (i % 2 == 1 ? extra : 0));
  }
  return sizes;
}

DataLoaderConfig config_for(std::vector<std::string> shards, int64_t batch, uint64_t seed = 7) {
  DataLoaderConfig config;
  config.shards = std::move(shards);
  config.batch_size = batch;
  config.seq_len = kT;
  config.vocab_size = kVocab;
  config.seed = seed;
  return config;
}

DataLoader open_or_fail(const DataLoaderConfig& config) {
  DataLoader loader;
  Status status = DataLoader::open(config, &loader);
  EXPECT_TRUE(status.ok()) << status.to_string();
  return loader;
}

struct Batch {
  std::vector<int32_t> inputs, targets;
  bool operator==(const Batch&) const = default;
};

Batch next(DataLoader& loader) {
  const auto n = size_t(loader.config().batch_size * loader.config().seq_len);
  Batch batch{std::vector<int32_t>(n), std::vector<int32_t>(n)};
  Status status = loader.next_batch(batch.inputs, batch.targets);
  EXPECT_TRUE(status.ok()) << status.to_string();
  return batch;
}

// The first token of each window in the batch: with numbered shards, it names the window.
std::vector<int32_t> window_ids(const Batch& batch, int64_t batch_size) {
  std::vector<int32_t> ids;
  for (int64_t b = 0; b < batch_size; ++b) ids.push_back(batch.inputs[size_t(b * kT)]);
  return ids;
}

// Every window of the numbered shards, by its first token.
std::set<int32_t> all_windows(const std::vector<int64_t>& windows) {
  std::set<int32_t> ids;
  for (size_t s = 0; s < windows.size(); ++s) {
    for (int64_t w = 0; w < windows[s]; ++w) ids.insert(int32_t(s) * 1000 + int32_t(w * kT));
  }
  return ids;
}

TEST(DataLoader, TargetsAreTheNextToken) {
  ScratchDir dir;
  DataLoader loader =
      open_or_fail(config_for(write_numbered_shards(dir, sizes_for({5, 4}), kVocab), 3));
  for (int step = 0; step < 6; ++step) {
    const Batch batch = next(loader);
    for (int64_t b = 0; b < 3; ++b) {
      const int32_t first = batch.inputs[size_t(b * kT)];
      EXPECT_EQ(first % 1000 % kT, 0) << "a window starts at a multiple of T";
      for (int64_t t = 0; t < kT; ++t) {
        EXPECT_EQ(batch.inputs[size_t(b * kT + t)], first + t);
        EXPECT_EQ(batch.targets[size_t(b * kT + t)], first + t + 1);
      }
    }
  }
}

TEST(DataLoader, AnEpochCoversEveryWindowOnce) {
  ScratchDir dir;
  // 12 windows, trailing tokens that make no window, and a shard too short for any.
  const std::vector<int64_t> windows = {5, 3, 0, 4};
  auto sizes = sizes_for(windows, kT - 1);
  sizes[2] = kT;  // T tokens: no room for the last target
  DataLoader loader = open_or_fail(config_for(write_numbered_shards(dir, sizes, kVocab), 3));
  EXPECT_EQ(loader.total_windows(), 12);
  ASSERT_EQ(loader.batches_per_epoch(), 4);

  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    std::multiset<int32_t> seen;
    for (int step = 0; step < 4; ++step) {
      EXPECT_EQ(loader.epoch(), epoch);
      for (int32_t id : window_ids(next(loader), 3)) seen.insert(id);
    }
    EXPECT_EQ(std::set<int32_t>(seen.begin(), seen.end()), all_windows(windows));
    EXPECT_EQ(seen.size(), 12u) << "no window twice";
  }
  EXPECT_EQ(loader.epoch(), 3);
}

TEST(DataLoader, WindowsBeyondTheLastFullBatchAreSkipped) {
  ScratchDir dir;
  const std::vector<int64_t> windows = {6, 7};  // 13 windows, batches of 4: 3 batches, 1 left
  DataLoader loader =
      open_or_fail(config_for(write_numbered_shards(dir, sizes_for(windows), kVocab), 4));
  ASSERT_EQ(loader.batches_per_epoch(), 3);
  std::set<int32_t> union_of_epochs;
  for (int epoch = 0; epoch < 4; ++epoch) {
    std::multiset<int32_t> seen;
    for (int step = 0; step < 3; ++step) {
      for (int32_t id : window_ids(next(loader), 4)) seen.insert(id);
    }
    EXPECT_EQ(seen.size(), 12u);
    EXPECT_EQ(std::set<int32_t>(seen.begin(), seen.end()).size(), 12u) << "no window twice";
    union_of_epochs.insert(seen.begin(), seen.end());
  }
  EXPECT_EQ(union_of_epochs, all_windows(windows)) << "the skipped window changes with the epoch";
}

TEST(DataLoader, OrderIsAFunctionOfTheSeed) {
  ScratchDir dir;
  const auto shards = write_numbered_shards(dir, sizes_for({9, 6, 8, 7}), kVocab);
  DataLoader a = open_or_fail(config_for(shards, 2, 123));
  DataLoader b = open_or_fail(config_for(shards, 2, 123));
  DataLoader c = open_or_fail(config_for(shards, 2, 124));
  std::vector<int32_t> order_a, order_c, epoch0, epoch1;
  for (int step = 0; step < 2 * 15; ++step) {
    const Batch batch_a = next(a);
    EXPECT_EQ(batch_a, next(b)) << "step " << step;
    auto ids = window_ids(batch_a, 2);
    order_a.insert(order_a.end(), ids.begin(), ids.end());
    (step < 15 ? epoch0 : epoch1)
        .insert((step < 15 ? epoch0 : epoch1).end(), ids.begin(), ids.end());
    auto ids_c = window_ids(next(c), 2);
    order_c.insert(order_c.end(), ids_c.begin(), ids_c.end());
  }
  EXPECT_NE(order_a, order_c) << "another seed, another order";
  EXPECT_NE(epoch0, epoch1) << "each epoch is shuffled anew";
  std::vector<int32_t> sorted = epoch0;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_NE(epoch0, sorted) << "shuffled, not file order";
}

TEST(DataLoader, ValidationIsInFileOrder) {
  ScratchDir dir;
  const std::vector<int64_t> windows = {3, 4, 2};
  auto config = config_for(write_numbered_shards(dir, sizes_for(windows), kVocab), 3);
  config.shuffle = false;
  DataLoader loader = open_or_fail(config);
  const std::set<int32_t> expected_set = all_windows(windows);
  const std::vector<int32_t> expected(expected_set.begin(), expected_set.end());  // file order
  for (int pass = 0; pass < 2; ++pass) {
    std::vector<int32_t> seen;
    for (int step = 0; step < 3; ++step) {
      auto ids = window_ids(next(loader), 3);
      seen.insert(seen.end(), ids.begin(), ids.end());
    }
    EXPECT_EQ(seen, expected) << "pass " << pass;
  }
  next(loader);
  loader.reset();
  EXPECT_EQ(window_ids(next(loader), 3),
            std::vector<int32_t>(expected.begin(), expected.begin() + 3));
}

TEST(DataLoader, RanksGetDisjointWindowsThatCoverTheEpoch) {
  ScratchDir dir;
  const std::vector<int64_t> windows = {11, 9, 12, 8};  // 40 windows = 5 batches of 2 on 4 ranks
  const auto shards = write_numbered_shards(dir, sizes_for(windows), kVocab);
  for (bool shuffle : {true, false}) {
    std::map<int32_t, int> owner;
    for (int rank = 0; rank < 4; ++rank) {
      auto config = config_for(shards, 2, 99);
      config.shuffle = shuffle;
      config.rank = rank;
      config.world_size = 4;
      DataLoader loader = open_or_fail(config);
      ASSERT_EQ(loader.batches_per_epoch(), 5);
      for (int step = 0; step < 5; ++step) {
        for (int32_t id : window_ids(next(loader), 2)) {
          EXPECT_TRUE(owner.emplace(id, rank).second)
              << "window " << id << " went to rank " << owner[id] << " and rank " << rank;
        }
      }
    }
    std::set<int32_t> covered;
    for (const auto& [id, rank] : owner) covered.insert(id);
    EXPECT_EQ(covered, all_windows(windows)) << "shuffle " << shuffle;
  }
}

TEST(DataLoader, RestoredPositionContinuesExactly) {
  ScratchDir dir;
  const auto shards = write_numbered_shards(dir, sizes_for({5, 7, 6}), kVocab);
  auto config = config_for(shards, 2, 2024);
  config.world_size = 2;
  config.rank = 1;
  for (int saved_after : {0, 1, 4, 5, 9, 13}) {  // 9 batches per epoch: across epoch boundaries
    DataLoader straight = open_or_fail(config);
    for (int step = 0; step < saved_after; ++step) next(straight);
    const std::vector<uint8_t> position = straight.save_position();

    DataLoader resumed = open_or_fail(config);
    next(resumed);  // somewhere else first: restore must not depend on where it was
    Status status = resumed.restore_position(position);
    ASSERT_TRUE(status.ok()) << status.to_string();
    EXPECT_EQ(resumed.epoch(), straight.epoch());
    EXPECT_EQ(resumed.batch_in_epoch(), straight.batch_in_epoch());
    for (int step = 0; step < 12; ++step) {
      ASSERT_EQ(next(resumed), next(straight))
          << "saved after " << saved_after << ", step " << step;
    }
  }
}

TEST(DataLoader, AnyRanksPositionRestoresEveryRank) {
  ScratchDir dir;
  const auto shards = write_numbered_shards(dir, sizes_for({8, 8}), kVocab);
  auto config0 = config_for(shards, 2, 5);
  config0.world_size = 2;
  auto config1 = config0;
  config1.rank = 1;
  DataLoader rank0 = open_or_fail(config0);
  DataLoader rank1 = open_or_fail(config1);
  for (int step = 0; step < 3; ++step) {
    next(rank0);
    next(rank1);
  }
  DataLoader resumed1 = open_or_fail(config1);
  ASSERT_TRUE(resumed1.restore_position(rank0.save_position()).ok());
  for (int step = 0; step < 6; ++step) EXPECT_EQ(next(resumed1), next(rank1));
}

void expect_error(const Status& status, std::initializer_list<const char*> parts) {
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  for (const char* part : parts) {
    EXPECT_NE(status.message().find(part), std::string::npos)
        << "message '" << status.message() << "' lacks '" << part << "'";
  }
}

TEST(DataLoader, RestoreRejectsAnotherConfiguration) {
  ScratchDir dir;
  const auto shards = write_numbered_shards(dir, sizes_for({5, 7, 6}), kVocab);
  DataLoader loader = open_or_fail(config_for(shards, 2, 1));
  next(loader);
  const std::vector<uint8_t> position = loader.save_position();

  auto expect_rejected = [&](const DataLoaderConfig& config, const char* field) {
    DataLoader other = open_or_fail(config);
    const std::vector<uint8_t> before = other.save_position();
    expect_error(other.restore_position(position), {field});
    EXPECT_EQ(other.save_position(), before) << "a rejected restore leaves the position";
  };
  expect_rejected(config_for(shards, 2, 2), "seed");
  expect_rejected(config_for(shards, 3, 1), "batch_size");
  expect_rejected(config_for({shards[0], shards[1]}, 2, 1), "number of shards");
  expect_rejected(config_for({shards[1], shards[0], shards[2]}, 2, 1), "shard sizes");
  auto two_ranks = config_for(shards, 2, 1);
  two_ranks.world_size = 2;
  expect_rejected(two_ranks, "world_size");
  auto longer = config_for(shards, 2, 1);
  longer.seq_len = kT - 1;
  expect_rejected(longer, "seq_len");
  auto in_order = config_for(shards, 2, 1);
  in_order.shuffle = false;
  expect_rejected(in_order, "shuffle");

  expect_error(loader.restore_position(std::vector<uint8_t>(5, 0)), {"5 bytes"});
  auto garbage = position;
  garbage[0] ^= 0xFF;
  expect_error(loader.restore_position(garbage), {"not a saved loader position"});
  auto past_end = position;
  const uint64_t batch = 1000;
  std::memcpy(past_end.data() + past_end.size() - 8, &batch, 8);
  expect_error(loader.restore_position(past_end), {"batch 1000", "past"});
}

TEST(DataLoader, OpenRejectsBadConfigurations) {
  ScratchDir dir;
  const auto shards = write_numbered_shards(dir, sizes_for({3, 2}), kVocab);
  auto expect_open_error = [](const DataLoaderConfig& config,
                              std::initializer_list<const char*> parts) {
    DataLoader loader;
    expect_error(DataLoader::open(config, &loader), parts);
  };
  auto config = config_for(shards, 2);
  expect_open_error(config_for({}, 2), {"shards is empty"});
  expect_open_error(config_for(shards, 0), {"batch_size = 0"});
  config.seq_len = 0;
  expect_open_error(config, {"seq_len = 0"});
  config = config_for(shards, 2);
  config.vocab_size = 0;
  expect_open_error(config, {"vocab_size = 0"});
  config = config_for(shards, 2);
  config.world_size = 0;
  expect_open_error(config, {"world_size = 0"});
  config = config_for(shards, 2);
  config.world_size = 2;
  config.rank = 2;
  expect_open_error(config, {"rank = 2", "world_size = 2"});
  config = config_for(shards, 3);
  config.world_size = 2;
  expect_open_error(config, {"5 windows", "seq_len + 1 = 9", "batch_size · world_size = 6"});
  expect_open_error(config_for({shards[0], dir.file("missing.bin")}, 2),
                    {"missing.bin", "cannot open"});
  test::write_bytes(dir.file("junk.bin"), std::vector<uint8_t>(2048, 1));
  expect_open_error(config_for({dir.file("junk.bin")}, 2), {"junk.bin", "magic"});
}

TEST(DataLoader, TokenPastTheVocabularyFailsTheBatchWithoutWriting) {
  ScratchDir dir;
  // Shard 1's tokens are 1000 + i: fine for vocab 65536, not for 1005.
  auto config = config_for(write_numbered_shards(dir, sizes_for({2, 2}), kVocab), 1);
  config.vocab_size = 1005;
  config.shuffle = false;
  DataLoader loader = open_or_fail(config);  // headers are fine; ids are checked on loading
  next(loader);
  next(loader);
  std::vector<int32_t> inputs(size_t(kT), -7), targets(size_t(kT), -7);
  expect_error(loader.next_batch(inputs, targets), {"numbered_000001.bin", "vocab_size = 1005"});
  EXPECT_EQ(inputs, std::vector<int32_t>(size_t(kT), -7));
  EXPECT_EQ(targets, std::vector<int32_t>(size_t(kT), -7));
  EXPECT_EQ(loader.batch_in_epoch(), 2) << "the position stays";
}

TEST(DataLoader, NextBatchChecksTheBufferSizes) {
  ScratchDir dir;
  DataLoader loader =
      open_or_fail(config_for(write_numbered_shards(dir, sizes_for({4}), kVocab), 2));
  std::vector<int32_t> small(5), right(size_t(2 * kT));
  expect_error(loader.next_batch(small, right), {"16 elements", "got 5 and 16"});
  expect_error(loader.next_batch(right, small), {"got 16 and 5"});
}

TEST(DataLoader, Uint32Shards) {
  ScratchDir dir;
  const int64_t vocab = 128256;
  auto config = config_for(write_numbered_shards(dir, sizes_for({3, 3}), vocab, 1000, 120000), 2);
  config.vocab_size = vocab;
  config.shuffle = false;
  DataLoader loader = open_or_fail(config);
  const Batch batch = next(loader);
  EXPECT_EQ(batch.inputs[0], 120000);
  EXPECT_EQ(batch.targets[size_t(kT - 1)], 120000 + kT);
}

TEST(ExpandShardPattern, SortedMatchesOrAnError) {
  ScratchDir dir;
  for (const char* name :
       {"d_train_000002.bin", "d_train_000000.bin", "d_val_000000.bin", "d_train_000001.bin"}) {
    test::write_bytes(dir.file(name), {});
  }
  std::vector<std::string> paths;
  ASSERT_TRUE(expand_shard_pattern(dir.file("d_train_*.bin"), &paths).ok());
  EXPECT_EQ(paths, (std::vector<std::string>{dir.file("d_train_000000.bin"),
                                             dir.file("d_train_000001.bin"),
                                             dir.file("d_train_000002.bin")}));
  expect_error(expand_shard_pattern(dir.file("e_*.bin"), &paths), {"e_*.bin", "no file matches"});
}

}  // namespace
}  // namespace flare::train
