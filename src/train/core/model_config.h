// model_config.h — what a model is: its family, its dimensions, and the list of parameter tensors
// that a config implies, laid out in one flat buffer.
//
// Every part of the trainer agrees through this file: the CPU and CUDA models read their weights
// at the offsets parameter_layout() gives, the optimizer walks the same list (weight decay per
// tensor), checkpoints and the safetensors export name tensors by it, and the data-parallel shard
// plan cuts the same flat buffer. Shapes are row-major; a linear layer's weight is (out, in),
// as in torch.nn.Linear, so y = x · Wᵀ (+ b).
//
// Two families share one code base:
//   GPT   — learned positions, LayerNorm with bias, GELU (tanh) MLP of 4·d_model, biases on every
//           linear layer, the output head tied to the token embedding.
//   LLaMA — RoPE (optionally with LLaMA-3 frequency scaling), RMSNorm, SwiGLU MLP, no biases,
//           grouped-query attention (n_kv_head divides n_head; K/V heads are never copied), an
//           untied output head.
//
// Conventions every part relies on (added with the first implementation, model_config.cpp):
//   - The fused qkv weight holds rows of the n_head query heads, then the n_kv_head key heads,
//     then the n_kv_head value heads, head_dim rows each. The fused gate_up weight holds the
//     ffn_hidden gate rows, then the ffn_hidden up rows: y = silu(x·Wgᵀ) ⊙ (x·Wuᵀ).
//   - RoPE rotates the pairs (j, j + head_dim/2) of each head (the "rotate half" form of Hugging
//     Face's LlamaForCausalLM), with inverse frequency theta^(-2j/head_dim), j < head_dim/2. So
//     q/k rows export to Hugging Face names unpermuted.
//   - Each tensor starts at an offset that is a multiple of kParamAlignment elements (128 bytes
//     of bf16), so every tensor can be read with 16-byte vector loads. The gaps between tensors
//     (usually none: most sizes are multiples of 64 already) are zero and stay zero: they get no
//     gradient and no optimizer update, and they are not part of parameter_count().
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flare/status.h"

