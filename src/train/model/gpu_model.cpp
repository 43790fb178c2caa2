// gpu_model.cpp — the GPU model of gpu_model.h: buffers, one function per block, then the step
// (forward, backward) read top to bottom. N = batch · seq tokens; d = d_model; H, K = query and
// key/value heads; hd = head_dim; qkv_w = (H + 2·K)·hd; q_w = H·hd; mlp_in_w = ffn (GPT, the
// pre-GELU) or 2·ffn (LLaMA, gate_up).
#include "train/model/gpu_model.h"

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/message.h"
#include "flare/attention.h"
#include "train/cpu/ops.h"
#include "train/cuda/classifier.h"
#include "train/cuda/embedding.h"
#include "train/cuda/matmul.h"
#include "train/cuda/norm.h"
#include "train/cuda/rope.h"
#include "train/dist/cp_rows.h"
#include "train/cuda/swiglu.h"

namespace flare::train::cuda {
namespace {

constexpr int64_t kBufferAlignment = 256;

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Buffers are requested by size, then carved out of one allocation in request order.
class Arena {
 public:
  template <typename T>
  void request(T** target, int64_t count) {
    const int64_t bytes = round_up(count * static_cast<int64_t>(sizeof(T)), kBufferAlignment);
    requests_.push_back({bytes, [target](char* p) { *target = reinterpret_cast<T*>(p); }});
    total_ += bytes;
  }
  void request_bytes(void** target, int64_t bytes) {
    bytes = round_up(bytes, kBufferAlignment);
    requests_.push_back({bytes, [target](char* p) { *target = p; }});
    total_ += bytes;
  }
  int64_t total() const { return total_; }
  Status allocate(void** base) {
    FLARE_RETURN_IF_ERROR(cuda_status(kCudaContext, "GpuModel buffers",
                                      cudaMalloc(base, static_cast<size_t>(total_))));
    char* p = static_cast<char*>(*base);
    for (const auto& [bytes, assign] : requests_) {
      assign(p);
      p += bytes;
    }
    return Status::ok_status();
  }

 private:
  std::vector<std::pair<int64_t, std::function<void(char*)>>> requests_;
  int64_t total_ = 0;
};

int64_t offset_of(const ParameterLayout& layout, const std::string& name) {
  const ParamSpec* p = layout.find(name);
  return p ? p->offset : -1;
}

}  // namespace

// A norm's parameters: offsets into the flat buffers (bias −1 for RMSNorm).
struct NormOffsets {
  int64_t weight = -1, bias = -1;
};

struct LayerOffsets {
  NormOffsets attn_norm, mlp_norm;
  int64_t qkv_weight = -1, qkv_bias = -1;
  int64_t out_weight = -1, out_bias = -1;
  int64_t up_weight = -1, up_bias = -1;      // GPT fc (ffn, d); LLaMA gate_up (2·ffn, d)
  int64_t down_weight = -1, down_bias = -1;  // GPT proj (d, ffn); LLaMA down (d, ffn)
};

// The activations of one layer that its backward reads.
struct LayerActivations {
  bf16* input = nullptr;       // (N, d) the residual stream entering the layer; kept per layer
  bf16* attn_norm = nullptr;   // (N, d)
  float* attn_mean = nullptr;  // (N) GPT only
  float* attn_rstd = nullptr;  // (N)
  bf16* qkv = nullptr;         // (N, qkv_w) q and k after RoPE
  bf16* attn_out = nullptr;    // (N, q_w) = (B, T, H, hd)
  float* lse = nullptr;        // (B, H, T)
  bf16* mid = nullptr;         // (N, d) input + attention branch
  bf16* mlp_norm = nullptr;    // (N, d)
  float* mlp_mean = nullptr;   // (N) GPT only
  float* mlp_rstd = nullptr;   // (N)
  bf16* mlp_in = nullptr;      // (N, mlp_in_w) GPT pre-GELU; LLaMA gate_up
  bf16* mlp_act = nullptr;     // (N, ffn) GELU or SwiGLU output
};

struct GpuModel::Impl {
  ParameterLayout layout;
  GpuModelOptions options;
  MatmulContext matmul;
  void* buffers = nullptr;

  // Offsets into the flat buffers.
  int64_t embed = -1, pos_embed = -1, head = -1;
  NormOffsets final_norm;
  std::vector<LayerOffsets> layer_offsets;

  // Forward activations; with recompute every layer's entries but `input` alias shared_.
  std::vector<LayerActivations> layers;
  float* rope_cos = nullptr;   // (seq, hd/2) LLaMA only
  float* rope_sin = nullptr;
  bf16* branch = nullptr;      // (N, d) a block's branch output before its residual add
  bf16* final_in = nullptr;    // (N, d) the last layer's output
  bf16* final_norm_out = nullptr;  // (N, d)
  float* final_mean = nullptr; // (N) GPT only
  float* final_rstd = nullptr; // (N)
  float* losses = nullptr;     // (N) per-token losses

