// decode_kernel.cuh — KV-cache decoding on CUDA: the attention of a few new query rows over each
// sequence's cache, read in place (contiguous or paged), split over keys.
//
// Work split. The query rows of one (sequence, kv head) — s_q rows times the `group` query heads
// that share the kv head — are packed into tiles of 16 rows, row r = (query row r / group, query
// head r % group): with GQA one K/V row feeds every head of its group, and the 16-row tile is one
// tensor-core product per 8 keys. A CTA takes one (row tile, sequence · kv head, split) and its
// four warps take every fourth key block of the split's key range, each with its own double-
// buffered K/V tiles in shared memory (no CTA-wide barrier until the end), an online softmax in
// registers and O accumulated in fp32. The warps' partial results are combined in shared memory;
// with one split the CTA writes o and lse, with several it writes fp32 partials (O, LSE) that
// merge_kernel combines with the rule of dist/merge.h. Decoding reads each cache byte once per
// call, so the kernel is built to keep the memory busy: 16-byte copies (cp.async) of the next key
// block in flight while a warp computes on the current one, three CTAs per SM (up to d 128).
//
// Masks and score modifiers are those of core/score_mod.h with the mask aligned to the bottom
// right (query row j of s_q sits at key position j + len − s_q).
//
// NaN and Inf. The tensor-core path computes P·V over whole key blocks, so a key a row must not
// see can still reach it as 0 · Inf; and a row whose visible scores are all −inf comes out as
// "no key" (LSE −inf, O 0) where the reference gives NaN. Both show as a non-finite O or LSE in a
// row that sees at least one key, and only then: such rows are recomputed by exact_row, one warp
// per row, with the reference's own arithmetic over the visible keys alone (never taken on finite
// data, so it costs nothing there).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/numeric.h"
#include "core/score_mod.h"
#include "cuda/decode/decode_launch.h"
#include "cuda/decode/decode_params.h"
#include "cuda/online_softmax.cuh"
#include "cuda/ptx/cp_async.cuh"
#include "cuda/ptx/fast_math.cuh"
#include "cuda/ptx/ldmatrix.cuh"
#include "cuda/ptx/mma.cuh"

