// model_config.cpp — the model presets, the rules a config must satisfy, the flat parameter
// layout a config implies, and the two numbers the trainer reports about a model: its parameter
// count and its FLOPs per token.
//
// Preset sources:
//   GPT-2      — Radford et al. 2019 and the released checkpoints (n_layer/n_embd/n_head of
//                gpt2, gpt2-medium, gpt2-large, gpt2-xl); vocab 50257, context 1024.
//   GPT-3      — Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1; context
//                2048, the GPT-2 tokenizer. The paper's alternating locally banded sparse layers
//                are not modelled: every layer is dense, as in most reproductions.
//   LLaMA      — the config.json of each released checkpoint on the Hugging Face hub
//                (meta-llama/Llama-2-7b-hf, Meta-Llama-3-8B, Llama-3.2-1B, Llama-3.2-3B).
#include "train/core/model_config.h"

#include <cmath>

#include "core/message.h"

namespace flare::train {
namespace {

// Limits that keep every product of dimensions far inside int64 and reject typos early.
constexpr int64_t kMaxVocab = int64_t{1} << 24;
constexpr int64_t kMaxWidth = int64_t{1} << 17;  // d_model and ffn_hidden
constexpr int64_t kMaxLayers = 1024;
constexpr int64_t kMaxHeads = 1024;
constexpr int64_t kMaxSeq = int64_t{1} << 24;
// flare's attention serves head_dim ≤ 256 (src/core/attention.cpp); the CUDA kernels take the
// 16-byte vector path only for head_dim % 8 == 0 (src/cuda/sm80 `vec`), and RoPE needs pairs.
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kHeadDimMultiple = 8;

int64_t round_up(int64_t x, int64_t multiple) { return (x + multiple - 1) / multiple * multiple; }

ModelConfig gpt_preset(const char* name, int64_t n_layer, int64_t d_model, int64_t n_head,
                       int64_t head_dim, int64_t max_seq) {
  ModelConfig c;
  c.family = Family::kGpt;
  c.name = name;
  c.vocab_size = 50257;
  c.padded_vocab = padded_vocab_size(c.vocab_size);
  c.n_layer = n_layer;
  c.d_model = d_model;
  c.n_head = n_head;
  c.n_kv_head = n_head;
  c.head_dim = head_dim;
  c.ffn_hidden = 4 * d_model;
  c.max_seq = max_seq;
  c.norm_eps = 1e-5;
  c.tied_embeddings = true;
  return c;
}

struct LlamaDims {
  int64_t n_layer, d_model, n_head, n_kv_head, head_dim, ffn_hidden, vocab_size, max_seq;
  double rope_theta;
  bool llama3_scaling;  // rope_type "llama3", factor 32, low 1, high 4, original 8192
  bool tied;
};

ModelConfig llama_preset(const char* name, const LlamaDims& d) {
  ModelConfig c;
  c.family = Family::kLlama;
  c.name = name;
  c.vocab_size = d.vocab_size;
  c.padded_vocab = padded_vocab_size(d.vocab_size);
  c.n_layer = d.n_layer;
  c.d_model = d.d_model;
  c.n_head = d.n_head;
  c.n_kv_head = d.n_kv_head;
  c.head_dim = d.head_dim;
  c.ffn_hidden = d.ffn_hidden;
  c.max_seq = d.max_seq;
  c.norm_eps = 1e-5;
  c.rope_theta = d.rope_theta;
  if (d.llama3_scaling) {
    c.rope_scaling.enabled = true;
    c.rope_scaling.factor = 32.0;
    c.rope_scaling.low_freq_factor = 1.0;
    c.rope_scaling.high_freq_factor = 4.0;
    c.rope_scaling.original_max_position = 8192;
  }
  c.tied_embeddings = d.tied;
  return c;
}

std::vector<ModelConfig> all_presets() {
  std::vector<ModelConfig> p;
  // GPT-2: head_dim 64 throughout.
  p.push_back(gpt_preset("gpt2", 12, 768, 12, 64, 1024));
  p.push_back(gpt_preset("gpt2-medium", 24, 1024, 16, 64, 1024));
  p.push_back(gpt_preset("gpt2-large", 36, 1280, 20, 64, 1024));
  p.push_back(gpt_preset("gpt2-xl", 48, 1600, 25, 64, 1024));
  // GPT-3, Table 2.1 (n_layers, d_model, n_heads, d_head).
  p.push_back(gpt_preset("gpt3-125m", 12, 768, 12, 64, 2048));
  p.push_back(gpt_preset("gpt3-350m", 24, 1024, 16, 64, 2048));
  p.push_back(gpt_preset("gpt3-760m", 24, 1536, 16, 96, 2048));
  // The table lists GPT-3 XL as 24 heads of d_head 128 with d_model 2048, which cannot all hold
  // (24·128 = 3072). d_head 128 with 16 heads keeps n_heads·d_head = d_model as every other row
  // does and reproduces the 1.3B parameter count (24 heads of 128 would give 1.5B).
  p.push_back(gpt_preset("gpt3-1.3b", 24, 2048, 16, 128, 2048));
  p.push_back(gpt_preset("gpt3-2.7b", 32, 2560, 32, 80, 2048));
  // LLaMA (n_layer, d_model, n_head, n_kv_head, head_dim, ffn, vocab, max_seq, theta, scaling, tied).
  p.push_back(llama_preset("llama2-7b", {32, 4096, 32, 32, 128, 11008, 32000, 4096, 1e4, false, false}));
  p.push_back(llama_preset("llama3-8b", {32, 4096, 32, 8, 128, 14336, 128256, 8192, 5e5, false, false}));
  p.push_back(llama_preset("llama3.2-1b", {16, 2048, 32, 8, 64, 8192, 128256, 131072, 5e5, true, true}));
  p.push_back(llama_preset("llama3.2-3b", {28, 3072, 24, 8, 128, 8192, 128256, 131072, 5e5, true, true}));
  // Test models: two layers, seconds on one CPU core. vocab 300 pads to 384 so the padding rows
  // are exercised; llama-tiny is untied so the head's own tensor is too.
  ModelConfig gpt_tiny = gpt_preset("gpt-tiny", 2, 64, 4, 16, 64);
  gpt_tiny.vocab_size = 300;
  gpt_tiny.padded_vocab = padded_vocab_size(300);
  p.push_back(gpt_tiny);
  p.push_back(llama_preset("llama-tiny", {2, 64, 4, 2, 16, 128, 300, 64, 1e4, false, false}));
  return p;
}

// Builds the layout: appends tensors at aligned offsets in the order they are added.
class LayoutBuilder {
 public:
  // A matrix or embedding: normal(0, std).
  void add_normal(const std::string& name, std::vector<int64_t> shape, double std, bool decay) {
    add(name, std::move(shape), std, decay, false);
  }
  void add_ones(const std::string& name, int64_t n) { add(name, {n}, 0.0, false, true); }
  void add_zeros(const std::string& name, int64_t n) { add(name, {n}, 0.0, false, false); }

