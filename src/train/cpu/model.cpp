// model.cpp — the CPU model of model.h: one function per layer, then the step (forward, backward)
// read top to bottom. N = batch · seq_len tokens; d = d_model; H, K = query and key/value heads;
// hd = head_dim; qkv_width = (H + 2·K)·hd.
#include "train/cpu/model.h"

#include <algorithm>
#include <string>

#include "core/message.h"
#include "flare/attention.h"
#include "train/dist/cp_rows.h"

namespace flare::train::cpu {
namespace {

// The tensor at `offset` of a flat buffer, or nullptr for a tensor the family does not have.
const float* at(const float* base, int64_t offset) { return offset < 0 ? nullptr : base + offset; }
float* at(float* base, int64_t offset) { return offset < 0 ? nullptr : base + offset; }

size_t sz(int64_t n) { return static_cast<size_t>(n); }

// q, k and v as (B, T, heads, hd) views into the fused qkv rows (N, qkv_width): the heads of a
// token are consecutive, tokens qkv_width apart. Attention reads through these views, so nothing
// is copied; the const_cast only lets a read-only buffer be described by a TensorView.
struct QkvViews {
  TensorView q, k, v;
};

QkvViews qkv_views(const float* qkv, const ModelConfig& c, int64_t B, int64_t T) {
  float* base = const_cast<float*>(qkv);
  const int64_t hd = c.head_dim;
  const int64_t row = (c.n_head + 2 * c.n_kv_head) * hd;
  auto view = [&](int64_t first_head, int64_t heads) {
    return TensorView::strided(base + first_head * hd, DType::kFloat32, {B, T, heads, hd},
                               {T * row, row, hd, 1});
  };
  return {view(0, c.n_head), view(c.n_head, c.n_kv_head),
          view(c.n_head + c.n_kv_head, c.n_kv_head)};
}

AttentionOptions causal_attention(flare::Backend backend) {
  AttentionOptions options;
  options.causal = true;  // softmax_scale 0: 1/sqrt(head_dim)
  options.backend = backend;
  return options;
}

int64_t offset_of(const ParameterLayout& layout, const std::string& name) {
  const ParamSpec* p = layout.find(name);
  return p ? p->offset : -1;
}

}  // namespace

// ---- Construction -------------------------------------------------------------------------------

CpuModel::~CpuModel() = default;

Status CpuModel::create(const ModelConfig& config, int64_t batch, int64_t global_seq_len,
                        std::unique_ptr<CpuModel>* out, dist::Communicator* cp,
                        flare::Backend attention_backend) {
  FLARE_RETURN_IF_ERROR(validate_model_config(config));
  if (batch < 1) return invalid("batch = ", batch, " must be at least 1");
  if (global_seq_len < 1 || global_seq_len > config.max_seq) {
    return invalid("seq_len = ", global_seq_len, " must be in [1, max_seq = ", config.max_seq, "]");
  }
  std::unique_ptr<CpuModel> m(new CpuModel());
  m->config_ = config;
  m->layout_ = parameter_layout(config);
  m->batch_ = batch;
  m->attention_ = causal_attention(attention_backend);
  FLARE_RETURN_IF_ERROR(m->split_sequence(global_seq_len, cp));
  const int64_t seq_len = m->seq_len_;

  const ParameterLayout& L = m->layout_;
  m->embed_ = offset_of(L, "embed.weight");
  m->pos_embed_ = offset_of(L, "pos_embed.weight");
  m->final_norm_weight_ = offset_of(L, "final_norm.weight");
  m->final_norm_bias_ = offset_of(L, "final_norm.bias");
  m->head_ = config.tied_embeddings ? m->embed_ : offset_of(L, "head.weight");
  for (int64_t i = 0; i < config.n_layer; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    LayerOffsets w;
    w.attn_norm_weight = offset_of(L, p + "attn_norm.weight");
    w.attn_norm_bias = offset_of(L, p + "attn_norm.bias");
    w.qkv_weight = offset_of(L, p + "attn.qkv.weight");
    w.qkv_bias = offset_of(L, p + "attn.qkv.bias");
    w.attn_out_weight = offset_of(L, p + "attn.out.weight");
    w.attn_out_bias = offset_of(L, p + "attn.out.bias");
    w.mlp_norm_weight = offset_of(L, p + "mlp_norm.weight");
    w.mlp_norm_bias = offset_of(L, p + "mlp_norm.bias");
    w.fc_weight = offset_of(L, p + "mlp.fc.weight");
    w.fc_bias = offset_of(L, p + "mlp.fc.bias");
    w.proj_weight = offset_of(L, p + "mlp.proj.weight");
    w.proj_bias = offset_of(L, p + "mlp.proj.bias");
    w.gate_up_weight = offset_of(L, p + "mlp.gate_up.weight");
    w.down_weight = offset_of(L, p + "mlp.down.weight");
    m->layer_offsets_.push_back(w);
  }

  const bool gpt = config.family == Family::kGpt;
  const int64_t N = batch * seq_len, d = config.d_model, H = config.n_head;
  const int64_t hd = config.head_dim, ffn = config.ffn_hidden;
  const int64_t qkv_width = (H + 2 * config.n_kv_head) * hd;
  const int64_t mlp_in_width = gpt ? ffn : 2 * ffn;
  const int64_t stats = gpt ? N : 0;  // LayerNorm keeps means; RMSNorm has none

  m->tokens_.resize(sz(N));
  if (!gpt) {
    m->rope_cos_.resize(sz(seq_len * hd / 2));
    m->rope_sin_.resize(sz(seq_len * hd / 2));
    rope_table(m->rope_cos_.data(), m->rope_sin_.data(), seq_len, hd, config.rope_theta,
               config.rope_scaling, m->positions_.data());
  }
  m->layers_.resize(sz(config.n_layer));
  for (LayerActivations& a : m->layers_) {
    a.input.resize(sz(N * d));
    a.attn_norm.resize(sz(N * d));
    a.attn_norm_mean.resize(sz(stats));
    a.attn_norm_rstd.resize(sz(N));
    a.qkv.resize(sz(N * qkv_width));
    a.attn_out.resize(sz(N * H * hd));
    a.attn_lse.resize(sz(batch * H * seq_len));
    a.mid.resize(sz(N * d));
    a.mlp_norm.resize(sz(N * d));
    a.mlp_norm_mean.resize(sz(stats));
    a.mlp_norm_rstd.resize(sz(N));
    a.mlp_in.resize(sz(N * mlp_in_width));
    a.mlp_act.resize(sz(N * ffn));
  }
  m->final_in_.resize(sz(N * d));
  m->final_norm_.resize(sz(N * d));
  m->final_norm_mean_.resize(sz(stats));
  m->final_norm_rstd_.resize(sz(N));
  m->logits_.resize(sz(N * config.padded_vocab));

  m->d_resid_.resize(sz(N * d));
  m->d_norm_.resize(sz(N * d));
  m->d_attn_out_.resize(sz(N * H * hd));
  m->d_qkv_.resize(sz(N * qkv_width));
  if (config.n_kv_head != H) m->d_q_.resize(sz(N * H * hd));
  m->d_mlp_in_.resize(sz(N * mlp_in_width));
  m->d_mlp_act_.resize(sz(N * ffn));
  *out = std::move(m);
  return Status::ok_status();
}

// This model's rows of each sequence: all of them, or a context-parallel rank's zigzag share.
Status CpuModel::split_sequence(int64_t global_seq_len, dist::Communicator* cp) {
  if (cp && cp->size() > 1 && cp->device() != DeviceType::kCPU) {
    return invalid("cp: the CPU model needs a communicator over host memory, got ", cp->kind());
  }
  FLARE_RETURN_IF_ERROR(dp::context_parallel_rows(global_seq_len, cp, &positions_));
  seq_len_ = static_cast<int64_t>(positions_.size());
  if (!cp || cp->size() == 1) return Status::ok_status();
  return dp::make_context_parallel_attention(cp, config_, batch_, global_seq_len, DType::kFloat32,
                                             attention_, &cp_);
}

Status CpuModel::attend_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                                const TensorView& o, const TensorView& lse) {
  return cp_ ? cp_->forward(q, k, v, o, lse) : attention_forward(q, k, v, o, lse, attention_);
}

