// loader.cpp — the shuffled, rank-split, resumable window loader (see loader.h for the scheme).
#include "train/data/loader.h"

#include <glob.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>

#include "core/message.h"

namespace flare::train {

namespace {

// splitmix64: a small counter-based generator whose output is fixed by its definition, unlike
// std::shuffle and the std distributions, so an order drawn here is the same on every platform.
struct SplitMix64 {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, bound) by rejection, so no value is favoured.
  uint64_t below(uint64_t bound) {
    const uint64_t limit =
        std::numeric_limits<uint64_t>::max() - std::numeric_limits<uint64_t>::max() % bound;
    uint64_t x = next();
    while (x >= limit) x = next();
    return x % bound;
  }
};

// The stream for one (seed, epoch, purpose): purpose 0 orders the shards, purpose s + 1 orders
// the windows of shard s.
SplitMix64 stream_for(uint64_t seed, int64_t epoch, uint64_t purpose) {
  SplitMix64 mix{seed};
  uint64_t state = mix.next();
  state ^= SplitMix64{uint64_t(epoch) ^ 0x5851f42d4c957f2dull}.next();
  state ^= SplitMix64{purpose * 0x2545f4914f6cdd1dull + 1}.next();
  return SplitMix64{state};
}

// Fisher–Yates over `values` with the given stream.
template <typename T>
void shuffle_with(SplitMix64 stream, std::vector<T>* values) {
  for (size_t i = values->size(); i > 1; --i) {
    const size_t j = size_t(stream.below(uint64_t(i)));
    std::swap((*values)[i - 1], (*values)[j]);
  }
}

int64_t windows_in(int64_t num_tokens, int64_t seq_len) {
  return num_tokens > seq_len ? (num_tokens - 1) / seq_len : 0;
}

// The saved position: a fixed list of little-endian uint64 fields.
constexpr uint64_t kPositionMagic = 0x464c444c4f414431ull;  // "FLDLOAD1"
enum PositionField {
  kMagic,
  kSeed,
  kShuffle,
  kWorldSize,
  kBatchSize,
  kSeqLen,
  kNumShards,
  kShardsFingerprint,
  kEpoch,
  kBatch,
  kPositionFields
};
const char* const kPositionFieldNames[kPositionFields] = {
    "format",           "seed",        "shuffle", "world_size", "batch_size", "seq_len",
    "number of shards", "shard sizes", "epoch",   "batch"};

}  // namespace

Status expand_shard_pattern(const std::string& pattern, std::vector<std::string>* paths) {
  glob_t matches{};
  const int rc = glob(pattern.c_str(), 0, nullptr, &matches);
  std::vector<std::string> found;
  if (rc == 0) {
    for (size_t i = 0; i < matches.gl_pathc; ++i) found.emplace_back(matches.gl_pathv[i]);
  }
  globfree(&matches);
  if (rc == GLOB_NOMATCH || found.empty()) {
    return invalid("shard pattern '", pattern, "': no file matches it");
  }
  if (rc != 0) return invalid("shard pattern '", pattern, "': cannot be expanded (read error)");
  std::sort(found.begin(), found.end());
  *paths = std::move(found);
  return Status::ok_status();
}

Status DataLoader::open(const DataLoaderConfig& config, DataLoader* loader) {
  if (config.shards.empty()) return invalid("DataLoader: shards is empty (no files given)");
  if (config.batch_size <= 0)
    return invalid("DataLoader: batch_size = ", config.batch_size, " must be positive");
  if (config.seq_len <= 0)
    return invalid("DataLoader: seq_len = ", config.seq_len, " must be positive");
  if (config.vocab_size <= 0)
    return invalid("DataLoader: vocab_size = ", config.vocab_size, " must be positive");
  if (config.world_size <= 0)
    return invalid("DataLoader: world_size = ", config.world_size, " must be positive");
  if (config.rank < 0 || config.rank >= config.world_size) {
    return invalid("DataLoader: rank = ", config.rank,
                   " must lie in [0, world_size = ", config.world_size, ")");
  }

  DataLoader opened;
  opened.config_ = config;
  for (const std::string& path : config.shards) {
    ShardHeader header;
    FLARE_RETURN_IF_ERROR(read_shard_header(path, &header));
    opened.shard_windows_.push_back(windows_in(header.num_tokens, config.seq_len));
    opened.total_windows_ += opened.shard_windows_.back();
  }
  const int64_t per_batch = config.batch_size * config.world_size;
  opened.batches_per_epoch_ = opened.total_windows_ / per_batch;
  if (opened.batches_per_epoch_ == 0) {
    return invalid("DataLoader: the ", config.shards.size(), " shard(s) hold ",
                   opened.total_windows_, " windows of seq_len + 1 = ", config.seq_len + 1,
                   " tokens, fewer than one batch of batch_size · world_size = ", per_batch);
  }
  opened.start_epoch(0);
  *loader = std::move(opened);
  return Status::ok_status();
}

