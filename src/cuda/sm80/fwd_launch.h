// fwd_launch.h — the host-side face of the sm80 forward kernels: one launcher per compiled
// (dtype, head-dim bucket) variant. Defined in fwd_kernel.cuh and instantiated once per variant in
// a generated translation unit (src/cuda/kernels.cmake), so including this costs no device code.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/params.h"
#include "cuda/dispatch.h"
#include "cuda/sm80/fwd_tiles.h"
#include "cuda/sm80/tile_order.h"
#include "flare/status.h"

namespace flare::cuda::sm80 {

// Enqueues the forward kernel of one CTA order (kGrouped: tile_order.h's grouped order with
// `tile_group`; else launch order) and tile (kShort: the bucket's short-walk tile, fwd_tiles.h) on
// `stream`; checks the launch, never synchronises.
template <DType kDType, int kHeadDim, bool kGrouped, bool kShort>
Status launch_forward_order(const AttentionParams& p, int tile_group, cudaStream_t stream);

// Enqueues the forward on `stream` with one tile: grouped CTA order under causal or windowed
// masks, where a head's query blocks differ in cost (K and V of a query head are shared by
// head_group query heads). Per bucket, from A/Bs on the H100 (fwd_notes.md v13): d 128 takes the
// grouped kernel for every mask (its code alone measured 2.4-3.2% faster on the non-causal cells
// too); d 64 keeps the launch-order kernel (grouped: −1 to −5% at causal s ≤ 2k, +1 to +2% above).
template <DType kDType, int kHeadDim, bool kShort>
Status launch_forward_tile(const AttentionParams& p, cudaStream_t stream) {
  constexpr int kBlockM = fwd_tile(kHeadDim, kShort).block_m;
  const int64_t m_blocks = (int64_t{p.seqlen_q} + kBlockM - 1) / kBlockM;
  const int group = tile_group(
      p.has_window(), int64_t{4} * p.seqlen_k * kHeadDim / (p.head_group > 0 ? p.head_group : 1),
      m_blocks, int64_t{p.heads_q} * p.batch);
  if (kHeadDim == 128 || (group > 1 && kHeadDim != 64))
    return launch_forward_order<kDType, kHeadDim, true, kShort>(p, group, stream);
  return launch_forward_order<kDType, kHeadDim, false, kShort>(p, 1, stream);
}

// Enqueues the forward on `stream`: the bucket's short-walk tile where it has one and rows see few
// keys under a causal or windowed mask (or where overrides.forward_tiles asks for it), else its
// primary tile.
template <DType kDType, int kHeadDim>
Status launch_forward(const AttentionParams& p, const DispatchOverrides& overrides,
                      cudaStream_t stream) {
  if constexpr (has_short_fwd_tile(kHeadDim)) {
    const int forced = overrides.forward_tiles;
    if (forced != 0 ? forced == 2 : takes_short_fwd_tile(p))
      return launch_forward_tile<kDType, kHeadDim, true>(p, stream);
  }
  return launch_forward_tile<kDType, kHeadDim, false>(p, stream);
}

}  // namespace flare::cuda::sm80
