// flare_torch_ops.cpp — C++ kernels for the operators torch.ops.flare.fwd / bwd and
// block_sparse_fwd / block_sparse_bwd (their schema is flare/_torch.py's), which torch.compile's
// generated code calls through the dispatcher. With the kernels in Python, each call boxed its
// arguments into Python objects and ran the extension's attribute reads (about seven per
// tensor); here the dispatcher calls C++ with the at::Tensor arguments unboxed, and the views
// are read off them directly.
//
// Built only where torch's headers are found (python/CMakeLists.txt), as the shared library
// flare/_torch_ops.so. It does not link flare: the extension module hands over its C ABI entry
// points (c_api_table.h) through flare_torch_ops_bind() when flare/_torch.py loads this library.
// Errors raise the Python exception the extension raises for the same status code.
//
// It also carries torch.ops.flare.attention, the eager road of flash_attn_func with autograd in
// C++: its Autograd kernel is a torch::autograd::Function whose backward the autograd engine runs
// without entering Python, as SDPA's does. flare/_torch.py's Python Function remains the road
// under torch.compile (which traces it) and where this library was not built.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#ifdef FLARE_TORCH_OPS_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "c_api_table.h"

namespace {

const flare_c_api_table* api = nullptr;  // set once by flare_torch_ops_bind, before any call

// torch's Python name of a dtype flare refuses ("float64", as the extension's messages say).
std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return "float64";
    case at::kLong: return "int64";
    case at::kShort: return "int16";
    case at::kChar: return "int8";
    case at::kBool: return "bool";
    default: return c10::toString(t);
  }
}

int32_t flare_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return FLARE_FLOAT32;
    case at::kHalf: return FLARE_FLOAT16;
    case at::kBFloat16: return FLARE_BFLOAT16;
    case at::kInt: return FLARE_INT32;
    case at::kByte: return FLARE_UINT8;
    default:
      C10_THROW_ERROR(ValueError,
                      c10::str(name, ": dtype ", dtype_name(t.scalar_type()),
                               " is not supported; flare takes float32, float16 and bfloat16 "
                               "tensors (int32 for cu_seqlens, int32 or uint8 for block masks; "
                               "float8_e4m3fn q, k and v: flare.attention_forward_fp8)"));
  }
}

flare_tensor view(const at::Tensor& t, const char* name) {
  TORCH_CHECK_NOT_IMPLEMENTED(t.is_cpu() || t.is_cuda(), name, ": device '", t.device(),
                              "' is not supported; flare runs on CPU and CUDA tensors");
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, name, ": flare takes strided (dense) tensors");
  TORCH_CHECK_VALUE(t.dim() <= 4, name, ": expected at most 4 dimensions, got ", t.dim());
  flare_tensor v{};
  v.device = t.is_cuda() ? FLARE_CUDA : FLARE_CPU;
  v.device_index = t.is_cuda() ? t.get_device() : 0;
  v.dtype = flare_dtype(t, name);
  v.ndim = static_cast<int32_t>(t.dim());
  for (int64_t i = 0; i < t.dim(); ++i) {
    v.shape[i] = t.size(i);
    v.stride[i] = t.stride(i);
  }
  v.data = t.data_ptr();
  return v;
}

flare_tensor optional_view(const std::optional<at::Tensor>& t, const char* name) {
  return t.has_value() ? view(*t, name) : flare_tensor{};
}

void check(int code) {
  if (code == FLARE_OK) return;
  const std::string message = api->last_error();
  switch (code) {
    case FLARE_INVALID_ARGUMENT: C10_THROW_ERROR(ValueError, message);
    case FLARE_UNSUPPORTED: C10_THROW_ERROR(NotImplementedError, message);
    case FLARE_OUT_OF_MEMORY: C10_THROW_ERROR(OutOfMemoryError, message);
    case FLARE_DEVICE_ERROR: C10_THROW_ERROR(Error, message);
    default: C10_THROW_ERROR(Error, "flare internal error: " + message);
  }
}

// The call's stream: the current stream of q's device, as the Python kernels passed it.
void* stream_of(const at::Tensor& q) {
#ifdef FLARE_TORCH_OPS_CUDA
  if (q.is_cuda()) return c10::cuda::getCurrentCUDAStream(q.get_device()).stream();
#endif
  TORCH_CHECK(!q.is_cuda(), "flare's torch operators were built without CUDA");
  return nullptr;
}

