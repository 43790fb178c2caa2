// The safetensors export (src/train/core/safetensors.h), read back by a small reader of the
// format written here: names, shapes, offsets tiling the data section, and every value.
#include "train/core/safetensors.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>

#include "core/numeric.h"

namespace flare::train {
namespace {

namespace fs = std::filesystem;

// ---- a reader for the JSON subset safetensors headers use: objects, arrays, strings, integers

struct Json {
  enum Kind { kObject, kArray, kString, kNumber } kind = kNumber;
  std::map<std::string, Json> object;
  std::vector<std::string> keys;  // object keys in file order
  std::vector<Json> array;
  std::string string;
  int64_t number = 0;
};

class JsonParser {
 public:
  explicit JsonParser(const std::string& text) : s_(text) {}
  Json parse() {
    skip_space();
    Json v;
    if (peek() == '{') {
      v.kind = Json::kObject;
      ++i_;
      while (skip_space(), peek() != '}') {
        std::string key = parse_string();
        skip_space();
        expect(':');
        v.keys.push_back(key);
        v.object[key] = parse();
        skip_space();
        if (peek() == ',') ++i_;
      }
      ++i_;
    } else if (peek() == '[') {
      v.kind = Json::kArray;
      ++i_;
      while (skip_space(), peek() != ']') {
        v.array.push_back(parse());
        skip_space();
        if (peek() == ',') ++i_;
      }
      ++i_;
    } else if (peek() == '"') {
      v.kind = Json::kString;
      v.string = parse_string();
    } else {
      size_t used = 0;
      v.number = std::stoll(s_.substr(i_), &used);
      i_ += used;
    }
    return v;
  }
  bool at_end() {
    skip_space();
    return i_ == s_.size();
  }