void DataLoader::start_epoch(int64_t epoch) {
  epoch_ = epoch;
  batch_ = 0;
  const int num_shards = int(config_.shards.size());
  shard_order_.resize(size_t(num_shards));
  std::iota(shard_order_.begin(), shard_order_.end(), 0);
  if (config_.shuffle) shuffle_with(stream_for(config_.seed, epoch, 0), &shard_order_);
  order_start_.assign(size_t(num_shards) + 1, 0);
  for (int k = 0; k < num_shards; ++k) {
    order_start_[size_t(k) + 1] =
        order_start_[size_t(k)] + shard_windows_[size_t(shard_order_[size_t(k)])];
  }
}

Status DataLoader::load_shard(int shard) {
  if (shard != loaded_shard_) {
    ShardTokens tokens;
    FLARE_RETURN_IF_ERROR(read_shard(config_.shards[size_t(shard)], config_.vocab_size, &tokens));
    if (windows_in(tokens.size(), config_.seq_len) != shard_windows_[size_t(shard)]) {
      return invalid("shard ", config_.shards[size_t(shard)],
                     ": changed on disk since the loader was opened");
    }
    tokens_ = std::move(tokens);
    loaded_shard_ = shard;
    loaded_epoch_ = -1;
  }
  if (loaded_epoch_ != epoch_) {
    window_order_.resize(size_t(shard_windows_[size_t(shard)]));
    std::iota(window_order_.begin(), window_order_.end(), int64_t(0));
    if (config_.shuffle) {
      shuffle_with(stream_for(config_.seed, epoch_, uint64_t(shard) + 1), &window_order_);
    }
    loaded_epoch_ = epoch_;
  }
  return Status::ok_status();
}

Status DataLoader::next_batch(std::span<int32_t> inputs, std::span<int32_t> targets) {
  const int64_t B = config_.batch_size;
  const int64_t T = config_.seq_len;
  if (int64_t(inputs.size()) != B * T || int64_t(targets.size()) != B * T) {
    return invalid("DataLoader::next_batch: inputs and targets need batch_size · seq_len = ", B * T,
                   " elements each; got ", inputs.size(), " and ", targets.size());
  }
  // Built aside and copied at the end, so a failed shard load leaves the outputs untouched.
  std::vector<int32_t> batch_inputs(size_t(B * T));
  std::vector<int32_t> batch_targets(size_t(B * T));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t position = (batch_ * B + b) * config_.world_size + config_.rank;
    const auto slot = std::upper_bound(order_start_.begin(), order_start_.end(), position) -
                      order_start_.begin() - 1;
    const int shard = shard_order_[size_t(slot)];
    FLARE_RETURN_IF_ERROR(load_shard(shard));
    const int64_t window = window_order_[size_t(position - order_start_[size_t(slot)])];
    const int64_t first = window * T;
    for (int64_t t = 0; t < T; ++t) {
      batch_inputs[size_t(b * T + t)] = tokens_.at(first + t);
      batch_targets[size_t(b * T + t)] = tokens_.at(first + t + 1);
    }
  }
  std::copy(batch_inputs.begin(), batch_inputs.end(), inputs.begin());
  std::copy(batch_targets.begin(), batch_targets.end(), targets.begin());
  if (++batch_ == batches_per_epoch_) start_epoch(epoch_ + 1);
  return Status::ok_status();
}

void DataLoader::reset() { start_epoch(0); }