Status CpuModel::attend_backward(const TensorView& d_o, const TensorView& q, const TensorView& k,
                                 const TensorView& v, const TensorView& o, const TensorView& lse,
                                 const TensorView& dq, const TensorView& dk, const TensorView& dv) {
  return cp_ ? cp_->backward(d_o, q, k, v, o, lse, dq, dk, dv)
             : attention_backward(d_o, q, k, v, o, lse, dq, dk, dv, attention_);
}

// ---- Layers -------------------------------------------------------------------------------------

// tokens (N) → x (N, d): token embedding, plus the learned position embedding for GPT.
Status CpuModel::embed_forward(const float* params, const int32_t* tokens, float* x) {
  return embedding_forward(tokens, params + embed_, at(params, pos_embed_), x, batch_ * seq_len_,
                           seq_len_, config_.vocab_size, config_.d_model, positions_.data());
}

// The family's norm: LayerNorm with bias (GPT; saves mean and rstd) or RMSNorm (LLaMA; saves rstd).
// x, y (N, d).
void CpuModel::norm_forward(const float* params, int64_t weight, int64_t bias, const float* x,
                            float* y, float* mean, float* rstd) {
  const int64_t N = batch_ * seq_len_, d = config_.d_model;
  if (config_.family == Family::kGpt) {
    layernorm_forward(x, params + weight, params + bias, y, mean, rstd, N, d, config_.norm_eps);
  } else {
    rmsnorm_forward(x, params + weight, y, rstd, N, d, config_.norm_eps);
  }
}