 private:
  char peek() const { return i_ < s_.size() ? s_[i_] : '\0'; }
  void skip_space() {
    while (i_ < s_.size() && s_[i_] == ' ') ++i_;
  }
  void expect(char c) {
    EXPECT_EQ(peek(), c) << "at " << i_;
    ++i_;
  }
  std::string parse_string() {
    expect('"');
    const size_t end = s_.find('"', i_);
    std::string out = s_.substr(i_, end - i_);
    i_ = end + 1;
    return out;
  }
  const std::string& s_;
  size_t i_ = 0;
};

struct SafetensorsFile {
  std::string header_text;
  Json header;
  std::vector<char> data;
};

SafetensorsFile read_safetensors(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::vector<char> bytes{std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
  SafetensorsFile out;
  uint64_t n = 0;
  EXPECT_GE(bytes.size(), 8u);
  std::memcpy(&n, bytes.data(), 8);
  out.header_text.assign(bytes.begin() + 8, bytes.begin() + 8 + static_cast<long>(n));
  JsonParser parser(out.header_text);
  out.header = parser.parse();
  EXPECT_TRUE(parser.at_end());
  out.data.assign(bytes.begin() + 8 + static_cast<long>(n), bytes.end());
  return out;
}

// ---- tests -----------------------------------------------------------------------------------

class SafetensorsTest : public testing::Test {
 protected:
  void SetUp() override {
    path_ = (fs::path(testing::TempDir()) /
             ("flare_st_" + std::to_string(::getpid()) + "_" +
              testing::UnitTest::GetInstance()->current_test_info()->name() + ".safetensors"))
                .string();
  }
  void TearDown() override { fs::remove(path_); }

  static std::vector<float> random_params(const ModelConfig& c) {
    std::vector<float> p(parameter_layout(c).total);
    std::mt19937 rng(7);
    std::normal_distribution<float> normal;
    for (float& x : p) x = normal(rng);
    return p;
  }

  // Exports, reads back, checks the format's rules and every value against the flat buffer.
  SafetensorsFile export_and_check(const ModelConfig& c, DType dtype) {
    const std::vector<float> params = random_params(c);
    Status s = export_safetensors(path_, c, params.data(), static_cast<int64_t>(params.size()), dtype);
    EXPECT_TRUE(s.ok()) << s.to_string();
    SafetensorsFile file = read_safetensors(path_);
    EXPECT_EQ(file.header_text.size() % 8, 0u);
    EXPECT_EQ(file.header_text.front(), '{');
    EXPECT_EQ(file.header.kind, Json::kObject);
    EXPECT_EQ(file.header.object["__metadata__"].object["format"].string, "pt");

    const std::vector<ExportTensor> tensors = export_tensors(c);
    EXPECT_EQ(file.header.keys.size(), tensors.size() + 1);
    const int64_t element = dtype == DType::kBFloat16 ? 2 : 4;
    const char* tag = dtype == DType::kBFloat16 ? "BF16" : "F32";
    int64_t at = 0;  // offsets must tile the data section in order
    for (const ExportTensor& t : tensors) {
      Json& entry = file.header.object[t.name];
      EXPECT_EQ(entry.object["dtype"].string, tag) << t.name;
      std::vector<int64_t> shape;
      for (const Json& d : entry.object["shape"].array) shape.push_back(d.number);
      EXPECT_EQ(shape, t.shape) << t.name;
      const std::vector<Json>& offsets = entry.object["data_offsets"].array;
      EXPECT_EQ(offsets.size(), 2u);
      EXPECT_EQ(offsets[0].number, at) << t.name;
      EXPECT_EQ(offsets[1].number, at + t.numel * element) << t.name;
      int64_t wrong = 0;  // values that differ from the flat buffer's, bit for bit
      for (int64_t k = 0; k < t.numel; ++k) {
        const float want = params[t.offset + k];
        if (dtype == DType::kBFloat16) {
          uint16_t got;
          std::memcpy(&got, file.data.data() + at + 2 * k, 2);
          wrong += got != float_to_bf16(want);
        } else {
          float got;
          std::memcpy(&got, file.data.data() + at + 4 * k, 4);
          wrong += got != want;
        }
      }
      EXPECT_EQ(wrong, 0) << t.name;
      at += t.numel * element;
    }
    EXPECT_EQ(static_cast<int64_t>(file.data.size()), at);
    return file;
  }

  std::string path_;
};

ModelConfig preset(const std::string& name) {
  ModelConfig c;
  EXPECT_TRUE(model_preset(name, &c).ok());
  return c;
}

TEST_F(SafetensorsTest, LlamaUsesHuggingFaceNamesAndSplitsFusedRows) {
  const ModelConfig c = preset("llama-tiny");  // 4 heads, 2 kv heads of 16, ffn 128, untied
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    SafetensorsFile f = export_and_check(c, dtype);
    EXPECT_EQ(f.header.keys[1], "model.embed_tokens.weight");
    auto shape = [&](const std::string& name) {
      std::vector<int64_t> s;
      for (const Json& d : f.header.object.at(name).object.at("shape").array) s.push_back(d.number);
      return s;
    };
    EXPECT_EQ(shape("model.embed_tokens.weight"), (std::vector<int64_t>{300, 64}));
    EXPECT_EQ(shape("model.layers.1.self_attn.q_proj.weight"), (std::vector<int64_t>{64, 64}));
    EXPECT_EQ(shape("model.layers.1.self_attn.k_proj.weight"), (std::vector<int64_t>{32, 64}));
    EXPECT_EQ(shape("model.layers.1.self_attn.v_proj.weight"), (std::vector<int64_t>{32, 64}));
    EXPECT_EQ(shape("model.layers.1.self_attn.o_proj.weight"), (std::vector<int64_t>{64, 64}));
    EXPECT_EQ(shape("model.layers.0.mlp.gate_proj.weight"), (std::vector<int64_t>{128, 64}));
    EXPECT_EQ(shape("model.layers.0.mlp.up_proj.weight"), (std::vector<int64_t>{128, 64}));
    EXPECT_EQ(shape("model.layers.0.mlp.down_proj.weight"), (std::vector<int64_t>{64, 128}));
    EXPECT_EQ(shape("model.layers.0.input_layernorm.weight"), (std::vector<int64_t>{64}));
    EXPECT_EQ(shape("model.layers.0.post_attention_layernorm.weight"), (std::vector<int64_t>{64}));
    EXPECT_EQ(shape("model.norm.weight"), (std::vector<int64_t>{64}));
    EXPECT_EQ(shape("lm_head.weight"), (std::vector<int64_t>{300, 64}));
  }
  // The split rows start where the layout says: k after the 64 q rows, up after the 128 gate rows.
  const ParameterLayout layout = parameter_layout(c);
  for (const ExportTensor& t : export_tensors(c)) {
    if (t.name == "model.layers.1.self_attn.k_proj.weight") {
      EXPECT_EQ(t.offset, layout.find("layers.1.attn.qkv.weight")->offset + 64 * 64);
    }
    if (t.name == "model.layers.1.mlp.up_proj.weight") {
      EXPECT_EQ(t.offset, layout.find("layers.1.mlp.gate_up.weight")->offset + 128 * 64);
    }
  }
}

TEST_F(SafetensorsTest, TiedLlamaHasNoHead) {
  ModelConfig c = preset("llama-tiny");
  c.tied_embeddings = true;
  SafetensorsFile f = export_and_check(c, DType::kBFloat16);
  EXPECT_EQ(f.header.object.count("lm_head.weight"), 0u);
}

TEST_F(SafetensorsTest, GptUsesNanoGptNames) {
  const ModelConfig c = preset("gpt-tiny");
  SafetensorsFile f = export_and_check(c, DType::kFloat32);
  const std::vector<std::string> first = {
      "__metadata__", "transformer.wte.weight", "transformer.wpe.weight",
      "transformer.h.0.ln_1.weight", "transformer.h.0.ln_1.bias",
      "transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_attn.bias",
      "transformer.h.0.attn.c_proj.weight", "transformer.h.0.attn.c_proj.bias",
      "transformer.h.0.ln_2.weight", "transformer.h.0.ln_2.bias",
      "transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_fc.bias",
      "transformer.h.0.mlp.c_proj.weight", "transformer.h.0.mlp.c_proj.bias"};
  for (size_t i = 0; i < first.size(); ++i) EXPECT_EQ(f.header.keys[i], first[i]);
  EXPECT_EQ(f.header.keys.back(), "transformer.ln_f.bias");
  EXPECT_EQ(f.header.object.count("lm_head.weight"), 0u);  // tied
  EXPECT_EQ(f.header.object["transformer.wte.weight"].object["shape"].array[0].number, 300);
  EXPECT_EQ(f.header.object["transformer.h.1.attn.c_attn.weight"].object["shape"].array[0].number, 192);
  EXPECT_EQ(f.header.object["transformer.h.1.mlp.c_proj.weight"].object["shape"].array[1].number, 256);
}

TEST_F(SafetensorsTest, RejectsBadArguments) {
  const ModelConfig c = preset("gpt-tiny");
  std::vector<float> p(parameter_layout(c).total, 1.0f);
  const int64_t n = static_cast<int64_t>(p.size());
  Status s = export_safetensors(path_, c, p.data(), n, DType::kFloat16);
  EXPECT_NE(s.message().find("dtype"), std::string::npos) << s.message();
  s = export_safetensors(path_, c, p.data(), n + 1, DType::kFloat32);
  EXPECT_NE(s.message().find("n: "), std::string::npos) << s.message();
  s = export_safetensors(path_, c, nullptr, n, DType::kFloat32);
  EXPECT_NE(s.message().find("params"), std::string::npos) << s.message();
  ModelConfig quoted = c;
  quoted.name = "a\"b";
  s = export_safetensors(path_, quoted, p.data(), n, DType::kFloat32);
  EXPECT_NE(s.message().find("config.name"), std::string::npos) << s.message();
  EXPECT_FALSE(fs::exists(path_));
  s = export_safetensors((fs::path(testing::TempDir()) / "no-such-dir" / "x.safetensors").string(),
                         c, p.data(), n, DType::kFloat32);
  EXPECT_NE(s.message().find("no-such-dir"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace flare::train
