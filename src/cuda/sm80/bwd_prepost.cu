// bwd_prepost.cu — the two memory-bound kernels around the backward main kernel.
//
// preprocess: D_i = rowsum(dO_i ∘ O_i) in fp32 (FlashAttention-2's "dot(dO, O)"), which turns
//   dS = P∘(dP − rowsum(P∘dP)) into an elementwise step, and zeroes the fp32 dQ accumulator the
//   main kernel adds into (every split slice in deterministic mode).
// convert: dq = scale · Σ_s accumulator[s], summing the slices in index order (so deterministic
//   mode is bitwise reproducible), rounded to the dtype and written with dq's own strides. A dQ
//   element that comes out ±Inf/NaN sets a flag in the workspace (the main kernels set another
//   for dK/dV).
// fixup (launched after convert where the problem has masked pairs): where a flag is set, every
//   non-finite dq, dk or dv row is recomputed exactly from the inputs (nonfinite_fixup.cuh). The
//   main kernels multiply a masked pair's P = 0 or dS = 0 into dO, Q and K, and form its dS from
//   dP = dO·V, so an infinite value beside a pair a row cannot see makes a gradient NaN. A kernel
//   of its own rather than a call from convert or the main kernels: ptxas counts a callee's
//   registers against its caller (convert went from 38 to 80-100 registers) and a call made the
//   main kernels at their register limit spill.
// Each CTA owns 64 query rows of one (head, batch). Where rows are 16-byte aligned and head_dim
// is a multiple of 8 (`vec`, the common case) every thread moves whole 16-byte chunks with the
// dtype's hardware conversions: a row's chunks sit on a power-of-two group of lanes, and D is
// reduced over the group with a fixed shuffle tree, so it is deterministic. Other layouts take a
// scalar path, one warp per row with the dtype as a runtime value. These kernels move O(s·d)
// bytes against the main kernel's O(s²·d) work, but at s = 512 that is a tenth of the backward,
// so the common case runs at memory speed.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "core/numeric.h"
#include "core/params.h"
#include "cuda/device_probe.h"
#include "cuda/nonfinite_fixup.cuh"
#include "cuda/ptx/mma.cuh"  // pack2
#include "cuda/sm80/bwd_launch.h"