namespace flare::cuda::decode {

// ---- sequence checks ----------------------------------------------------------------------------

// What a kernel needs to know of sequence i, and whether its integer arguments obey the rules the
// host checks on the CPU path: cache_seqlens ≥ 0, length within the capacity, the cache row
// (cache_batch_idx) inside the cache, the rotary tables long enough. Block-table entries are
// checked where they are read (cache_offset).
struct Sequence {
  bool ok;
  int len_before;     // tokens in the cache before this call's append
  int len;            // keys attended: len_before + seqlen_new (0 when !ok)
  int64_t cache_row;  // contiguous caches
};

__device__ __forceinline__ Sequence sequence_of(const DecodeParams& p, int i) {
  Sequence s{true, p.cache_seqlen, 0, i};
  if (p.cache_seqlens != nullptr) s.len_before = p.cache_seqlens[i * p.cache_seqlens_stride];
  const int64_t n = static_cast<int64_t>(s.len_before) + p.seqlen_new;
  s.ok = s.len_before >= 0 && n <= p.capacity;
  if (p.block_table == nullptr && p.cache_batch_idx != nullptr)
    s.cache_row = p.cache_batch_idx[i * p.cache_batch_idx_stride];
  if (p.block_table == nullptr) s.ok = s.ok && s.cache_row >= 0 && s.cache_row < p.batch_cache;
  if (p.rotary_cos != nullptr) {
    const int q_span = p.rotate_q_per_row ? p.seqlen_q : (p.seqlen_q < 1 ? p.seqlen_q : 1);
    const int span = p.seqlen_new > q_span ? p.seqlen_new : q_span;
    s.ok = s.ok && static_cast<int64_t>(s.len_before) + span <= p.seqlen_rotary;
  }
  s.len = s.ok ? static_cast<int>(n) : 0;
  return s;
}

// Element offset of (token t, kv head h, 0) of sequence i in a cache with `stride`; −1 when the
// block_table entry holding t lies outside [0, num_blocks).
__device__ __forceinline__ int64_t cache_offset(const DecodeParams& p, const int64_t (&stride)[3],
                                                const Sequence& s, int i, int t, int h) {
  if (p.block_table != nullptr) {
    const int32_t blk =
        p.block_table[i * p.block_table_stride[0] + (t / p.block_size) * p.block_table_stride[1]];
    if (blk < 0 || blk >= p.num_blocks) return -1;
    return blk * stride[0] + static_cast<int64_t>(t % p.block_size) * stride[1] + h * stride[2];
  }
  return s.cache_row * stride[0] + static_cast<int64_t>(t) * stride[1] + h * stride[2];
}

// ---- element conversions ------------------------------------------------------------------------

template <typename T>
__device__ __forceinline__ float load_element(const void* base, int64_t index) {
  const T x = static_cast<const T*>(base)[index];
  if constexpr (std::is_same_v<T, __half>)
    return __half2float(x);
  else
    return __bfloat162float(x);
}

// x rounded to T's precision with core/numeric.h's conversions: the CPU path's bits.
template <typename T>
__device__ __forceinline__ float round_as_cpu(float x) {
  if constexpr (std::is_same_v<T, __half>)
    return half_to_float(float_to_half(x));
  else
    return bf16_to_float(float_to_bf16(x));
}

// ---- rotary ------------------------------------------------------------------------------------

// Element e of the head vector x (unit stride, p.dtype) rotated at position pos, rounded to the
// dtype once: the CPU path's arithmetic (kvcache.cpp, copy_head), with the products and the sum
// kept apart so no FMA changes a bit.
template <typename T>
__device__ __forceinline__ float rotated_element(const DecodeParams& p, const void* x, int64_t base,
                                                 int e, int64_t pos) {
  const int half = p.rotary_half;
  if (p.rotary_cos == nullptr || e >= 2 * half) return load_element<T>(x, base + e);
  const bool first = p.rotary_interleaved ? (e & 1) == 0 : e < half;
  const int m = p.rotary_interleaved ? e >> 1 : (first ? e : e - half);
  const int e0 = p.rotary_interleaved ? 2 * m : m, e1 = p.rotary_interleaved ? 2 * m + 1 : m + half;
  const int64_t at_cos = pos * p.cos_stride[0] + m * p.cos_stride[1];
  const int64_t at_sin = pos * p.sin_stride[0] + m * p.sin_stride[1];
  const float co = p.rotary_fp32 ? static_cast<const float*>(p.rotary_cos)[at_cos]
                                 : load_element<T>(p.rotary_cos, at_cos);
  const float si = p.rotary_fp32 ? static_cast<const float*>(p.rotary_sin)[at_sin]
                                 : load_element<T>(p.rotary_sin, at_sin);
  const float x0 = load_element<T>(x, base + e0), x1 = load_element<T>(x, base + e1);
  const float r = first ? __fsub_rn(__fmul_rn(x0, co), __fmul_rn(x1, si))
                        : __fadd_rn(__fmul_rn(x0, si), __fmul_rn(x1, co));
  return round_as_cpu<T>(r);
}

// Query row j of sequence i, head h, element e, as attended (rotated when rotary is on).
template <typename T>
__device__ __forceinline__ float query_element(const DecodeParams& p, const Sequence& s, int i,
                                               int j, int h, int e) {
  const int64_t base = i * p.q_batch_stride + j * p.q_row_stride + h * p.q_head_stride;
  const int64_t pos = static_cast<int64_t>(s.len_before) + (p.rotate_q_per_row ? j : 0);
  return rotated_element<T>(p, p.q, base, e, pos);
}

// ---- scores -------------------------------------------------------------------------------------

// The score of (query row j, key t) from the raw dot product q·k, natural base: scale, softcap,
// ALiBi, in the reference's order.
__device__ __forceinline__ float modified_score(const DecodeParams& p, float dot, float slope,
                                                int j, int t, int len) {
  return flare::modified_score(
      dot * p.scale, p.softcap, p.softcap_inverse,
      p.alibi_slopes != nullptr ? alibi_bias(slope, j, t, p.seqlen_q, len) : 0.0f);
}

__device__ __forceinline__ float slope_of(const DecodeParams& p, int i, int h) {
  return p.alibi_slopes ? p.alibi_slopes[i * p.alibi_batch_stride + h] : 0.0f;
}

// ---- the exact path for rows with NaN or Inf ----------------------------------------------------

template <typename T>
__device__ __forceinline__ T from_float(float x) {
  if constexpr (std::is_same_v<T, __half>)
    return __float2half_rn(x);
  else
    return __float2bfloat16_rn(x);
}

template <typename T>
__device__ __forceinline__ void store_element(void* base, int64_t index, float x) {
  static_cast<T*>(base)[index] = from_float<T>(x);
}

// The score of (query row j, head h, key t) with fp32 dot products, as exact_row reads it.
template <typename T>
__device__ __forceinline__ float exact_score(const DecodeParams& p, const Sequence& s, int i, int j,
                                             int h, int t, float slope) {
  const int64_t k_off = cache_offset(p, p.k_stride, s, i, t, h / p.group);
  if (k_off < 0) return NAN;
  float dot = 0.0f;
  for (int e = 0; e < p.head_dim; ++e)
    dot += query_element<T>(p, s, i, j, h, e) * load_element<T>(p.k_cache, k_off + e);
  return modified_score(p, dot, slope, j, t, s.len);
}

// One warp recomputes row (i, j, h) as the reference does — m the largest visible score that is
// not NaN, LSE = m + log Σ exp(s − m), O = Σ exp(s − LSE)·v — over the visible keys only, in fp32,
// and writes o and lse. kMaxD / 32 accumulators per lane.
template <typename T, int kMaxD>
__device__ __forceinline__ void exact_row(const DecodeParams& p, const Sequence& s, int i, int j,
                                          int h) {
  const int lane = threadIdx.x % 32, kvh = h / p.group, d = p.head_dim;
  const KeyRange keys = visible_keys(j, p.seqlen_q, s.len, p.window_left, p.window_right);
  const float slope = slope_of(p, i, h);
  // A block_table entry out of range reads as a NaN score or value: the row comes out NaN.
  auto score = [&](int t) { return exact_score<T>(p, s, i, j, h, t, slope); };

  float m = -INFINITY;
  for (int t = keys.lo + lane; t < keys.hi; t += 32) {
    const float x = score(t);
    if (x > m) m = x;
  }
  for (int off = 16; off > 0; off /= 2) {
    const float other = __shfl_xor_sync(0xffffffffu, m, off);
    if (other > m) m = other;  // lanes' maxima are never NaN: the reference's comparison
  }
  float sum = 0.0f;
  for (int t = keys.lo + lane; t < keys.hi; t += 32) sum += expf(score(t) - m);
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  const float lse = m + logf(sum);
  float acc[kMaxD / 32] = {};
  for (int t0 = keys.lo; t0 < keys.hi; t0 += 32) {
    const int t = t0 + lane;
    const float prob = t < keys.hi ? expf(score(t) - lse) : 0.0f;
    const int n = keys.hi - t0 < 32 ? keys.hi - t0 : 32;
    for (int k = 0; k < n; ++k) {
      const float pk = __shfl_sync(0xffffffffu, prob, k);
      const int64_t v_off = cache_offset(p, p.v_stride, s, i, t0 + k, kvh);
#pragma unroll
      for (int c = 0; c < kMaxD / 32; ++c)
        if (c * 32 + lane < d)
          acc[c] += v_off < 0 ? NAN : pk * load_element<T>(p.v_cache, v_off + c * 32 + lane);
    }
  }
  const int64_t o_base = i * p.o_batch_stride + j * p.o_row_stride + h * p.o_head_stride;
#pragma unroll
  for (int c = 0; c < kMaxD / 32; ++c)
    if (c * 32 + lane < d) store_element<T>(p.o, o_base + c * 32 + lane, acc[c]);
  if (lane == 0 && p.lse != nullptr)
    p.lse[(static_cast<int64_t>(i) * p.heads_q + h) * p.seqlen_q + j] = lse;
}

// ---- the tiled kernel ---------------------------------------------------------------------------

template <int kHeadDim>
struct Tile {
  static constexpr int kRows = kRowsPerTile;      // query rows per CTA: one mma M
  static constexpr int kWarps = kWarpsPerCta;     // each over every fourth key block
  static constexpr int kKeys = keys_per_block(kHeadDim);
  static constexpr int kChunks = kHeadDim / 8;    // 16-byte chunks per row
  static constexpr int kBlockElems = kKeys * kHeadDim;
  static constexpr int kStages = 2;
  // Q, then per warp and stage a K and a V block; the combine reuses the blocks' space.
  static constexpr int kQElems = kRows * kHeadDim;
  static constexpr int kWarpElems = kStages * 2 * kBlockElems;
  template <typename T>
  static constexpr int smem_bytes() {
    return static_cast<int>((kQElems + kWarps * kWarpElems) * sizeof(T));
  }
  static_assert(kKeys % 16 == 0 && kChunks >= 8, "decode tile: whole mma steps, 8+ chunks a row");
};

// Element offset of (row r, 16-byte chunk c) in a tile whose rows hold kChunks chunks: chunks are
// XOR-swizzled by the row's low three bits, so the eight rows one ldmatrix reads hit eight
// different bank groups.
template <int kChunks>
__device__ __forceinline__ int swizzled(int r, int c) {
  return r * kChunks * 8 + ((c ^ (r & 7)) << 3);
}

// Copies one 16-byte chunk (`valid` of its 8 elements, the rest zeros) into shared memory. With
// valid ≤ 0 nothing is read (cp.async with source size 0), so src may point anywhere.
template <typename T>
__device__ __forceinline__ void copy_chunk(T* dst, const T* src, int valid, bool aligned16) {
  if (aligned16) {
    ptx::cp_async_16_zfill(ptx::smem_addr(dst), src, valid > 0);
  } else {
    for (int e = 0; e < 8; ++e) dst[e] = e < valid ? src[e] : from_float<T>(0.0f);
  }
}

// Copies key rows [t0, t0 + kKeys) of the K and V caches into a tile each, rows past `t_end` and
// elements past head_dim as zeros (zeros keep Q·Kᵀ exact and 0·V finite). A lane always copies
// the same 16-byte chunk of its rows, kRowsPerPass rows apart: its addresses advance by a
// constant in a contiguous cache; in a paged one each row's page comes from the block table (an
// entry out of range leaves zeros and sets *bad).
template <typename T, int kHeadDim>
__device__ __forceinline__ void load_kv_block(const DecodeParams& p, const Sequence& s, int i,
                                              int kvh, int t0, int t_end, T* k_tile, T* v_tile,
                                              bool* bad) {
  using TL = Tile<kHeadDim>;
  constexpr int kRowsPerPass = 32 / TL::kChunks;
  const int lane = threadIdx.x % 32, c = lane % TL::kChunks, r0 = lane / TL::kChunks;
  const int width = p.head_dim - c * 8 < 8 ? p.head_dim - c * 8 : 8;  // ≤ 0 past head_dim
  const T* k_base = static_cast<const T*>(p.k_cache) + kvh * p.k_stride[2] + c * 8;
  const T* v_base = static_cast<const T*>(p.v_cache) + kvh * p.v_stride[2] + c * 8;
  if (p.block_table == nullptr) {
    const T* k_row = k_base + s.cache_row * p.k_stride[0] + static_cast<int64_t>(t0 + r0) * p.k_stride[1];
    const T* v_row = v_base + s.cache_row * p.v_stride[0] + static_cast<int64_t>(t0 + r0) * p.v_stride[1];
#pragma unroll
    for (int it = 0; it < TL::kKeys / kRowsPerPass; ++it) {
      const int r = it * kRowsPerPass + r0;
      const int valid = t0 + r < t_end ? width : 0;
      copy_chunk(k_tile + swizzled<TL::kChunks>(r, c), k_row, valid, p.aligned16);
      copy_chunk(v_tile + swizzled<TL::kChunks>(r, c), v_row, valid, p.aligned16);
      k_row += kRowsPerPass * p.k_stride[1];
      v_row += kRowsPerPass * p.v_stride[1];
    }
  } else {
    // Lane r reads the table entries of rows r and r + 32 — all reads issued before any copy
    // (the copies' asm is a compiler barrier) — and the copying lanes take them by shuffle.
    static_assert(TL::kKeys <= 64, "two rows per lane");
    const int32_t* table = p.block_table + i * p.block_table_stride[0];
    int32_t entry[2] = {0, 0};
    int in_page[2] = {0, 0};
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int t = t0 + lane + 32 * half;
      if (lane + 32 * half < TL::kKeys && t < t_end) {
        entry[half] = table[(t / p.block_size) * p.block_table_stride[1]];
        in_page[half] = t % p.block_size;
        if (entry[half] < 0 || entry[half] >= p.num_blocks) {
          *bad = true;
          entry[half] = -1;
        }
      } else {
        entry[half] = -1;
      }
    }
#pragma unroll
    for (int it = 0; it < TL::kKeys / kRowsPerPass; ++it) {
      const int r = it * kRowsPerPass + r0;  // r / 32 is the same in every lane
      const int64_t blk = __shfl_sync(0xffffffffu, r < 32 ? entry[0] : entry[1], r % 32);
      const int64_t row = __shfl_sync(0xffffffffu, r < 32 ? in_page[0] : in_page[1], r % 32);
      const int valid = blk >= 0 ? width : 0;
      copy_chunk(k_tile + swizzled<TL::kChunks>(r, c),
                 k_base + blk * p.k_stride[0] + row * p.k_stride[1], valid, p.aligned16);
      copy_chunk(v_tile + swizzled<TL::kChunks>(r, c),
                 v_base + blk * p.v_stride[0] + row * p.v_stride[1], valid, p.aligned16);
    }
  }
  ptx::cp_async_commit();
}

