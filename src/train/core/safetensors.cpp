// safetensors.cpp — flare's layout renamed and split into PyTorch's tensors, and the writer of
// the .safetensors file (format and mapping in safetensors.h).
#include "train/core/safetensors.h"

#include <algorithm>
#include <bit>
#include <cstdio>

#include "core/message.h"
#include "core/numeric.h"
#include "train/core/atomic_file.h"

namespace flare::train {
namespace {

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian");

// Rows [row_begin, row_begin + rows) of a 2-D tensor (or all of a 1-D one) under a new name.
ExportTensor rows_of(const ParamSpec& p, const std::string& name, int64_t row_begin, int64_t rows) {
  const int64_t cols = p.shape.size() == 2 ? p.shape[1] : 1;
  ExportTensor t;
  t.name = name;
  t.shape = p.shape.size() == 2 ? std::vector<int64_t>{rows, cols} : std::vector<int64_t>{rows};
  t.offset = p.offset + row_begin * cols;
  t.numel = rows * cols;
  return t;
}

ExportTensor whole(const ParamSpec& p, const std::string& name) {
  return rows_of(p, name, 0, p.shape[0]);
}

class Exporter {
 public:
  explicit Exporter(const ModelConfig& c) : c_(c), layout_(parameter_layout(c)) {}

  const ParamSpec& param(const std::string& name) const { return *layout_.find(name); }
  void add(ExportTensor t) { out_.push_back(std::move(t)); }
  void add_whole(const std::string& from, const std::string& to) { add(whole(param(from), to)); }
  // A weight and, where the family has them, its bias.
  void add_with_bias(const std::string& from, const std::string& to) {
    add_whole(from + ".weight", to + ".weight");
    if (c_.family == Family::kGpt) add_whole(from + ".bias", to + ".bias");
  }
  void add_vocab_rows(const std::string& from, const std::string& to) {
    add(rows_of(param(from), to, 0, c_.vocab_size));
  }
  std::vector<ExportTensor> finish() { return std::move(out_); }

