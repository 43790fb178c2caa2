// test_cpu_data_util.h — what the data tests share: a scratch directory per test and shards whose
// token values say where they came from.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "train/data/shard.h"

namespace flare::train::test {

// A fresh directory under the system's temporary directory, removed with everything in it when
// the test ends.
class ScratchDir {
 public:
  ScratchDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::random_device entropy;
    path_ = std::filesystem::temp_directory_path() /
            (std::string("flare_") + info->test_suite_name() + "_" + info->name() + "_" +
             std::to_string(entropy()));
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

inline std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline void write_bytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
}

// Writes shard s with tokens base + s·stride + i, so every token of every shard is distinct and a
// window is known by its first token. Returns the paths in order.
inline std::vector<std::string> write_numbered_shards(const ScratchDir& dir,
                                                      const std::vector<int64_t>& sizes,
                                                      int64_t vocab_size, int32_t stride = 1000,
                                                      int32_t base = 0) {
  std::vector<std::string> paths;
  for (size_t s = 0; s < sizes.size(); ++s) {
    std::vector<int32_t> tokens(size_t(sizes[s]));
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = base + int32_t(s) * stride + int32_t(i);
    char name[64];
    std::snprintf(name, sizeof(name), "numbered_%06zu.bin", s);
    paths.push_back(dir.file(name));
    Status status = write_shard(paths.back(), tokens, vocab_size);
    EXPECT_TRUE(status.ok()) << status.to_string();
  }
  return paths;
}

}  // namespace flare::train::test