// Per-thread online-softmax state of the two rows (g, g + 8) a lane holds.
struct RowState {
  float m[2] = {-INFINITY, -INFINITY};  // running maximum, base 2
  float l[2] = {0.0f, 0.0f};            // running sum of exp2(s − m), this lane's columns
};

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(128, ctas_per_sm(kHeadDim)) decode_kernel(const DecodeParams p) {
  using TL = Tile<kHeadDim>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* q_tile = reinterpret_cast<T*>(smem_raw);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, tq = lane % 4;

  const int i = blockIdx.x / p.heads_kv, kvh = blockIdx.x % p.heads_kv;
  const int split = blockIdx.y, row0 = blockIdx.z * TL::kRows;
  const int rows_total = p.seqlen_q * p.group;
  const Sequence s = sequence_of(p, i);

  // The tile's rows: packed row r → query row j, query head h.
  auto row_query = [&](int r) { return (row0 + r) / p.group; };
  auto row_head = [&](int r) { return kvh * p.group + (row0 + r) % p.group; };
  auto row_keys = [&](int r) {
    if (row0 + r >= rows_total) return KeyRange{0, 0};
    return visible_keys(row_query(r), p.seqlen_q, s.len, p.window_left, p.window_right);
  };

  // The keys any row of the tile sees, and this split's share of them in whole key blocks.
  int lo = s.len, hi = 0;
  for (int r = 0; r < TL::kRows; ++r) {
    const KeyRange k = row_keys(r);
    if (k.lo < k.hi) {
      lo = min(lo, k.lo);
      hi = max(hi, k.hi);
    }
  }
  const int span_blocks = hi > lo ? (hi - lo + TL::kKeys - 1) / TL::kKeys : 0;
  const int blocks_per_split = (span_blocks + p.num_splits - 1) / p.num_splits;
  const int k_begin = lo + split * blocks_per_split * TL::kKeys;
  const int k_end = min(hi, k_begin + blocks_per_split * TL::kKeys);
  const int n_blocks = k_end > k_begin ? (k_end - k_begin + TL::kKeys - 1) / TL::kKeys : 0;

  T* my_tiles = q_tile + TL::kQElems + warp * TL::kWarpElems;
  auto k_tile = [&](int stage) { return my_tiles + stage * 2 * TL::kBlockElems; };
  auto v_tile = [&](int stage) { return k_tile(stage) + TL::kBlockElems; };

  bool bad = !s.ok;
  auto issue = [&](int blk, int stage) {
    load_kv_block<T, kHeadDim>(p, s, i, kvh, k_begin + blk * TL::kKeys, k_end, k_tile(stage),
                               v_tile(stage), &bad);
  };
  // The first key block is on its way before Q is read: the two latencies overlap.
  if (s.ok && warp < n_blocks) issue(warp, 0);

  // Q, rotated, rows past the problem and elements past head_dim as zeros; unrolled by four, so
  // that loads are in flight together (fully unrolled, the rotation's code made this unit the
  // slowest of the build to compile).
#pragma unroll 4
  for (int idx = threadIdx.x; idx < TL::kRows * kHeadDim; idx += 128) {
    const int r = idx / kHeadDim, e = idx % kHeadDim;
    float x = 0.0f;
    if (s.ok && row0 + r < rows_total && e < p.head_dim)
      x = query_element<T>(p, s, i, row_query(r), row_head(r), e);
    q_tile[swizzled<TL::kChunks>(r, e / 8) + e % 8] = from_float<T>(x);
  }
  __syncthreads();

  // This lane's two rows: visible keys and ALiBi slopes.
  KeyRange vis[2];
  float slope[2];
  int qrow[2];
#pragma unroll
  for (int h2 = 0; h2 < 2; ++h2) {
    const int r = g + 8 * h2;
    vis[h2] = row_keys(r);
    qrow[h2] = row_query(r);
    slope[h2] = row0 + r < rows_total ? slope_of(p, i, row_head(r)) : 0.0f;
  }
  const bool plain_scores = p.softcap <= 0.0f && p.alibi_slopes == nullptr;
  const float scale_log2 = p.scale * kLog2e;
  // Keys every row of the tile sees (rows past the problem aside): [tile_lo, tile_hi).
  int tile_lo = 0, tile_hi = s.len;
  for (int r = 0; r < TL::kRows && row0 + r < rows_total; ++r) {
    const KeyRange k = row_keys(r);
    tile_lo = max(tile_lo, k.lo);
    tile_hi = min(tile_hi, k.hi);
  }
  float alpha[2];

  float acc_o[kHeadDim / 8][4] = {};
  RowState st;
  if (s.ok && warp < n_blocks) {
    int stage = 0;
    for (int blk = warp; blk < n_blocks; blk += TL::kWarps, stage ^= 1) {
      const bool next = blk + TL::kWarps < n_blocks;
      if (next) {
        issue(blk + TL::kWarps, stage ^ 1);
        ptx::cp_async_wait<1>();  // one group per block: this block's has landed
      } else {
        ptx::cp_async_wait<0>();
      }
      __syncwarp();
      const T* kt = k_tile(stage);
      const T* vt = v_tile(stage);
      const int t0 = k_begin + blk * TL::kKeys;

      // S = Q·Kᵀ for 16 rows × kKeys keys.
      float acc_s[TL::kKeys / 8][4] = {};
#pragma unroll
      for (int kk = 0; kk < kHeadDim / 16; ++kk) {
        uint32_t a[4];
        ptx::ldmatrix_x4(a, ptx::smem_addr(q_tile + swizzled<TL::kChunks>(
                                                        (lane & 7) + ((lane >> 3) & 1) * 8,
                                                        kk * 2 + (lane >> 4))));
#pragma unroll
        for (int np = 0; np < TL::kKeys / 16; ++np) {
          uint32_t b[4];
          ptx::ldmatrix_x4(b, ptx::smem_addr(kt + swizzled<TL::kChunks>(
                                                      np * 16 + (lane & 7) + (lane >> 4) * 8,
                                                      kk * 2 + ((lane >> 3) & 1))));
          ptx::mma_m16n8k16<T>(acc_s[2 * np], a, b[0], b[1]);
          ptx::mma_m16n8k16<T>(acc_s[2 * np + 1], a, b[2], b[3]);
        }
      }

      // Scores (base 2), masks, the online softmax; P rounded into A fragments. A block every
      // row of the tile sees whole takes no mask test (padding rows past the problem get scores
      // too, but are never written).
      const bool open = plain_scores && t0 >= tile_lo && t0 + TL::kKeys <= min(k_end, tile_hi);
      float row_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int nt = 0; nt < TL::kKeys / 8; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int h2 = c / 2, t = t0 + nt * 8 + 2 * tq + (c & 1);
          float x;
          if (open) {
            x = acc_s[nt][c] * scale_log2;
          } else if (t >= k_end || t < vis[h2].lo || t >= vis[h2].hi) {
            x = -INFINITY;
          } else if (plain_scores) {
            x = acc_s[nt][c] * scale_log2;
          } else {
            x = modified_score(p, acc_s[nt][c], slope[h2], qrow[h2], t, s.len) * kLog2e;
          }
          acc_s[nt][c] = x;
          row_max[h2] = fmaxf(row_max[h2], x);
        }
      float m_use[2];
      bool moved = false;  // O needs rescaling only where a row that has seen a key found a new max
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        const float m_old = st.m[h2];
        const MaxStep step = advance_row_max<false>(st.m[h2], quad_row_max(row_max[h2]));
        m_use[h2] = step.base;  // no key yet: exp2(−inf − 0) = 0
        alpha[h2] = step.correction;
        moved = moved || (st.m[h2] != m_old && m_old != -INFINITY);
        st.l[h2] *= alpha[h2];
      }
      if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
        for (int dt = 0; dt < kHeadDim / 8; ++dt)
#pragma unroll
          for (int c = 0; c < 4; ++c) acc_o[dt][c] *= alpha[c / 2];
      }
