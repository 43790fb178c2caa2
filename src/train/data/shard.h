// shard.h — token shards on disk: llm.c's .bin format, extended to 32-bit tokens.
//
// A shard is a 256 × int32 header (little-endian) followed by the tokens:
//   header[0] = 20240520   magic
//   header[1] = 1 | 2      version: 1 = uint16 tokens (llm.c's own; vocabularies up to 65536,
//                          GPT-2's 50257), 2 = uint32 tokens (flare's extension, for LLaMA-3's
//                          128256); llm.c itself reads only version 1
//   header[2] = count      number of tokens that follow
//   header[3..255] = 0     reserved
// so a version-1 shard is exactly 1024 + 2·count bytes and a version-2 shard 1024 + 4·count.
//
// The reader checks the header against the file's size (a truncated or padded file is an error
// that names the file and the rule) and, when the tokens are loaded, that every id is below the
// vocabulary size: one linear pass over the shard's bytes as they are read, so a corrupt shard
// fails when it is opened rather than as a garbage embedding lookup in the middle of training.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "flare/status.h"

namespace flare::train {

constexpr int32_t kShardMagic = 20240520;
constexpr int32_t kShardVersionU16 = 1;
constexpr int32_t kShardVersionU32 = 2;
constexpr int64_t kShardHeaderInts = 256;
constexpr int64_t kShardHeaderBytes = kShardHeaderInts * 4;

// What a shard's header says, checked against its file size.
struct ShardHeader {
  int32_t version = kShardVersionU16;
  int64_t num_tokens = 0;
  int64_t token_bytes = 2;  // 2 for version 1, 4 for version 2
};

// A shard's tokens in memory, in the width they were stored (one of the two vectors is filled).
struct ShardTokens {
  ShardHeader header;
  std::vector<uint16_t> u16;
  std::vector<uint32_t> u32;

  int64_t size() const { return header.num_tokens; }
  int32_t at(int64_t i) const {
    return header.version == kShardVersionU16 ? int32_t(u16[size_t(i)]) : int32_t(u32[size_t(i)]);
  }
};

// The version a vocabulary needs: 1 (uint16) when every id fits in 16 bits, else 2 (uint32).
int32_t shard_version_for_vocab(int64_t vocab_size);

// Writes `tokens` as a shard at `path`, atomically: the bytes go to `path`.tmp, which is renamed
// over `path` only once complete, so a reader never sees a half-written shard. Every token must
// lie in [0, vocab_size); the version follows shard_version_for_vocab(vocab_size).
Status write_shard(const std::string& path, std::span<const int32_t> tokens, int64_t vocab_size);

// Reads and validates the header only (magic, version, count against the file size).
Status read_shard_header(const std::string& path, ShardHeader* header);

// Reads a whole shard and checks every token id against vocab_size.
Status read_shard(const std::string& path, int64_t vocab_size, ShardTokens* tokens);

}  // namespace flare::train