 private:
  const ModelConfig& c_;
  ParameterLayout layout_;
  std::vector<ExportTensor> out_;
};

std::vector<ExportTensor> llama_tensors(const ModelConfig& c) {
  Exporter e(c);
  const int64_t q_rows = c.n_head * c.head_dim;
  const int64_t kv_rows = c.n_kv_head * c.head_dim;
  e.add_vocab_rows("embed.weight", "model.embed_tokens.weight");
  for (int64_t i = 0; i < c.n_layer; ++i) {
    const std::string from = "layers." + std::to_string(i) + ".";
    const std::string to = "model.layers." + std::to_string(i) + ".";
    e.add_whole(from + "attn_norm.weight", to + "input_layernorm.weight");
    const ParamSpec& qkv = e.param(from + "attn.qkv.weight");
    e.add(rows_of(qkv, to + "self_attn.q_proj.weight", 0, q_rows));
    e.add(rows_of(qkv, to + "self_attn.k_proj.weight", q_rows, kv_rows));
    e.add(rows_of(qkv, to + "self_attn.v_proj.weight", q_rows + kv_rows, kv_rows));
    e.add_whole(from + "attn.out.weight", to + "self_attn.o_proj.weight");
    e.add_whole(from + "mlp_norm.weight", to + "post_attention_layernorm.weight");
    const ParamSpec& gate_up = e.param(from + "mlp.gate_up.weight");
    e.add(rows_of(gate_up, to + "mlp.gate_proj.weight", 0, c.ffn_hidden));
    e.add(rows_of(gate_up, to + "mlp.up_proj.weight", c.ffn_hidden, c.ffn_hidden));
    e.add_whole(from + "mlp.down.weight", to + "mlp.down_proj.weight");
  }
  e.add_whole("final_norm.weight", "model.norm.weight");
  if (!c.tied_embeddings) e.add_vocab_rows("head.weight", "lm_head.weight");
  return e.finish();
}

std::vector<ExportTensor> gpt_tensors(const ModelConfig& c) {
  Exporter e(c);
  e.add_vocab_rows("embed.weight", "transformer.wte.weight");
  e.add_whole("pos_embed.weight", "transformer.wpe.weight");
  for (int64_t i = 0; i < c.n_layer; ++i) {
    const std::string from = "layers." + std::to_string(i) + ".";
    const std::string to = "transformer.h." + std::to_string(i) + ".";
    e.add_with_bias(from + "attn_norm", to + "ln_1");
    e.add_with_bias(from + "attn.qkv", to + "attn.c_attn");
    e.add_with_bias(from + "attn.out", to + "attn.c_proj");
    e.add_with_bias(from + "mlp_norm", to + "ln_2");
    e.add_with_bias(from + "mlp.fc", to + "mlp.c_fc");
    e.add_with_bias(from + "mlp.proj", to + "mlp.c_proj");
  }
  e.add_with_bias("final_norm", "transformer.ln_f");
  if (!c.tied_embeddings) e.add_vocab_rows("head.weight", "lm_head.weight");
  return e.finish();
}

// The JSON header, padded with spaces to a multiple of 8 bytes.
std::string header_json(const ModelConfig& c, const std::vector<ExportTensor>& tensors,
                        int64_t element_bytes, const char* dtype_tag) {
  std::string json = cat("{\"__metadata__\":{\"format\":\"pt\",\"flare_model\":\"", c.name,
                         "\",\"flare_family\":\"", family_name(c.family), "\"}");
  int64_t at = 0;
  for (const ExportTensor& t : tensors) {
    json += cat(",\"", t.name, "\":{\"dtype\":\"", dtype_tag, "\",\"shape\":[");
    for (size_t k = 0; k < t.shape.size(); ++k) json += cat(k ? "," : "", t.shape[k]);
    const int64_t end = at + t.numel * element_bytes;
    json += cat("],\"data_offsets\":[", at, ",", end, "]}");
    at = end;
  }
  json += "}";
  json.append((8 - json.size() % 8) % 8, ' ');
  return json;
}

// The tensor bytes, converted to bf16 a chunk at a time where asked.
bool write_data(FILE* f, const std::vector<ExportTensor>& tensors, const float* params, DType dtype) {
  std::vector<uint16_t> chunk(size_t{1} << 16);
  for (const ExportTensor& t : tensors) {
    const float* src = params + t.offset;
    if (dtype == DType::kFloat32) {
      const size_t count = static_cast<size_t>(t.numel);
      if (std::fwrite(src, sizeof(float), count, f) != count) return false;
      continue;
    }
    for (int64_t done = 0; done < t.numel;) {
      const size_t count = static_cast<size_t>(std::min<int64_t>(t.numel - done, static_cast<int64_t>(chunk.size())));
      for (size_t k = 0; k < count; ++k) chunk[k] = float_to_bf16(src[done + static_cast<int64_t>(k)]);
      if (std::fwrite(chunk.data(), sizeof(uint16_t), count, f) != count) return false;
      done += static_cast<int64_t>(count);
    }
  }
  return true;
}

}  // namespace

std::vector<ExportTensor> export_tensors(const ModelConfig& config) {
  return config.family == Family::kLlama ? llama_tensors(config) : gpt_tensors(config);
}

Status export_safetensors(const std::string& path, const ModelConfig& config, const float* params,
                          int64_t n, DType dtype) {
  if (params == nullptr) return invalid("params: must not be null");
  if (dtype != DType::kFloat32 && dtype != DType::kBFloat16)
    return invalid("dtype: ", dtype_name(dtype), " is not exported; use float32 or bfloat16");
  FLARE_RETURN_IF_ERROR(validate_model_config(config));
  const int64_t expected_n = parameter_layout(config).total;
  if (n != expected_n)
    return invalid("n: ", n, " must equal the layout's total = ", expected_n, " of model '",
                   config.name, "'");
  for (char ch : config.name) {
    if (ch == '"' || ch == '\\' || static_cast<unsigned char>(ch) < 0x20)
      return invalid("config.name: '", config.name, "' has a character JSON would need escaped");
  }

  const std::vector<ExportTensor> tensors = export_tensors(config);
  const bool bf16 = dtype == DType::kBFloat16;
  const std::string json = header_json(config, tensors, bf16 ? 2 : 4, bf16 ? "BF16" : "F32");
  const uint64_t json_bytes = json.size();
  return write_file_atomically(path, [&](FILE* f) {
    return std::fwrite(&json_bytes, sizeof json_bytes, 1, f) == 1 &&
           std::fwrite(json.data(), 1, json.size(), f) == json.size() &&
           write_data(f, tensors, params, dtype);
  });
}

}  // namespace flare::train
