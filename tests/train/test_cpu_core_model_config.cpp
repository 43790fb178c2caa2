// Model presets, validation rules and the flat parameter layout (src/train/core/model_config.h).
#include "train/core/model_config.h"

#include <gtest/gtest.h>

#include <cmath>
#include <set>

namespace flare::train {
namespace {

ModelConfig preset(const std::string& name) {
  ModelConfig c;
  Status s = model_preset(name, &c);
  EXPECT_TRUE(s.ok()) << s.to_string();
  return c;
}

// The message of a config that must fail, checked to name `field`.
void expect_rejected(const ModelConfig& c, const std::string& field) {
  Status s = validate_model_config(c);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << field;
  EXPECT_NE(s.message().find(field), std::string::npos) << s.message();
}

TEST(ModelConfig, EveryPresetIsValidAndNamedAsListed) {
  const std::vector<std::string> names = model_preset_names();
  EXPECT_EQ(names.size(), 15u);
  for (const std::string& name : names) {
    ModelConfig c = preset(name);
    EXPECT_EQ(c.name, name);
    Status s = validate_model_config(c);
    EXPECT_TRUE(s.ok()) << name << ": " << s.to_string();
    EXPECT_EQ(c.padded_vocab, padded_vocab_size(c.vocab_size)) << name;
  }
}

TEST(ModelConfig, UnknownPresetNamesTheKnownOnes) {
  ModelConfig c;
  Status s = model_preset("gpt5", &c);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("gpt5"), std::string::npos);
  EXPECT_NE(s.message().find("llama3.2-1b"), std::string::npos);
  EXPECT_FALSE(model_preset("gpt2", nullptr).ok());
}

TEST(ModelConfig, PublishedDimensions) {
  struct Row {
    const char* name;
    int64_t n_layer, d_model, n_head, n_kv_head, head_dim, ffn, vocab, max_seq;
    bool tied;
  };
  const Row rows[] = {
      {"gpt2", 12, 768, 12, 12, 64, 3072, 50257, 1024, true},
      {"gpt2-medium", 24, 1024, 16, 16, 64, 4096, 50257, 1024, true},
      {"gpt2-large", 36, 1280, 20, 20, 64, 5120, 50257, 1024, true},
      {"gpt2-xl", 48, 1600, 25, 25, 64, 6400, 50257, 1024, true},
      {"gpt3-125m", 12, 768, 12, 12, 64, 3072, 50257, 2048, true},
      {"gpt3-350m", 24, 1024, 16, 16, 64, 4096, 50257, 2048, true},
      {"gpt3-760m", 24, 1536, 16, 16, 96, 6144, 50257, 2048, true},
      {"gpt3-1.3b", 24, 2048, 16, 16, 128, 8192, 50257, 2048, true},
      {"gpt3-2.7b", 32, 2560, 32, 32, 80, 10240, 50257, 2048, true},
      {"llama2-7b", 32, 4096, 32, 32, 128, 11008, 32000, 4096, false},
      {"llama3-8b", 32, 4096, 32, 8, 128, 14336, 128256, 8192, false},
      {"llama3.2-1b", 16, 2048, 32, 8, 64, 8192, 128256, 131072, true},
      {"llama3.2-3b", 28, 3072, 24, 8, 128, 8192, 128256, 131072, true},
  };
  for (const Row& r : rows) {
    ModelConfig c = preset(r.name);
    EXPECT_EQ(c.n_layer, r.n_layer) << r.name;
    EXPECT_EQ(c.d_model, r.d_model) << r.name;
    EXPECT_EQ(c.n_head, r.n_head) << r.name;
    EXPECT_EQ(c.n_kv_head, r.n_kv_head) << r.name;
    EXPECT_EQ(c.head_dim, r.head_dim) << r.name;
    EXPECT_EQ(c.ffn_hidden, r.ffn) << r.name;
    EXPECT_EQ(c.vocab_size, r.vocab) << r.name;
    EXPECT_EQ(c.max_seq, r.max_seq) << r.name;
    EXPECT_EQ(c.tied_embeddings, r.tied) << r.name;
  }
  EXPECT_EQ(preset("gpt2").padded_vocab, 50304);
  EXPECT_EQ(preset("llama2-7b").padded_vocab, 32000);
  EXPECT_EQ(preset("llama3-8b").padded_vocab, 128256);

  ModelConfig l1 = preset("llama3.2-1b");
  EXPECT_EQ(l1.rope_theta, 5e5);
  EXPECT_TRUE(l1.rope_scaling.enabled);
  EXPECT_EQ(l1.rope_scaling.factor, 32.0);
  EXPECT_EQ(l1.rope_scaling.low_freq_factor, 1.0);
  EXPECT_EQ(l1.rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(l1.rope_scaling.original_max_position, 8192);
  EXPECT_FALSE(preset("llama3-8b").rope_scaling.enabled);
  EXPECT_EQ(preset("llama2-7b").rope_theta, 1e4);
}

// The counts the released checkpoints report (Hugging Face num_parameters()).
TEST(ModelConfig, ParameterCountsMatchReleasedCheckpoints) {
  EXPECT_EQ(parameter_count(preset("gpt2")), 124439808);
  EXPECT_EQ(parameter_count(preset("gpt2-medium")), 354823168);
  EXPECT_EQ(parameter_count(preset("gpt2-large")), 774030080);
  EXPECT_EQ(parameter_count(preset("gpt2-xl")), 1557611200);
  EXPECT_EQ(parameter_count(preset("llama2-7b")), 6738415616);
  EXPECT_EQ(parameter_count(preset("llama3-8b")), 8030261248);
  EXPECT_EQ(parameter_count(preset("llama3.2-1b")), 1235814400);
  EXPECT_EQ(parameter_count(preset("llama3.2-3b")), 3212749824);
  // GPT-3 XL as chosen (16 heads of 128) lands on the paper's 1.3B.
  EXPECT_NEAR(static_cast<double>(parameter_count(preset("gpt3-1.3b"))), 1.3e9, 0.05e9);
}

TEST(ModelConfig, LayoutIsOrderedAlignedAndComplete) {
  for (const std::string& name : model_preset_names()) {
    ModelConfig c = preset(name);
    ParameterLayout layout = parameter_layout(c);
    std::set<std::string> seen;
    int64_t end = 0;
    for (const ParamSpec& p : layout.params) {
      EXPECT_TRUE(seen.insert(p.name).second) << name << ": duplicate " << p.name;
      int64_t numel = 1;
      for (int64_t s : p.shape) numel *= s;
      EXPECT_EQ(p.numel, numel) << p.name;
      EXPECT_EQ(p.offset % kParamAlignment, 0) << p.name;
      EXPECT_GE(p.offset, end) << p.name;
      EXPECT_LT(p.offset - end, kParamAlignment) << p.name << ": gap beyond alignment";
      EXPECT_EQ(p.weight_decay, p.shape.size() == 2 && p.name.find("embed") == std::string::npos)
          << p.name;
      EXPECT_EQ(layout.find(p.name), &p);
      end = p.offset + p.numel;
    }
    EXPECT_EQ(layout.total % kParamAlignment, 0);
    EXPECT_GE(layout.total, end);
    EXPECT_LT(layout.total - end, kParamAlignment);
    EXPECT_EQ(layout.find("no.such.tensor"), nullptr);
  }
}

TEST(ModelConfig, GptLayoutNamesShapesAndInit) {
  ModelConfig c = preset("gpt-tiny");  // 2 layers, d 64, 4 heads of 16, vocab 300 → 384
  ParameterLayout layout = parameter_layout(c);
  const std::vector<std::string> expected_names = {
      "embed.weight", "pos_embed.weight",
      "layers.0.attn_norm.weight", "layers.0.attn_norm.bias",
      "layers.0.attn.qkv.weight", "layers.0.attn.qkv.bias",
      "layers.0.attn.out.weight", "layers.0.attn.out.bias",
      "layers.0.mlp_norm.weight", "layers.0.mlp_norm.bias",
      "layers.0.mlp.fc.weight", "layers.0.mlp.fc.bias",
      "layers.0.mlp.proj.weight", "layers.0.mlp.proj.bias"};
  ASSERT_EQ(layout.params.size(), 2 + 12 * 2 + 2u);
  for (size_t i = 0; i < expected_names.size(); ++i) EXPECT_EQ(layout.params[i].name, expected_names[i]);
  EXPECT_EQ(layout.params.back().name, "final_norm.bias");
  EXPECT_EQ(layout.find("head.weight"), nullptr);  // tied

  EXPECT_EQ(layout.find("embed.weight")->shape, (std::vector<int64_t>{384, 64}));
  EXPECT_EQ(layout.find("pos_embed.weight")->shape, (std::vector<int64_t>{64, 64}));
  EXPECT_EQ(layout.find("layers.1.attn.qkv.weight")->shape, (std::vector<int64_t>{192, 64}));
  EXPECT_EQ(layout.find("layers.1.attn.out.weight")->shape, (std::vector<int64_t>{64, 64}));
  EXPECT_EQ(layout.find("layers.1.mlp.fc.weight")->shape, (std::vector<int64_t>{256, 64}));
  EXPECT_EQ(layout.find("layers.1.mlp.proj.weight")->shape, (std::vector<int64_t>{64, 256}));

  const double residual_std = 0.02 / std::sqrt(4.0);
  EXPECT_DOUBLE_EQ(layout.find("layers.0.attn.qkv.weight")->init_std, 0.02);
  EXPECT_DOUBLE_EQ(layout.find("layers.0.attn.out.weight")->init_std, residual_std);
  EXPECT_DOUBLE_EQ(layout.find("layers.0.mlp.proj.weight")->init_std, residual_std);
  EXPECT_DOUBLE_EQ(layout.find("pos_embed.weight")->init_std, 0.01);
  EXPECT_TRUE(layout.find("layers.0.attn_norm.weight")->init_ones);
  const ParamSpec* bias = layout.find("layers.0.attn.qkv.bias");
  EXPECT_FALSE(bias->init_ones);
  EXPECT_EQ(bias->init_std, 0.0);
  EXPECT_FALSE(bias->weight_decay);
  EXPECT_FALSE(layout.find("embed.weight")->weight_decay);
}

TEST(ModelConfig, LlamaLayoutNamesShapesAndInit) {
  ModelConfig c = preset("llama-tiny");  // 4 heads, 2 kv heads of 16, ffn 128, untied
  ParameterLayout layout = parameter_layout(c);
  const std::vector<std::string> expected_names = {
      "embed.weight", "layers.0.attn_norm.weight", "layers.0.attn.qkv.weight",
      "layers.0.attn.out.weight", "layers.0.mlp_norm.weight", "layers.0.mlp.gate_up.weight",
      "layers.0.mlp.down.weight"};
  ASSERT_EQ(layout.params.size(), 1 + 6 * 2 + 2u);
  for (size_t i = 0; i < expected_names.size(); ++i) EXPECT_EQ(layout.params[i].name, expected_names[i]);
  EXPECT_EQ(layout.params[layout.params.size() - 2].name, "final_norm.weight");
  EXPECT_EQ(layout.params.back().name, "head.weight");
  EXPECT_EQ(layout.find("pos_embed.weight"), nullptr);
  EXPECT_EQ(layout.find("layers.0.attn.qkv.bias"), nullptr);

  EXPECT_EQ(layout.find("layers.0.attn.qkv.weight")->shape, (std::vector<int64_t>{(4 + 2 * 2) * 16, 64}));
  EXPECT_EQ(layout.find("layers.0.mlp.gate_up.weight")->shape, (std::vector<int64_t>{256, 64}));
  EXPECT_EQ(layout.find("layers.0.mlp.down.weight")->shape, (std::vector<int64_t>{64, 128}));
  const ParamSpec* head = layout.find("head.weight");
  EXPECT_EQ(head->shape, (std::vector<int64_t>{384, 64}));
  EXPECT_TRUE(head->weight_decay);
  EXPECT_DOUBLE_EQ(head->init_std, 0.02);
  EXPECT_DOUBLE_EQ(layout.find("layers.1.mlp.down.weight")->init_std, 0.02 / 2.0);
}

TEST(ModelConfig, OddSizesLeaveAlignedGaps) {
  ModelConfig c = preset("gpt-tiny");
  c.d_model = 72;  // 9 heads of 8: a bias of 72 elements leaves a gap before the next tensor
  c.n_head = c.n_kv_head = 9;
  c.head_dim = 8;
  c.ffn_hidden = 4 * 72;
  ASSERT_TRUE(validate_model_config(c).ok());
  ParameterLayout layout = parameter_layout(c);
  const ParamSpec* norm_w = layout.find("layers.0.attn_norm.weight");
  const ParamSpec* norm_b = layout.find("layers.0.attn_norm.bias");
  EXPECT_EQ(norm_b->offset, norm_w->offset + 128);
  EXPECT_EQ(parameter_count(c), [&] {
    int64_t n = 0;
    for (const ParamSpec& p : layout.params) n += p.numel;
    return n - (c.padded_vocab - c.vocab_size) * c.d_model;
  }());
}

TEST(ModelConfig, EachRuleNamesItsField) {
  const ModelConfig gpt = preset("gpt2");
  const ModelConfig llama = preset("llama3.2-1b");
  ModelConfig c;

  c = gpt; c.vocab_size = 0; expect_rejected(c, "vocab_size");
  c = gpt; c.padded_vocab = 50257; expect_rejected(c, "padded_vocab");
  c = gpt; c.padded_vocab = 50176; expect_rejected(c, "padded_vocab");
  c = gpt; c.n_layer = 0; expect_rejected(c, "n_layer");
  c = gpt; c.d_model = -1; expect_rejected(c, "d_model");
  c = gpt; c.n_head = 0; expect_rejected(c, "n_head");
  c = llama; c.n_kv_head = 3; expect_rejected(c, "n_kv_head: 3 must divide n_head = 32");
  c = llama; c.n_kv_head = 64; expect_rejected(c, "n_kv_head");
  c = llama; c.head_dim = 60; expect_rejected(c, "head_dim: 60");
  c = llama; c.head_dim = 264; expect_rejected(c, "head_dim: 264");
  c = llama; c.ffn_hidden = 0; expect_rejected(c, "ffn_hidden");
  c = llama; c.max_seq = 0; expect_rejected(c, "max_seq");
  c = llama; c.norm_eps = 0; expect_rejected(c, "norm_eps");
  c = llama; c.norm_eps = NAN; expect_rejected(c, "norm_eps");
  c = llama; c.rope_theta = 0; expect_rejected(c, "rope_theta");
  c = llama; c.rope_scaling.factor = 0.5; expect_rejected(c, "rope_scaling.factor");
  c = llama; c.rope_scaling.low_freq_factor = 0; expect_rejected(c, "rope_scaling.low_freq_factor");
  c = llama; c.rope_scaling.high_freq_factor = 1; expect_rejected(c, "rope_scaling.high_freq_factor");
  c = llama; c.rope_scaling.original_max_position = 0;
  expect_rejected(c, "rope_scaling.original_max_position");
  c = gpt; c.n_kv_head = 4; expect_rejected(c, "n_kv_head");
  c = gpt; c.head_dim = 128; expect_rejected(c, "head_dim");
  c = gpt; c.rope_scaling.enabled = true; expect_rejected(c, "rope_scaling");
}

TEST(ModelConfig, FlopsPerTokenByHand) {
  // gpt2 at T = 1024: matmul weights 12·(2304·768 + 768·768 + 2·3072·768) + 50257·768.
  ModelConfig c = preset("gpt2");
  const double matmul = 12.0 * (2304.0 * 768 + 768.0 * 768 + 2 * 3072.0 * 768) + 50257.0 * 768;
  const double attention = 6.0 * 12 * 12 * 64 * 1024;
  EXPECT_DOUBLE_EQ(model_flops_per_token(c, 1024), 6 * matmul + attention);
  // LLaMA: three MLP matrices, GQA's narrower K/V, the head counted once whether tied or not.
  ModelConfig l = preset("llama3.2-1b");
  const double l_matmul =
      16.0 * ((32 + 16) * 64.0 * 2048 + 2048.0 * 2048 + 3 * 2048.0 * 8192) + 128256.0 * 2048;
  EXPECT_DOUBLE_EQ(model_flops_per_token(l, 2048), 6 * l_matmul + 6.0 * 16 * 32 * 64 * 2048);
}

}  // namespace
}  // namespace flare::train
