// fwd_fixup.cu — the forward's non-finite fixup kernel: rows the forward kernels left with a
// non-finite LSE, recomputed exactly (cuda/nonfinite_fixup.cuh says why and how).
//
// Launched after the forward kernel under a sliding-window or causal mask, the only forward
// problems where a tile's P·V product can multiply a masked key's ±Inf/NaN V by P = 0 (without a
// window every real key is visible to every row, and keys past a sequence end are zero-filled).
// The forward kernels mark a row whose O came out non-finite with LSE = NaN; rows that see no key
// keep O = 0, LSE = −inf and are skipped here. One read of the LSE entries when nothing is marked.
#include "cuda/fwd_fixup.h"

#include <cuda_runtime.h>

#include <string>

#include "cuda/nonfinite_fixup.cuh"

namespace flare::cuda {
namespace {

constexpr int kWarpsPerCta = 8;

// CTAs stride over the (batch, head) pairs, each warp over 32 consecutive rows of one at a time,
// recomputing the marked ones one by one. (32-bit index arithmetic: a 64-bit division is a
// subroutine call, and with it ptxas spilled.)
__global__ void __launch_bounds__(kWarpsPerCta * 32, 1)
    forward_fixup_kernel(const __grid_constant__ AttentionParams p) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int bh = blockIdx.x; bh < p.batch * p.heads_q; bh += gridDim.x) {
    const int b = bh / p.heads_q, h = bh % p.heads_q;
    const SequenceInfo seq = sequence_info(p, b);
    for (int i0 = warp * 32; i0 < seq.len_q; i0 += kWarpsPerCta * 32) {
      const int i = i0 + lane;
      bool marked = false;
      if (i < seq.len_q) {
        const float lse = p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + seq.q_row0 + i];
        if (!(fabsf(lse) < INFINITY)) {
          const KeyRange keys =
              visible_keys(i, seq.len_q, seq.len_k, p.window_left, p.window_right);
          marked = keys.lo < keys.hi;
        }
      }
      for (uint32_t todo = __ballot_sync(0xffffffffu, marked); todo != 0; todo &= todo - 1)
        forward_recompute_row(p, b, h, i0 + __ffs(todo) - 1);
    }
  }
}

}  // namespace

Status launch_forward_fixup(const AttentionParams& p, int ctas, cudaStream_t stream) {
  if (p.batch == 0 || p.seqlen_q == 0 || p.heads_q == 0) return {};
  forward_fixup_kernel<<<ctas, kWarpsPerCta * 32, 0, stream>>>(p);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    return Status::device_error(std::string("forward fixup launch: ") + cudaGetErrorString(err));
  return {};
}

}  // namespace flare::cuda