namespace flare::train {

enum class Family { kGpt, kLlama };

// LLaMA-3's RoPE frequency scaling (rope_type "llama3"): wavelengths longer than
// original_max_position / low_freq_factor are divided by `factor`, shorter than
// original_max_position / high_freq_factor are kept, and the band between is interpolated.
struct RopeScaling {
  bool enabled = false;
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position = 8192;
};

struct ModelConfig {
  Family family = Family::kGpt;
  std::string name;            // the preset it came from, or "custom"
  int64_t vocab_size = 50257;  // tokens the tokenizer produces
  int64_t padded_vocab = 50304;  // rows of the embedding/head: vocab_size rounded up to 128
  int64_t n_layer = 12;
  int64_t d_model = 768;
  int64_t n_head = 12;
  int64_t n_kv_head = 12;      // GPT: equals n_head
  int64_t head_dim = 64;       // usually d_model / n_head; LLaMA may set it independently
  int64_t ffn_hidden = 3072;   // GPT: 4·d_model; LLaMA: the SwiGLU width
  int64_t max_seq = 1024;      // GPT: rows of the position table; LLaMA: longest trained sequence
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;  // LLaMA only
  RopeScaling rope_scaling;     // LLaMA only
  bool tied_embeddings = true;  // GPT: true; LLaMA-3.2 1B/3B tie too, LLaMA-2 7B / LLaMA-3 8B do not
};

// One parameter tensor of the flat buffer.
struct ParamSpec {
  std::string name;            // flare's own name, e.g. "layers.3.attn.qkv.weight"
  std::vector<int64_t> shape;  // row-major
  int64_t offset = 0;          // in elements from the start of the flat buffer
  int64_t numel = 0;
  bool weight_decay = false;   // matrices decay; norms, biases and (by convention) embeddings don't
  double init_std = 0.0;       // normal(0, init_std); 0 means "norm weight: ones" or "bias: zeros"
  bool init_ones = false;      // norm weights start at 1
};

struct ParameterLayout {
  std::vector<ParamSpec> params;  // in buffer order
  int64_t total = 0;              // elements in the flat buffer
  const ParamSpec* find(const std::string& name) const;
};

// Tensor offsets in the flat buffer are multiples of this many elements (see the conventions above).
inline constexpr int64_t kParamAlignment = 64;

// The backward stages, numbered in the order the backward completes them:
//   0                    the output head (when untied) and the final norm
//   1 + (n_layer−1−i)    layer i (layer n_layer−1 is stage 1, layer 0 is stage n_layer)
//   n_layer + 1          the embeddings (token, and position for GPT); a tied head's gradient is
//                        the token embedding's, final only here
// The GPU model signals the end of each stage (gpu_model.h's hooks) with these numbers, and data
// parallelism reduces gradients by them (train/dist/dp_plan.h).
int64_t backward_stage_count(int64_t n_layer);
// The stage after which `param`'s gradient is final (an unknown name: the last stage).
int64_t backward_stage(const ParamSpec& param, int64_t n_layer);

// The flat range [begin[s], end[s]) of each stage's tensors, each tensor's slot running to the
// next tensor's offset (or total): the stages tile [0, layout.total), an empty stage as an empty
// range where the order puts it. Fails, naming the tensor, if a stage is not one contiguous range.
Status backward_stage_ranges(const ParameterLayout& layout, int64_t n_layer, std::vector<int64_t>* begin,
                             std::vector<int64_t>* end);

// vocab_size rounded up to a multiple of 128: the rows of the embedding and the output head, so
// the head's matmul has tile-friendly dimensions (50257 → 50304).
int64_t padded_vocab_size(int64_t vocab_size);

// The named presets ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "gpt3-125m" … "gpt3-2.7b",
// "llama2-7b", "llama3.2-1b", "llama3.2-3b", "llama3-8b", and the small "gpt-tiny" /
// "llama-tiny" used by tests), and the list of their names for help texts.
Status model_preset(const std::string& name, ModelConfig* out);
std::vector<std::string> model_preset_names();

// Every rule a config must satisfy, each failure naming the field: heads divide d_model (or
// head_dim is set), n_kv_head divides n_head, head_dim is one flare's attention serves, sizes are
// positive, padded_vocab ≥ vocab_size.
Status validate_model_config(const ModelConfig& config);

// The parameter tensors of a valid config, in buffer order.
ParameterLayout parameter_layout(const ModelConfig& config);

// "gpt" or "llama", for messages and file headers.
const char* family_name(Family family);

// Trainable parameters of the model as published: embedding rows count vocab_size (not the
// padding rows), a tied head counts once, alignment gaps do not count. GPT-2 small: 124,439,808.
int64_t parameter_count(const ModelConfig& config);

// Model FLOPs of one trained token (forward + backward) at sequence length `seq`, the numerator of
// MFU. PaLM's appendix-B count, 6·N + 12·L·H·Q·T, with two choices stated:
//   N — the weights that take part in a matmul per token: every linear layer of every block plus
//       the output head (vocab_size rows, tied or not). Embedding and position lookups are not
//       matmuls; norms and biases are O(d) per token and are left out.
//   attention — QKᵀ and P·V cost 2·T·Q FLOPs each per head per token in the forward, ×3 for
//       forward + backward, so 12·L·H·Q·T without a mask. Training is causal: a token attends to
//       (T+1)/2 keys on average, so this counts the causal work, 6·L·H·Q·T (the halving
//       FlashAttention's benchmarks use). nanoGPT and llm.c report MFU with the unhalved term;
//       add 6·L·H·Q·T to compare with them.
double model_flops_per_token(const ModelConfig& config, int64_t seq);

}  // namespace flare::train