  ParameterLayout finish() {
    layout_.total = round_up(layout_.total, kParamAlignment);
    return std::move(layout_);
  }

 private:
  void add(const std::string& name, std::vector<int64_t> shape, double std, bool decay,
           bool ones) {
    ParamSpec p;
    p.name = name;
    p.numel = 1;
    for (int64_t s : shape) p.numel *= s;
    p.shape = std::move(shape);
    p.offset = round_up(layout_.total, kParamAlignment);
    p.weight_decay = decay;
    p.init_std = std;
    p.init_ones = ones;
    layout_.total = p.offset + p.numel;
    layout_.params.push_back(std::move(p));
  }

  ParameterLayout layout_;
};

}  // namespace

int64_t padded_vocab_size(int64_t vocab_size) { return round_up(vocab_size, 128); }

const char* family_name(Family family) { return family == Family::kGpt ? "gpt" : "llama"; }

const ParamSpec* ParameterLayout::find(const std::string& name) const {
  for (const ParamSpec& p : params) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

Status model_preset(const std::string& name, ModelConfig* out) {
  if (out == nullptr) return invalid("model_preset: out must not be null");
  for (const ModelConfig& c : all_presets()) {
    if (c.name == name) {
      *out = c;
      return Status::ok_status();
    }
  }
  std::string known;
  for (const std::string& n : model_preset_names()) known += (known.empty() ? "" : ", ") + n;
  return invalid("model: unknown preset '", name, "' (known: ", known, ")");
}

std::vector<std::string> model_preset_names() {
  std::vector<std::string> names;
  for (const ModelConfig& c : all_presets()) names.push_back(c.name);
  return names;
}

Status validate_model_config(const ModelConfig& c) {
  auto in_range = [](int64_t v, int64_t lo, int64_t hi) { return v >= lo && v <= hi; };
  if (!in_range(c.vocab_size, 1, kMaxVocab))
    return invalid("vocab_size: ", c.vocab_size, " must be in [1, ", kMaxVocab, "]");
  if (c.padded_vocab < c.vocab_size || c.padded_vocab % 128 != 0)
    return invalid("padded_vocab: ", c.padded_vocab, " must be a multiple of 128 and >= vocab_size = ",
                   c.vocab_size, " (padded_vocab_size() gives ", padded_vocab_size(c.vocab_size), ")");
  if (!in_range(c.n_layer, 1, kMaxLayers))
    return invalid("n_layer: ", c.n_layer, " must be in [1, ", kMaxLayers, "]");
  if (!in_range(c.d_model, 1, kMaxWidth))
    return invalid("d_model: ", c.d_model, " must be in [1, ", kMaxWidth, "]");
  if (!in_range(c.n_head, 1, kMaxHeads))
    return invalid("n_head: ", c.n_head, " must be in [1, ", kMaxHeads, "]");
  if (!in_range(c.n_kv_head, 1, c.n_head) || c.n_head % c.n_kv_head != 0)
    return invalid("n_kv_head: ", c.n_kv_head, " must divide n_head = ", c.n_head);
  if (!in_range(c.head_dim, 1, kMaxHeadDim) || c.head_dim % kHeadDimMultiple != 0)
    return invalid("head_dim: ", c.head_dim, " must be a multiple of ", kHeadDimMultiple,
                   " in [", kHeadDimMultiple, ", ", kMaxHeadDim, "] (flare's attention kernels)");
  if (!in_range(c.ffn_hidden, 1, kMaxWidth))
    return invalid("ffn_hidden: ", c.ffn_hidden, " must be in [1, ", kMaxWidth, "]");
  if (!in_range(c.max_seq, 1, kMaxSeq))
    return invalid("max_seq: ", c.max_seq, " must be in [1, ", kMaxSeq, "]");
  if (!std::isfinite(c.norm_eps) || c.norm_eps <= 0)
    return invalid("norm_eps: ", c.norm_eps, " must be finite and > 0");

  if (c.family == Family::kGpt) {
    if (c.n_kv_head != c.n_head)
      return invalid("n_kv_head: ", c.n_kv_head, " must equal n_head = ", c.n_head,
                     " for the gpt family (no grouped-query attention)");
    if (c.n_head * c.head_dim != c.d_model)
      return invalid("head_dim: n_head·head_dim = ", c.n_head, "·", c.head_dim, " = ",
                     c.n_head * c.head_dim, " must equal d_model = ", c.d_model, " for the gpt family");
    if (c.rope_scaling.enabled)
      return invalid("rope_scaling: enabled, but the gpt family has learned positions, no RoPE");
    return Status::ok_status();
  }

  if (!std::isfinite(c.rope_theta) || c.rope_theta <= 1)
    return invalid("rope_theta: ", c.rope_theta, " must be finite and > 1");
  if (c.rope_scaling.enabled) {
    const RopeScaling& s = c.rope_scaling;
    if (!std::isfinite(s.factor) || s.factor < 1)
      return invalid("rope_scaling.factor: ", s.factor, " must be finite and >= 1");
    if (!std::isfinite(s.low_freq_factor) || s.low_freq_factor <= 0)
      return invalid("rope_scaling.low_freq_factor: ", s.low_freq_factor, " must be finite and > 0");
    if (!std::isfinite(s.high_freq_factor) || s.high_freq_factor <= s.low_freq_factor)
      return invalid("rope_scaling.high_freq_factor: ", s.high_freq_factor,
                     " must be finite and > low_freq_factor = ", s.low_freq_factor);
    if (s.original_max_position < 1)
      return invalid("rope_scaling.original_max_position: ", s.original_max_position, " must be >= 1");
  }
  return Status::ok_status();
}

ParameterLayout parameter_layout(const ModelConfig& c) {
  const bool gpt = c.family == Family::kGpt;
  const double std = 0.02;
  // GPT-2's scaled init for the projections that write into the residual stream, so its variance
  // does not grow with depth: two such writes per layer.
  const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(c.n_layer));
  const int64_t d = c.d_model;
  const int64_t q_width = c.n_head * c.head_dim;
  const int64_t qkv_rows = (c.n_head + 2 * c.n_kv_head) * c.head_dim;

  LayoutBuilder b;
  b.add_normal("embed.weight", {c.padded_vocab, d}, std, false);
  // GPT-2's released code initialised wpe with std 0.01 (wte 0.02); we follow it.
  if (gpt) b.add_normal("pos_embed.weight", {c.max_seq, d}, 0.01, false);

  auto add_norm = [&](const std::string& prefix) {
    b.add_ones(prefix + ".weight", d);
    if (gpt) b.add_zeros(prefix + ".bias", d);
  };
  // A linear layer (out, in) with a zero bias in the gpt family.
  auto add_linear = [&](const std::string& prefix, int64_t out, int64_t in, double init_std) {
    b.add_normal(prefix + ".weight", {out, in}, init_std, true);
    if (gpt) b.add_zeros(prefix + ".bias", out);
  };

  for (int64_t i = 0; i < c.n_layer; ++i) {
    const std::string layer = "layers." + std::to_string(i);
    add_norm(layer + ".attn_norm");
    add_linear(layer + ".attn.qkv", qkv_rows, d, std);
    add_linear(layer + ".attn.out", d, q_width, residual_std);
    add_norm(layer + ".mlp_norm");
    if (gpt) {
      add_linear(layer + ".mlp.fc", c.ffn_hidden, d, std);
      add_linear(layer + ".mlp.proj", d, c.ffn_hidden, residual_std);
    } else {
      add_linear(layer + ".mlp.gate_up", 2 * c.ffn_hidden, d, std);
      add_linear(layer + ".mlp.down", d, c.ffn_hidden, residual_std);
    }
  }
  add_norm("final_norm");
  if (!c.tied_embeddings) b.add_normal("head.weight", {c.padded_vocab, d}, std, true);
  return b.finish();
}

int64_t parameter_count(const ModelConfig& c) {
  // The layout's tensors, with the embedding/head padding rows taken back out.
  const int64_t padding_rows = c.padded_vocab - c.vocab_size;
  const int64_t vocab_tensors = c.tied_embeddings ? 1 : 2;
  int64_t n = 0;
  for (const ParamSpec& p : parameter_layout(c).params) n += p.numel;
  return n - vocab_tensors * padding_rows * c.d_model;
}

double model_flops_per_token(const ModelConfig& c, int64_t seq) {
  const double d = static_cast<double>(c.d_model);
  const double q_width = static_cast<double>(c.n_head * c.head_dim);
  const double qkv_rows = static_cast<double>((c.n_head + 2 * c.n_kv_head) * c.head_dim);
  const double mlp_matrices = c.family == Family::kGpt ? 2.0 : 3.0;
  const double per_layer = qkv_rows * d + d * q_width + mlp_matrices * d * c.ffn_hidden;
  const double matmul_params = c.n_layer * per_layer + static_cast<double>(c.vocab_size) * d;
  const double causal_attention = 6.0 * c.n_layer * q_width * static_cast<double>(seq);
  return 6.0 * matmul_params + causal_attention;
}

// ---- The backward's stages ----------------------------------------------------------------------

namespace {

// "layers.12.attn.qkv.weight" → 12; −1 for a name outside the layers.
int64_t layer_of(const std::string& name) {
  static const std::string kPrefix = "layers.";
  if (name.compare(0, kPrefix.size(), kPrefix) != 0) return -1;
  const size_t dot = name.find('.', kPrefix.size());
  if (dot == std::string::npos || dot == kPrefix.size()) return -1;
  int64_t layer = 0;
  for (size_t i = kPrefix.size(); i < dot; ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
    layer = layer * 10 + (name[i] - '0');
  }
  return layer;
}

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

}  // namespace

int64_t backward_stage_count(int64_t n_layer) { return n_layer + 2; }

int64_t backward_stage(const ParamSpec& param, int64_t n_layer) {
  const int64_t layer = layer_of(param.name);
  if (layer >= 0 && layer < n_layer) return 1 + (n_layer - 1 - layer);
  if (starts_with(param.name, "final_norm.") || starts_with(param.name, "head.")) return 0;
  return n_layer + 1;
}

Status backward_stage_ranges(const ParameterLayout& layout, int64_t n_layer, std::vector<int64_t>* begin,
                             std::vector<int64_t>* end) {
  const auto stages = static_cast<size_t>(backward_stage_count(n_layer));
  begin->assign(stages, -1);
  end->assign(stages, -1);
  int64_t previous = -1;
  for (size_t i = 0; i < layout.params.size(); ++i) {
    const auto s = static_cast<size_t>(backward_stage(layout.params[i], n_layer));
    if ((*begin)[s] < 0) {
      (*begin)[s] = layout.params[i].offset;
    } else if (static_cast<int64_t>(s) != previous) {
      return invalid("layout: the tensors of backward stage ", s, " are not one contiguous range ('",
                     layout.params[i].name, "' follows another stage's)");
    }
    (*end)[s] = i + 1 < layout.params.size() ? layout.params[i + 1].offset : layout.total;
    previous = static_cast<int64_t>(s);
  }
  // A stage without tensors: an empty range where the order puts it (stage s + 1 lies below s).
  for (size_t s = stages; s-- > 0;) {
    if ((*begin)[s] >= 0) continue;
    (*begin)[s] = (*end)[s] = s + 1 < stages ? (*end)[s + 1] : 0;
  }
  return Status::ok_status();
}

}  // namespace flare::train