  // Backward scratch, shared by every layer.
  bf16* d_resid = nullptr;     // (N, d) gradient of the residual stream
  bf16* d_norm = nullptr;      // (N, d) gradient of a norm's output
  bf16* d_attn_out = nullptr;  // (N, q_w)
  bf16* d_qkv = nullptr;       // (N, qkv_w)
  bf16* d_mlp_in = nullptr;    // (N, mlp_in_w)
  bf16* d_mlp_act = nullptr;   // (N, ffn) LLaMA only (GPT's DGELU epilogue skips it)
  void* norm_scratch = nullptr;
  void* embed_scratch = nullptr;
  int64_t* positions_device = nullptr;  // (T) positions, on the device (the position embedding's)
  bool have_dlogits = false;

  // Context parallelism (GpuModelOptions::cp): the rows' global positions and the group's plan.
  std::vector<int64_t> positions;
  std::unique_ptr<dist::ContextParallelAttention> cp;
  // The position embedding's rows, for the kernels: null (row j is position j) unless context parallel.
  const int64_t* embedding_positions() const { return cp ? positions_device : nullptr; }
};

namespace {

// Requests every buffer of the model for (B, T) into `arena`, filling `impl`'s pointers once the
// arena is allocated. Shared by create() and buffer_bytes() so the two cannot disagree.
void plan_buffers(const ModelConfig& c, int64_t B, int64_t T, bool recompute, int64_t total_params,
                  bool whole_gradient, bool bf16_grads, GpuModel::Impl* m, bf16** weights, float** grads,
                  bf16** grads16, bf16** logits, Arena* arena) {
  const bool gpt = c.family == Family::kGpt;
  const int64_t N = B * T, d = c.d_model, H = c.n_head, hd = c.head_dim, ffn = c.ffn_hidden;
  const int64_t qkv_w = (H + 2 * c.n_kv_head) * hd, q_w = H * hd;
  const int64_t mlp_in_w = gpt ? ffn : 2 * ffn;

  arena->request(weights, total_params);
  if (whole_gradient && bf16_grads)
    arena->request(grads16, total_params);
  else if (whole_gradient)
    arena->request(grads, total_params);
  m->layers.assign(static_cast<size_t>(c.n_layer), LayerActivations{});
  auto request_set = [&](LayerActivations& a) {
    arena->request(&a.attn_norm, N * d);
    if (gpt) arena->request(&a.attn_mean, N);
    arena->request(&a.attn_rstd, N);
    arena->request(&a.qkv, N * qkv_w);
    arena->request(&a.attn_out, N * q_w);
    arena->request(&a.lse, B * H * T);
    arena->request(&a.mid, N * d);
    arena->request(&a.mlp_norm, N * d);
    if (gpt) arena->request(&a.mlp_mean, N);
    arena->request(&a.mlp_rstd, N);
    arena->request(&a.mlp_in, N * mlp_in_w);
    arena->request(&a.mlp_act, N * ffn);
  };
  for (LayerActivations& a : m->layers) arena->request(&a.input, N * d);
  if (recompute) {
    // One set for all layers: requested through layer 0, copied to the others after allocation
    // (see create()).
    request_set(m->layers[0]);
  } else {
    for (LayerActivations& a : m->layers) request_set(a);
  }
  if (!gpt) {
    arena->request(&m->rope_cos, T * hd / 2);
    arena->request(&m->rope_sin, T * hd / 2);
  }
  arena->request(&m->branch, N * d);
  arena->request(&m->final_in, N * d);
  arena->request(&m->final_norm_out, N * d);
  if (gpt) arena->request(&m->final_mean, N);
  arena->request(&m->final_rstd, N);
  arena->request(logits, N * c.padded_vocab);
  arena->request(&m->losses, N);

  arena->request(&m->d_resid, N * d);
  arena->request(&m->d_norm, N * d);
  arena->request(&m->d_attn_out, N * q_w);
  arena->request(&m->d_qkv, N * qkv_w);
  arena->request(&m->d_mlp_in, N * mlp_in_w);
  if (!gpt) arena->request(&m->d_mlp_act, N * ffn);
  arena->request_bytes(&m->norm_scratch, norm_backward_scratch_bytes(N, d));
  arena->request_bytes(&m->embed_scratch, embedding_backward_scratch_bytes(c.vocab_size));
  arena->request(&m->positions_device, T);
}

// q, k and v as (B, T, heads, hd) views into fused qkv rows (N, qkv_w) on the device.
struct QkvViews {
  TensorView q, k, v;
};

QkvViews qkv_views(const bf16* qkv, const ModelConfig& c, int64_t B, int64_t T, int device) {
  bf16* base = const_cast<bf16*>(qkv);  // a TensorView describes read-only inputs too
  const int64_t hd = c.head_dim, row = (c.n_head + 2 * c.n_kv_head) * hd;
  auto view = [&](int64_t first_head, int64_t heads) {
    return TensorView::strided(base + first_head * hd, DType::kBFloat16, {B, T, heads, hd},
                               {T * row, row, hd, 1}, DeviceType::kCUDA, device);
  };
  return {view(0, c.n_head), view(c.n_head, c.n_kv_head), view(c.n_head + c.n_kv_head, c.n_kv_head)};
}

}  // namespace

// ---- Construction -------------------------------------------------------------------------------

GpuModel::GpuModel() : impl_(std::make_unique<Impl>()) {}

GpuModel::~GpuModel() {
  if (impl_ && impl_->buffers) cudaFree(impl_->buffers);
}

const ParameterLayout& GpuModel::layout() const { return impl_->layout; }

int64_t GpuModel::buffer_bytes(const ModelConfig& config, int64_t batch, int64_t seq, bool recompute,
                               bool whole_gradient, bool bf16_grads) {
  Impl impl;
  bf16 *weights = nullptr, *grads16 = nullptr, *logits = nullptr;
  float* grads = nullptr;
  Arena arena;
  plan_buffers(config, batch, seq, recompute, parameter_layout(config).total, whole_gradient, bf16_grads,
               &impl, &weights, &grads, &grads16, &logits, &arena);
  return arena.total();
}

Status GpuModel::create(const ModelConfig& config, int64_t batch, int64_t seq,
                        const GpuModelOptions& options, cudaStream_t stream,
                        std::unique_ptr<GpuModel>* out) {
  FLARE_RETURN_IF_ERROR(validate_model_config(config));
  if (batch < 1) return invalid("batch: ", batch, " must be at least 1");
  if (seq < 1 || seq > config.max_seq) {
    return invalid("seq: ", seq, " must be in [1, max_seq = ", config.max_seq, "]");
  }
  if (options.bf16_grads && !options.whole_gradient)
    return invalid("bf16_grads: needs the whole gradient on the model (whole_gradient)");
  std::unique_ptr<GpuModel> g(new GpuModel());
  g->config_ = config;
  g->batch_ = batch;
  g->stream_ = stream;
  Impl& m = *g->impl_;
  m.options = options;
  m.layout = parameter_layout(config);
  if (options.cp && options.cp->size() > 1 && options.cp->device() != DeviceType::kCUDA) {
    return invalid("cp: the GPU model needs a communicator over CUDA memory (NCCL), got ", options.cp->kind());
  }
  FLARE_RETURN_IF_ERROR(dp::context_parallel_rows(seq, options.cp, &m.positions));
  const int64_t global_seq = seq;
  seq = static_cast<int64_t>(m.positions.size());  // the rows this model holds, from here on
  g->seq_ = seq;

  const ParameterLayout& L = m.layout;
  m.embed = offset_of(L, "embed.weight");
  m.pos_embed = offset_of(L, "pos_embed.weight");
  m.final_norm = {offset_of(L, "final_norm.weight"), offset_of(L, "final_norm.bias")};
  m.head = config.tied_embeddings ? m.embed : offset_of(L, "head.weight");
  const bool gpt = config.family == Family::kGpt;
  for (int64_t i = 0; i < config.n_layer; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    LayerOffsets w;
    w.attn_norm = {offset_of(L, p + "attn_norm.weight"), offset_of(L, p + "attn_norm.bias")};
    w.mlp_norm = {offset_of(L, p + "mlp_norm.weight"), offset_of(L, p + "mlp_norm.bias")};
    w.qkv_weight = offset_of(L, p + "attn.qkv.weight");
    w.qkv_bias = offset_of(L, p + "attn.qkv.bias");
    w.out_weight = offset_of(L, p + "attn.out.weight");
    w.out_bias = offset_of(L, p + "attn.out.bias");
    w.up_weight = offset_of(L, p + (gpt ? "mlp.fc.weight" : "mlp.gate_up.weight"));
    w.up_bias = offset_of(L, p + "mlp.fc.bias");
    w.down_weight = offset_of(L, p + (gpt ? "mlp.proj.weight" : "mlp.down.weight"));
    w.down_bias = offset_of(L, p + "mlp.proj.bias");
    m.layer_offsets.push_back(w);
  }

  FLARE_RETURN_IF_ERROR(m.matmul.init());
  Arena arena;
  plan_buffers(config, batch, seq, options.recompute, L.total, options.whole_gradient, options.bf16_grads,
               &m, &g->weights_, &g->grads_, &g->grads16_, &g->logits_, &arena);
  FLARE_RETURN_IF_ERROR(arena.allocate(&m.buffers));
  if (options.recompute) {
    for (size_t i = 1; i < m.layers.size(); ++i) {
      bf16* input = m.layers[i].input;
      m.layers[i] = m.layers[0];
      m.layers[i].input = input;
    }
  }
  // Weights and gradients start at zero so the alignment gaps, which no kernel writes, are zero.
  FLARE_RETURN_IF_ERROR(cuda_status(
      kCudaContext, "GpuModel weights",
      cudaMemsetAsync(g->weights_, 0, static_cast<size_t>(L.total) * sizeof(bf16), stream)));
  if (g->gradient()) FLARE_RETURN_IF_ERROR(g->zero_grads());
  FLARE_RETURN_IF_ERROR(
      cuda_status(kCudaContext, "GpuModel positions",
                  cudaMemcpy(m.positions_device, m.positions.data(),
                             static_cast<size_t>(seq) * sizeof(int64_t), cudaMemcpyHostToDevice)));
  if (!gpt) {
    // The RoPE tables at the rows' positions, in double rounded once to fp32, by the CPU
    // reference's function.
    const size_t n = static_cast<size_t>(seq * config.head_dim / 2);
    std::vector<float> cos_table(n), sin_table(n);
    cpu::rope_table(cos_table.data(), sin_table.data(), seq, config.head_dim, config.rope_theta,
                    config.rope_scaling, m.positions.data());
    FLARE_RETURN_IF_ERROR(cuda_status(
        kCudaContext, "rope table",
        cudaMemcpy(m.rope_cos, cos_table.data(), n * sizeof(float), cudaMemcpyHostToDevice)));
    FLARE_RETURN_IF_ERROR(cuda_status(
        kCudaContext, "rope table",
        cudaMemcpy(m.rope_sin, sin_table.data(), n * sizeof(float), cudaMemcpyHostToDevice)));
  }
  if (options.cp && options.cp->size() > 1) {
    AttentionOptions attention;
    attention.causal = true;
    attention.deterministic = options.deterministic_attention;
    FLARE_RETURN_IF_ERROR(dp::make_context_parallel_attention(options.cp, config, batch, global_seq,
                                                              DType::kBFloat16, attention, &m.cp));
    FLARE_RETURN_IF_ERROR(m.cp->set_timing(true));  // the step's profile reports the exchanges
  }
  *out = std::move(g);
  return Status::ok_status();
}

const std::vector<int64_t>& GpuModel::positions() const { return impl_->positions; }

Status GpuModel::take_cp_timing(dist::CpTiming* out) {
  *out = {};
  return impl_->cp ? impl_->cp->take_timing(out) : Status::ok_status();
}

Status GpuModel::zero_grads() {
  if (!gradient()) return invalid("zero_grads: the model holds no whole gradient (GpuModelOptions::whole_gradient)");
  return cuda_status(
      kCudaContext, "zero_grads",
      cudaMemsetAsync(gradient().data(), 0,
                      static_cast<size_t>(impl_->layout.total * gradient().element_bytes()), stream_));
}

// ---- Blocks ---------------------------------------------------------------------------------------
// Each is a free function over the model's state so the step below reads top to bottom.

namespace {

struct Step {
  const ModelConfig& c;
  GpuModel::Impl& m;
  const bf16* w;   // weights
  GradientOut g;   // the whole gradient, or null: then `placement` says where each one goes
  const GradientPlacement* placement;
  int64_t B, T, N;
  cudaStream_t s;
  bool accumulate = true;  // backward: add into the gradients, or write them (the step's first)

