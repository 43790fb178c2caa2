// bwd_prepost.cu — the two memory-bound kernels around the backward main kernel.
//
// preprocess: D_i = rowsum(dO_i ∘ O_i) in fp32 (FlashAttention-2's "dot(dO, O)"), which turns
//   dS = P∘(dP − rowsum(P∘dP)) into an elementwise step, and zeroes the fp32 dQ accumulator the
//   main kernel adds into (every split slice in deterministic mode).
// convert: dq = scale · Σ_s accumulator[s], summing the slices in index order (so deterministic
//   mode is bitwise reproducible), rounded to the dtype and written with dq's own strides.
// One warp per query row; D is reduced with a fixed shuffle tree, so it is deterministic too.
// Both read and write with the dtype as a runtime value: they move O(s·d) bytes against the main
// kernel's O(s²·d) work, so one instantiation serves every dtype and head dim.
#include <cuda_runtime.h>

#include <string>

#include "core/numeric.h"
#include "core/params.h"
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
    for (int c = lane; c < p.head_dim; c += 32) {
      float sum = 0.0f;
      for (int s = 0; s < w.num_splits; ++s) sum += src[s * slice + c];
      store_from_float(p.dq, dq_off + c, p.dtype, sum * p.scale);
    }
  });
}

template <typename Kernel>
Status launch_rows(Kernel kernel, const char* name, const AttentionParams& p,
                   const BwdWorkspace& w, cudaStream_t stream) {
  if (p.batch == 0 || p.seqlen_q == 0) return {};
  const dim3 grid((p.seqlen_q + kRowsPerCta - 1) / kRowsPerCta, p.heads_q, p.batch);
  kernel<<<grid, kWarpsPerCta * 32, 0, stream>>>(p, w, slice_elems(p, w));
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    return Status::device_error(std::string("backward: ") + name + " launch: " +
                                cudaGetErrorString(err));
  return {};
}

}  // namespace

Status launch_backward_preprocess(const AttentionParams& p, const BwdWorkspace& w,
                                  cudaStream_t stream) {
  return launch_rows(backward_preprocess_kernel, "preprocess", p, w, stream);
}

Status launch_backward_convert(const AttentionParams& p, const BwdWorkspace& w,
                               cudaStream_t stream) {
  return launch_rows(backward_convert_kernel, "convert", p, w, stream);
}

}  // namespace flare::cuda::sm80
