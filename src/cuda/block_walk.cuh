// block_walk.cuh — the CUDA kernels' walks under a block mask: how many tiles of a walk are on
// (count_on_tiles, all threads of a CTA at once; count_on_tiles_warp, one warp), and the
// backward's walk over the (query tile, query head) steps of one key block (QueryWalk), which
// visits only the steps whose block is on.
//
// A backward CTA holds one key block (inside one mask column block: every kernel tile divides
// kMaskTileMultiple, core/block_mask.h) and steps through query tiles m in [m_begin, m_end) of
// each query head h in [h_begin, h_end) of its kv head's group, m fastest. Dense, every step is
// on and the walk is the plain double loop; block-sparse, a step whose mask block is off is never
// visited, so its Q, dO, LSE and D are never read.
#pragma once

#include <cuda_runtime.h>

#include "core/block_mask.h"
#include "core/params.h"

namespace flare::cuda {

// The pairs (line, mask block) a count over tiles [t_begin, t_end) of `lines` walks shares out,
// and how many tiles the i-th pair holds that are on (on(line, block) says): count_on_tiles_warp's
// share of a lane. count_on_tiles writes the same share out for itself: drawn from this struct it
// moved the machine code of every sm90 backward and one-CTA-per-tile forward unit
// (scripts/sass-diff.sh), and those kernels are measured in the written-out form.
struct OnTileCount {
  int t_begin, t_end, per_block;  // per_block tiles to a mask block
  int blk_begin, blocks;
  __device__ OnTileCount(int tb, int te, int pb)
      : t_begin(tb),
        t_end(te),
        per_block(pb),
        blk_begin(tb / pb),
        blocks(te > tb ? (te - 1) / pb + 1 - tb / pb : 0) {}
  template <typename On>
  __device__ int tiles_on(int i, On& on) const {
    const int r = blk_begin + i % blocks, line = i / blocks;
    return on(line, r) ? min(t_end, (r + 1) * per_block) - max(t_begin, r * per_block) : 0;
  }
};

// Tiles t in [t_begin, t_end) (per_block tiles to a mask block), over `lines` walks, whose block
// is on: on(line, block) says. Every thread of the CTA (kThreads) calls it and reads a share of
// the blocks; `scratch` is a shared int. Starts and ends with a barrier; the caller keeps one
// more between two calls (the value is read after the second).
template <int kThreads, typename On>
__device__ int count_on_tiles(int lines, int t_begin, int t_end, int per_block, On on,
                              int* scratch) {
  const int blk_begin = t_begin / per_block;
  const int blocks = t_end > t_begin ? (t_end - 1) / per_block + 1 - blk_begin : 0;
  if (threadIdx.x == 0) *scratch = 0;
  __syncthreads();
  int mine = 0;
  for (int i = threadIdx.x; i < blocks * lines; i += kThreads) {
    const int r = blk_begin + i % blocks, line = i / blocks;
    if (on(line, r)) mine += min(t_end, (r + 1) * per_block) - max(t_begin, r * per_block);
  }
  if (mine != 0) atomicAdd(scratch, mine);
  __syncthreads();
  return *scratch;
}

// The same count by one warp alone (all 32 lanes call it; no barrier), for a warp that walks
// its own tiles while the rest of the CTA computes.
template <typename On>
__device__ int count_on_tiles_warp(int lines, int t_begin, int t_end, int per_block, On on) {
  const OnTileCount count(t_begin, t_end, per_block);
  int mine = 0;
  for (int i = threadIdx.x % 32; i < count.blocks * lines; i += 32) mine += count.tiles_on(i, on);
  return __reduce_add_sync(0xffffffffu, mine);
}

struct QueryWalk {
  int b;          // sequence
  int col_block;  // the key block's mask column block
  int m_begin, m_end, h_end;
  int tile_m;  // rows per query tile

  // A copy of one kept in shared memory, read through volatile loads so that a kernel tight on
  // registers holds none of its fields across its loops.
  __device__ __forceinline__ static QueryWalk load(const volatile QueryWalk* at) {
    return {at->b, at->col_block, at->m_begin, at->m_end, at->h_end, at->tile_m};
  }
  __device__ __forceinline__ void store(volatile QueryWalk* at) const {
    at->b = b, at->col_block = col_block, at->m_begin = m_begin, at->m_end = m_end;
    at->h_end = h_end, at->tile_m = tile_m;
  }

  // Moves (m, h) to the first step at or after it that is on; h == h_end once the walk is over.
  __device__ __forceinline__ void settle(const AttentionParams& p, int& m, int& h) const {
    if (p.block_mask == nullptr) return;
    for (; h < h_end; m = m_begin, ++h) {
      m = next_query_tile_on(p, b, h, col_block, m, m_end, tile_m);
      if (m < m_end) return;
    }
  }

  // The step after (m, h).
  __device__ __forceinline__ void advance(const AttentionParams& p, int& m, int& h) const {
    if (++m == m_end) m = m_begin, ++h;
    settle(p, m, h);
  }

  // How many steps are on (count_on_tiles over the heads h_begin..h_end).
  template <int kThreads>
  __device__ int count_steps(const AttentionParams& p, int h_begin, int* scratch) const {
    return count_on_tiles<kThreads>(
        h_end - h_begin, m_begin, m_end, p.block_m / tile_m,
        [&](int line, int r) { return block_on(p, b, h_begin + line, r, col_block); }, scratch);
  }
};

}  // namespace flare::cuda
