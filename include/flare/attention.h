// flare/attention.h — exact attention, forward and backward.
//
//   O = softmax(mask(bias(softcap(scale · Q Kᵀ)))) · V      (dropout applied to the probabilities)
//   LSE = log Σ_j exp(score_ij)                             (natural log, before dropout)
//
// Shapes (FlashAttention conventions):
//   fixed length:  q (b, s_q, h_q, d)   k, v (b, s_k, h_kv, d)   o like q   lse (b, h_q, s_q) fp32
//   varlen:        q (total_q, h_q, d)  k, v (total_k, h_kv, d)  o like q   lse (h_q, total_q) fp32
//                  with cu_seqlens_q / cu_seqlens_k: int32 (batch + 1), non-decreasing, from 0 to
//                  the total token count.
// Semantics:
//   - GQA/MQA: h_q is a multiple of h_kv; query head i reads kv head i / (h_q / h_kv).
//   - Masks are aligned to the bottom-right corner when s_q != s_k: query row i sits at key
//     position i + s_k − s_q. Causal keeps keys j ≤ that position; a sliding window (left, right)
//     keeps position − left ≤ j ≤ position + right; −1 means unbounded on that side. Causal is the
//     window (left, 0).
//   - softcap > 0 replaces a score s by softcap · tanh(s / softcap) (after scaling).
//   - ALiBi adds −slope_h · |position − j| to the score; slopes are fp32 (h_q) or (b, h_q).
//   - Dropout zeroes probabilities with probability p and scales survivors by 1/(1−p). The mask is
//     a pure function of (seed, offset, batch, head, row, column) via Philox 4x32-10, identical on
//     CPU and GPU, so the backward pass regenerates it.
//   - A query row that sees no key gets O = 0 and LSE = −inf; its gradients are 0.
// Every entry point validates all arguments first and writes nothing if it rejects the call.
// Beyond shapes, dtypes and devices it requires: data pointers aligned to the element size,
// element offsets that fit int64, outputs (o, lse, dq, dk, dv) that share no memory with
// themselves (no broadcast strides), with each other or with any input (views of one packed buffer
// that interleave without sharing an element are fine), and, for CPU tensors, cu_seqlens that start at 0, never decrease, end at the
// packed token count and stay within max_seqlen. cu_seqlens on the GPU are not read by the host
// (that would need a synchronisation): wrong values there are undefined behaviour. A tensor with
// no elements may have any strides.
#pragma once

#include <cstddef>
#include <cstdint>

#include "flare/status.h"
#include "flare/tensor.h"

namespace flare {

// Which implementation runs. kAuto picks the fastest for the tensors' device (CPU flash, or the
// CUDA kernels). kReference runs the float64 ground truth (CPU tensors only; slow, O(s²) memory).
enum class Backend : int { kAuto = 0, kReference = 1, kFlash = 2 };

struct AttentionOptions {
  float softmax_scale = 0.0f;  // 0 → 1/sqrt(head_dim); otherwise finite and > 0
  bool causal = false;
  int window_left = -1;        // −1 = unbounded
  int window_right = -1;       // −1 = unbounded
  float softcap = 0.0f;        // 0 disables; otherwise finite and > 0
  TensorView alibi_slopes;     // undefined → none; fp32 (h_q) or (b, h_q), same device as q
  float dropout_p = 0.0f;      // in [0, 1)
  uint64_t dropout_seed = 0;
  uint64_t dropout_offset = 0;
  bool deterministic = false;  // bitwise-reproducible backward (CPU is always deterministic)
  Backend backend = Backend::kAuto;
};

// Packed variable-length batch description. Leave undefined (the default) for fixed length.
struct VarlenArgs {
  TensorView cu_seqlens_q;  // int32 (batch + 1)
  TensorView cu_seqlens_k;  // int32 (batch + 1)
  int max_seqlen_q = 0;     // ≥ every sequence length; sizes GPU grids
  int max_seqlen_k = 0;
  bool defined() const { return cu_seqlens_q.defined() || cu_seqlens_k.defined(); }
};

// Stream for GPU calls: a cudaStream_t passed as void* so this header needs no CUDA headers.
// nullptr is the legacy default stream. Ignored for CPU tensors. No entry point synchronises.
using Stream = void*;

// Forward pass. Writes o and lse.
Status attention_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                         const TensorView& o, const TensorView& lse,
                         const AttentionOptions& options = {}, const VarlenArgs& varlen = {},
                         Stream stream = nullptr);

// Backward pass. Given dO and the forward's O and LSE (same options), writes dq, dk, dv
// (same dtype and shape as q, k, v).
Status attention_backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                          const TensorView& v, const TensorView& o, const TensorView& lse,
                          const TensorView& dq, const TensorView& dk, const TensorView& dv,
                          const AttentionOptions& options = {}, const VarlenArgs& varlen = {},
                          Stream stream = nullptr);

// Library version string, e.g. "0.1.0".
// ---- FP8 inputs (forward only, as in FlashAttention-3) ------------------------------------------
// q, k and v in float8_e4m3, each element standing for its value times a descale factor: element
// (b, i, h, :) of q is e4m3(q) · q_descale[b, h, i / block_rows] (likewise k and v over their own
// rows, i counted within the sequence), a dimension of size 1 in a descale broadcasting over that
// axis. o is float32, float16 or bfloat16 (rounded once from an fp32 result), lse float32; shapes,
// masks and every other option are attention_forward's.
//   q_descale, k_descale, v_descale: float32 (batch | 1, heads | 1, blocks | 1), heads being q's
//     for q (or k's: under GQA the query heads of a group then share their kv head's factor, as
//     FlashAttention-3's per-(batch, kv head) descales do) and k's for k and v; blocks =
//     ceil(seqlen / block_rows) (packed batches: ceil(max_seqlen / block_rows)). Undefined: 1.
//     So per tensor (1, 1, 1), per head (b, h, 1), per block of rows (b, h, blocks).
//   block_rows: rows per block; required (≥ 1) where a descale has blocks > 1.
// CPU tensors: the inputs are dequantized to float32 (each element rounded once) and run
// attention_forward's float32 path. CUDA tensors: FLARE_UNSUPPORTED (no FP8 kernel yet).
struct Fp8Descale {
  TensorView q, k, v;
  int block_rows = 0;
};

Status attention_forward_fp8(const TensorView& q, const TensorView& k, const TensorView& v,
                             const TensorView& o, const TensorView& lse,
                             const Fp8Descale& descale = {}, const AttentionOptions& options = {},
                             const VarlenArgs& varlen = {}, Stream stream = nullptr);

const char* version();
// True when this build carries the CUDA kernels.
bool cuda_built();

}  // namespace flare
