// safetensors.h — exporting trained weights as a .safetensors file that PyTorch code loads by
// name: Hugging Face LlamaForCausalLM names for the LLaMA family, nanoGPT's names for GPT.
//
// The format: an 8-byte little-endian u64 N, then N bytes of JSON, then the raw tensor bytes.
// The JSON maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]}, offsets in
// bytes from the start of the data section; the tensors must tile that section exactly (no
// gaps, no overlap) and names must be unique. An optional "__metadata__" maps strings to strings;
// transformers reads "format": "pt" from it. We pad the JSON with trailing spaces so the data
// starts 8-byte aligned (the format allows it) and write tensors in model order.
//
// Mapping from flare's layout (model_config.h):
//   LLaMA  embed.weight → model.embed_tokens.weight; layers.N.attn_norm → model.layers.N.
//          input_layernorm; attn.qkv rows → self_attn.{q,k,v}_proj (the fused rows split: q
//          heads, k heads, v heads; RoPE pairs as HF's rotate-half, so no row permutation);
//          attn.out → self_attn.o_proj; mlp_norm → post_attention_layernorm; mlp.gate_up rows →
//          mlp.{gate,up}_proj; mlp.down → mlp.down_proj; final_norm → model.norm; head →
//          lm_head.weight, absent when tied (transformers ties it back to embed_tokens).
//   GPT    nanoGPT's nn.Linear (out, in) weights: transformer.wte / wpe, transformer.h.N.{ln_1,
//          attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj}, transformer.ln_f; lm_head is
//          tied (nanoGPT ties it on construction), so it is only written for an untied config.
//          (Hugging Face's GPT2LMHeadModel stores Conv1D weights as (in, out): transpose there.)
// Embedding and head rows are cut back from padded_vocab to vocab_size.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flare/status.h"
#include "flare/tensor.h"
#include "train/core/model_config.h"

namespace flare::train {

// One exported tensor: a contiguous range of the flat buffer under its PyTorch name.
struct ExportTensor {
  std::string name;
  std::vector<int64_t> shape;
  int64_t offset = 0;  // elements from the start of the flat buffer
  int64_t numel = 0;
};

// The exported tensors of a valid config, in file order.
std::vector<ExportTensor> export_tensors(const ModelConfig& config);

// Writes the weights in `params` (the fp32 master buffer, n = parameter_layout(config).total
// elements) to `path` atomically, as DType::kFloat32 or DType::kBFloat16 (round to nearest even).
Status export_safetensors(const std::string& path, const ModelConfig& config, const float* params,
                          int64_t n, DType dtype);

}  // namespace flare::train