// dy (N, d) → dx (N, d) accumulated, as the norms' backward (the residual stream's gradient).
void CpuModel::norm_backward(const float* params, float* grads, int64_t weight, int64_t bias,
                             const float* dy, const float* x, const float* mean, const float* rstd,
                             float* dx) {
  const int64_t N = batch_ * seq_len_, d = config_.d_model;
  if (config_.family == Family::kGpt) {
    layernorm_backward(dy, x, params + weight, mean, rstd, dx, grads + weight, grads + bias, N, d);
  } else {
    rmsnorm_backward(dy, x, params + weight, rstd, dx, grads + weight, N, d);
  }
}

// a.input (N, d) → a.mid (N, d) = input + out(attention(rope(qkv(norm(input))))).
Status CpuModel::attention_block_forward(const float* params, const LayerOffsets& w,
                                         LayerActivations& a) {
  const ModelConfig& c = config_;
  const int64_t N = batch_ * seq_len_, d = c.d_model;
  const int64_t q_width = c.n_head * c.head_dim;
  const int64_t qkv_width = (c.n_head + 2 * c.n_kv_head) * c.head_dim;

  norm_forward(params, w.attn_norm_weight, w.attn_norm_bias, a.input.data(), a.attn_norm.data(),
               a.attn_norm_mean.data(), a.attn_norm_rstd.data());
  // (N, d) → (N, qkv_width)
  matmul_forward(a.attn_norm.data(), params + w.qkv_weight, at(params, w.qkv_bias), a.qkv.data(),
                 N, d, qkv_width);
  if (c.family == Family::kLlama) {
    rope_forward(a.qkv.data(), rope_cos_.data(), rope_sin_.data(), N, seq_len_, c.n_head,
                 c.n_kv_head, c.head_dim);
  }
  // (B, T, H, hd) from strided q, k, v views; lse (B, H, T).
  const QkvViews qkv = qkv_views(a.qkv.data(), c, batch_, seq_len_);
  const TensorView o = TensorView::contiguous(a.attn_out.data(), DType::kFloat32,
                                              {batch_, seq_len_, c.n_head, c.head_dim});
  const TensorView lse = TensorView::contiguous(a.attn_lse.data(), DType::kFloat32,
                                                {batch_, c.n_head, seq_len_});
  FLARE_RETURN_IF_ERROR(attend_forward(qkv.q, qkv.k, qkv.v, o, lse));
  // (N, q_width) → (N, d), then the residual add.
  matmul_forward(a.attn_out.data(), params + w.attn_out_weight, at(params, w.attn_out_bias),
                 a.mid.data(), N, q_width, d);
  residual_forward(a.input.data(), a.mid.data(), a.mid.data(), N * d);
  return Status::ok_status();
}