#pragma unroll
      for (int nt = 0; nt < TL::kKeys / 8; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const float pr = ptx::exp2_approx(acc_s[nt][c] - m_use[c / 2]);
          acc_s[nt][c] = pr;
          st.l[c / 2] += pr;
        }

      // O += P·V.
#pragma unroll
      for (int kk = 0; kk < TL::kKeys / 16; ++kk) {
        const uint32_t a[4] = {ptx::pack2<T>(acc_s[2 * kk][0], acc_s[2 * kk][1]),
                               ptx::pack2<T>(acc_s[2 * kk][2], acc_s[2 * kk][3]),
                               ptx::pack2<T>(acc_s[2 * kk + 1][0], acc_s[2 * kk + 1][1]),
                               ptx::pack2<T>(acc_s[2 * kk + 1][2], acc_s[2 * kk + 1][3])};
#pragma unroll
        for (int dp = 0; dp < kHeadDim / 16; ++dp) {
          uint32_t b[4];
          ptx::ldmatrix_x4_trans(b, ptx::smem_addr(vt + swizzled<TL::kChunks>(
                                                            kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                                            dp * 2 + (lane >> 4))));
          ptx::mma_m16n8k16<T>(acc_o[2 * dp], a, b[0], b[1]);
          ptx::mma_m16n8k16<T>(acc_o[2 * dp + 1], a, b[2], b[3]);
        }
      }
      __syncwarp();  // the next iteration's copies overwrite this stage
    }
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // The split merge may be scheduled now (it waits for this grid's results before reading).
  if (p.num_splits > 1) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