  const bf16* W(int64_t offset) const { return offset < 0 ? nullptr : w + offset; }
  GradientOut G(int64_t offset) const {
    if (offset < 0) return {};
    return g ? g + offset : GradientOut(placement->gradient_at(offset));
  }
  bool gpt() const { return c.family == Family::kGpt; }
  int64_t g_bytes() const { return g ? g.element_bytes() : int64_t{sizeof(float)}; }
  float eps() const { return static_cast<float>(c.norm_eps); }
  AttentionOptions attention_options() const {
    AttentionOptions o;
    o.causal = true;  // softmax_scale 0: 1/sqrt(head_dim)
    o.deterministic = m.options.deterministic_attention;
    return o;
  }
  // The attention core: flare's attention on this device, or the context-parallel group's.
  Status attend_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& o, const TensorView& lse) const {
    return m.cp ? m.cp->forward(q, k, v, o, lse, s) : attention_forward(q, k, v, o, lse, attention_options(), {}, s);
  }
  Status attend_backward(const TensorView& d_o, const TensorView& q, const TensorView& k,
                         const TensorView& v, const TensorView& o, const TensorView& lse,
                         const TensorView& dq, const TensorView& dk, const TensorView& dv) const {
    return m.cp ? m.cp->backward(d_o, q, k, v, o, lse, dq, dk, dv, s)
                : attention_backward(d_o, q, k, v, o, lse, dq, dk, dv, attention_options(), {}, s);
  }
};

// x (N, d) → out (N, d), saving mean (GPT) and rstd.
Status norm_forward(const Step& st, const NormOffsets& n, const bf16* x, bf16* out, float* mean,
                    float* rstd) {
  const int64_t d = st.c.d_model;
  if (st.gpt()) {
    return layernorm_forward(x, st.W(n.weight), st.W(n.bias), out, mean, rstd, st.N, d, st.eps(), st.s);
  }
  return rmsnorm_forward(x, st.W(n.weight), out, rstd, st.N, d, st.eps(), st.s);
}

// residual_out = residual + branch; out = norm(residual_out).
Status residual_norm_forward(const Step& st, const NormOffsets& n, const bf16* residual,
                             const bf16* branch, bf16* residual_out, bf16* out, float* mean,
                             float* rstd) {
  const int64_t d = st.c.d_model;
  if (st.gpt()) {
    return residual_layernorm_forward(residual, branch, st.W(n.weight), st.W(n.bias), residual_out,
                                      out, mean, rstd, st.N, d, st.eps(), st.s);
  }
  return residual_rmsnorm_forward(residual, branch, st.W(n.weight), residual_out, out, rstd, st.N,
                                  d, st.eps(), st.s);
}

// dx = dresidual + ∂L/∂x (dresidual may be null); the norm's parameter gradients are added or
// written (st.accumulate).
Status norm_backward(const Step& st, const NormOffsets& n, const bf16* dout, const bf16* x,
                     const float* mean, const float* rstd, const bf16* dresidual, bf16* dx) {
  const int64_t d = st.c.d_model;
  if (st.gpt()) {
    return layernorm_backward(dout, x, st.W(n.weight), mean, rstd, dresidual, dx, st.G(n.weight),
                              st.G(n.bias), st.N, d, st.accumulate, st.m.norm_scratch, st.s);
  }
  return rmsnorm_backward(dout, x, st.W(n.weight), rstd, dresidual, dx, st.G(n.weight), st.N, d,
                          st.accumulate, st.m.norm_scratch, st.s);
}

// a.attn_norm (N, d) → a.mid = input + out(attention(rope(qkv(attn_norm)))) and a.mlp_norm.
Status attention_block_forward(const Step& st, const LayerOffsets& w, const LayerActivations& a) {
  const ModelConfig& c = st.c;
  const int64_t d = c.d_model, hd = c.head_dim;
  const int64_t qkv_w = (c.n_head + 2 * c.n_kv_head) * hd, q_w = c.n_head * hd;
  MatmulContext& mm = st.m.matmul;
  // (N, d) → (N, qkv_w)
  FLARE_RETURN_IF_ERROR(matmul_forward(mm, a.attn_norm, st.W(w.qkv_weight), st.W(w.qkv_bias), a.qkv,
                                       nullptr, st.N, d, qkv_w, st.s));
  if (!st.gpt()) {
    FLARE_RETURN_IF_ERROR(rope_forward(st.m.rope_cos, st.m.rope_sin, a.qkv, st.N, st.T, c.n_head,
                                       c.n_kv_head, hd, st.s));
  }
  // (B, T, H, hd) from strided views of the qkv rows; lse (B, H, T).
  const int dev = st.m.options.device_index;
  const QkvViews qkv = qkv_views(a.qkv, c, st.B, st.T, dev);
  const TensorView o = TensorView::contiguous(a.attn_out, DType::kBFloat16, {st.B, st.T, c.n_head, hd},
                                              DeviceType::kCUDA, dev);
  const TensorView lse = TensorView::contiguous(a.lse, DType::kFloat32, {st.B, c.n_head, st.T},
                                                DeviceType::kCUDA, dev);
  FLARE_RETURN_IF_ERROR(st.attend_forward(qkv.q, qkv.k, qkv.v, o, lse));
  // (N, q_w) → (N, d), then mid = input + branch fused with the MLP's norm.
  FLARE_RETURN_IF_ERROR(matmul_forward(mm, a.attn_out, st.W(w.out_weight), st.W(w.out_bias),
                                       st.m.branch, nullptr, st.N, q_w, d, st.s));
  return residual_norm_forward(st, w.mlp_norm, a.input, st.m.branch, a.mid, a.mlp_norm, a.mlp_mean,
                               a.mlp_rstd);
}

// a.mlp_norm (N, d) → a.mlp_act (N, ffn); with `next` the MLP output too, added to a.mid into
// next_input and normed by next_norm (the next layer's attention norm, or the final norm).
struct NextNorm {
  const NormOffsets* norm;
  bf16* input;   // the residual stream after this layer
  bf16* out;     // its norm
  float* mean;
  float* rstd;
};

Status mlp_block_forward(const Step& st, const LayerOffsets& w, const LayerActivations& a,
                         const NextNorm* next) {
  const int64_t d = st.c.d_model, ffn = st.c.ffn_hidden;
  MatmulContext& mm = st.m.matmul;
  if (st.gpt()) {
    // (N, d) → (N, ffn): mlp_in = fc(x) + b kept for the backward, mlp_act = gelu(mlp_in).
    FLARE_RETURN_IF_ERROR(matmul_forward(mm, a.mlp_norm, st.W(w.up_weight), st.W(w.up_bias),
                                         a.mlp_act, a.mlp_in, st.N, d, ffn, st.s));
  } else {
    // (N, d) → (N, 2·ffn) → SwiGLU → (N, ffn)
    FLARE_RETURN_IF_ERROR(matmul_forward(mm, a.mlp_norm, st.W(w.up_weight), nullptr, a.mlp_in,
                                         nullptr, st.N, d, 2 * ffn, st.s));
    FLARE_RETURN_IF_ERROR(swiglu_forward(a.mlp_in, a.mlp_act, st.N, ffn, st.s));
  }
  if (!next) return Status::ok_status();  // recomputation: the backward needs no more
  // (N, ffn) → (N, d), then the residual add fused with the next norm.
  FLARE_RETURN_IF_ERROR(matmul_forward(mm, a.mlp_act, st.W(w.down_weight), st.W(w.down_bias),
                                       st.m.branch, nullptr, st.N, ffn, d, st.s));
  return residual_norm_forward(st, *next->norm, a.mid, st.m.branch, next->input, next->out,
                               next->mean, next->rstd);
}

// d_resid (N, d): on entry the gradient of the layer's output; on return that of a.mid.
Status mlp_block_backward(const Step& st, const LayerOffsets& w, const LayerActivations& a) {
  const int64_t d = st.c.d_model, ffn = st.c.ffn_hidden;
  GpuModel::Impl& m = st.m;
  MatmulContext& mm = m.matmul;
  if (st.gpt()) {
    // proj: (N, d) → (N, ffn), gelu'(mlp_in) folded in by the DGELU epilogue.
    FLARE_RETURN_IF_ERROR(matmul_backward_input(mm, m.d_resid, st.W(w.down_weight), a.mlp_in,
                                                m.d_mlp_in, st.N, ffn, d, st.s));
    FLARE_RETURN_IF_ERROR(matmul_backward_weight(mm, m.d_resid, a.mlp_act, st.G(w.down_weight),
                                                 st.G(w.down_bias), st.N, ffn, d, st.accumulate, st.s));
    // fc: (N, ffn) → (N, d)
    FLARE_RETURN_IF_ERROR(matmul_backward_input(mm, m.d_mlp_in, st.W(w.up_weight), nullptr,
                                                m.d_norm, st.N, d, ffn, st.s));
    FLARE_RETURN_IF_ERROR(matmul_backward_weight(mm, m.d_mlp_in, a.mlp_norm, st.G(w.up_weight),
                                                 st.G(w.up_bias), st.N, d, ffn, st.accumulate, st.s));
  } else {
    // down: (N, d) → (N, ffn); SwiGLU: (N, ffn) → (N, 2·ffn); gate_up: (N, 2·ffn) → (N, d)
    FLARE_RETURN_IF_ERROR(matmul_backward_input(mm, m.d_resid, st.W(w.down_weight), nullptr,
                                                m.d_mlp_act, st.N, ffn, d, st.s));
    FLARE_RETURN_IF_ERROR(matmul_backward_weight(mm, m.d_resid, a.mlp_act, st.G(w.down_weight),
                                                 nullptr, st.N, ffn, d, st.accumulate, st.s));
    FLARE_RETURN_IF_ERROR(swiglu_backward(m.d_mlp_act, a.mlp_in, m.d_mlp_in, st.N, ffn, st.s));
    FLARE_RETURN_IF_ERROR(matmul_backward_input(mm, m.d_mlp_in, st.W(w.up_weight), nullptr,
                                                m.d_norm, st.N, d, 2 * ffn, st.s));
    FLARE_RETURN_IF_ERROR(matmul_backward_weight(mm, m.d_mlp_in, a.mlp_norm, st.G(w.up_weight),
                                                 nullptr, st.N, d, 2 * ffn, st.accumulate, st.s));
  }
  // The skip path passes d_resid through; the norm adds the branch's share in place.
  return norm_backward(st, w.mlp_norm, m.d_norm, a.mid, a.mlp_mean, a.mlp_rstd, m.d_resid, m.d_resid);
}

// d_resid (N, d): on entry the gradient of a.mid; on return that of a.input.
Status attention_block_backward(const Step& st, const LayerOffsets& w, const LayerActivations& a) {
  const ModelConfig& c = st.c;
  const int64_t d = c.d_model, hd = c.head_dim;
  const int64_t qkv_w = (c.n_head + 2 * c.n_kv_head) * hd, q_w = c.n_head * hd;
  GpuModel::Impl& m = st.m;
  MatmulContext& mm = m.matmul;
  // out: (N, d) → (N, q_w)
  FLARE_RETURN_IF_ERROR(matmul_backward_input(mm, m.d_resid, st.W(w.out_weight), nullptr,
                                              m.d_attn_out, st.N, q_w, d, st.s));
  FLARE_RETURN_IF_ERROR(matmul_backward_weight(mm, m.d_resid, a.attn_out, st.G(w.out_weight),
                                               st.G(w.out_bias), st.N, q_w, d, st.accumulate, st.s));
  // Attention: dq, dk, dv written straight into the dqkv rows through strided views (under GQA
  // the three views have different head counts; they interleave without sharing an element).
  const int dev = m.options.device_index;
  const QkvViews qkv = qkv_views(a.qkv, c, st.B, st.T, dev);
  const QkvViews dqkv = qkv_views(m.d_qkv, c, st.B, st.T, dev);
  const TensorView o = TensorView::contiguous(a.attn_out, DType::kBFloat16, {st.B, st.T, c.n_head, hd},
                                              DeviceType::kCUDA, dev);
  const TensorView lse = TensorView::contiguous(a.lse, DType::kFloat32, {st.B, c.n_head, st.T},
                                                DeviceType::kCUDA, dev);
  const TensorView d_o = TensorView::contiguous(m.d_attn_out, DType::kBFloat16,
                                                {st.B, st.T, c.n_head, hd}, DeviceType::kCUDA, dev);
  FLARE_RETURN_IF_ERROR(st.attend_backward(d_o, qkv.q, qkv.k, qkv.v, o, lse, dqkv.q, dqkv.k, dqkv.v));
  if (!st.gpt()) {
    FLARE_RETURN_IF_ERROR(rope_backward(m.rope_cos, m.rope_sin, m.d_qkv, st.N, st.T, c.n_head,
                                        c.n_kv_head, hd, st.s));
  }
  // qkv: (N, qkv_w) → (N, d)
  FLARE_RETURN_IF_ERROR(matmul_backward_input(mm, m.d_qkv, st.W(w.qkv_weight), nullptr, m.d_norm,
                                              st.N, d, qkv_w, st.s));
  FLARE_RETURN_IF_ERROR(matmul_backward_weight(mm, m.d_qkv, a.attn_norm, st.G(w.qkv_weight),
                                               st.G(w.qkv_bias), st.N, d, qkv_w, st.accumulate, st.s));
  return norm_backward(st, w.attn_norm, m.d_norm, a.input, a.attn_mean, a.attn_rstd, m.d_resid,
                       m.d_resid);
}

// The forward of layer i from a.input, as far as its backward needs (recomputation).
Status recompute_layer(const Step& st, size_t i) {
  const LayerActivations& a = st.m.layers[i];
  const LayerOffsets& w = st.m.layer_offsets[i];
  FLARE_RETURN_IF_ERROR(norm_forward(st, w.attn_norm, a.input, a.attn_norm, a.attn_mean, a.attn_rstd));
  FLARE_RETURN_IF_ERROR(attention_block_forward(st, w, a));
  return mlp_block_forward(st, w, a, nullptr);
}

// Layer i's stage number in the hooks' numbering (dp_plan.h's backward_stage).
int64_t layer_stage_number(int64_t n_layer, size_t i) { return 1 + (n_layer - 1 - static_cast<int64_t>(i)); }

Status call_hook(const GpuModel::StageHook& hook, int64_t stage) {
  return hook ? hook(stage) : Status::ok_status();
}

}  // namespace

