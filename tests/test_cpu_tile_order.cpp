// Tests of the CUDA grids' CTA order (src/cuda/sm80/tile_order.h), which is host code: the grouped
// order must give every (tile, head, batch) slot to exactly one CTA for any grid shape and group,
// put each group's heavier ranks before its lighter ones, and pick groups by the stated rule. And
// the forward's choice between a bucket's tiles (src/cuda/sm80/fwd_tiles.h) and the decoding's
// split count (src/cuda/decode/decode_grid.h), host code too.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "cuda/decode/decode_grid.h"
#include "cuda/sm80/fwd_tiles.h"
#include "cuda/sm80/tile_order.h"
#include "cuda/sm90/bwd_tiles.h"
#include "cuda/sm90/fwd_tiles.h"

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
            if (first == prev_first) {
              EXPECT_GE(s.rank, prev_rank) << "linear " << linear;
            }
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
      if (g > 1) {
        EXPECT_LE(g * head_bytes, kTileGroupBytes);
      }
      if (2 * g <= heads) {
        EXPECT_GT(2 * g * head_bytes, kTileGroupBytes) << g;
      }
    }
  // The H100 grid's causal forward at s = 1k, d = 256: K and V 1 MiB per head, 128 heads.
  EXPECT_EQ(tile_group(true, int64_t{4} * 1024 * 256, 8, 128), 16);
}

// The short-walk rule: masks whose rows see at most kShortWalkKeys keys on average, never the
// unmasked (or only ragged) problems, whatever their length.
TEST(FwdTiles, ShortWalkTileForMasksWithShortKeyWalks) {
  using cuda::sm80::kShortWalkKeys;
  using cuda::sm80::mean_visible_keys;
  using cuda::sm80::takes_short_fwd_tile;
  auto problem = [](int s_q, int s_k, int left, int right) {
    AttentionParams p;
    p.seqlen_q = s_q;
    p.seqlen_k = s_k;
    p.window_left = left;
    p.window_right = right;
    return p;
  };
  // Causal (window_right = 0): a row i of s × s sees i + 1 keys, a mean of about s / 2.
  EXPECT_NEAR(mean_visible_keys(problem(2048, 2048, -1, 0)), 1024, 1);
  EXPECT_NEAR(mean_visible_keys(problem(4096, 4096, -1, 0)), 2048, 1);
  EXPECT_TRUE(takes_short_fwd_tile(problem(512, 512, -1, 0)));
  EXPECT_TRUE(takes_short_fwd_tile(problem(2048, 2048, -1, 0)));
  EXPECT_FALSE(takes_short_fwd_tile(problem(4096, 4096, -1, 0)));
  // Bottom-right aligned: 1k queries over 8k keys see 7k+ keys each.
  EXPECT_FALSE(takes_short_fwd_tile(problem(1024, 8192, -1, 0)));
  // A sliding window bounds the walk at any length (256 keys a row but for the first rows, which
  // the sample's row 0 stands for); a wide one does not.
  EXPECT_NEAR(mean_visible_keys(problem(65536, 65536, 255, 0)), 256, 256 / 16 + 1);
  EXPECT_TRUE(takes_short_fwd_tile(problem(65536, 65536, 255, 0)));
  EXPECT_FALSE(takes_short_fwd_tile(problem(65536, 65536, 2 * kShortWalkKeys, 0)));
  // No mask: every row sees every key, and the primary tile runs even for short sequences.
  EXPECT_FALSE(takes_short_fwd_tile(problem(512, 512, -1, -1)));
  EXPECT_FALSE(takes_short_fwd_tile(problem(64, 64, -1, -1)));
  // Rows that see no key count as zero, and an empty problem asks nothing.
  EXPECT_EQ(mean_visible_keys(problem(300, 0, -1, 0)), 0);
  EXPECT_EQ(mean_visible_keys(problem(0, 0, -1, 0)), 0);
  // Only d 256 has a short-walk tile now; the other buckets never ask.
  EXPECT_TRUE(cuda::sm80::has_short_fwd_tile(256));
  EXPECT_FALSE(cuda::sm80::has_short_fwd_tile(128));
}