uint64_t DataLoader::fingerprint() const {
  // FNV-1a over the window count of each shard: cheap, and it changes when shards are added,
  // removed, reordered or resized.
  uint64_t hash = 0xcbf29ce484222325ull;
  for (int64_t windows : shard_windows_) {
    for (int byte = 0; byte < 8; ++byte) {
      hash ^= (uint64_t(windows) >> (8 * byte)) & 0xff;
      hash *= 0x100000001b3ull;
    }
  }
  return hash;
}

std::vector<uint8_t> DataLoader::save_position() const {
  uint64_t fields[kPositionFields];
  fields[kMagic] = kPositionMagic;
  fields[kSeed] = config_.seed;
  fields[kShuffle] = config_.shuffle ? 1 : 0;
  fields[kWorldSize] = uint64_t(config_.world_size);
  fields[kBatchSize] = uint64_t(config_.batch_size);
  fields[kSeqLen] = uint64_t(config_.seq_len);
  fields[kNumShards] = uint64_t(config_.shards.size());
  fields[kShardsFingerprint] = fingerprint();
  fields[kEpoch] = uint64_t(epoch_);
  fields[kBatch] = uint64_t(batch_);
  std::vector<uint8_t> bytes(sizeof(fields));
  std::memcpy(bytes.data(), fields, sizeof(fields));  // little-endian host (see shard.cpp)
  return bytes;
}

Status DataLoader::restore_position(std::span<const uint8_t> bytes) {
  uint64_t saved[kPositionFields];
  if (bytes.size() != sizeof(saved)) {
    return invalid("DataLoader::restore_position: ", bytes.size(), " bytes, expected ",
                   sizeof(saved), " (not a saved loader position)");
  }
  std::memcpy(saved, bytes.data(), sizeof(saved));
  const std::vector<uint8_t> mine_bytes = save_position();
  uint64_t mine[kPositionFields];
  std::memcpy(mine, mine_bytes.data(), sizeof(mine));
  if (saved[kMagic] != kPositionMagic) {
    return invalid("DataLoader::restore_position: the bytes are not a saved loader position");
  }
  for (int field = kSeed; field < kEpoch; ++field) {
    if (!config_.shuffle && field == kSeed) continue;  // the seed plays no part then
    // Another batch size or rank count is converted below (data parallel resume).
    if (field == kWorldSize || field == kBatchSize) continue;
    if (saved[field] != mine[field]) {
      return invalid("DataLoader::restore_position: saved with ", kPositionFieldNames[field], " ",
                     saved[field], " but this loader has ", mine[field]);
    }
  }
  if (saved[kEpoch] > uint64_t(std::numeric_limits<int64_t>::max())) {
    return invalid("DataLoader::restore_position: epoch ", saved[kEpoch], " is out of range");
  }
  if (saved[kWorldSize] == 0 || saved[kBatchSize] == 0) {
    return invalid("DataLoader::restore_position: saved with batch_size ", saved[kBatchSize],
                   " and world_size ", saved[kWorldSize], " (must be positive)");
  }
  // The position as a window of the epoch's sequence, which batch size and rank count do not
  // change: the saved loader had used batch · batch_size · world_size windows of it.
  const uint64_t saved_per_batch = saved[kBatchSize] * saved[kWorldSize];
  const uint64_t saved_batches = uint64_t(total_windows_) / saved_per_batch;
  if (saved[kBatch] >= saved_batches) {
    return invalid("DataLoader::restore_position: batch ", saved[kBatch], " is past the epoch's ",
                   saved_batches, " batches");
  }
  const uint64_t window = saved[kBatch] * saved_per_batch;
  const uint64_t per_batch = uint64_t(config_.batch_size) * uint64_t(config_.world_size);
  if (window % per_batch != 0) {
    return invalid("DataLoader::restore_position: saved after ", window, " windows of its epoch ",
                   "(batch_size ", saved[kBatchSize], " x world_size ", saved[kWorldSize],
                   "), not a whole number of this loader's batches of batch_size ",
                   config_.batch_size, " x world_size ", config_.world_size);
  }
  start_epoch(int64_t(saved[kEpoch]));
  batch_ = int64_t(window / per_batch);
  // The saved configuration's epoch may hold windows this one skips as its last partial batch.
  if (batch_ >= batches_per_epoch_) start_epoch(epoch_ + 1);
  return Status::ok_status();
}

}  // namespace flare::train