// ---- The step -------------------------------------------------------------------------------------

Status GpuModel::forward(const int32_t* tokens, const int32_t* targets, float dloss_scale,
                         bool write_dlogits, double* loss_sum_out, const float* dloss_scale_device,
                         const StageHook& before_stage) {
  if (tokens == nullptr) return invalid("forward: tokens must not be null");
  if (targets && loss_sum_out == nullptr) return invalid("forward: loss_sum must not be null with targets");
  if (write_dlogits && targets == nullptr) return invalid("forward: write_dlogits needs targets");
  Impl& m = *impl_;
  const ModelConfig& c = config_;
  const Step st{c, m, weights_, gradient(), placement_, batch_, seq_, batch_ * seq_, stream_};
  m.have_dlogits = false;
  auto stage_next = [&](int64_t stage) { return call_hook(before_stage, stage); };
  const int64_t n_layer = static_cast<int64_t>(m.layers.size());
  auto layer_stage = [n_layer](size_t i) { return layer_stage_number(n_layer, i); };

  // tokens (N) → layer 0's input (N, d) → its attention norm.
  FLARE_RETURN_IF_ERROR(stage_next(n_layer + 1));
  FLARE_RETURN_IF_ERROR(stage_next(layer_stage(0)));
  LayerActivations& first = m.layers[0];
  FLARE_RETURN_IF_ERROR(embedding_forward(tokens, st.W(m.embed), st.W(m.pos_embed), first.input, st.N,
                                          seq_, c.vocab_size, c.d_model, stream_, m.embedding_positions()));
  FLARE_RETURN_IF_ERROR(norm_forward(st, m.layer_offsets[0].attn_norm, first.input, first.attn_norm,
                                     first.attn_mean, first.attn_rstd));
  for (size_t i = 0; i < m.layers.size(); ++i) {
    const LayerActivations& a = m.layers[i];
    FLARE_RETURN_IF_ERROR(stage_next(layer_stage(i)));
    FLARE_RETURN_IF_ERROR(attention_block_forward(st, m.layer_offsets[i], a));
    FLARE_RETURN_IF_ERROR(stage_next(i + 1 < m.layers.size() ? layer_stage(i + 1) : 0));
    NextNorm next;
    if (i + 1 < m.layers.size()) {
      const LayerActivations& b = m.layers[i + 1];
      next = {&m.layer_offsets[i + 1].attn_norm, b.input, b.attn_norm, b.attn_mean, b.attn_rstd};
    } else {
      next = {&m.final_norm, m.final_in, m.final_norm_out, m.final_mean, m.final_rstd};
    }
    FLARE_RETURN_IF_ERROR(mlp_block_forward(st, m.layer_offsets[i], a, &next));
  }
  // (N, d) → (N, padded_vocab) through the head (no bias).
  FLARE_RETURN_IF_ERROR(matmul_forward(m.matmul, m.final_norm_out, st.W(m.head), nullptr, logits_,
                                       nullptr, st.N, c.d_model, c.padded_vocab, stream_));
  if (!targets) return Status::ok_status();

  // Loss per token, summed on the device; dlogits over the logits in place.
  FLARE_RETURN_IF_ERROR(classifier_forward_backward(logits_, targets, m.losses, st.N, c.vocab_size,
                                                    c.padded_vocab, dloss_scale, write_dlogits, stream_,
                                                    dloss_scale_device));
  FLARE_RETURN_IF_ERROR(loss_sum(m.losses, st.N, loss_sum_out, stream_));
  m.have_dlogits = write_dlogits;
  return Status::ok_status();
}