// The sm90 forward's persistent kernel runs calls of at most 2048 keys in the buckets up to 128
// and 1024 at d 192 (the lengths where it measured faster), never the d 256 bucket; d 80 and 96
// take a 128-row tile there and a 192-row tile beyond, where block masks go to sm80; the tests'
// hook forces the persistent row where there is one. It counts query tiles in int, so calls with
// more than INT_MAX / 2 tiles stay off sm90.
TEST(Fwd90Tiles, RowPerKernelOfEachBucket) {
  using cuda::sm90::fwd90_row;
  auto problem = [](int d, int s_q, int s_k) {
    AttentionParams p;
    p.dtype = DType::kBFloat16;
    p.head_dim = d;
    p.seqlen_q = s_q;
    p.seqlen_k = s_k;
    return p;
  };
  for (int d : {40, 64, 72, 80, 96, 128}) {
    EXPECT_TRUE(fwd90_row(problem(d, 512, 512)).persistent) << d;
    EXPECT_TRUE(fwd90_row(problem(d, 4096, 2048)).persistent) << d;
    EXPECT_FALSE(fwd90_row(problem(d, 2048, 2049)).persistent) << d;
    EXPECT_FALSE(fwd90_row(problem(d, 16384, 16384)).persistent) << d;
    EXPECT_TRUE(fwd90_row(problem(d, 16384, 16384), true).persistent) << d;
  }
  EXPECT_TRUE(fwd90_row(problem(192, 512, 1024)).persistent);
  EXPECT_FALSE(fwd90_row(problem(192, 512, 1025)).persistent);
  EXPECT_EQ(fwd90_row(problem(192, 4096, 4096)).block_n, 96);
  EXPECT_FALSE(fwd90_row(problem(256, 512, 512), true).persistent);
  EXPECT_EQ(fwd90_row(problem(88, 512, 512)).head_dim, 96);
  EXPECT_EQ(fwd90_row(problem(80, 1024, 1024)).block_m, 128);
  EXPECT_EQ(fwd90_row(problem(80, 4096, 4096)).block_m, 192);
  EXPECT_EQ(fwd90_row(problem(32, 512, 512)).head_dim, 0);
  EXPECT_EQ(fwd90_row(problem(264, 512, 512)).head_dim, 0);

  // A block-sparse call the sm90 forward would take but for its tile (only the pointers'
  // alignment and the strides are read).
  alignas(16) static unsigned char tensor[16] = {1};
  AttentionParams sparse = problem(80, 1024, 1024);
  sparse.q = sparse.k = sparse.v = sparse.o = tensor;
  sparse.heads_q = sparse.heads_kv = sparse.batch = 1;
  sparse.q_row_stride = sparse.k_row_stride = sparse.v_row_stride = sparse.o_row_stride = 80;
  sparse.block_mask = tensor;
  sparse.block_m = sparse.block_n = 128;
  EXPECT_TRUE(cuda::sm90::forward_supported(sparse));
  sparse.seqlen_q = sparse.seqlen_k = 4096;
  EXPECT_FALSE(cuda::sm90::forward_supported(sparse));
  EXPECT_TRUE(cuda::sm90::forward_supported(sparse, true));

  AttentionParams p = problem(128, 1024, 1024);
  p.heads_q = 32;
  p.batch = 4;
  EXPECT_EQ(cuda::sm90::fwd90_tile_count(p, 128), 8 * 32 * 4);
  p.seqlen_q = 1025;  // a ragged last tile counts
  EXPECT_EQ(cuda::sm90::fwd90_tile_count(p, 128), 9 * 32 * 4);
  p.seqlen_q = 1 << 30;  // 2^23 tiles a head
  p.heads_q = 256;       // 2^31 in all
  p.batch = 1;
  EXPECT_GT(cuda::sm90::fwd90_tile_count(p, 128), int64_t{INT32_MAX} / 2);
}