namespace flare::cuda::sm80 {
namespace {

constexpr int kRowsPerCta = 64;
constexpr int kWarpsPerCta = 8;

int64_t slice_elems(const AttentionParams& p, const BwdWorkspace& w) {
  return static_cast<int64_t>(p.heads_q) * p.total_q * w.bucket;
}

// The rows of this CTA's (query block, head, batch), one warp per row: f(i, lane, row) with i the
// row within its sequence, row its index in the packed (head, row) space of dsum and dq_accum.
template <typename F>
__device__ __forceinline__ void for_each_row(const AttentionParams& p, F&& f) {
  const int b = blockIdx.z;
  const SequenceInfo seq = sequence_info(p, b);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t row0 = blockIdx.y * p.total_q + packed_q_row0(p, b, seq);
  for (int r = warp; r < kRowsPerCta; r += kWarpsPerCta) {
    const int i = blockIdx.x * kRowsPerCta + r;
    if (i >= seq.len_q) break;
    f(seq.q_row0 + i, lane, row0 + i);
  }
}

__global__ void __launch_bounds__(kWarpsPerCta * 32)
    backward_preprocess_kernel(const __grid_constant__ AttentionParams p, const BwdWorkspace w,
                               int64_t slice) {
  const int h = blockIdx.y, b = blockIdx.z;
  if ((blockIdx.x | h | b | threadIdx.x) == 0) w.nonfinite[kNonfiniteDq] = w.nonfinite[kNonfiniteDkDv] = 0;
  for_each_row(p, [&](int64_t q_row, int lane, int64_t row) {
    const int64_t o_off = b * p.o_batch_stride + q_row * p.o_row_stride + h * p.o_head_stride;
    const int64_t do_off = b * p.do_batch_stride + q_row * p.do_row_stride + h * p.do_head_stride;
    float acc = 0.0f;
    for (int c = lane; c < p.head_dim; c += 32)
      acc += load_as_float(p.dout, do_off + c, p.dtype) * load_as_float(p.o, o_off + c, p.dtype);
#pragma unroll
    for (int delta = 16; delta > 0; delta >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, delta);
    if (lane == 0) w.dsum[row] = acc;
    for (int s = 0; s < w.num_splits; ++s) {
      float4* const dst = reinterpret_cast<float4*>(w.dq_accum + s * slice + row * w.bucket);
      for (int c = lane; c < w.bucket / 4; c += 32) dst[c] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  });
}

__global__ void __launch_bounds__(kWarpsPerCta * 32)
    backward_convert_kernel(const __grid_constant__ AttentionParams p, const BwdWorkspace w,
                            int64_t slice) {
  const int h = blockIdx.y, b = blockIdx.z;
  for_each_row(p, [&](int64_t q_row, int lane, int64_t row) {
    const float* const src = w.dq_accum + row * w.bucket;
    const int64_t dq_off = b * p.dq_batch_stride + q_row * p.dq_row_stride + h * p.dq_head_stride;
    float probe = 0.0f;
    for (int c = lane; c < p.head_dim; c += 32) {
      float sum = 0.0f;
      for (int s = 0; s < w.num_splits; ++s) sum += src[s * slice + c];
      probe = nonfinite_probe(probe, sum);
      store_from_float(p.dq, dq_off + c, p.dtype, sum * p.scale);
    }
    if (probe_found(probe)) w.nonfinite[kNonfiniteDq] = 1;
  });
}

// ---- vector paths ----------------------------------------------------------------------------

// The CTA's rows: [i_begin, i_begin + rows) of sequence b, packed row `row0` for the first.
struct CtaRows {
  int i_begin = 0, rows = 0;
  int64_t q_row0 = 0;  // the sequence's first row in the user tensors
  int64_t row0 = 0;    // packed (head, row) index of row i_begin
};

__device__ __forceinline__ CtaRows cta_rows(const AttentionParams& p) {
  const int b = blockIdx.z;
  const SequenceInfo seq = sequence_info(p, b);
  CtaRows c;
  c.i_begin = blockIdx.x * kRowsPerCta;
  c.rows = min(kRowsPerCta, seq.len_q - c.i_begin);
  c.q_row0 = seq.q_row0;
  c.row0 = blockIdx.y * p.total_q + packed_q_row0(p, b, seq) + c.i_begin;
  return c;
}

// Eight dtype elements of a 16-byte chunk, as fp32.
template <typename Element>
__device__ __forceinline__ void chunk_to_float(const uint4& v, float (&f)[8]) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 pair;
    if constexpr (std::is_same_v<Element, __half>)
      pair = __half22float2(*reinterpret_cast<const __half2*>(&words[i]));
    else
      pair = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[i]));
    f[2 * i] = pair.x;
    f[2 * i + 1] = pair.y;
  }
}

