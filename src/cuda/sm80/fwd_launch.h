// fwd_launch.h — the host-side face of the sm80 forward kernels: one launcher per compiled
// (dtype, head-dim bucket) variant. Defined in fwd_kernel.cuh and instantiated once per variant in
// a generated translation unit (src/cuda/kernels.cmake), so including this costs no device code.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/params.h"
#include "cuda/sm80/fwd_tiles.h"
#include "cuda/sm80/tile_order.h"
#include "flare/status.h"

namespace flare::cuda::sm80 {

// Enqueues the forward kernel of one CTA order (kGrouped: tile_order.h's grouped order with
// `tile_group`; else launch order) on `stream`; checks the launch, never synchronises.
template <DType kDType, int kHeadDim, bool kGrouped>
Status launch_forward_order(const AttentionParams& p, int tile_group, cudaStream_t stream);

// Enqueues the forward on `stream`: grouped CTA order under causal or windowed masks, where a
// head's query blocks differ in cost (K and V of a query head are shared by head_group query
// heads). Per bucket, from A/Bs on the H100 (fwd_notes.md v13): d 128 takes the grouped kernel for
// every mask (its code alone measured 2.4-3.2% faster on the non-causal cells too); d 64 keeps the
// launch-order kernel (grouped: −1 to −5% at causal s ≤ 2k, +1 to +2% above).
template <DType kDType, int kHeadDim>
Status launch_forward(const AttentionParams& p, cudaStream_t stream) {
  const int64_t m_blocks =
      (int64_t{p.seqlen_q} + fwd_tile(kHeadDim).block_m - 1) / fwd_tile(kHeadDim).block_m;
  const int group = tile_group(
      p.has_window(), int64_t{4} * p.seqlen_k * kHeadDim / (p.head_group > 0 ? p.head_group : 1),
      m_blocks, int64_t{p.heads_q} * p.batch);
  if (kHeadDim == 128 || (group > 1 && kHeadDim != 64))
    return launch_forward_order<kDType, kHeadDim, true>(p, group, stream);
  return launch_forward_order<kDType, kHeadDim, false>(p, 1, stream);
}

}  // namespace flare::cuda::sm80
