// backends.h — the entry points each backend offers to the dispatcher in attention.cpp.
// Every backend receives a validated AttentionParams and may assume its invariants.
#pragma once

#include <vector>

#include "core/params.h"
#include "cuda/decode/decode_params.h"
#include "flare/attention.h"

namespace flare {

// Validate public arguments and fill params (src/core/attention.cpp). Exposed for tests and
// tools that drive a backend directly.
Status make_forward_params(const TensorView& q, const TensorView& k, const TensorView& v,
                           const TensorView& o, const TensorView& lse,
                           const AttentionOptions& options, const VarlenArgs& varlen,
                           AttentionParams* p);
// The same for attention_forward_fp8 (core/attention_fp8.cpp): q, k and v float8_e4m3, o any
// float type; `p` describes the call's sizes and mask (its dtype is q's: no backend runs it).
Status make_forward_params_fp8(const TensorView& q, const TensorView& k, const TensorView& v,
                               const TensorView& o, const TensorView& lse,
                               const AttentionOptions& options, const VarlenArgs& varlen,
                               AttentionParams* p);
Status make_backward_params(const TensorView& dout, const TensorView& q, const TensorView& k,
                            const TensorView& v, const TensorView& o, const TensorView& lse,
                            const TensorView& dq, const TensorView& dk, const TensorView& dv,
                            const AttentionOptions& options, const VarlenArgs& varlen,
                            AttentionParams* p);

namespace cpu {

// How the reference computes: float64 throughout (the ground truth), or "naive low precision":
// scores and softmax in fp32, P rounded to the input dtype before P·V (and dS before dS·K, dSᵀ·Q
// in the backward). The second gives the error budget of the tolerance rule
// (docs/architecture.md, "Tolerance rule"). kLowPrecisionReversed is the same naive backward with
// its sums in the opposite order (dot products, and the sums over keys and over query rows): a
// second, equally valid fp32 realisation of its rounding, for the budget to take the larger of
// two where a few summed terms decide an output (the forward treats it as kLowPrecision).
enum class RefPrecision { kFloat64, kLowPrecision, kLowPrecisionReversed };

// Dense reference outputs in packed logical order, whatever the input strides:
// o (total_q, h_q, d), lse (h_q, total_q), dq like o, dk / dv (total_k, h_kv, d).
// For fixed-length batches row b·s_q + i is sequence b, row i.
struct RefForward {
  std::vector<double> o;
  std::vector<double> lse;
};
struct RefBackward {
  std::vector<double> dq, dk, dv;
};

// Materialises scores; O(s_q·s_k) memory per (batch, head). Never fails on valid params.
RefForward reference_forward(const AttentionParams& p, RefPrecision precision);
// Reads p.dout. kFloat64 recomputes the forward internally; kLowPrecision reads the forward's
// stored p.o and p.lse, as a fast backward does.
RefBackward reference_backward(const AttentionParams& p, RefPrecision precision);

// Writes reference results into the params' output tensors (o/lse or dq/dk/dv), rounding to the
// output dtype. Used by Backend::kReference.
void store_forward(const AttentionParams& p, const RefForward& r);
void store_backward(const AttentionParams& p, const RefBackward& r);

// The tiled online-softmax backend (fp32 accumulation, threads, O(s) extra memory).
Status flash_forward(const AttentionParams& p);
Status flash_backward(const AttentionParams& p);
// The instruction-set level the two run at, chosen on first use (src/cpu/flash_dispatch.cpp):
// "x86-64-v4", "x86-64-v3" or "x86-64" in portable x86-64 builds, "native" in the others. Fails,
// as they do, when the environment variable FLARE_CPU_ISA names no level of this build.
Status flash_simd_level(const char** name);

}  // namespace cpu

namespace cuda {
// Implemented in src/cuda when FLARE_WITH_CUDA, else stubs that return kUnsupported. The
// dispatch chooses every kernel itself here; cuda/dispatch.h has the same calls with overrides.
Status forward(const AttentionParams& p, Stream stream);
Status backward(const AttentionParams& p, Stream stream);
// attention_with_kvcache on CUDA tensors (src/cuda/decode): the append, the attention over the
// cache in place and the split-KV merge, on device `device_index` and `stream`.
Status kvcache_forward(const DecodeParams& p, int device_index, Stream stream);
}  // namespace cuda

}  // namespace flare
