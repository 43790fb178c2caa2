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
  const int lane = threadIdx.x & 31;
  const int h = blockIdx.y, b = blockIdx.z;
  const SequenceInfo seq = sequence_info(p, b);
  const int i0 = blockIdx.x * kRowsPerCta + (threadIdx.x & ~31);
  if (i0 >= seq.len_q) return;  // whole warps: the ballot below needs every lane
  const int i = i0 + lane;
  bool marked = false;
  if (i < seq.len_q) {
    const float lse = p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + seq.q_row0 + i];
    // NaN marks a non-finite O, also in a row that sees no key (its P = 0 met a masked key's
    // ±Inf/NaN V; recomputed, it is O = 0, LSE = −inf).
    marked = !(fabsf(lse) < INFINITY) && forward_row_marked(p, b, h, seq, i, lse);
  }
  for (uint32_t todo = __ballot_sync(0xffffffffu, marked); todo != 0; todo &= todo - 1)
    forward_recompute_row(p, b, h, i0 + __ffs(todo) - 1);
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
