// tile_order.cuh — the device side of tile_order.h: the (tile, head, batch) slot of a CTA.
#pragma once

#include <cuda_runtime.h>

#include "cuda/sm80/tile_order.h"

namespace flare::cuda::sm80 {

// The CTA and grid indices; kVolatile reads them through volatile moves, so that a slot computed
// again (after a kernel's main loop) is recomputed there rather than held in registers across it.
template <bool kVolatile>
__device__ __forceinline__ uint4 grid_position() {
  if constexpr (!kVolatile) {
    return make_uint4(blockIdx.x, blockIdx.y, blockIdx.z, gridDim.y);
  } else {
    uint4 v;
    asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(v.x));
    asm volatile("mov.u32 %0, %%ctaid.y;\n" : "=r"(v.y));
    asm volatile("mov.u32 %0, %%ctaid.z;\n" : "=r"(v.z));
    v.w = gridDim.y;
    return v;
  }
}

// This CTA's slot: launch order for group 1, else grouped order (tile_order.h).
template <bool kVolatile = false>
__device__ __forceinline__ TileSlot tile_slot(int group) {
  const uint4 at = grid_position<kVolatile>();
  if (group == 1) return {static_cast<int>(at.x), static_cast<int>(at.y), static_cast<int>(at.z)};
  const int tiles = gridDim.x, heads = at.w;
  return grouped_slot(at.x + tiles * (at.y + heads * at.z), tiles, heads, heads * gridDim.z, group);
}

}  // namespace flare::cuda::sm80
