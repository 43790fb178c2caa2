// Checkpoints (src/train/core/checkpoint.h): bitwise round trip, every kind of damage detected
// with nothing written to the caller's buffers, atomic replacement; and the CRC-32 underneath.
#include "train/core/checkpoint.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "train/core/crc32.h"

namespace flare::train {
namespace {

namespace fs = std::filesystem;

TEST(Crc32, KnownValues) {
  EXPECT_EQ(crc32("123456789", 9), 0xCBF43926u);
  EXPECT_EQ(crc32("", 0), 0u);
  EXPECT_EQ(crc32("a", 1), 0xE8B7BE43u);
  // Fed in uneven pieces, the 8-byte path and the byte tail agree with one pass.
  std::vector<uint8_t> data(1000);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 37 + 11);
  Crc32 pieces;
  pieces.update(data.data(), 3);
  pieces.update(data.data() + 3, 500);
  pieces.update(data.data() + 503, 497);
  EXPECT_EQ(pieces.value(), crc32(data.data(), data.size()));
  // Bytewise definition, the bit-serial reference.
  uint32_t c = 0xFFFFFFFFu;
  for (uint8_t b : data) {
    c ^= b;
    for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ 0xEDB88320u : c >> 1;
  }
  EXPECT_EQ(~c, crc32(data.data(), data.size()));
}

struct State {
  CheckpointMeta meta;
  std::vector<float> master, m, v;
};

State make_state(const std::string& preset, uint64_t seed) {
  State s;
  EXPECT_TRUE(model_preset(preset, &s.meta.model).ok());
  s.meta.train.batch = 3;
  s.meta.train.seq = 48;
  s.meta.train.lr = 3e-4;
  s.meta.train.recompute = true;
  s.meta.train.seed = seed;
  s.meta.train.train_data = "/data/train_*.bin";
  s.meta.step = 1234;
  s.meta.rng_seed = seed ^ 0x9e3779b97f4a7c15ull;
  s.meta.rng_offset = 987654321;
  s.meta.loader_state = {1, 2, 3, 0, 255, 7};
  const int64_t n = parameter_layout(s.meta.model).total;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  for (auto* buf : {&s.master, &s.m, &s.v}) {
    buf->resize(n);
    for (float& x : *buf) x = normal(rng);
  }
  s.v[5] = std::numeric_limits<float>::quiet_NaN();  // kept bit for bit like any value
  return s;
}

class CheckpointTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(testing::TempDir()) /
           ("flare_ckpt_" + std::to_string(::getpid()) + "_" +
            testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    path_ = (dir_ / "run.ckpt").string();
  }
  void TearDown() override { fs::remove_all(dir_); }

  static std::vector<char> read_bytes(const std::string& p) {
    std::ifstream f(p, std::ios::binary);
    return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
  }
  static void write_bytes(const std::string& p, const std::vector<char>& bytes) {
    std::ofstream f(p, std::ios::binary | std::ios::trunc);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  Status save(const State& s) {
    return save_checkpoint(path_, s.meta, s.master.data(), s.m.data(), s.v.data(),
                           static_cast<int64_t>(s.master.size()));
  }
  // Loads into sentinel-filled buffers; on failure checks they were not touched.
  Status load_expecting_untouched_on_error(const ModelConfig& expected) {
    const int64_t n = parameter_layout(expected).total;
    std::vector<float> master(n, -7.0f), m(n, -7.0f), v(n, -7.0f);
    CheckpointMeta meta;
    meta.step = -99;
    Status s = load_checkpoint(path_, expected, &meta, master.data(), m.data(), v.data(), n);
    if (!s.ok()) {
      for (const auto* buf : {&master, &m, &v})
        for (float x : *buf) EXPECT_EQ(x, -7.0f);
      EXPECT_EQ(meta.step, -99);
    }
    return s;
  }
  void expect_error(const ModelConfig& expected, const std::string& words) {
    Status s = load_expecting_untouched_on_error(expected);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find(words), std::string::npos) << s.message();
  }