// d_resid_ (N, d): on entry the gradient of a.mid; on return that of a.input (the skip path
// passes it through unchanged and the norm's backward adds the branch's share).
Status CpuModel::attention_block_backward(const float* params, float* grads,
                                          const LayerOffsets& w, const LayerActivations& a) {
  const ModelConfig& c = config_;
  const int64_t N = batch_ * seq_len_, d = c.d_model;
  const int64_t q_width = c.n_head * c.head_dim;
  const int64_t qkv_width = (c.n_head + 2 * c.n_kv_head) * c.head_dim;

  // (N, d) → (N, q_width)
  matmul_backward(d_resid_.data(), a.attn_out.data(), params + w.attn_out_weight,
                  d_attn_out_.data(), grads + w.attn_out_weight, at(grads, w.attn_out_bias), N,
                  q_width, d);
  const QkvViews qkv = qkv_views(a.qkv.data(), c, batch_, seq_len_);
  QkvViews d_qkv = qkv_views(d_qkv_.data(), c, batch_, seq_len_);
  // flare's overlap check is exact only between views of one shape, so under GQA (fewer K/V heads
  // than Q heads) it rejects a dq interleaved with dk and dv although they share no element: dq
  // goes to its own buffer and is copied into the dqkv rows after the call.
  const bool separate_dq = c.n_kv_head != c.n_head;
  if (separate_dq) {
    d_qkv.q = TensorView::contiguous(d_q_.data(), DType::kFloat32,
                                     {batch_, seq_len_, c.n_head, c.head_dim});
  }
  const auto o = TensorView::contiguous(const_cast<float*>(a.attn_out.data()), DType::kFloat32,
                                        {batch_, seq_len_, c.n_head, c.head_dim});
  const auto lse = TensorView::contiguous(const_cast<float*>(a.attn_lse.data()), DType::kFloat32,
                                          {batch_, c.n_head, seq_len_});
  const auto d_o = TensorView::contiguous(d_attn_out_.data(), DType::kFloat32,
                                          {batch_, seq_len_, c.n_head, c.head_dim});
  FLARE_RETURN_IF_ERROR(attend_backward(d_o, qkv.q, qkv.k, qkv.v, o, lse, d_qkv.q, d_qkv.k, d_qkv.v));
  if (separate_dq) {
    for (int64_t n = 0; n < N; ++n) {
      std::copy(d_q_.begin() + n * q_width, d_q_.begin() + (n + 1) * q_width,
                d_qkv_.begin() + n * qkv_width);
    }
  }
  if (c.family == Family::kLlama) {
    rope_backward(d_qkv_.data(), rope_cos_.data(), rope_sin_.data(), N, seq_len_, c.n_head,
                  c.n_kv_head, c.head_dim);
  }
  // (N, qkv_width) → (N, d)
  matmul_backward(d_qkv_.data(), a.attn_norm.data(), params + w.qkv_weight, d_norm_.data(),
                  grads + w.qkv_weight, at(grads, w.qkv_bias), N, d, qkv_width);
  norm_backward(params, grads, w.attn_norm_weight, w.attn_norm_bias, d_norm_.data(),
                a.input.data(), a.attn_norm_mean.data(), a.attn_norm_rstd.data(), d_resid_.data());
  return Status::ok_status();
}

// a.mid (N, d) → out (N, d) = mid + mlp(norm(mid)).
void CpuModel::mlp_block_forward(const float* params, const LayerOffsets& w, LayerActivations& a,
                                 float* out) {
  const ModelConfig& c = config_;
  const int64_t N = batch_ * seq_len_, d = c.d_model, ffn = c.ffn_hidden;
  norm_forward(params, w.mlp_norm_weight, w.mlp_norm_bias, a.mid.data(), a.mlp_norm.data(),
               a.mlp_norm_mean.data(), a.mlp_norm_rstd.data());
  if (c.family == Family::kGpt) {
    // (N, d) → (N, ffn) → GELU → (N, d)
    matmul_forward(a.mlp_norm.data(), params + w.fc_weight, params + w.fc_bias, a.mlp_in.data(),
                   N, d, ffn);
    gelu_forward(a.mlp_in.data(), a.mlp_act.data(), N * ffn);
    matmul_forward(a.mlp_act.data(), params + w.proj_weight, params + w.proj_bias, out, N, ffn, d);
  } else {
    // (N, d) → (N, 2·ffn) → SwiGLU → (N, ffn) → (N, d)
    matmul_forward(a.mlp_norm.data(), params + w.gate_up_weight, nullptr, a.mlp_in.data(), N, d,
                   2 * ffn);
    swiglu_forward(a.mlp_in.data(), a.mlp_act.data(), N, ffn);
    matmul_forward(a.mlp_act.data(), params + w.down_weight, nullptr, out, N, ffn, d);
  }
  residual_forward(a.mid.data(), out, out, N * d);
}