// D = rowsum(dO∘O): lane group of 2^lane_bits threads per row, chunk `sub` each.
template <typename Element>
__global__ void __launch_bounds__(kWarpsPerCta * 32)
    backward_preprocess_vec_kernel(const __grid_constant__ AttentionParams p, const BwdWorkspace w,
                                   int64_t slice, int lane_bits) {
  if ((blockIdx.x | blockIdx.y | blockIdx.z | threadIdx.x) == 0)
    w.nonfinite[kNonfiniteDq] = w.nonfinite[kNonfiniteDkDv] = 0;
  const CtaRows c = cta_rows(p);
  if (c.rows <= 0) return;
  const int h = blockIdx.y, b = blockIdx.z;
  const int sub = threadIdx.x & ((1 << lane_bits) - 1);
  const bool chunk_in = sub * 8 < p.head_dim;
  const int rows_per_pass = (kWarpsPerCta * 32) >> lane_bits;
  // Every lane runs every pass (the shuffles need the whole warp); rows past the end add nothing.
  for (int r0 = 0; r0 < kRowsPerCta; r0 += rows_per_pass) {
    const int r = r0 + (threadIdx.x >> lane_bits);
    const bool in = chunk_in && r < c.rows;
    float acc = 0.0f;
    if (in) {
      const int64_t q_row = c.q_row0 + c.i_begin + r;
      const uint4 o = *reinterpret_cast<const uint4*>(
          static_cast<const Element*>(p.o) + b * p.o_batch_stride + q_row * p.o_row_stride +
          h * p.o_head_stride + sub * 8);
      const uint4 dout = *reinterpret_cast<const uint4*>(
          static_cast<const Element*>(p.dout) + b * p.do_batch_stride + q_row * p.do_row_stride +
          h * p.do_head_stride + sub * 8);
      float fo[8], fd[8];
      chunk_to_float<Element>(o, fo);
      chunk_to_float<Element>(dout, fd);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc += fd[e] * fo[e];
    }
    for (int delta = (1 << lane_bits) >> 1; delta > 0; delta >>= 1)
      acc += __shfl_xor_sync(0xffffffffu, acc, delta);
    if (sub == 0 && r < c.rows) w.dsum[c.row0 + r] = acc;
  }
  // The CTA's accumulator rows are contiguous in every slice.
  const int64_t n4 = static_cast<int64_t>(c.rows) * w.bucket / 4;
  for (int s = 0; s < w.num_splits; ++s) {
    float4* const dst = reinterpret_cast<float4*>(w.dq_accum + s * slice + c.row0 * w.bucket);
    for (int64_t k = threadIdx.x; k < n4; k += kWarpsPerCta * 32)
      dst[k] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

// dq = scale · Σ_s accumulator[s]: one 16-byte chunk of dq per thread and pass.
template <typename Element>
__global__ void __launch_bounds__(kWarpsPerCta * 32)
    backward_convert_vec_kernel(const __grid_constant__ AttentionParams p, const BwdWorkspace w,
                                int64_t slice, int lane_bits) {
  const CtaRows c = cta_rows(p);
  if (c.rows <= 0) return;
  const int h = blockIdx.y, b = blockIdx.z;
  const int sub = threadIdx.x & ((1 << lane_bits) - 1);
  if (sub * 8 >= p.head_dim) return;
  const int rows_per_pass = (kWarpsPerCta * 32) >> lane_bits;
  float probe = 0.0f;  // NaN once a written element is ±Inf/NaN
  for (int r = threadIdx.x >> lane_bits; r < c.rows; r += rows_per_pass) {
    const float4* const src =
        reinterpret_cast<const float4*>(w.dq_accum + (c.row0 + r) * w.bucket + sub * 8);
    float4 lo = src[0], hi = src[1];
    for (int s = 1; s < w.num_splits; ++s) {
      const float4 a = src[s * slice / 4], e = src[s * slice / 4 + 1];
      lo.x += a.x, lo.y += a.y, lo.z += a.z, lo.w += a.w;
      hi.x += e.x, hi.y += e.y, hi.z += e.z, hi.w += e.w;
    }
    const float sc = p.scale;
    const int64_t q_row = c.q_row0 + c.i_begin + r;
    *reinterpret_cast<uint4*>(static_cast<Element*>(p.dq) + b * p.dq_batch_stride +
                              q_row * p.dq_row_stride + h * p.dq_head_stride + sub * 8) =
        make_uint4(ptx::pack2<Element>(lo.x * sc, lo.y * sc),
                   ptx::pack2<Element>(lo.z * sc, lo.w * sc),
                   ptx::pack2<Element>(hi.x * sc, hi.y * sc),
                   ptx::pack2<Element>(hi.z * sc, hi.w * sc));
    probe = nonfinite_probe(nonfinite_probe(probe, lo.x), lo.y);
    probe = nonfinite_probe(nonfinite_probe(probe, lo.z), lo.w);
    probe = nonfinite_probe(nonfinite_probe(probe, hi.x), hi.y);
    probe = nonfinite_probe(nonfinite_probe(probe, hi.z), hi.w);
  }
  if (probe_found(probe)) w.nonfinite[kNonfiniteDq] = 1;
}

// After convert, where a flag of w.nonfinite is set: the dk/dv rows of every (batch, kv head) and
// the dq rows of every (batch, query head), one warp per row, those whose stored values hold
// ±Inf/NaN recomputed exactly (nonfinite_fixup.cuh). CTAs stride over the (batch, head) pairs,
// warps over their rows. (32-bit index arithmetic: a 64-bit division is a subroutine call, and
// with it ptxas spilled.)
__global__ void __launch_bounds__(kWarpsPerCta * 32, 1)
    backward_fixup_kernel(const __grid_constant__ AttentionParams p, const BwdWorkspace w) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (w.nonfinite[kNonfiniteDkDv] != 0) {
    for (int bh = blockIdx.x; bh < p.batch * p.heads_kv; bh += gridDim.x) {
      const int b = bh / p.heads_kv, hk = bh % p.heads_kv;
      const int len_k = sequence_info(p, b).len_k;
      for (int j = warp; j < len_k; j += kWarpsPerCta)
        backward_fixup_keys(p, w.dsum, b, hk, j, 1, 0, p.head_dim);
    }
  }
  if (w.nonfinite[kNonfiniteDq] != 0) {
    for (int bh = blockIdx.x; bh < p.batch * p.heads_q; bh += gridDim.x) {
      const int b = bh / p.heads_q, h = bh % p.heads_q;
      const SequenceInfo seq = sequence_info(p, b);
      for (int i = warp; i < seq.len_q; i += kWarpsPerCta) {
        const int64_t dq_off = b * p.dq_batch_stride + (seq.q_row0 + i) * p.dq_row_stride +
                               h * p.dq_head_stride;
        float probe = 0.0f;
        for (int c = lane; c < p.head_dim; c += 32)
          probe = nonfinite_probe(probe, load_as_float(p.dq, dq_off + c, p.dtype));
        if (!__any_sync(0xffffffffu, probe_found(probe))) continue;
        __syncwarp();  // every lane has read the row before any rewrites it
        if (lane * 8 < p.head_dim) backward_fixup_dq(p, w.dsum, b, h, i, lane * 8);
      }
    }
  }
}

// Lanes per row of the vector paths: the row's 16-byte chunks rounded up to a power of two.
int row_lane_bits(int head_dim) {
  int bits = 0;
  while ((1 << bits) * 8 < head_dim) ++bits;
  return bits;
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

// Whole 16-byte chunks per row, every row 16-byte aligned, in both given tensors.
bool rows_vec(const AttentionParams& p, const void* a, int64_t a_strides, const void* b,
              int64_t b_strides) {
  return (p.dtype == DType::kFloat16 || p.dtype == DType::kBFloat16) && p.head_dim % 8 == 0 &&
         aligned16(a) && aligned16(b) && (a_strides | b_strides) % 8 == 0;
}

dim3 rows_grid(const AttentionParams& p) {
  return dim3((p.seqlen_q + kRowsPerCta - 1) / kRowsPerCta, p.heads_q, p.batch);
}

template <typename Kernel>
Status launch_rows(Kernel kernel, const char* name, const AttentionParams& p,
                   const BwdWorkspace& w, cudaStream_t stream) {
  if (p.batch == 0 || p.seqlen_q == 0) return {};
  kernel<<<rows_grid(p), kWarpsPerCta * 32, 0, stream>>>(p, w, slice_elems(p, w));
  return launch_status("backward", name);
}

// A vector-path kernel: the fp16 or the bf16 instance, by p.dtype.
template <typename Kernel>
Status launch_vec(Kernel fp16_kernel, Kernel bf16_kernel, const char* name,
                  const AttentionParams& p, const BwdWorkspace& w, cudaStream_t stream) {
  const Kernel kernel = p.dtype == DType::kFloat16 ? fp16_kernel : bf16_kernel;
  kernel<<<rows_grid(p), kWarpsPerCta * 32, 0, stream>>>(p, w, slice_elems(p, w),
                                                     row_lane_bits(p.head_dim));
  return launch_status("backward", name);
}

}  // namespace

Status launch_backward_preprocess(const AttentionParams& p, const BwdWorkspace& w,
                                  cudaStream_t stream) {
  const int64_t o_strides = p.o_batch_stride | p.o_row_stride | p.o_head_stride;
  const int64_t do_strides = p.do_batch_stride | p.do_row_stride | p.do_head_stride;
  if (p.batch == 0 || p.seqlen_q == 0 || !rows_vec(p, p.o, o_strides, p.dout, do_strides))
    return launch_rows(backward_preprocess_kernel, "preprocess", p, w, stream);
  return launch_vec(backward_preprocess_vec_kernel<__half>,
                    backward_preprocess_vec_kernel<__nv_bfloat16>, "preprocess", p, w, stream);
}

Status launch_backward_fixup(const AttentionParams& p, const BwdWorkspace& w, int ctas,
                             cudaStream_t stream) {
  if (p.batch == 0 || p.seqlen_q == 0) return {};
  backward_fixup_kernel<<<ctas, kWarpsPerCta * 32, 0, stream>>>(p, w);
  return launch_status("backward", "fixup");
}

Status launch_backward_convert(const AttentionParams& p, const BwdWorkspace& w,
                               cudaStream_t stream) {
  const int64_t dq_strides = p.dq_batch_stride | p.dq_row_stride | p.dq_head_stride;
  if (p.batch == 0 || p.seqlen_q == 0 || !rows_vec(p, p.dq, dq_strides, p.dq, dq_strides))
    return launch_rows(backward_convert_kernel, "convert", p, w, stream);
  return launch_vec(backward_convert_vec_kernel<__half>,
                    backward_convert_vec_kernel<__nv_bfloat16>, "convert", p, w, stream);
}

}  // namespace flare::cuda::sm80