  fs::path dir_;
  std::string path_;
};

TEST_F(CheckpointTest, RoundTripIsBitwise) {
  for (const char* preset : {"gpt-tiny", "llama-tiny"}) {
    const State s = make_state(preset, 42);
    ASSERT_TRUE(save(s).ok());
    EXPECT_FALSE(fs::exists(path_ + ".tmp"));
    const int64_t n = static_cast<int64_t>(s.master.size());
    std::vector<float> master(n), m(n), v(n);
    CheckpointMeta meta;
    Status st = load_checkpoint(path_, s.meta.model, &meta, master.data(), m.data(), v.data(), n);
    ASSERT_TRUE(st.ok()) << st.to_string();
    EXPECT_EQ(std::memcmp(master.data(), s.master.data(), n * sizeof(float)), 0);
    EXPECT_EQ(std::memcmp(m.data(), s.m.data(), n * sizeof(float)), 0);
    EXPECT_EQ(std::memcmp(v.data(), s.v.data(), n * sizeof(float)), 0);
    EXPECT_TRUE(check_same_model(meta.model, s.meta.model).ok());
    EXPECT_EQ(meta.model.name, preset);
    EXPECT_EQ(meta.step, 1234);
    EXPECT_EQ(meta.rng_seed, s.meta.rng_seed);
    EXPECT_EQ(meta.rng_offset, 987654321u);
    EXPECT_EQ(meta.loader_state, s.meta.loader_state);
    EXPECT_EQ(meta.train.batch, 3);
    EXPECT_EQ(meta.train.seq, 48);
    EXPECT_EQ(meta.train.lr, 3e-4);
    EXPECT_EQ(meta.train.seed, 42u);
    EXPECT_TRUE(meta.train.recompute);
    EXPECT_EQ(meta.train.beta2, TrainConfig{}.beta2);
    EXPECT_TRUE(meta.train.train_data.empty());  // paths are not stored

    CheckpointMeta header_only;
    ASSERT_TRUE(read_checkpoint_meta(path_, &header_only).ok());
    EXPECT_EQ(header_only.step, 1234);
  }
}

TEST_F(CheckpointTest, WrongMagic) {
  const State s = make_state("gpt-tiny", 1);
  ASSERT_TRUE(save(s).ok());
  std::vector<char> bytes = read_bytes(path_);
  bytes[0] = 'X';
  write_bytes(path_, bytes);
  expect_error(s.meta.model, "not a flare checkpoint");
  write_bytes(path_, {});
  expect_error(s.meta.model, "not a flare checkpoint");
}

TEST_F(CheckpointTest, WrongVersion) {
  const State s = make_state("gpt-tiny", 2);
  ASSERT_TRUE(save(s).ok());
  std::vector<char> bytes = read_bytes(path_);
  bytes[8] = 2;  // version, a little-endian u32 after the magic
  write_bytes(path_, bytes);
  expect_error(s.meta.model, "checkpoint version 2; this build reads version 1");
}

TEST_F(CheckpointTest, Truncated) {
  const State s = make_state("gpt-tiny", 3);
  ASSERT_TRUE(save(s).ok());
  std::vector<char> bytes = read_bytes(path_);
  for (size_t keep : {bytes.size() - 1, bytes.size() / 2, size_t{20}}) {
    write_bytes(path_, std::vector<char>(bytes.begin(), bytes.begin() + static_cast<long>(keep)));
    expect_error(s.meta.model, "truncated");
  }
  std::vector<char> longer = bytes;
  longer.push_back(0);
  write_bytes(path_, longer);
  expect_error(s.meta.model, "longer than written");
}

TEST_F(CheckpointTest, ChecksumMismatch) {
  const State s = make_state("llama-tiny", 4);
  ASSERT_TRUE(save(s).ok());
  const std::vector<char> bytes = read_bytes(path_);
  // One flipped bit in the header, the buffers and the stored CRC itself.
  for (size_t at : {size_t{40}, bytes.size() / 2, bytes.size() - 2}) {
    std::vector<char> bad = bytes;
    bad[at] ^= 0x10;
    write_bytes(path_, bad);
    expect_error(s.meta.model, "checksum");
  }
}