// d_resid_ (N, d): on entry the gradient of the layer's output; on return that of a.mid.
void CpuModel::mlp_block_backward(const float* params, float* grads, const LayerOffsets& w,
                                  const LayerActivations& a) {
  const ModelConfig& c = config_;
  const int64_t N = batch_ * seq_len_, d = c.d_model, ffn = c.ffn_hidden;
  if (c.family == Family::kGpt) {
    matmul_backward(d_resid_.data(), a.mlp_act.data(), params + w.proj_weight, d_mlp_act_.data(),
                    grads + w.proj_weight, grads + w.proj_bias, N, ffn, d);
    gelu_backward(d_mlp_act_.data(), a.mlp_in.data(), d_mlp_in_.data(), N * ffn);
    matmul_backward(d_mlp_in_.data(), a.mlp_norm.data(), params + w.fc_weight, d_norm_.data(),
                    grads + w.fc_weight, grads + w.fc_bias, N, d, ffn);
  } else {
    matmul_backward(d_resid_.data(), a.mlp_act.data(), params + w.down_weight, d_mlp_act_.data(),
                    grads + w.down_weight, nullptr, N, ffn, d);
    swiglu_backward(d_mlp_act_.data(), a.mlp_in.data(), d_mlp_in_.data(), N, ffn);
    matmul_backward(d_mlp_in_.data(), a.mlp_norm.data(), params + w.gate_up_weight,
                    d_norm_.data(), grads + w.gate_up_weight, nullptr, N, d, 2 * ffn);
  }
  norm_backward(params, grads, w.mlp_norm_weight, w.mlp_norm_bias, d_norm_.data(), a.mid.data(),
                a.mlp_norm_mean.data(), a.mlp_norm_rstd.data(), d_resid_.data());
}

// ---- The step -----------------------------------------------------------------------------------

Status CpuModel::forward(const float* params, const int32_t* tokens, const int32_t* targets,
                         ClassifierResult* result) {
  const ModelConfig& c = config_;
  const int64_t N = batch_ * seq_len_, d = c.d_model;
  have_dlogits_ = false;

  // tokens (N) → x (N, d)
  FLARE_RETURN_IF_ERROR(embed_forward(params, tokens, layers_.empty() ? final_in_.data()
                                                                      : layers_[0].input.data()));
  std::copy(tokens, tokens + N, tokens_.begin());

  // Each layer's output is the next layer's input; the last one's is final_in_.
  for (size_t i = 0; i < layers_.size(); ++i) {
    LayerActivations& a = layers_[i];
    float* out = i + 1 < layers_.size() ? layers_[i + 1].input.data() : final_in_.data();
    FLARE_RETURN_IF_ERROR(attention_block_forward(params, layer_offsets_[i], a));
    mlp_block_forward(params, layer_offsets_[i], a, out);
  }

  // (N, d) → final norm → (N, padded_vocab) logits through the head (no bias).
  norm_forward(params, final_norm_weight_, final_norm_bias_, final_in_.data(), final_norm_.data(),
               final_norm_mean_.data(), final_norm_rstd_.data());
  matmul_forward(final_norm_.data(), params + head_, nullptr, logits_.data(), N, d,
                 c.padded_vocab);
  if (!targets) return Status::ok_status();

  // The loss, and its gradient written over the logits.
  FLARE_RETURN_IF_ERROR(classifier_forward_backward(logits_.data(), targets, nullptr,
                                                    logits_.data(), result, N, c.vocab_size,
                                                    c.padded_vocab));
  have_dlogits_ = true;
  return Status::ok_status();
}

Status CpuModel::backward(const float* params, float* grads) {
  if (!have_dlogits_) {
    return invalid("backward: needs a forward with targets first (the loss's gradient)");
  }
  const ModelConfig& c = config_;
  const int64_t N = batch_ * seq_len_, d = c.d_model;

  // dlogits (N, padded_vocab) → d final_norm (N, d) → d_resid_ (N, d), the last layer's output.
  matmul_backward(logits_.data(), final_norm_.data(), params + head_, d_norm_.data(),
                  grads + head_, nullptr, N, d, c.padded_vocab);
  std::fill(d_resid_.begin(), d_resid_.end(), 0.0f);
  norm_backward(params, grads, final_norm_weight_, final_norm_bias_, d_norm_.data(),
                final_in_.data(), final_norm_mean_.data(), final_norm_rstd_.data(),
                d_resid_.data());

  for (size_t i = layers_.size(); i-- > 0;) {
    mlp_block_backward(params, grads, layer_offsets_[i], layers_[i]);
    FLARE_RETURN_IF_ERROR(attention_block_backward(params, grads, layer_offsets_[i], layers_[i]));
  }

  // d_resid_ is now the gradient of the embedding output.
  embedding_backward(d_resid_.data(), tokens_.data(), grads + embed_, at(grads, pos_embed_), N,
                     seq_len_, d, positions_.data());
  return Status::ok_status();
}

}  // namespace flare::train::cpu