#pragma unroll
  for (int h2 = 0; h2 < 2; ++h2) {
    st.l[h2] += __shfl_xor_sync(0xffffffffu, st.l[h2], 1);
    st.l[h2] += __shfl_xor_sync(0xffffffffu, st.l[h2], 2);
  }

  // Combine the four warps: each leaves its m, l and O (fp32) in the space of the key blocks.
  __shared__ float warp_m[TL::kWarps][TL::kRows], warp_l[TL::kWarps][TL::kRows];
  __shared__ int any_bad;
  __shared__ int row_exact[TL::kRows];
  if (threadIdx.x == 0) any_bad = 0;
  if (threadIdx.x < TL::kRows) row_exact[threadIdx.x] = 0;
  __syncthreads();  // every warp is past its last read of the key blocks
  if (bad) atomicOr(&any_bad, 1);
  float* warp_o = reinterpret_cast<float*>(q_tile + TL::kQElems);  // [warp][row][kHeadDim]
  float* my_o = warp_o + warp * TL::kRows * kHeadDim;
  if (tq == 0) {
    warp_m[warp][g] = st.m[0];
    warp_m[warp][g + 8] = st.m[1];
    warp_l[warp][g] = st.l[0];
    warp_l[warp][g + 8] = st.l[1];
  }