// The options and varlen description of both operators (the schema's shared tail).
struct CallArgs {
  flare_attention_options options;
  flare_varlen varlen;
  bool is_varlen;
};

CallArgs make_args(const std::optional<at::Tensor>& cu_seqlens_q,
                   const std::optional<at::Tensor>& cu_seqlens_k, int64_t max_seqlen_q,
                   int64_t max_seqlen_k, double dropout_p, double softmax_scale, bool causal,
                   int64_t window_left, int64_t window_right, double softcap,
                   const std::optional<at::Tensor>& alibi_slopes, bool deterministic,
                   const std::optional<at::Tensor>& rng_state, int64_t backend) {
  TORCH_CHECK(api != nullptr, "flare's torch operators are not bound to the extension module");
  CallArgs a;
  a.options = api->default_options();
  a.options.softmax_scale = static_cast<float>(softmax_scale);
  a.options.causal = causal ? 1 : 0;
  a.options.window_left = static_cast<int32_t>(window_left);
  a.options.window_right = static_cast<int32_t>(window_right);
  a.options.softcap = static_cast<float>(softcap);
  a.options.alibi_slopes = optional_view(alibi_slopes, "alibi_slopes");
  a.options.dropout_p = static_cast<float>(dropout_p);
  if (rng_state.has_value()) {  // [seed, offset], int64 on the CPU (flare/_torch.py); uint64 bits
    TORCH_CHECK_VALUE(rng_state->is_cpu() && rng_state->scalar_type() == at::kLong &&
                          rng_state->numel() == 2 && rng_state->is_contiguous(),
                      "rng_state: expected a contiguous int64 CPU tensor [seed, offset]");
    const int64_t* s = rng_state->data_ptr<int64_t>();
    a.options.dropout_seed = static_cast<uint64_t>(s[0]);
    a.options.dropout_offset = static_cast<uint64_t>(s[1]);
  }
  a.options.deterministic = deterministic ? 1 : 0;
  a.options.backend = static_cast<int32_t>(backend);
  a.varlen = flare_varlen{};
  a.varlen.cu_seqlens_q = optional_view(cu_seqlens_q, "cu_seqlens_q");
  a.varlen.cu_seqlens_k = optional_view(cu_seqlens_k, "cu_seqlens_k");
  a.varlen.max_seqlen_q = static_cast<int32_t>(max_seqlen_q);
  a.varlen.max_seqlen_k = static_cast<int32_t>(max_seqlen_k);
  a.is_varlen = cu_seqlens_q.has_value() || cu_seqlens_k.has_value();
  return a;
}

// One forward or backward into the caller's outputs, dense (mask null) or block-sparse.
void forward_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& out, const at::Tensor& lse, const flare_block_mask* mask,
                  const CallArgs& a) {
  const flare_tensor tq = view(q, "q"), tk = view(k, "k"), tv = view(v, "v"), to = view(out, "o"),
                     tl = view(lse, "lse");
  const flare_varlen* varlen = a.is_varlen ? &a.varlen : nullptr;
  check(mask == nullptr
            ? api->forward(&tq, &tk, &tv, &to, &tl, &a.options, varlen, stream_of(q))
            : api->block_sparse_forward(&tq, &tk, &tv, &to, &tl, mask, &a.options, varlen,
                                        stream_of(q)));
}

void backward_into(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                   const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                   const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv,
                   const flare_block_mask* mask, const CallArgs& a) {
  const flare_tensor tdo = view(dout, "dout"), tq = view(q, "q"), tk = view(k, "k"),
                     tv = view(v, "v"), to = view(out, "o"), tl = view(lse, "lse"),
                     tdq = view(dq, "dq"), tdk = view(dk, "dk"), tdv = view(dv, "dv");
  const flare_varlen* varlen = a.is_varlen ? &a.varlen : nullptr;
  check(mask == nullptr ? api->backward(&tdo, &tq, &tk, &tv, &to, &tl, &tdq, &tdk, &tdv,
                                        &a.options, varlen, stream_of(q))
                        : api->block_sparse_backward(&tdo, &tq, &tk, &tv, &to, &tl, &tdq, &tdk,
                                                     &tdv, mask, &a.options, varlen,
                                                     stream_of(q)));
}

