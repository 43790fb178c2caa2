// Token shards: the exact llm.c layout for uint16 and the uint32 extension, atomic writes, and a
// clear error for every way a shard can be wrong.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <random>

#include "test_cpu_data_util.h"
#include "train/data/shard.h"

namespace flare::train {
namespace {

using test::read_bytes;
using test::ScratchDir;
using test::write_bytes;

std::vector<int32_t> random_tokens(size_t n, int64_t vocab_size, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> tokens(n);
  for (auto& t : tokens) t = int32_t(rng() % uint64_t(vocab_size));
  tokens.back() = int32_t(vocab_size - 1);  // the largest id must survive the round trip
  return tokens;
}

int32_t header_int(const std::vector<uint8_t>& bytes, int index) {
  int32_t value = 0;
  std::memcpy(&value, bytes.data() + 4 * index, 4);
  return value;
}

void set_header_int(std::vector<uint8_t>* bytes, int index, int32_t value) {
  std::memcpy(bytes->data() + 4 * index, &value, 4);
}

void expect_error(const Status& status, std::initializer_list<const char*> parts) {
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  for (const char* part : parts) {
    EXPECT_NE(status.message().find(part), std::string::npos)
        << "message '" << status.message() << "' lacks '" << part << "'";
  }
}

TEST(Shard, Uint16RoundTripHasLlmcLayout) {
  ScratchDir dir;
  const std::string path = dir.file("a.bin");
  const auto tokens = random_tokens(1001, 50257, 1);
  ASSERT_TRUE(write_shard(path, tokens, 50257).ok());

  const auto bytes = read_bytes(path);
  ASSERT_EQ(bytes.size(), 1024u + 2u * tokens.size());
  EXPECT_EQ(header_int(bytes, 0), 20240520);
  EXPECT_EQ(header_int(bytes, 1), 1);
  EXPECT_EQ(header_int(bytes, 2), 1001);
  for (int i = 3; i < 256; ++i) EXPECT_EQ(header_int(bytes, i), 0);
  uint16_t first = 0;
  std::memcpy(&first, bytes.data() + 1024, 2);
  EXPECT_EQ(first, tokens[0]);

  ShardTokens loaded;
  Status status = read_shard(path, 50257, &loaded);
  ASSERT_TRUE(status.ok()) << status.to_string();
  ASSERT_EQ(loaded.size(), 1001);
  for (int64_t i = 0; i < loaded.size(); ++i) ASSERT_EQ(loaded.at(i), tokens[size_t(i)]) << i;
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
}

TEST(Shard, Uint32ForVocabulariesPast65536) {
  ScratchDir dir;
  const std::string path = dir.file("llama3.bin");
  const int64_t vocab = 128256;
  const auto tokens = random_tokens(777, vocab, 2);
  EXPECT_EQ(shard_version_for_vocab(65536), kShardVersionU16);
  EXPECT_EQ(shard_version_for_vocab(65537), kShardVersionU32);
  ASSERT_TRUE(write_shard(path, tokens, vocab).ok());

  ShardHeader header;
  ASSERT_TRUE(read_shard_header(path, &header).ok());
  EXPECT_EQ(header.version, 2);
  EXPECT_EQ(header.num_tokens, 777);
  EXPECT_EQ(header.token_bytes, 4);
  EXPECT_EQ(std::filesystem::file_size(path), 1024u + 4u * 777u);

  ShardTokens loaded;
  ASSERT_TRUE(read_shard(path, vocab, &loaded).ok());
  for (int64_t i = 0; i < loaded.size(); ++i) ASSERT_EQ(loaded.at(i), tokens[size_t(i)]) << i;
}

TEST(Shard, EmptyShardAndOverwrite) {
  ScratchDir dir;
  const std::string path = dir.file("e.bin");
  ASSERT_TRUE(write_shard(path, std::vector<int32_t>{5, 6, 7}, 10).ok());
  ASSERT_TRUE(write_shard(path, std::vector<int32_t>{}, 10).ok());  // replaces the old one
  ShardTokens loaded;
  ASSERT_TRUE(read_shard(path, 10, &loaded).ok());
  EXPECT_EQ(loaded.size(), 0);
}

TEST(Shard, WriteRejectsIdsOutsideTheVocabulary) {
  ScratchDir dir;
  const std::string path = dir.file("bad.bin");
  expect_error(write_shard(path, std::vector<int32_t>{1, 2, 3, 10}, 10),
               {"bad.bin", "token 3", "is 10", "vocab_size = 10"});
  expect_error(write_shard(path, std::vector<int32_t>{-1}, 10), {"token 0", "is -1"});
  expect_error(write_shard(path, std::vector<int32_t>{1}, 0), {"vocab_size = 0"});
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  expect_error(write_shard(dir.file("no/such/dir/x.bin"), std::vector<int32_t>{1}, 10),
               {"cannot create", "x.bin.tmp"});
}

// One valid shard, then each rule broken in its own copy.
class ShardErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(write_shard(good_, std::vector<int32_t>{1, 2, 3, 4, 5}, 100).ok());
    bytes_ = read_bytes(good_);
  }
  Status read_modified(const std::vector<uint8_t>& bytes) {
    write_bytes(bad_, bytes);
    ShardTokens tokens;
    return read_shard(bad_, 100, &tokens);
  }
  ScratchDir dir_;
  std::string good_ = dir_.file("good.bin");
  std::string bad_ = dir_.file("bad.bin");
  std::vector<uint8_t> bytes_;
};

