// model.h — the whole GPT or LLaMA model on the CPU in fp32: forward to the loss, backward to the
// gradient of every parameter.
//
// The model reads its weights from one flat buffer laid out by parameter_layout(config) and writes
// gradients into a second buffer of the same layout, so the optimizer, checkpoints and the CUDA
// model all share one view of the parameters. Each block is pre-norm:
//
//   x = embed(tokens) (+ pos_embed)                                   (N, d)
//   for each layer:  x = x + attn.out(attention(rope(attn.qkv(norm(x)))))
//                    x = x + mlp(norm(x))
//                        mlp: GPT proj(gelu(fc(·))), LLaMA down(swiglu(gate_up(·)))
//   logits = final_norm(x) · headᵀ            (N, padded_vocab), head = embed when tied
//   loss = mean cross-entropy over the targets that are not −1
//
// The attention core is flare's own attention_forward / attention_backward (causal, GQA native:
// K and V keep n_kv_head heads), called on strided views into the fused qkv rows, so q, k and v
// are never copied out. It is the CPU flash backend, fp32 in and out.
//
// Context parallel (create() with a communicator of several ranks): each rank runs its own model
// on its share of every sequence, the rows the zigzag layout gives it (dist.h sequence_shard:
// chunks r and 2·ranks − 1 − r of 2·ranks), at their global positions (RoPE and the learned
// position embedding read positions()); the attention core is flare's context-parallel attention
// over the communicator, every other layer works row by row as before. The loss and gradients are
// then this rank's share, which data parallelism over all ranks adds up (backend.h).
//
// Activations live in buffers owned by the model, sized once for (batch, seq_len); forward()
// keeps everything backward() needs. Gradients are accumulated (+=) into the caller's buffer, so
// the caller zeroes it once per optimizer step and micro-batches add up.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "flare/dist.h"
#include "flare/status.h"
#include "train/core/model_config.h"
#include "train/cpu/ops.h"

namespace flare::train::cpu {

// Where one layer's tensors start in the flat parameter (and gradient) buffer; −1 for a tensor
// the family does not have (biases in LLaMA, fc/proj in LLaMA, gate_up/down in GPT).
struct LayerOffsets {
  int64_t attn_norm_weight = -1, attn_norm_bias = -1;
  int64_t qkv_weight = -1, qkv_bias = -1;
  int64_t attn_out_weight = -1, attn_out_bias = -1;
  int64_t mlp_norm_weight = -1, mlp_norm_bias = -1;
  int64_t fc_weight = -1, fc_bias = -1;          // GPT (ffn, d)
  int64_t proj_weight = -1, proj_bias = -1;      // GPT (d, ffn)
  int64_t gate_up_weight = -1;                   // LLaMA (2·ffn, d)
  int64_t down_weight = -1;                      // LLaMA (d, ffn)
};

// The activations of one layer that its backward reads. N = batch · seq_len tokens.
struct LayerActivations {
  std::vector<float> input;          // (N, d) the residual stream entering the layer
  std::vector<float> attn_norm;      // (N, d) norm(input)
  std::vector<float> attn_norm_mean; // (N) GPT only (LayerNorm)
  std::vector<float> attn_norm_rstd; // (N)
  std::vector<float> qkv;            // (N, (n_head + 2·n_kv_head)·head_dim), q and k after RoPE
  std::vector<float> attn_out;       // (N, n_head·head_dim) = (B, T, n_head, head_dim)
  std::vector<float> attn_lse;       // (B, n_head, T) attention's log-sum-exp
  std::vector<float> mid;            // (N, d) input + attention branch
  std::vector<float> mlp_norm;       // (N, d) norm(mid)
  std::vector<float> mlp_norm_mean;  // (N) GPT only
  std::vector<float> mlp_norm_rstd;  // (N)
  std::vector<float> mlp_in;         // GPT (N, ffn) fc output before GELU; LLaMA (N, 2·ffn) gate_up
  std::vector<float> mlp_act;        // (N, ffn) GELU or SwiGLU output
};

class CpuModel {
 public:
  // Validates the config (validate_model_config) and the sizes: batch ≥ 1, 1 ≤ seq_len ≤
  // config.max_seq, and allocates the activations for batch × seq_len tokens.
  // With cp (not owned; outlives the model; a CPU communicator of more than one rank) the model is
  // this rank's part of a context-parallel group: seq_len is the global length, a multiple of
  // 2 · cp->size(), the model holds seq_len / cp->size() rows of each sequence (seq_len() below)
  // and create() is collective over cp.
  // attention_backend picks flare's CPU attention backend (kReference: float64 arithmetic rounded
  // to fp32 once, for comparisons against exact attention).
  static Status create(const ModelConfig& config, int64_t batch, int64_t seq_len,
                       std::unique_ptr<CpuModel>* out, dist::Communicator* cp = nullptr,
                       flare::Backend attention_backend = flare::Backend::kAuto);
  ~CpuModel();

