// fwd_fixup.cu — the forward's non-finite fixup kernel: rows the forward kernels left with a
// non-finite LSE, recomputed exactly (cuda/nonfinite_fixup.cuh says why and how).
//
// Launched after the forward kernel under a sliding-window or causal mask and on packed batches,
// the only forward problems where a tile's P·V product can multiply a hidden key's ±Inf/NaN V by
// P = 0 (rows_may_meet_hidden_keys, fwd_fixup.h), and under a block mask, where a row left with
// LSE = −inf may still see a key (all its scores −inf: NaN in the reference) — off blocks are
// skipped whole, so they never pollute a row. Not after the sm90 kernel where it recomputes its
// rows itself (sm90_forward_fixes_rows_itself). The forward kernels mark a row whose O came out
// non-finite with LSE = NaN; rows that see no key and were not marked keep O = 0, LSE = −inf and
// are skipped here. One read of the LSE entries when nothing is marked.
#include "cuda/fwd_fixup.h"

#include <cuda_runtime.h>

#include "cuda/device_probe.h"
#include "cuda/nonfinite_fixup.cuh"

namespace flare::cuda {
namespace {

constexpr int kRowsPerCta = 256;

// One thread per LSE entry: grid (row blocks of kRowsPerCta, heads, batch), each warp reading 32
// consecutive rows and recomputing the marked ones one by one. A single pass over the entries
// with every load in flight at once: at s 16k with 32 heads a loop of (batch, head) pairs per
// CTA would leave most SMs idle and take tens of microseconds.
__global__ void __launch_bounds__(kRowsPerCta, 1)
    forward_fixup_kernel(const __grid_constant__ AttentionParams p) {
  const int h = blockIdx.y, b = blockIdx.z;
  const int i0 = blockIdx.x * kRowsPerCta + (threadIdx.x & ~31);
  if (i0 >= sequence_info(p, b).len_q) return;  // whole warps: the ballot needs every lane
  forward_fix_marked_rows(p, b, h, i0, 32);
}

}  // namespace

Status launch_forward_fixup(const AttentionParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.seqlen_q == 0 || p.heads_q == 0) return {};
  const dim3 grid(static_cast<unsigned>((p.seqlen_q + kRowsPerCta - 1) / kRowsPerCta),
                  static_cast<unsigned>(p.heads_q), static_cast<unsigned>(p.batch));
  forward_fixup_kernel<<<grid, kRowsPerCta, 0, stream>>>(p);
  return launch_status("forward", "fixup");
}

}  // namespace flare::cuda