Status GpuModel::backward(const int32_t* tokens, bool accumulate, const StageHook& after_stage) {
  Impl& m = *impl_;
  if (!m.have_dlogits) {
    return invalid("backward: needs a forward with targets and write_dlogits first");
  }
  if (tokens == nullptr) return invalid("backward: tokens must not be null");
  if (!gradient() && placement_ == nullptr) {
    return invalid("backward: the model holds no whole gradient and no GradientPlacement was set");
  }
  if (grads16_ && accumulate) {
    return invalid("backward: bf16 gradients are written, not accumulated (accumulate must be false: "
                   "one micro-batch per step)");
  }
  const ModelConfig& c = config_;
  const Step st{c, m, weights_, gradient(), placement_, batch_, seq_, batch_ * seq_, stream_, accumulate};
  auto stage_done = [&](int64_t stage) { return call_hook(after_stage, stage); };
  const int64_t n_layer = static_cast<int64_t>(m.layers.size());

  // dlogits (N, padded_vocab) → d final_norm (N, d) → d_resid (N, d), the last layer's output.
  FLARE_RETURN_IF_ERROR(matmul_backward_input(m.matmul, logits_, st.W(m.head), nullptr, m.d_norm, st.N,
                                              c.d_model, c.padded_vocab, stream_));
  FLARE_RETURN_IF_ERROR(matmul_backward_weight(m.matmul, logits_, m.final_norm_out, st.G(m.head), nullptr,
                                               st.N, c.d_model, c.padded_vocab, accumulate, stream_));
  FLARE_RETURN_IF_ERROR(norm_backward(st, m.final_norm, m.d_norm, m.final_in, m.final_mean,
                                      m.final_rstd, nullptr, m.d_resid));
  FLARE_RETURN_IF_ERROR(stage_done(0));

  for (size_t i = m.layers.size(); i-- > 0;) {
    // With recompute the shared set still holds the last layer from the forward.
    if (m.options.recompute && i + 1 < m.layers.size()) FLARE_RETURN_IF_ERROR(recompute_layer(st, i));
    FLARE_RETURN_IF_ERROR(mlp_block_backward(st, m.layer_offsets[i], m.layers[i]));
    FLARE_RETURN_IF_ERROR(attention_block_backward(st, m.layer_offsets[i], m.layers[i]));
    FLARE_RETURN_IF_ERROR(stage_done(layer_stage_number(n_layer, i)));
  }

  // d_resid is now the gradient of the embedding output. The embedding's backward adds into the
  // tables (rows no token touched keep their value), so a written gradient starts them at zero:
  // all but a tied token table, which the head's gradient has just written.
  if (!accumulate) {
    for (const char* table : {"embed.weight", "pos_embed.weight"}) {
      const ParamSpec* spec = m.layout.find(table);
      if (spec == nullptr || (c.tied_embeddings && spec->offset == m.embed)) continue;
      FLARE_RETURN_IF_ERROR(cuda_status(kCudaContext, "embedding gradient",
                                        cudaMemsetAsync(st.G(spec->offset).data(), 0,
                                                        static_cast<size_t>(spec->numel * st.g_bytes()), stream_)));
    }
  }
  FLARE_RETURN_IF_ERROR(embedding_backward(m.d_resid, tokens, st.G(m.embed), st.G(m.pos_embed), st.N,
                                           seq_, c.vocab_size, c.d_model, m.embed_scratch, stream_,
                                           m.embedding_positions()));
  m.have_dlogits = false;
  return stage_done(n_layer + 1);
}

}  // namespace flare::train::cuda