TEST_F(ShardErrors, MissingFile) {
  ShardTokens tokens;
  expect_error(read_shard(dir_.file("absent.bin"), 100, &tokens), {"absent.bin", "cannot open"});
}

TEST_F(ShardErrors, ShorterThanHeader) {
  expect_error(read_modified(std::vector<uint8_t>(bytes_.begin(), bytes_.begin() + 100)),
               {"bad.bin", "100 bytes", "header"});
}

TEST_F(ShardErrors, WrongMagic) {
  auto bytes = bytes_;
  set_header_int(&bytes, 0, 20240326);
  expect_error(read_modified(bytes), {"bad.bin", "magic", "20240326", "20240520"});
}

TEST_F(ShardErrors, UnknownVersion) {
  auto bytes = bytes_;
  set_header_int(&bytes, 1, 3);
  expect_error(read_modified(bytes), {"bad.bin", "version", "is 3"});
}

TEST_F(ShardErrors, NegativeCount) {
  auto bytes = bytes_;
  set_header_int(&bytes, 2, -4);
  expect_error(read_modified(bytes), {"bad.bin", "negative"});
}

TEST_F(ShardErrors, Truncated) {
  auto bytes = bytes_;
  bytes.pop_back();
  expect_error(read_modified(bytes), {"bad.bin", "5 tokens", "1034 bytes", "1033", "truncated"});
}

TEST_F(ShardErrors, ExtraBytes) {
  auto bytes = bytes_;
  bytes.push_back(0);
  bytes.push_back(0);
  expect_error(read_modified(bytes), {"bad.bin", "extra bytes"});
}

TEST_F(ShardErrors, CountDisagreesWithSize) {
  auto bytes = bytes_;
  set_header_int(&bytes, 2, 6);
  expect_error(read_modified(bytes), {"bad.bin", "6 tokens", "truncated"});
}

TEST_F(ShardErrors, TokenAtOrPastVocabularyWhenLoaded) {
  // The header is fine (read_shard_header passes); the ids are checked when the tokens load.
  ShardHeader header;
  EXPECT_TRUE(read_shard_header(good_, &header).ok());
  ShardTokens tokens;
  expect_error(read_shard(good_, 5, &tokens), {"good.bin", "token 4", "is 5", "vocab_size = 5"});
  EXPECT_TRUE(read_shard(good_, 6, &tokens).ok());
}

}  // namespace
}  // namespace flare::train
