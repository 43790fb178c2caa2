// c_api.cpp — the extern "C" mirror of attention.h: converts C structs to flare types, calls the
// C++ entry points, and turns a Status into a code plus a thread-local message. Nothing crosses
// the ABI as an exception: allocation failures while converting are reported as
// FLARE_OUT_OF_MEMORY. The helpers are shared with c_api_dist.cpp (dist.h's mirror),
// c_api_kvcache.cpp and c_api_block_sparse.cpp through c_api_internal.h.
#include "flare/c_api.h"

#include <string>

#include "core/c_api_internal.h"
#include "flare/attention.h"

using flare::c_api::guarded;
using flare::c_api::rank_error;
using flare::c_api::to_options;
using flare::c_api::to_varlen;
using flare::c_api::to_view;

namespace {

thread_local std::string g_last_error;

}  // namespace

namespace flare::c_api {

// A flare_dtype is a DType by value, so a view converts by a cast; an unknown code passes through
// and validation names it.
static_assert(FLARE_FLOAT32 == static_cast<int>(DType::kFloat32));
static_assert(FLARE_FLOAT16 == static_cast<int>(DType::kFloat16));
static_assert(FLARE_BFLOAT16 == static_cast<int>(DType::kBFloat16));
static_assert(FLARE_INT32 == static_cast<int>(DType::kInt32));
static_assert(FLARE_UINT8 == static_cast<int>(DType::kUInt8));
static_assert(FLARE_FLOAT8_E4M3 == static_cast<int>(DType::kFloat8E4M3));

TensorView to_view(const flare_tensor* t) {
  TensorView v;
  if (t == nullptr) return v;
  v.data = t->data;
  v.dtype = static_cast<DType>(t->dtype);
  v.device = static_cast<DeviceType>(t->device);
  v.device_index = t->device_index;
  v.ndim = t->ndim;
  for (int i = 0; i < kMaxDims; ++i) {
    v.shape[i] = t->shape[i];
    v.stride[i] = t->stride[i];
  }
  return v;
}

AttentionOptions to_options(const flare_attention_options* o) {
  AttentionOptions r;
  if (o == nullptr) return r;
  r.softmax_scale = o->softmax_scale;
  r.causal = o->causal != 0;
  r.window_left = o->window_left;
  r.window_right = o->window_right;
  r.softcap = o->softcap;
  r.alibi_slopes = to_view(&o->alibi_slopes);
  r.dropout_p = o->dropout_p;
  r.dropout_seed = o->dropout_seed;
  r.dropout_offset = o->dropout_offset;
  r.deterministic = o->deterministic != 0;
  r.backend = static_cast<Backend>(o->backend);
  return r;
}

VarlenArgs to_varlen(const flare_varlen* v) {
  VarlenArgs r;
  if (v == nullptr) return r;
  r.cu_seqlens_q = to_view(&v->cu_seqlens_q);
  r.cu_seqlens_k = to_view(&v->cu_seqlens_k);
  r.max_seqlen_q = v->max_seqlen_q;
  r.max_seqlen_k = v->max_seqlen_k;
  return r;
}

int fail(int code, const char* message) {
  try {
    g_last_error = message;
  } catch (...) {
    g_last_error.clear();
  }
  return code;
}

Status rank_error(std::initializer_list<NamedTensor> tensors,
                  const flare_attention_options* options, const flare_varlen* varlen) {
  auto check = [](const char* name, const flare_tensor* t) {
    if (t == nullptr || (t->ndim >= 0 && t->ndim <= kMaxDims)) return Status();
    return Status::invalid_argument(std::string(name) + ": ndim = " + std::to_string(t->ndim) +
                                    " must be in [0, " + std::to_string(kMaxDims) + "]");
  };
  for (const NamedTensor& n : tensors) FLARE_RETURN_IF_ERROR(check(n.name, n.tensor));
  if (options != nullptr) FLARE_RETURN_IF_ERROR(check("alibi_slopes", &options->alibi_slopes));
  if (varlen != nullptr) {
    FLARE_RETURN_IF_ERROR(check("cu_seqlens_q", &varlen->cu_seqlens_q));
    FLARE_RETURN_IF_ERROR(check("cu_seqlens_k", &varlen->cu_seqlens_k));
  }
  return {};
}

}  // namespace flare::c_api

extern "C" {

flare_attention_options flare_default_options(void) {
  flare_attention_options o{};
  o.window_left = -1;
  o.window_right = -1;
  return o;
}

int flare_attention_forward(const flare_tensor* q, const flare_tensor* k, const flare_tensor* v,
                            const flare_tensor* o, const flare_tensor* lse,
                            const flare_attention_options* options, const flare_varlen* varlen,
                            void* stream) {
  return guarded([&] {
    FLARE_RETURN_IF_ERROR(
        rank_error({{"q", q}, {"k", k}, {"v", v}, {"o", o}, {"lse", lse}}, options, varlen));
    return flare::attention_forward(to_view(q), to_view(k), to_view(v), to_view(o), to_view(lse),
                                    to_options(options), to_varlen(varlen), stream);
  });
}

int flare_attention_forward_fp8(const flare_tensor* q, const flare_tensor* k,
                                const flare_tensor* v, const flare_tensor* o,
                                const flare_tensor* lse, const flare_fp8_descale* descale,
                                const flare_attention_options* options,
                                const flare_varlen* varlen, void* stream) {
  return guarded([&] {
    const flare_fp8_descale none{};
    const flare_fp8_descale& ds = descale != nullptr ? *descale : none;
    FLARE_RETURN_IF_ERROR(rank_error({{"q", q}, {"k", k}, {"v", v}, {"o", o}, {"lse", lse},
                                      {"q_descale", &ds.q_descale}, {"k_descale", &ds.k_descale},
                                      {"v_descale", &ds.v_descale}},
                                     options, varlen));
    flare::Fp8Descale d;
    d.q = to_view(&ds.q_descale);
    d.k = to_view(&ds.k_descale);
    d.v = to_view(&ds.v_descale);
    d.block_rows = ds.block_rows;
    return flare::attention_forward_fp8(to_view(q), to_view(k), to_view(v), to_view(o),
                                        to_view(lse), d, to_options(options), to_varlen(varlen),
                                        stream);
  });
}

int flare_attention_backward(const flare_tensor* dout, const flare_tensor* q,
                             const flare_tensor* k, const flare_tensor* v, const flare_tensor* o,
                             const flare_tensor* lse, const flare_tensor* dq,
                             const flare_tensor* dk, const flare_tensor* dv,
                             const flare_attention_options* options, const flare_varlen* varlen,
                             void* stream) {
  return guarded([&] {
    FLARE_RETURN_IF_ERROR(rank_error({{"dout", dout}, {"q", q}, {"k", k}, {"v", v}, {"o", o},
                                      {"lse", lse}, {"dq", dq}, {"dk", dk}, {"dv", dv}},
                                     options, varlen));
    return flare::attention_backward(to_view(dout), to_view(q), to_view(k), to_view(v), to_view(o),
                                     to_view(lse), to_view(dq), to_view(dk), to_view(dv),
                                     to_options(options), to_varlen(varlen), stream);
  });
}

const char* flare_last_error(void) { return g_last_error.c_str(); }
const char* flare_version(void) { return flare::version(); }
int flare_cuda_built(void) { return flare::cuda_built() ? 1 : 0; }

}  // extern "C"