// Packed variable-length batches run the persistent kernel of buckets that have one, whatever
// the longest sequence, and count at most ceil(total_q / block_m) + batch tiles a head (the host
// does not read cu_seqlens).
TEST(Fwd90Tiles, PackedBatchesRunThePersistentKernel) {
  alignas(16) static unsigned char tensor[16] = {1};
  static const int32_t cu[3] = {0, 100, 5000};
  auto packed = [](int d, int max_len, int64_t total) {
    AttentionParams p;
    p.dtype = DType::kBFloat16;
    p.head_dim = d;
    p.q = p.k = p.v = p.o = tensor;
    p.dout = p.dk = p.dv = tensor;
    p.heads_q = 8;
    p.heads_kv = 2;
    p.batch = 2;
    p.seqlen_q = p.seqlen_k = max_len;
    p.total_q = p.total_k = total;
    p.cu_seqlens_q = p.cu_seqlens_k = cu;
    p.q_row_stride = p.o_row_stride = p.do_row_stride = 8 * d;
    p.k_row_stride = p.v_row_stride = p.dk_row_stride = p.dv_row_stride = 2 * d;
    p.q_head_stride = p.k_head_stride = p.v_head_stride = p.o_head_stride = d;
    p.do_head_stride = p.dk_head_stride = p.dv_head_stride = d;
    return p;  // batch strides 0: rows are found by cu_seqlens
  };
  for (int d : {40, 64, 80, 96, 128, 136, 192}) {
    const AttentionParams p = packed(d, 4900, 5000);
    EXPECT_TRUE(cuda::sm90::fwd90_row(p).persistent) << d;
    EXPECT_TRUE(cuda::sm90::forward_supported(p)) << d;
  }
  EXPECT_FALSE(cuda::sm90::forward_supported(packed(256, 4900, 5000)));  // no persistent row
  AttentionParams sparse = packed(128, 4900, 5000);
  sparse.block_mask = tensor;
  sparse.block_m = sparse.block_n = 128;
  EXPECT_FALSE(cuda::sm90::forward_supported(sparse));
  EXPECT_FALSE(cuda::sm90::forward_supported(packed(128, 4900, int64_t{INT32_MAX})));

  // The backward takes packed batches in every bucket, without a block mask.
  for (int d : {40, 64, 80, 128, 136, 160, 200, 256})
    EXPECT_TRUE(cuda::sm90::backward_supported(packed(d, 4900, 5000))) << d;
  for (int d : {32, 168, 192})  // sm80's 32 and 192 buckets
    EXPECT_FALSE(cuda::sm90::backward_supported(packed(d, 4900, 5000))) << d;

  // Score modifiers, dropout and determinism: both passes take softcap, ALiBi and dropout; the
  // backward the deterministic mode too (turns at each query block; a block mask, which packed
  // batches refuse anyway, would leave holes in the turns).
  static const float slopes[8] = {};
  AttentionParams capped = packed(128, 4900, 5000), biased = capped, dropped = capped,
                  ordered = capped;
  capped.softcap = 30.0f;
  biased.alibi_slopes = slopes;
  dropped.dropout_p = 0.1f;
  ordered.deterministic = true;
  EXPECT_TRUE(cuda::sm90::forward_supported(capped));
  EXPECT_TRUE(cuda::sm90::forward_supported(biased));
  EXPECT_TRUE(cuda::sm90::forward_supported(dropped));
  EXPECT_TRUE(cuda::sm90::backward_supported(capped));
  EXPECT_TRUE(cuda::sm90::backward_supported(biased));
  EXPECT_TRUE(cuda::sm90::backward_supported(dropped));
  EXPECT_TRUE(cuda::sm90::backward_supported(ordered));
  EXPECT_FALSE(cuda::sm90::backward_supported(sparse));
  EXPECT_FALSE(cuda::sm90::backward_supported(packed(128, 4900, int64_t{INT32_MAX})));

  // 2 sequences of 100 and 4900 rows: 1 + 39 tiles of 128 a head (the bound says 40 + 2).
  EXPECT_EQ(cuda::sm90::fwd90_tile_count(packed(128, 4900, 5000), 128), (40 + 2) * 8);
  // Many short sequences: the padded count is smaller than the bound.
  AttentionParams short_ones = packed(128, 3, 5000);
  short_ones.batch = 2;
  EXPECT_EQ(cuda::sm90::fwd90_tile_count(short_ones, 128), 2 * 8);
}

// The decoding's splits on 132 SMs (396 places at head dim 128), each count worked out by hand
// from decode_grid.h's model: waves(splits) · (6 + blocks / (4 · splits)), in key blocks a warp.
TEST(DecodeSplits, FillWholeWavesAndWeighEachCtasFixedCost) {
  auto call = [](int batch, int heads_kv, int group, int64_t capacity) {
    cuda::DecodeParams p;
    p.batch = batch;
    p.heads_kv = heads_kv;
    p.group = group;
    p.heads_q = heads_kv * group;
    p.seqlen_q = 1;
    p.head_dim = 128;
    p.capacity = capacity;
    p.num_splits = 0;  // automatic, as attention_with_kvcache passes it
    return p;
  };
  using cuda::decode::split_count;
  // 8 CTAs of 2048 blocks: 49 splits fill one wave at 6 + 2048 / 196 = 16.45; 50 would spill
  // 4 CTAs into a second (2 · 16.24), 99 run two full waves (2 · 11.17).
  EXPECT_EQ(split_count(call(1, 8, 4, 32768), 132), 49);
  // 32 CTAs: 12 splits (384 CTAs, 6 + 42.7); 13 would spill into a second wave.
  EXPECT_EQ(split_count(call(1, 32, 1, 32768), 132), 12);
  // 512 CTAs of 2048 blocks, 2 waves unsplit (1036): 3 splits run 4 waves of 176.7 (707).
  EXPECT_EQ(split_count(call(16, 32, 1, 32768), 132), 3);
  // 1024 CTAs of 64 blocks: 3 waves of 22 (66) unsplit, split 2 ways 6 waves of 14 (84).
  EXPECT_EQ(split_count(call(128, 8, 4, 1024), 132), 1);
  // 64 blocks allow 8 splits (8 blocks each): 6 + 2 = 8, the least.
  EXPECT_EQ(split_count(call(1, 8, 4, 1024), 132), 8);
  EXPECT_EQ(split_count(call(1, 8, 4, 100), 132), 1);  // under 16 blocks: no split
  // The caller's count wins, capped at kMaxSplits.
  cuda::DecodeParams asked = call(1, 8, 4, 32768);
  asked.num_splits = 3;
  EXPECT_EQ(split_count(asked, 132), 3);
  asked.num_splits = 1000;
  EXPECT_EQ(split_count(asked, 132), cuda::decode::kMaxSplits);
}

}  // namespace
}  // namespace flare
