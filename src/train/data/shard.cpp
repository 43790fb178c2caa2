// shard.cpp — writing and reading llm.c-format token shards (see shard.h for the format).
#include "train/data/shard.h"

#include <bit>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <system_error>
#include <utility>

#include "core/message.h"

namespace flare::train {

// The format is little-endian; reading it into native integers is only right on such a host.
static_assert(std::endian::native == std::endian::little, "shards assume a little-endian host");

namespace {

int64_t token_bytes_of(int32_t version) { return version == kShardVersionU16 ? 2 : 4; }

// Checks the ids one by one; the message names the first bad position.
template <typename T>
Status check_token_ids(const std::string& path, const std::vector<T>& tokens, int64_t vocab_size) {
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (int64_t(tokens[i]) >= vocab_size) {
      return invalid("shard ", path, ": token ", i, " is ", int64_t(tokens[i]),
                     ", not below vocab_size = ", vocab_size);
    }
  }
  return Status::ok_status();
}

template <typename T>
Status read_token_array(std::ifstream& in, const std::string& path, int64_t count,
                        std::vector<T>* out) {
  out->resize(size_t(count));
  in.read(reinterpret_cast<char*>(out->data()), std::streamsize(count * int64_t(sizeof(T))));
  if (!in) return invalid("shard ", path, ": could not read its ", count, " tokens");
  return Status::ok_status();
}

template <typename T>
void narrow_tokens(std::span<const int32_t> tokens, std::vector<T>* out) {
  out->resize(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) (*out)[i] = T(tokens[i]);
}

}  // namespace

int32_t shard_version_for_vocab(int64_t vocab_size) {
  return vocab_size <= int64_t(std::numeric_limits<uint16_t>::max()) + 1 ? kShardVersionU16
                                                                         : kShardVersionU32;
}

Status write_shard(const std::string& path, std::span<const int32_t> tokens, int64_t vocab_size) {
  if (vocab_size <= 0 || vocab_size > int64_t(std::numeric_limits<int32_t>::max())) {
    return invalid("write_shard: vocab_size = ", vocab_size, " must lie in [1, 2^31)");
  }
  if (int64_t(tokens.size()) > int64_t(std::numeric_limits<int32_t>::max())) {
    return invalid("write_shard ", path, ": ", tokens.size(),
                   " tokens do not fit the header's int32 count; split them into more shards");
  }
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= vocab_size) {
      return invalid("write_shard ", path, ": token ", i, " is ", tokens[i],
                     ", not in [0, vocab_size = ", vocab_size, ")");
    }
  }

  const int32_t version = shard_version_for_vocab(vocab_size);
  std::vector<int32_t> header(kShardHeaderInts, 0);
  header[0] = kShardMagic;
  header[1] = version;
  header[2] = int32_t(tokens.size());
  std::vector<uint16_t> u16;
  std::vector<uint32_t> u32;
  const char* payload = nullptr;
  if (version == kShardVersionU16) {
    narrow_tokens(tokens, &u16);
    payload = reinterpret_cast<const char*>(u16.data());
  } else {
    narrow_tokens(tokens, &u32);
    payload = reinterpret_cast<const char*>(u32.data());
  }
  const auto payload_bytes = std::streamsize(int64_t(tokens.size()) * token_bytes_of(version));

  const std::string temp = path + ".tmp";
  {
    std::ofstream out(temp, std::ios::binary | std::ios::trunc);
    if (!out) return invalid("write_shard: cannot create ", temp);
    out.write(reinterpret_cast<const char*>(header.data()), std::streamsize(kShardHeaderBytes));
    out.write(payload, payload_bytes);
    out.close();
    if (!out) {
      std::remove(temp.c_str());
      return invalid("write_shard: writing ", temp, " failed (disk full?)");
    }
  }
  std::error_code error;
  std::filesystem::rename(temp, path, error);
  if (error) {
    std::remove(temp.c_str());
    return invalid("write_shard: cannot rename ", temp, " to ", path, ": ", error.message());
  }
  return Status::ok_status();
}

namespace {

// Opens the file, reads and checks the header; leaves `in` positioned at the first token.
Status open_shard(const std::string& path, std::ifstream* in, ShardHeader* header) {
  std::error_code error;
  const auto file_bytes = std::filesystem::file_size(path, error);
  if (error) return invalid("shard ", path, ": cannot open: ", error.message());
  if (int64_t(file_bytes) < kShardHeaderBytes) {
    return invalid("shard ", path, ": ", file_bytes, " bytes is shorter than the ",
                   kShardHeaderBytes, "-byte header");
  }
  in->open(path, std::ios::binary);
  if (!*in) return invalid("shard ", path, ": cannot open for reading");

  std::vector<int32_t> raw(kShardHeaderInts);
  in->read(reinterpret_cast<char*>(raw.data()), std::streamsize(kShardHeaderBytes));
  if (!*in) return invalid("shard ", path, ": cannot read the header");
  if (raw[0] != kShardMagic) {
    return invalid("shard ", path, ": header[0] (magic) is ", raw[0], ", expected ", kShardMagic,
                   " (not a token shard)");
  }
  if (raw[1] != kShardVersionU16 && raw[1] != kShardVersionU32) {
    return invalid("shard ", path, ": header[1] (version) is ", raw[1], ", expected ",
                   kShardVersionU16, " (uint16 tokens) or ", kShardVersionU32, " (uint32 tokens)");
  }
  if (raw[2] < 0) return invalid("shard ", path, ": header[2] (token count) is negative: ", raw[2]);

  header->version = raw[1];
  header->num_tokens = raw[2];
  header->token_bytes = token_bytes_of(raw[1]);
  const int64_t expected = kShardHeaderBytes + header->num_tokens * header->token_bytes;
  if (int64_t(file_bytes) != expected) {
    return invalid("shard ", path, ": header[2] says ", header->num_tokens, " tokens of ",
                   header->token_bytes, " bytes, so the file must be ", expected,
                   " bytes, but it is ", file_bytes,
                   int64_t(file_bytes) < expected ? " (truncated)" : " (extra bytes)");
  }
  return Status::ok_status();
}

}  // namespace

Status read_shard_header(const std::string& path, ShardHeader* header) {
  std::ifstream in;
  return open_shard(path, &in, header);
}

Status read_shard(const std::string& path, int64_t vocab_size, ShardTokens* tokens) {
  if (vocab_size <= 0) return invalid("read_shard: vocab_size = ", vocab_size, " must be positive");
  std::ifstream in;
  ShardHeader header;
  FLARE_RETURN_IF_ERROR(open_shard(path, &in, &header));
  ShardTokens loaded;
  loaded.header = header;
  if (header.version == kShardVersionU16) {
    FLARE_RETURN_IF_ERROR(read_token_array(in, path, header.num_tokens, &loaded.u16));
    FLARE_RETURN_IF_ERROR(check_token_ids(path, loaded.u16, vocab_size));
  } else {
    FLARE_RETURN_IF_ERROR(read_token_array(in, path, header.num_tokens, &loaded.u32));
    FLARE_RETURN_IF_ERROR(check_token_ids(path, loaded.u32, vocab_size));
  }
  *tokens = std::move(loaded);
  return Status::ok_status();
}

}  // namespace flare::train
