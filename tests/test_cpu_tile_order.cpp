// Tests of the CUDA grids' CTA order (src/cuda/sm80/tile_order.h), which is host code: the grouped
// order must give every (tile, head, batch) slot to exactly one CTA for any grid shape and group,
// put each group's heavier ranks before its lighter ones, and pick groups by the stated rule.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "cuda/sm80/tile_order.h"

namespace flare {
namespace {

using cuda::sm80::grouped_slot;
using cuda::sm80::kTileGroupBytes;
using cuda::sm80::tile_group;
using cuda::sm80::TileSlot;

TEST(TileOrder, GroupedOrderIsAPermutationWithHeaviestFirstInEachGroup) {
  int shapes = 0;
  for (int tiles : {1, 2, 3, 8, 13})
    for (int heads : {1, 2, 3, 8})
      for (int batches : {1, 2, 5})
        for (int group : {1, 2, 4, 8, 16, 64}) {
          const int heads_total = heads * batches;
          if (group > heads_total) continue;
          const int count = tiles * heads_total;
          std::vector<int> seen(count, 0);
          int prev_rank = -1, prev_first = -1;
          for (int linear = 0; linear < count; ++linear) {
            const TileSlot s = grouped_slot(linear, tiles, heads, heads_total, group);
            ASSERT_GE(s.rank, 0);
            ASSERT_LT(s.rank, tiles);
            ASSERT_GE(s.head, 0);
            ASSERT_LT(s.head, heads);
            ASSERT_GE(s.batch, 0);
            ASSERT_LT(s.batch, batches);
            ++seen[(s.batch * heads + s.head) * tiles + s.rank];
            // Within a group (same first head-batch index) the rank never decreases: every head's
            // heaviest tile before any head's next one.
            const int first = (s.batch * heads + s.head) / group * group;
            if (first == prev_first) EXPECT_GE(s.rank, prev_rank) << "linear " << linear;
            prev_first = first;
            prev_rank = s.rank;
          }
          for (int i = 0; i < count; ++i)
            ASSERT_EQ(seen[i], 1) << "slot " << i << " of tiles=" << tiles << " heads=" << heads
                                  << " batches=" << batches << " group=" << group;
          ++shapes;
        }
  EXPECT_GT(shapes, 100);
}

TEST(TileOrder, GroupOneIsLaunchOrder) {
  const int tiles = 5, heads = 3, batches = 2;
  for (int linear = 0; linear < tiles * heads * batches; ++linear) {
    const TileSlot s = grouped_slot(linear, tiles, heads, heads * batches, 1);
    EXPECT_EQ(s.rank, linear % tiles);
    EXPECT_EQ(s.head, linear / tiles % heads);
    EXPECT_EQ(s.batch, linear / tiles / heads);
  }
}

TEST(TileOrder, GroupRule) {
  // Equal tile costs, or a grid whose linear index would pass 2^31: launch order.
  EXPECT_EQ(tile_group(false, 1024, 8, 128), 1);
  EXPECT_EQ(tile_group(true, 1024, int64_t{1} << 20, int64_t{1} << 11), 1);
  EXPECT_EQ(tile_group(true, 0, 8, 128), 1);
  // Otherwise the largest power of two with G·head_bytes within the budget, at most the heads.
  for (int64_t head_bytes : {int64_t{1} << 10, int64_t{3} << 18, int64_t{1} << 20, int64_t{5} << 21,
                             kTileGroupBytes, kTileGroupBytes * 3})
    for (int64_t heads : {1, 6, 128, 100000}) {
      const int g = tile_group(true, head_bytes, 8, heads);
      EXPECT_GE(g, 1);
      EXPECT_EQ(g & (g - 1), 0) << g;
      EXPECT_LE(g, heads);
      if (g > 1) EXPECT_LE(g * head_bytes, kTileGroupBytes);
      if (2 * g <= heads) EXPECT_GT(2 * g * head_bytes, kTileGroupBytes) << g;
    }
  // The H100 grid's causal forward at s = 1k, d = 256: K and V 1 MiB per head, 128 heads.
  EXPECT_EQ(tile_group(true, int64_t{4} * 1024 * 256, 8, 128), 16);
}

}  // namespace
}  // namespace flare
