// tile_order.h — which (tile, head, batch) a CTA of the forward or backward grid takes: the
// host-side choice (tile_order.cuh has the device side).
//
// Both grids are (tiles, heads, batch), tile fastest, and the hardware starts CTAs roughly in that
// linear order. Rank 0 is a head's heaviest tile under a causal mask (the forward's last query
// block, the backward's first key block). With every tile of a head costing the same (no mask,
// or only a ragged end), the launch order is the one to keep: concurrent CTAs share one head's K
// and V (forward) or Q, dO and dQ (backward) in L2. With causal or windowed masks the costs
// differ up to the tile count (the last causal query block of s = 1k sees 16 key steps of 64,
// the first 2), and in launch order the last heads' heaviest tiles start near the end and run on
// alone: a list-scheduling model of the H100 grid puts that tail at 10-13% of the forward's time
// at s = 1k-8k. Grouped order takes heads in groups of G and, within a group, rank 0 of every
// head first, then rank 1, ..., so each group — and the grid — ends on its lightest tiles
// (longest-processing-time first). G is a power of two chosen so that a group's per-head bytes
// (what its concurrent CTAs reread) stay within kTileGroupBytes of L2.
#pragma once

#include <cstdint>

#include "core/host_device.h"

namespace flare::cuda::sm80 {

// L2 bytes a group's heads may occupy: a third of the H100's 50 MB.
inline constexpr int64_t kTileGroupBytes = int64_t{16} << 20;

// The group size G for a grid of `tiles` × `heads` CTAs whose heads each reread `head_bytes`:
// 1 (launch order) where tile costs are equal (!varying) or the linear CTA index could overflow.
inline int tile_group(bool varying, int64_t head_bytes, int64_t tiles, int64_t heads) {
  if (!varying || tiles * heads >= (int64_t{1} << 31) || head_bytes <= 0) return 1;
  int64_t g = kTileGroupBytes / head_bytes;
  if (g > heads) g = heads;
  int group = 1;
  while (group * int64_t{2} <= g) group *= 2;
  return group;
}

struct TileSlot {
  int rank;   // 0: the head's heaviest tile
  int head;   // grid y
  int batch;  // grid z
};

// The slot of the CTA at `linear` (x + tiles·(y + heads·z)) of a (tiles, heads, batches) grid in
// grouped order: group g holds heads·batches indices [g·G, g·G + size), size = G except in a
// smaller last group, and within it index r = rank·size + member. Every slot once (tested).
FLARE_HD TileSlot grouped_slot(int linear, int tiles, int heads, int heads_total, int group) {
  const int first = linear / (group * tiles) * group;  // the group's first (head, batch)
  const int size = group < heads_total - first ? group : heads_total - first;
  const int r = linear - first * tiles;
  const int rank = r / size;
  const int hb = first + (r - rank * size);
  return {rank, hb % heads, hb / heads};
}

}  // namespace flare::cuda::sm80