// The block-sparse operators' mask: fwd / bwd's arguments with the mask and its block sizes after
// the outputs (a bool mask arrives as its uint8 view, flare/_torch.py).
flare_block_mask block_mask(const at::Tensor& mask, int64_t block_m, int64_t block_n) {
  flare_block_mask m{};
  m.mask = view(mask, "block_mask");
  m.block_m = static_cast<int32_t>(block_m);
  m.block_n = static_cast<int32_t>(block_n);
  return m;
}

// The schema's shared tail of arguments, written once for the four kernels (the dispatcher
// takes each kernel's own C++ signature), and its conversion.
#define FLARE_OPTION_PARAMS                                                                      \
  const std::optional<at::Tensor>& cu_seqlens_q, const std::optional<at::Tensor>& cu_seqlens_k, \
      int64_t max_seqlen_q, int64_t max_seqlen_k, double dropout_p, double softmax_scale,      \
      bool causal, int64_t window_left, int64_t window_right, double softcap,                  \
      const std::optional<at::Tensor>& alibi_slopes, bool deterministic,                       \
      const std::optional<at::Tensor>& rng_state, int64_t backend
#define FLARE_OPTION_ARGS                                                                     \
  make_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, \
            causal, window_left, window_right, softcap, alibi_slopes, deterministic, rng_state, \
            backend)

void fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
         const at::Tensor& lse, FLARE_OPTION_PARAMS) {
  forward_into(q, k, v, out, lse, nullptr, FLARE_OPTION_ARGS);
}

void bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
         const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dq, const at::Tensor& dk,
         const at::Tensor& dv, FLARE_OPTION_PARAMS) {
  backward_into(dout, q, k, v, out, lse, dq, dk, dv, nullptr, FLARE_OPTION_ARGS);
}

void block_sparse_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& out, const at::Tensor& lse, const at::Tensor& mask,
                      int64_t block_m, int64_t block_n, FLARE_OPTION_PARAMS) {
  const flare_block_mask m = block_mask(mask, block_m, block_n);
  forward_into(q, k, v, out, lse, &m, FLARE_OPTION_ARGS);
}

void block_sparse_bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                      const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                      const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv,
                      const at::Tensor& mask, int64_t block_m, int64_t block_n,
                      FLARE_OPTION_PARAMS) {
  const flare_block_mask m = block_mask(mask, block_m, block_n);
  backward_into(dout, q, k, v, out, lse, dq, dk, dv, &m, FLARE_OPTION_ARGS);
}

// ---- torch.ops.flare.attention: the eager road with autograd in C++ --------------------------

// flare reads rows with a unit last stride: strided tensors of other layouts (a gradient autograd
// hands over may be expanded, with stride 0) are copied, as flash_attn does. Other layouts are
// left for view() to reject.
at::Tensor unit_last_stride(const at::Tensor& t) {
  return t.layout() == at::kStrided && t.dim() > 0 && t.size(-1) > 1 && t.stride(-1) != 1
             ? t.contiguous()
             : t;
}

// The forward into new outputs: out like q and lse (float32: (b, h, s_q), or (h, total_q) for a
// packed batch), contiguous, as flare/_torch.py's forward_outputs allocates them (for q of a
// wrong rank a dummy lse: the library reports q's rank, which it checks first).
std::pair<at::Tensor, at::Tensor> forward_new(const at::Tensor& q, const at::Tensor& k,
                                              const at::Tensor& v, const CallArgs& a) {
  std::vector<int64_t> lse_shape{1};
  if (a.is_varlen && q.dim() == 3) lse_shape = {q.size(1), q.size(0)};
  if (!a.is_varlen && q.dim() == 4) lse_shape = {q.size(0), q.size(2), q.size(1)};
  at::Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
  at::Tensor lse = at::empty(lse_shape, q.options().dtype(at::kFloat));
  forward_into(q, k, v, out, lse, nullptr, a);
  return {out, lse};
}