  // Forward over tokens (batch, seq_len()) int32 in [0, vocab_size) — context parallel: this
  // rank's rows, positions() of each sequence, in that order. With targets (batch, seq_len())
  // int32 in [0, vocab_size) or −1 (ignored), writes the mean loss into *result and keeps
  // dlogits for backward(); targets may be nullptr to compute only the logits.
  // params: layout().total floats. Returns invalid_argument for an out-of-range token or target.
  Status forward(const float* params, const int32_t* tokens, const int32_t* targets,
                 ClassifierResult* result);

  // Backward of the last forward() that had targets, for the same params: accumulates (+=) the
  // gradient of the mean loss into grads (layout().total floats). Returns invalid_argument when
  // there was no such forward.
  Status backward(const float* params, float* grads);

  const ModelConfig& config() const { return config_; }
  const ParameterLayout& layout() const { return layout_; }
  int64_t batch() const { return batch_; }
  int64_t seq_len() const { return seq_len_; }  // rows per sequence this model holds
  // The global position of each of those rows (0 … seq_len() − 1 without context parallelism).
  const std::vector<int64_t>& positions() const { return positions_; }
  // (N, padded_vocab): the last forward's logits, or its dlogits once it had targets.
  const std::vector<float>& logits() const { return logits_; }

 private:
  CpuModel() = default;

  ModelConfig config_;
  ParameterLayout layout_;
  int64_t batch_ = 0, seq_len_ = 0;
  bool have_dlogits_ = false;
  AttentionOptions attention_;                           // causal, the chosen backend
  std::vector<int64_t> positions_;                       // (seq_len_)
  std::unique_ptr<dist::ContextParallelAttention> cp_;   // context parallel only

  // Offsets into the flat buffers.
  int64_t embed_ = -1, pos_embed_ = -1, final_norm_weight_ = -1, final_norm_bias_ = -1, head_ = -1;
  std::vector<LayerOffsets> layer_offsets_;

  // Forward activations. N = batch · seq_len, d = d_model.
  std::vector<int32_t> tokens_;           // (N) the last forward's tokens
  std::vector<float> rope_cos_, rope_sin_; // (seq_len, head_dim / 2) LLaMA only, row j at positions_[j]
  std::vector<LayerActivations> layers_;
  std::vector<float> final_in_;           // (N, d) the last layer's output
  std::vector<float> final_norm_;         // (N, d)
  std::vector<float> final_norm_mean_;    // (N) GPT only
  std::vector<float> final_norm_rstd_;    // (N)
  std::vector<float> logits_;             // (N, padded_vocab), dlogits after a forward with targets

  // Backward scratch, reused by every layer.
  std::vector<float> d_resid_;     // (N, d) gradient of the residual stream
  std::vector<float> d_norm_;      // (N, d) gradient of a norm's output
  std::vector<float> d_attn_out_;  // (N, n_head·head_dim)
  std::vector<float> d_qkv_;       // (N, (n_head + 2·n_kv_head)·head_dim)
  std::vector<float> d_q_;         // (N, n_head·head_dim) GQA/MQA only, see model.cpp
  std::vector<float> d_mlp_in_;    // (N, ffn) GPT or (N, 2·ffn) LLaMA
  std::vector<float> d_mlp_act_;   // (N, ffn)

  // One function per layer; see model.cpp.
  Status embed_forward(const float* params, const int32_t* tokens, float* x);
  void norm_forward(const float* params, int64_t weight, int64_t bias, const float* x, float* y,
                    float* mean, float* rstd);
  void norm_backward(const float* params, float* grads, int64_t weight, int64_t bias,
                     const float* dy, const float* x, const float* mean, const float* rstd,
                     float* dx);
  Status attention_block_forward(const float* params, const LayerOffsets& w, LayerActivations& a);
  Status attention_block_backward(const float* params, float* grads, const LayerOffsets& w,
                                  const LayerActivations& a);
  void mlp_block_forward(const float* params, const LayerOffsets& w, LayerActivations& a,
                         float* out);
  void mlp_block_backward(const float* params, float* grads, const LayerOffsets& w,
                          const LayerActivations& a);
  Status split_sequence(int64_t global_seq_len, dist::Communicator* cp);
  // The attention core: flare's attention, or the context-parallel group's.
  Status attend_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& o, const TensorView& lse);
  Status attend_backward(const TensorView& d_o, const TensorView& q, const TensorView& k,
                         const TensorView& v, const TensorView& o, const TensorView& lse,
                         const TensorView& dq, const TensorView& dk, const TensorView& dv);
};

}  // namespace flare::train::cpu