#pragma unroll
  for (int dt = 0; dt < kHeadDim / 8; ++dt)
#pragma unroll
    for (int c = 0; c < 4; ++c)
      my_o[(g + 8 * (c / 2)) * kHeadDim + dt * 8 + 2 * tq + (c & 1)] = acc_o[dt][c];
  __syncthreads();

  const bool failed = any_bad != 0;
  for (int idx = threadIdx.x; idx < TL::kRows * kHeadDim; idx += blockDim.x) {
    const int r = idx / kHeadDim, e = idx % kHeadDim;
    if (row0 + r >= rows_total || e >= p.head_dim) continue;
    float m = -INFINITY;
    for (int w = 0; w < TL::kWarps; ++w) m = fmaxf(m, warp_m[w][r]);
    const float m_use = softmax_base(m);
    float l = 0.0f, o = 0.0f;
    for (int w = 0; w < TL::kWarps; ++w) {
      const float scale = ptx::exp2_approx(warp_m[w][r] - m_use);
      l += warp_l[w][r] * scale;
      o += warp_o[(w * TL::kRows + r) * kHeadDim + e] * scale;
    }
    // l = 0: no key seen (O 0, LSE −inf); NaN in l stays NaN in both.
    float out = l == 0.0f ? 0.0f : o / l;
    float lse = l == 0.0f ? -INFINITY : lse_from_log2(m, l);
    if (failed) out = lse = NAN;
    const int j = row_query(r), h = row_head(r);
    const int64_t row_id = (static_cast<int64_t>(i) * p.heads_q + h) * p.seqlen_q + j;
    if (p.num_splits > 1) {
      const int64_t part = static_cast<int64_t>(split) * p.batch * p.heads_q * p.seqlen_q + row_id;
      p.partial_o[part * p.head_dim + e] = out;
      if (e == 0) p.partial_lse[part] = lse;
      continue;
    }
    const KeyRange k = row_keys(r);
    if (!failed && k.lo < k.hi && !(isfinite(out) && isfinite(lse))) {
      row_exact[r] = 1;  // the exact path writes the whole row
      continue;
    }
    store_element<T>(p.o, i * p.o_batch_stride + j * p.o_row_stride + h * p.o_head_stride + e, out);
    if (e == 0 && p.lse != nullptr) p.lse[row_id] = lse;
  }
  if (p.num_splits > 1) return;
  __syncthreads();
  for (int r = warp; r < TL::kRows; r += TL::kWarps)
    if (row_exact[r]) exact_row<T, kHeadDim>(p, s, i, row_query(r), row_head(r));
}