TEST_F(CheckpointTest, ModelMismatchNamesTheField) {
  const State s = make_state("llama-tiny", 5);
  ASSERT_TRUE(save(s).ok());
  ModelConfig other = s.meta.model;
  other.n_layer = 3;
  expect_error(other, "n_layer: checkpoint has 2, expected 3");
  other = s.meta.model;
  other.norm_eps = 1e-6;  // same layout, another model
  expect_error(other, "norm_eps");
  other = s.meta.model;
  other.tied_embeddings = true;
  expect_error(other, "tied_embeddings");
  ModelConfig gpt;
  ASSERT_TRUE(model_preset("gpt-tiny", &gpt).ok());
  expect_error(gpt, "family: checkpoint has llama, expected gpt");
  other = s.meta.model;
  other.name = "renamed";  // the name is not part of the model
  EXPECT_TRUE(load_expecting_untouched_on_error(other).ok());
}

TEST_F(CheckpointTest, MissingFileAndBadArguments) {
  const State s = make_state("gpt-tiny", 6);
  expect_error(s.meta.model, "cannot open");
  const int64_t n = static_cast<int64_t>(s.master.size());
  Status bad_n = save_checkpoint(path_, s.meta, s.master.data(), s.m.data(), s.v.data(), n - 1);
  EXPECT_NE(bad_n.message().find("n: "), std::string::npos) << bad_n.message();
  EXPECT_FALSE(save_checkpoint(path_, s.meta, nullptr, s.m.data(), s.v.data(), n).ok());
  EXPECT_FALSE(save_checkpoint("", s.meta, s.master.data(), s.m.data(), s.v.data(), n).ok());
  EXPECT_FALSE(fs::exists(path_));
}

TEST_F(CheckpointTest, UnwritableDirectoryLeavesNothing) {
  const State s = make_state("gpt-tiny", 7);
  const std::string missing = (dir_ / "no-such-dir" / "run.ckpt").string();
  Status st = save_checkpoint(missing, s.meta, s.master.data(), s.m.data(), s.v.data(),
                              static_cast<int64_t>(s.master.size()));
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("no-such-dir"), std::string::npos) << st.message();
}

// A write that fails part way (the file-size limit cuts it off, as a full disk would) leaves the
// previous checkpoint whole and no temporary file behind.
TEST_F(CheckpointTest, FailedWriteKeepsThePreviousCheckpoint) {
  const State old_state = make_state("gpt-tiny", 8);
  ASSERT_TRUE(save(old_state).ok());
  const std::vector<char> old_bytes = read_bytes(path_);
  State new_state = make_state("gpt-tiny", 9);
  new_state.meta.step = 2000;

  struct rlimit saved;
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  void (*old_handler)(int) = std::signal(SIGXFSZ, SIG_IGN);  // EFBIG instead of a signal
  struct rlimit limited = saved;
  limited.rlim_cur = 4096;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &limited), 0);
  Status st = save(new_state);
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &saved), 0);
  std::signal(SIGXFSZ, old_handler);

  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("failed"), std::string::npos) << st.message();
  EXPECT_FALSE(fs::exists(path_ + ".tmp"));
  EXPECT_EQ(read_bytes(path_), old_bytes);
  CheckpointMeta meta;
  ASSERT_TRUE(read_checkpoint_meta(path_, &meta).ok());
  EXPECT_EQ(meta.step, 1234);
  // And the same write succeeds without the limit, replacing the old file.
  ASSERT_TRUE(save(new_state).ok());
  ASSERT_TRUE(read_checkpoint_meta(path_, &meta).ok());
  EXPECT_EQ(meta.step, 2000);
}

}  // namespace
}  // namespace flare::train
