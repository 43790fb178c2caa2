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
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#ifdef FLARE_TORCH_OPS_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

#include <cstdint>
#include <optional>
#include <string>

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
                               "tensors (int32 for cu_seqlens, int32 or uint8 for block masks)"));
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

#undef FLARE_OPTION_PARAMS
#undef FLARE_OPTION_ARGS

}  // namespace

extern "C" __attribute__((visibility("default"))) void flare_torch_ops_bind(
    const flare_c_api_table* table) {
  api = table;
}

TORCH_LIBRARY_IMPL(flare, CPU, m) {
  m.impl("fwd", &fwd);
  m.impl("bwd", &bwd);
  m.impl("block_sparse_fwd", &block_sparse_fwd);
  m.impl("block_sparse_bwd", &block_sparse_bwd);
}

#ifdef FLARE_TORCH_OPS_CUDA
TORCH_LIBRARY_IMPL(flare, CUDA, m) {
  m.impl("fwd", &fwd);
  m.impl("bwd", &bwd);
  m.impl("block_sparse_fwd", &block_sparse_fwd);
  m.impl("block_sparse_bwd", &block_sparse_bwd);
}
#endif