// ---- split-KV merge -----------------------------------------------------------------------------

// One CTA per row; grid (s_q, heads_q, batch). LSE = log Σ exp(LSE_s), O = Σ exp(LSE_s − LSE)·O_s
// over the splits, the larger LSE taken out first (dist/merge.h's rule for any number of blocks).
// The splits' partial O rows are read four warps at a time, each lane holding a run of
// kHeadDim / 32 elements, so up to 128 splits take a few rounds of memory latency, not one per
// split. A NaN partial stays NaN; rows left non-finite with a visible key take the exact path.
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(128, 1) merge_kernel(const DecodeParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Launched before the attention kernel ends (programmatic dependent launch): wait for its
  // partials here.
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
  constexpr int kWarps = 4, kPerLane = kMaxSplits / 32, kRun = kHeadDim / 32;
  const int j = blockIdx.x, h = blockIdx.y, i = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t rows = static_cast<int64_t>(p.batch) * p.heads_q * p.seqlen_q;
  const int64_t row_id = (static_cast<int64_t>(i) * p.heads_q + h) * p.seqlen_q + j;

  // Every warp reads the splits' LSEs (a lane per split) and forms the same weights.
  float part_lse[kPerLane];
  float m = -INFINITY;
#pragma unroll
  for (int c = 0; c < kPerLane; ++c) {
    const int sp = c * 32 + lane;
    part_lse[c] = sp < p.num_splits ? p.partial_lse[sp * rows + row_id] : -INFINITY;
    m = fmaxf(m, part_lse[c]);
  }
  for (int off = 16; off > 0; off /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  const float m_use = softmax_base(m);
  float sum = 0.0f;
#pragma unroll
  for (int c = 0; c < kPerLane; ++c) sum += expf(part_lse[c] - m_use);  // NaN partials: NaN
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  const float lse = sum == 0.0f ? -INFINITY : m_use + logf(sum);
  float weight[kPerLane];
#pragma unroll
  for (int c = 0; c < kPerLane; ++c) weight[c] = sum == 0.0f ? 0.0f : expf(part_lse[c] - lse);

  // Warp w sums splits w, w + 4, …; lane l elements [l·kRun, (l + 1)·kRun).
  float acc[kRun] = {};
  const int e0 = lane * kRun;
#pragma unroll 4
  for (int sp = warp; sp < p.num_splits; sp += kWarps) {
    float mine = weight[0];  // split sp's weight sits in lane sp % 32, register sp / 32
#pragma unroll
    for (int c = 1; c < kPerLane; ++c)
      if (sp / 32 == c) mine = weight[c];
    const float w = __shfl_sync(0xffffffffu, mine, sp % 32);
    const float* part = p.partial_o + (sp * rows + row_id) * p.head_dim;
#pragma unroll
    for (int v = 0; v < kRun; ++v)
      if (e0 + v < p.head_dim) acc[v] += w * part[e0 + v];
  }
  __shared__ float by_warp[kWarps][kHeadDim];
#pragma unroll
  for (int v = 0; v < kRun; ++v) by_warp[warp][e0 + v] = acc[v];
  __syncthreads();
  if (warp != 0) return;
  float out[kRun];
  bool finite = isfinite(lse);
#pragma unroll
  for (int v = 0; v < kRun; ++v) {
    out[v] = sum == 0.0f ? 0.0f
                         : by_warp[0][e0 + v] + by_warp[1][e0 + v] + by_warp[2][e0 + v] + by_warp[3][e0 + v];
    finite = finite && isfinite(out[v]);
  }
  const int64_t o_base = i * p.o_batch_stride + j * p.o_row_stride + h * p.o_head_stride;
#pragma unroll
  for (int v = 0; v < kRun; ++v)
    if (e0 + v < p.head_dim) store_element<T>(p.o, o_base + e0 + v, out[v]);
  if (lane == 0 && p.lse != nullptr) p.lse[row_id] = lse;
  // A non-finite row that sees a key is rewritten by the exact path (the same warp, after its
  // own stores).
  const Sequence s = sequence_of(p, i);
  const KeyRange keys = visible_keys(j, p.seqlen_q, s.len, p.window_left, p.window_right);
  if (__any_sync(0xffffffffu, !finite) && s.ok && keys.lo < keys.hi)
    exact_row<T, kHeadDim>(p, s, i, j, h);
}

// ---- the append ---------------------------------------------------------------------------------

// One CTA per sequence: first every block_table entry the sequence uses (its first
// ceil(len / block_size)) is checked, then its warps write the (new row, kv head) vectors: k_new
// rotated at its position (fp32, one rounding, as the CPU path) and v_new. A sequence whose
// values break a rule is left entirely unwritten.
template <typename T>
__global__ void __launch_bounds__(128) append_kernel(const DecodeParams p) {
  const int i = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const Sequence s = sequence_of(p, i);
  if (!s.ok) return;
  bool bad = false;
  if (p.block_table != nullptr)
    for (int lb = threadIdx.x; lb < (s.len + p.block_size - 1) / p.block_size; lb += blockDim.x) {
      const int32_t blk = p.block_table[i * p.block_table_stride[0] + lb * p.block_table_stride[1]];
      bad = bad || blk < 0 || blk >= p.num_blocks;
    }
  if (__syncthreads_or(bad)) return;
  T* kc = static_cast<T*>(p.k_cache);
  T* vc = static_cast<T*>(p.v_cache);
  const T* kn = static_cast<const T*>(p.k_new);
  const T* vn = static_cast<const T*>(p.v_new);
  for (int item = warp; item < p.seqlen_new * p.heads_kv; item += blockDim.x / 32) {
    const int j = item / p.heads_kv, h = item % p.heads_kv, pos = s.len_before + j;
    const int64_t k_dst = cache_offset(p, p.k_stride, s, i, pos, h);
    const int64_t v_dst = cache_offset(p, p.v_stride, s, i, pos, h);
    const int64_t k_src = i * p.k_new_stride[0] + j * p.k_new_stride[1] + h * p.k_new_stride[2];
    const int64_t v_src = i * p.v_new_stride[0] + j * p.v_new_stride[1] + h * p.v_new_stride[2];
    for (int e = lane; e < p.head_dim; e += 32) {
      if (p.rotary_cos != nullptr)
        store_from_float(kc, k_dst + e, p.dtype, rotated_element<T>(p, kn, k_src, e, pos));
      else
        kc[k_dst + e] = kn[k_src + e];
      vc[v_dst + e] = vn[v_src + e];
    }
  }
}

}  // namespace flare::cuda::decode