struct AttentionFunction : public torch::autograd::Function<AttentionFunction> {
  static torch::autograd::variable_list forward(
      torch::autograd::AutogradContext* ctx, const at::Tensor& q_arg, const at::Tensor& k_arg,
      const at::Tensor& v_arg, const std::optional<at::Tensor>& cu_seqlens_q,
      const std::optional<at::Tensor>& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
      double dropout_p, double softmax_scale, bool causal, int64_t window_left,
      int64_t window_right, double softcap, const std::optional<at::Tensor>& alibi_slopes,
      bool deterministic, const std::optional<at::Tensor>& rng_state, int64_t backend) {
    // The copies a layout needs are the ones saved, so the backward does not copy again.
    const at::Tensor q = unit_last_stride(q_arg), k = unit_last_stride(k_arg),
                     v = unit_last_stride(v_arg);
    auto [out, lse] = forward_new(q, k, v, FLARE_OPTION_ARGS);
    // The backward's arguments: tensors saved (absent optional ones as undefined), the rest as
    // values.
    ctx->save_for_backward({q, k, v, out, lse, cu_seqlens_q.value_or(at::Tensor()),
                            cu_seqlens_k.value_or(at::Tensor()),
                            alibi_slopes.value_or(at::Tensor()), rng_state.value_or(at::Tensor())});
    ctx->saved_data["ints"] = std::vector<int64_t>{max_seqlen_q, max_seqlen_k, window_left,
                                                   window_right, backend, causal, deterministic};
    ctx->saved_data["reals"] = std::vector<double>{dropout_p, softmax_scale, softcap};
    // lse never has a gradient (flash_attn's softmax_lse is not differentiable either), and no
    // zero-filled one is made for it.
    ctx->mark_non_differentiable({lse});
    ctx->set_materialize_grads(false);
    return {out, lse};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    torch::autograd::variable_list none(17);  // one per forward argument after ctx
    if (!grads[0].defined()) return none;      // out did not reach the loss
    const torch::autograd::variable_list t = ctx->get_saved_variables();
    const auto ints = ctx->saved_data["ints"].toIntVector();
    const auto reals = ctx->saved_data["reals"].toDoubleVector();
    auto optional = [](const at::Tensor& x) {
      return x.defined() ? std::optional<at::Tensor>(x) : std::nullopt;
    };
    const CallArgs a = make_args(optional(t[5]), optional(t[6]), ints[0], ints[1], reals[0],
                                 reals[1], ints[5] != 0, ints[2], ints[3], reals[2],
                                 optional(t[7]), ints[6] != 0, optional(t[8]), ints[4]);
    const at::Tensor &q = t[0], &k = t[1], &v = t[2];
    at::Tensor dq = at::empty_like(q, at::MemoryFormat::Contiguous),
               dk = at::empty_like(k, at::MemoryFormat::Contiguous),
               dv = at::empty_like(v, at::MemoryFormat::Contiguous);
    backward_into(unit_last_stride(grads[0]), q, k, v, t[3], t[4], dq, dk, dv, nullptr, a);
    none[0] = dq;
    none[1] = dk;
    none[2] = dv;
    return none;
  }
};

std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& v, FLARE_OPTION_PARAMS) {
  const torch::autograd::variable_list r = AttentionFunction::apply(
      q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
      causal, window_left, window_right, softcap, alibi_slopes, deterministic, rng_state,
      backend);
  return {r[0], r[1]};
}

// Tensors without autograd (torch.inference_mode) reach the backend keys directly.
std::tuple<at::Tensor, at::Tensor> attention_without_autograd(const at::Tensor& q,
                                                              const at::Tensor& k,
                                                              const at::Tensor& v,
                                                              FLARE_OPTION_PARAMS) {
  return forward_new(unit_last_stride(q), unit_last_stride(k), unit_last_stride(v),
                     FLARE_OPTION_ARGS);
}

#undef FLARE_OPTION_PARAMS
#undef FLARE_OPTION_ARGS

}  // namespace

extern "C" __attribute__((visibility("default"))) void flare_torch_ops_bind(
    const flare_c_api_table* table) {
  api = table;
}

TORCH_LIBRARY_IMPL(flare, Autograd, m) { m.impl("attention", &attention); }

// The same kernels for CPU and CUDA tensors.
static void register_kernels(torch::Library& m) {
  m.impl("attention", &attention_without_autograd);
  m.impl("fwd", &fwd);
  m.impl("bwd", &bwd);
  m.impl("block_sparse_fwd", &block_sparse_fwd);
  m.impl("block_sparse_bwd", &block_sparse_bwd);
}

TORCH_LIBRARY_IMPL(flare, CPU, m) { register_kernels(m); }

#ifdef FLARE_TORCH_OPS_CUDA
TORCH_LIBRARY_IMPL(flare, CUDA, m) { register_kernels(m); }
#endif
