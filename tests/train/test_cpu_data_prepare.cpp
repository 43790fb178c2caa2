// scripts/prepare_data.py end to end: its tiny mode (built-in text, a BPE trained by the script)
// runs here, and what it wrote must load in C++: the tokenizer file parses, the C++ encoder gives
// the same tokens as the script's on its sample text, and the train/val shards feed the loader.
//
// With FLARE_DATA_DIR set to the output of a full run (python3 scripts/prepare_data.py --out DIR,
// GPT-2's tokenizer on the Python documentation), the same checks run on it; the agreement there
// is between the C++ encoder and the script's (pure Python or tiktoken).
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "test_cpu_data_util.h"
#include "train/data/loader.h"
#include "train/data/shard.h"
#include "train/data/tokenizer.h"

namespace flare::train {
namespace {

namespace fs = std::filesystem;

fs::path script_path() {
  // This file is tests/train/<name>.cpp in the source tree.
  return fs::path(__FILE__).parent_path().parent_path().parent_path() / "scripts" /
         "prepare_data.py";
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// The first position where two token lists differ, with the text around it, for the message.
std::string describe_difference(const Tokenizer& tokenizer, const std::vector<int32_t>& cpp,
                                const std::vector<int32_t>& python) {
  size_t i = 0;
  while (i < cpp.size() && i < python.size() && cpp[i] == python[i]) ++i;
  auto around = [&](const std::vector<int32_t>& tokens) {
    const size_t from = i >= 3 ? i - 3 : 0;
    const size_t to = std::min(tokens.size(), i + 4);
    std::string text;
    (void)tokenizer.decode(std::vector<int32_t>(tokens.begin() + std::ptrdiff_t(from),
                                                tokens.begin() + std::ptrdiff_t(to)),
                           &text);
    std::ostringstream out;
    for (size_t k = from; k < to; ++k) out << tokens[k] << ' ';
    return out.str() + "'" + text + "'";
  };
  return "first difference at token " + std::to_string(i) + " of " + std::to_string(python.size()) +
         ": C++ " + around(cpp) + " vs Python " + around(python);
}

// Checks one output directory of prepare_data.py whose shards are named <name>_{train,val}_*.bin.
void check_prepared(const fs::path& dir, const std::string& name) {
  Tokenizer tokenizer;
  Status status = Tokenizer::load((dir / "tokenizer.tiktoken").string(), &tokenizer);
  ASSERT_TRUE(status.ok()) << status.to_string();

  // The encoders agree on the sample, and decoding gives the text back.
  const std::string sample = read_text(dir / "sample.txt");
  ASSERT_FALSE(sample.empty());
  ShardTokens expected;
  status = read_shard((dir / "sample_tokens.bin").string(), tokenizer.vocab_size(), &expected);
  ASSERT_TRUE(status.ok()) << status.to_string();
  std::vector<int32_t> python(size_t(expected.size()));
  for (int64_t i = 0; i < expected.size(); ++i) python[size_t(i)] = expected.at(i);
  const std::vector<int32_t> cpp = tokenizer.encode(sample);
  EXPECT_TRUE(cpp == python) << describe_difference(tokenizer, cpp, python);
  std::string decoded;
  ASSERT_TRUE(tokenizer.decode(python, &decoded).ok());
  EXPECT_EQ(decoded, sample);

  // Both splits load; every document starts with end-of-text, so the first shard does too.
  for (const char* split : {"train", "val"}) {
    DataLoaderConfig config;
    status = expand_shard_pattern((dir / (name + "_" + split + "_*.bin")).string(), &config.shards);
    ASSERT_TRUE(status.ok()) << status.to_string();
    ShardTokens first;
    ASSERT_TRUE(read_shard(config.shards[0], tokenizer.vocab_size(), &first).ok());
    EXPECT_EQ(first.at(0), tokenizer.eot_token()) << split;

    config.batch_size = 2;
    config.seq_len = 16;
    config.vocab_size = tokenizer.vocab_size();
    config.shuffle = std::string(split) == "train";
    DataLoader loader;
    status = DataLoader::open(config, &loader);
    ASSERT_TRUE(status.ok()) << status.to_string();
    std::vector<int32_t> inputs(32), targets(32);
    for (int64_t step = 0; step < std::min<int64_t>(loader.batches_per_epoch(), 200); ++step) {
      status = loader.next_batch(inputs, targets);
      ASSERT_TRUE(status.ok()) << status.to_string();
    }
  }
}

TEST(PrepareData, TinyModeLoadsInCpp) {
  if (std::system("python3 --version > /dev/null 2>&1") != 0) GTEST_SKIP() << "python3 not found";
  if (!fs::exists(script_path())) GTEST_SKIP() << script_path() << " is not in this tree";
  test::ScratchDir dir;
  const std::string command = "python3 " + script_path().string() + " --tiny --out " +
                              dir.path().string() + " > " + dir.file("log.txt") + " 2>&1";
  ASSERT_EQ(std::system(command.c_str()), 0) << command << "\n" << read_text(dir.file("log.txt"));
  check_prepared(dir.path(), "tiny");

  // The shards the script wrote are byte for byte what the C++ writer makes of their tokens.
  std::vector<std::string> shards;
  ASSERT_TRUE(expand_shard_pattern(dir.file("tiny_train_*.bin"), &shards).ok());
  ShardTokens tokens;
  ASSERT_TRUE(read_shard(shards[0], 65536, &tokens).ok());
  std::vector<int32_t> ids(size_t(tokens.size()));
  for (int64_t i = 0; i < tokens.size(); ++i) ids[size_t(i)] = tokens.at(i);
  ASSERT_TRUE(write_shard(dir.file("rewritten.bin"), ids, 65536).ok());
  EXPECT_EQ(test::read_bytes(dir.file("rewritten.bin")), test::read_bytes(shards[0]));
}

TEST(PrepareData, FullDatasetFromEnvironment) {
  const char* dir = std::getenv("FLARE_DATA_DIR");
  if (dir == nullptr) GTEST_SKIP() << "set FLARE_DATA_DIR to a prepare_data.py output to check it";
  check_prepared(dir, "pydoc");
}

}  // namespace
}  // namespace flare::train
