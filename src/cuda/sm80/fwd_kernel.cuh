// fwd_kernel.cuh — the FlashAttention-2 forward kernel for sm_80 and later (mma.sync, ldmatrix,
// cp.async), fp16 and bf16, and its launcher.
//
// Work partitioning (FlashAttention-2, Dao 2023). One CTA owns kBlockM query rows of one
// (batch, head) and walks the keys that any of its rows may see in steps of kBlockN. Its warps
// split the rows (kBlockM / warps each) and never exchange data: every warp keeps its own running
// row max m, row sum l and output accumulator O in registers, so the only CTA-wide barriers are
// the ones that hand shared-memory tiles from the copy engine to the warps and back.
//
// Per key step j, for each warp (S, P in registers, fp32):
//   S  = Q·K_jᵀ                         ldmatrix Q and K fragments, mma m16n8k16
//   S  → base-2 scores                  scale·log2(e) folded into one FFMA (after the score
//                                       modifiers softcap, ALiBi: a runtime branch)
//   mask                                only on boundary steps: ragged key tail, causal diagonal,
//                                       window edges; every other step skips it
//   m' = max(m, rowmax S); P = 2^(S − m'); l = 2^(m − m')·l + rowsum P; O = 2^(m − m')·O
//                                       (O's rescale skipped when no row of the warp moved m)
//   P  → dropout (Philox, the mask the CPU draws), rounded to fp16/bf16 in the A layout
//   O += P·V_j                          ldmatrix.trans V fragments
// and at the end O /= l, LSE = m·ln2 + ln l (natural log). A row that saw no key keeps m = −inf,
// l = 0 and is written O = 0, LSE = −inf: the subtraction base is clamped to 0 so −inf − −inf never
// happens and no NaN is produced.
//
// Pipeline. Shared memory holds Q (kBlockM rows), one K tile and one V tile, rows padded by 16
// bytes so ldmatrix's eight row addresses fall in distinct banks. K and V ping-pong through
// cp.async: V_j is fetched while S = Q·K_jᵀ and the softmax run, K_{j+1} while O += P·V_j runs;
// each copy hides behind the other operand's product, with a second CTA per SM (d ≤ 128) covering
// what remains. d 256 on sm_90a (one CTA per SM) runs a pipelined step instead: K and V
// double-buffered, the next step's S formed beside this step's softmax, the two halves of the
// warps in opposite orders, and the copies spread between MMAs (see the key loop).
// Tiles hanging past the sequence end or past head_dim are zero-filled by the copy.
// Tensors whose rows are not 16-byte aligned (odd head_dim, odd strides) take a scalar-load path
// that fills the same tiles; the branch is uniform and costs the aligned path nothing.
//
// Registers. O (kWarpRows·d/32 fp32 per thread) and S (kWarpRows·kBlockN/32) are the bulk of a
// thread's 255 registers. Where they reach 192 (32-row warps: d 128 at 128×64, d 64 at 128×128) the
// kernel runs register-tight (FwdConfig::kRegisterTight): row max and sum in a per-thread
// shared-memory slot, P rounded to fp16/bf16 pairs right after the softmax, K/V pointers stepped,
// dropout drawn row by row — each worth a few registers, together the difference between spilling
// and not.
// ptxas allocates differently per arch, so the sm_80–sm_89 device code may take a shorter key
// step than sm_90a (fwd_tiles.h's last column); block_m and warps, hence the launch, are shared.
//
// Scheduling. The grid is (query blocks, heads, batch) with the query-block index reversed, so
// under causal masking each head's blocks with the most keys start first. Under causal or windowed
// masks the grouped kernel (kGrouped) goes further: heads in groups whose K/V fit a share of L2,
// every head's heaviest block before any head's next (tile_order.h), so the grid ends on light
// blocks; H100: +6 to +12% on causal d 128 from s = 1k, +4 to +9% at d 256. Keys are walked front
// to back so that concurrent CTAs of one head stream the same K/V tiles through L2. Masks follow visible_keys() from core/score_mod.h — the CPU backends' definition:
// the block's key range calls it, the per-element test is its 32-bit equivalent.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "core/block_mask.h"
#include "core/numeric.h"
#include "core/params.h"
#include "core/philox.h"
#include "core/score_mod.h"
#include "cuda/device_probe.h"
#include "cuda/element_type.cuh"
#include "cuda/nonfinite_fixup.cuh"
#include "cuda/online_softmax.cuh"
#include "cuda/ptx/cp_async.cuh"
#include "cuda/sm80/chunk_copy.cuh"
#include "cuda/ptx/fast_math.cuh"
#include "cuda/ptx/ldmatrix.cuh"
#include "cuda/ptx/mma.cuh"
#include "cuda/ptx/thread_index.cuh"
#include "cuda/sm80/fwd_launch.h"
#include "cuda/sm80/fwd_tiles.h"
#include "cuda/sm80/tile_order.cuh"

namespace flare::cuda::sm80 {

// kPreHopper: the configuration of the sm_80–sm_89 device code, whose key step may be shorter
// (fwd_tiles.h's block_n_sm80); block_m and warps, all the host sees besides shared memory, are
// the same, and the host sizes shared memory for the larger of the two. kShort: the bucket's
// short-walk tile (fwd_tiles.h, kFwdShortTiles) instead of its primary one.
template <DType kDType, int kHeadDim, bool kPreHopper = false, bool kShort = false>
struct FwdConfig {
  using Element = ElementOf<kDType>;
  static constexpr FwdTile kTile = fwd_tile(kHeadDim, kShort);
  static_assert(kTile.head_dim == kHeadDim, "head-dim bucket missing from kFwdTiles");
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kPreHopper ? kTile.block_n_sm80 : kTile.block_n;
  static constexpr int kWarps = kTile.warps;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kWarpRows = kBlockM / kWarps;    // query rows per warp
  static constexpr int kMFrags = kWarpRows / 16;        // m16 fragments per warp
  static constexpr int kNFrags = kBlockN / 8;           // n8 fragments of S
  static constexpr int kDFrags = kHeadDim / 8;          // n8 fragments of O
  static constexpr int kChunksPerRow = kHeadDim / 8;    // 16-byte chunks per tile row
  static constexpr int kSmemStride = kHeadDim + 8;      // elements; +16 bytes: no bank conflicts
  // Where O and S take 192 of a thread's 255 registers (32-row warps: d 128 with 64-key steps, d 64
  // with 128-key steps, both sm_90a) the kernel is register-tight and trades a little work for
  // registers: the running row max and sum live in a per-thread shared-memory slot (8 registers
  // back for 8 LDS/STS per step, next to the ~100 ldmatrix of the same step), P is rounded to
  // fp16/bf16 pairs as soon as the row sums are taken (32 registers back across the dropout draws
  // and the next K tile's copy), and the K/V pointers step instead of being recomputed. The other
  // tiles keep the v3 code: applied to every tile, these changes cost d 64 at 128×64 4% on the H100
  // (fwd_notes.md, v4).
  // The d 256 short-walk tile (16-row warps, 4 warps, two CTAs per SM) is register-tight too: it
  // spills 16-20 bytes on sm_90a otherwise.
  static constexpr bool kRegisterTight =
      kMFrags * (kDFrags + kNFrags) * 4 >= 192 || (kHeadDim == 256 && kWarps == 4);
  static constexpr bool kStatsInSmem = kRegisterTight;
  static constexpr int kStatsBytes = kStatsInSmem ? kMFrags * 4 * kThreads * 4 : 0;
  // Pipelined step (d 256 on sm_90a, 16-row warps at one CTA per SM): S_{j+1} = Q·K_{j+1}ᵀ is
  // formed beside the softmax of S_j, K and V double-buffered (see the key loop). The same order
  // at d 192, without its spread copies (24 chunks per row do not give each thread one column),
  // measured 3-8% slower than the plain step on the H100. Not the short-walk tile: its two CTAs
  // per SM desynchronise on their own.
  static constexpr bool kPipelineS = !kPreHopper && kHeadDim == 256 && !kShort;
  // The plain d 256 step of one CTA of 8 warps per SM (sm_80–sm_89) rescales O every step and
  // takes the general epilogue; the others vote on O's rescale and take the short epilogue.
  static constexpr bool kPlainD256 = kHeadDim == 256 && !kPipelineS && kWarps == 8;
  static constexpr int kKVBuffers = kPipelineS ? 2 : 1;
  static constexpr int kSmemBytes =
      (kBlockM + 2 * kKVBuffers * kBlockN) * kSmemStride * static_cast<int>(sizeof(Element)) +
      kStatsBytes;
  static_assert(kWarpRows % 16 == 0 && kBlockN % 16 == 0 && kHeadDim % 16 == 0, "tile shape");
  static_assert(kBlockN * kChunksPerRow % kThreads == 0 && kBlockM * kChunksPerRow % kThreads == 0,
                "tile copies must split evenly over the threads");
};

// The running softmax statistics of a thread's row fragments: base-2 row max and thread-partial
// row sum per (m16 fragment, half). In registers, or in this thread's own column of a
// (4·kMFrags, kThreads) fp32 shared-memory array (no other thread touches it: no barriers).
template <int kMFrags, bool kInSmem, int kThreads>
struct RowStats {
  float m[kMFrags][2], l[kMFrags][2];
  __device__ __forceinline__ explicit RowStats(float*) {}
  __device__ __forceinline__ float& max(int mf, int half) { return m[mf][half]; }
  __device__ __forceinline__ float& sum(int mf, int half) { return l[mf][half]; }
};
template <int kMFrags, int kThreads>
struct RowStats<kMFrags, true, kThreads> {
  float* slot;  // this thread's column
  __device__ __forceinline__ explicit RowStats(float* s) : slot(s) {}
  __device__ __forceinline__ float& max(int mf, int half) {
    return slot[(mf * 2 + half) * kThreads];
  }
  __device__ __forceinline__ float& sum(int mf, int half) {
    return slot[((kMFrags + mf) * 2 + half) * kThreads];
  }
};

// Copies a (rows_valid ≤ kRows, d_valid ≤ kHeadDim) tile of a row-major global tensor into
// shared memory as (kRows, kHeadDim), zero-filling the rest. `vec`: rows are 16-byte aligned and
// d_valid is a multiple of 8, so whole 16-byte chunks go through cp.async; otherwise elements
// are read one by one and stored synchronously (ordered by the same barriers).
template <typename Cfg, int kRows>
__device__ __forceinline__ void load_tile(typename Cfg::Element* s,
                                          const typename Cfg::Element* g, int64_t row_stride,
                                          int rows_valid, int d_valid, bool vec, int tid) {
  constexpr int kCpr = Cfg::kChunksPerRow;
  // When the chunks of a row divide the thread count, each thread keeps one column and walks
  // rows with one running pointer (no registers per chunk: d 128 would spill otherwise);
  // otherwise (d 96, 192) chunk c = tid + i·kThreads is placed by division by a constant.
  constexpr bool kFixedColumn = Cfg::kThreads % kCpr == 0;
  constexpr int kIters = kRows * kCpr / Cfg::kThreads;
  const typename Cfg::Element* src = g + (tid / kCpr) * row_stride + (tid % kCpr) * 8;
  const int64_t src_step = (Cfg::kThreads / kCpr) * row_stride;
  if constexpr (kFixedColumn && kCpr >= 8) {
    if (vec && rows_valid >= kRows && d_valid == kCpr * 8) {
      // Whole tile: no bounds to test, one copy per chunk (not at d 32, where the second copy
      // loop spills on sm_80).
#pragma unroll
      for (int i = 0; i < kIters; ++i) {
        const int c = tid + i * Cfg::kThreads;
        ptx::cp_async_16_zfill(ptx::smem_addr(s + (c / kCpr) * Cfg::kSmemStride + (c % kCpr) * 8),
                               src, true);
        src += src_step;
      }
      return;
    }
  }
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int c = tid + i * Cfg::kThreads;
    const int row = c / kCpr;
    const int col = (c % kCpr) * 8;
    if (!kFixedColumn) src = g + row * row_stride + col;
    copy_chunk16(s + row * Cfg::kSmemStride + col, src, g, row < rows_valid, col, d_valid, vec);
    if (kFixedColumn) src += src_step;
  }
}

// kGrouped: the CTA's slot follows tile_group (tile_order.cuh); otherwise launch order, and the
// code is what it was before the grouped order existed (its timings were taken with it).
template <DType kDType, int kHeadDim, bool kGrouped, bool kShort>
__global__ void __launch_bounds__(FwdConfig<kDType, kHeadDim, false, kShort>::kThreads)
    attention_forward_kernel(const __grid_constant__ AttentionParams p, const int tile_group) {
  using HostCfg = FwdConfig<kDType, kHeadDim, false, kShort>;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  using Cfg = FwdConfig<kDType, kHeadDim, true, kShort>;
#else
  using Cfg = HostCfg;
#endif
  static_assert(Cfg::kThreads == HostCfg::kThreads && Cfg::kBlockM == HostCfg::kBlockM &&
                    Cfg::kSmemBytes <= HostCfg::kSmemBytes,
                "the launcher's grid, block and shared memory must fit every arch's tile");
  using Element = typename Cfg::Element;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kStride = Cfg::kSmemStride;
  constexpr int kMFrags = Cfg::kMFrags, kNFrags = Cfg::kNFrags, kDFrags = Cfg::kDFrags;

  extern __shared__ __align__(16) unsigned char smem[];
  Element* sQ = reinterpret_cast<Element*>(smem);  // (kBlockM, kHeadDim); later O
  Element* sK = sQ + kBlockM * kStride;             // kKVBuffers × (kBlockN, kHeadDim)
  Element* sV = sK + Cfg::kKVBuffers * kBlockN * kStride;  // kKVBuffers × (kBlockN, kHeadDim)
  float* sStats = reinterpret_cast<float*>(sV + Cfg::kKVBuffers * kBlockN * kStride);

  const TileSlot slot = kGrouped ? tile_slot(tile_group) : TileSlot{};
  const int m_block = gridDim.x - 1 - (kGrouped ? slot.rank : blockIdx.x);  // heaviest first
  const int h = kGrouped ? slot.head : blockIdx.y;
  const int b = kGrouped ? slot.batch : blockIdx.z;
  const SequenceInfo seq = sequence_info(p, b);
  const int m0 = m_block * kBlockM;
  // The tile's first row, head and batch for code inside the key loop and after it. Grouped, they
  // are worked out again from volatile block-index reads: the slot is arithmetic on the block
  // index, and held in registers from the start it cost the register-tight and pipelined tiles
  // spills.
  struct Where {
    int m0, head, batch;
  };
  auto where = [&]() -> Where {
    if constexpr (kGrouped) {
      const TileSlot at = tile_slot<true>(tile_group);
      return {static_cast<int>(gridDim.x - 1 - at.rank) * kBlockM, at.head, at.batch};
    } else {
      return {m0, h, b};
    }
  };
  if (m0 >= seq.len_q) return;  // varlen: this sequence is shorter than the longest
  const int rows_q = min(kBlockM, seq.len_q - m0);
  const int d = p.head_dim;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;  // fragment row group, thread in group
  const int warp_row0 = warp * Cfg::kWarpRows;
  const int hk = h / p.head_group;

  const Element* gQ = static_cast<const Element*>(p.q) + b * p.q_batch_stride +
                      (seq.q_row0 + m0) * p.q_row_stride + h * p.q_head_stride;
  const Element* gK = static_cast<const Element*>(p.k) + b * p.k_batch_stride +
                      seq.k_row0 * p.k_row_stride + hk * p.k_head_stride;
  const Element* gV = static_cast<const Element*>(p.v) + b * p.v_batch_stride +
                      seq.k_row0 * p.v_row_stride + hk * p.v_head_stride;
  const bool vec =
      ((reinterpret_cast<uintptr_t>(p.q) | reinterpret_cast<uintptr_t>(p.k) |
        reinterpret_cast<uintptr_t>(p.v) | reinterpret_cast<uintptr_t>(p.o)) & 15) == 0 &&
      ((p.q_batch_stride | p.q_row_stride | p.q_head_stride | p.k_batch_stride |
        p.k_row_stride | p.k_head_stride | p.v_batch_stride | p.v_row_stride |
        p.v_head_stride | p.o_batch_stride | p.o_row_stride | p.o_head_stride | d) & 7) == 0;

  // Keys seen by any row of the block: [first.lo, last.hi), both ends monotone in the row.
  // A step is fully visible to every row when it starts at or after last.lo and ends at or
  // before first.hi; only the other steps pay for the mask.
  const KeyRange first = visible_keys(m0, seq.len_q, seq.len_k, p.window_left, p.window_right);
  const KeyRange last =
      visible_keys(m0 + rows_q - 1, seq.len_q, seq.len_k, p.window_left, p.window_right);
  const int n_end = last.hi > first.lo ? (last.hi + kBlockN - 1) / kBlockN : first.lo / kBlockN;
  // Block-sparse: the key steps walked are those whose mask block is on for the tile's rows (one
  // mask row block: kBlockM divides block_m; core/block_mask.h), so an off block is never read.
  // The tile's place comes from where(), not from registers held across the loop.
  auto next_step = [&](int n) {
    if (p.block_mask == nullptr) return n;
    const Where at = where();
    const int row_block = at.m0 / p.block_m;
    return next_key_tile_on(p, at.batch, at.head, row_block, row_block, n, n_end, kBlockN);
  };
  const int n_begin = next_step(first.lo / kBlockN);
  // The pipelined step reads the two bounds of the boundary test back from shared memory (written
  // before the barrier that precedes its key loop): held in registers, one of them spills.
  __shared__ int s_full_keys[2];  // kBoundsInSmem: last.lo, first.hi
  constexpr bool kBoundsInSmem = Cfg::kPipelineS && kGrouped;
  if (kBoundsInSmem && tid == 0) {
    s_full_keys[0] = last.lo;
    s_full_keys[1] = first.hi;
  }

  // Register-tight tiles advance gK and gV by one key step per iteration (no 64-bit products in
  // the loop, part of what keeps d 128 spill-free); the others keep indexing from the sequence
  // start, the code their timings were taken with.
  constexpr bool kStepPointers = Cfg::kRegisterTight;
  if constexpr (kStepPointers) {
    gK += int64_t{n_begin} * kBlockN * p.k_row_stride;
    gV += int64_t{n_begin} * kBlockN * p.v_row_stride;
  }
  load_tile<Cfg, kBlockM>(sQ, gQ, p.q_row_stride, rows_q, d, vec, tid);
  if (n_begin < n_end)
    load_tile<Cfg, kBlockN>(
        sK, kStepPointers ? gK : gK + int64_t{n_begin} * kBlockN * p.k_row_stride,
        p.k_row_stride, seq.len_k - n_begin * kBlockN, d, vec, tid);
  ptx::cp_async_commit();

  float acc_o[kMFrags][kDFrags][4];  // (kWarpRows, kHeadDim) per warp
#pragma unroll
  for (int mf = 0; mf < kMFrags; ++mf)
#pragma unroll
    for (int df = 0; df < kDFrags; ++df)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc_o[mf][df][i] = 0.0f;
  RowStats<kMFrags, Cfg::kStatsInSmem, Cfg::kThreads> stats(sStats + tid);  // m, l
#pragma unroll
  for (int mf = 0; mf < kMFrags; ++mf)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      stats.max(mf, half) = -INFINITY;
      stats.sum(mf, half) = 0.0f;
    }

  const bool score_mods = p.has_score_mods();

  // Per-lane ldmatrix addresses at fragment (0, 0) of buffer 0; fragment offsets are compile-time
  // constants.
  const uint32_t sQ_lane =
      ptx::smem_addr(sQ) + ((warp_row0 + (lane & 15)) * kStride + (lane >> 4) * 8) * 2;
  const uint32_t sK_lane =
      ptx::smem_addr(sK) + (((lane & 7) + ((lane >> 4) << 3)) * kStride + ((lane >> 3) & 1) * 8) * 2;
  const uint32_t sV_lane =
      ptx::smem_addr(sV) + (((lane & 7) + ((lane >> 3) & 1) * 8) * kStride + (lane >> 4) * 8) * 2;
  constexpr uint32_t kTileBytes = kBlockN * kStride * 2;  // one K or V buffer

  using STile = float[kMFrags][kNFrags][4];     // S or P, (kWarpRows, kBlockN) per warp
  using PTile = uint32_t[kMFrags][kNFrags][2];  // P rounded, packed pairs
  // Register-tight and pipelined tiles round P to fp16/bf16 right after the softmax, two columns
  // per register: (g, 2t..2t+1) and (g+8, 2t..2t+1) of each n8 fragment, the A layout of P·V.
  // Others round it fragment by fragment inside P·V, where the conversions interleave with the
  // MMAs.
  constexpr bool kPackEarly = Cfg::kRegisterTight || Cfg::kPipelineS;

  // S = Q·Kᵀ for the K tile at lane address k_lane; between(kk) runs after the MMAs of k slice kk
  // (the pipelined step places the softmax of the previous S there).
  auto qk_product = [&](STile& s, uint32_t k_lane, auto&& between) {
#pragma unroll
    for (int mf = 0; mf < kMFrags; ++mf)
#pragma unroll
      for (int nf = 0; nf < kNFrags; ++nf)
#pragma unroll
        for (int i = 0; i < 4; ++i) s[mf][nf][i] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      uint32_t a[kMFrags][4];
#pragma unroll
      for (int mf = 0; mf < kMFrags; ++mf)
        ptx::ldmatrix_x4(a[mf], sQ_lane + (mf * 16 * kStride + kk * 16) * 2);
#pragma unroll
      for (int np = 0; np < kNFrags / 2; ++np) {
        uint32_t bk[4];
        ptx::ldmatrix_x4(bk, k_lane + (np * 16 * kStride + kk * 16) * 2);
#pragma unroll
        for (int mf = 0; mf < kMFrags; ++mf) {
          ptx::mma_m16n8k16<Element>(s[mf][2 * np], a[mf], bk[0], bk[1]);
          ptx::mma_m16n8k16<Element>(s[mf][2 * np + 1], a[mf], bk[2], bk[3]);
        }
      }
      between(kk);
    }
  };
  auto nothing = [](int) {};

  // Score modifiers and the mask of the step at key n0.
  auto modify_and_mask = [&](STile& s, int n0) {
    // Score modifiers (ScoreMods, core/score_mod.h), raw scores in and out, so every path leaves
    // S for the same FFMA with scale·log2(e), which the hardware reads straight from the parameter
    // bank. One loop for both modifiers: as a loop each (the sm90 kernels' form) ptxas interleaves
    // a whole tile's tanh and spills at d 64 (28 bytes).
    if (score_mods) {
      const Where at = where();
      const ScoreMods mods(p, alibi_slope(p, at.batch, at.head));
      // ElementMask::rel of each element: rel0 plus a compile-time offset.
      const float rel0 =
          static_cast<float>(n0 + 2 * t - (at.m0 + warp_row0 + g + seq.len_k - seq.len_q));
#pragma unroll
      for (int mf = 0; mf < kMFrags; ++mf)
#pragma unroll
        for (int nf = 0; nf < kNFrags; ++nf)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            float& x = s[mf][nf][i];
            if (mods.capped) x = mods.cap(x);
            const int offset = nf * 8 + (i & 1) - mf * 16 - (i >> 1) * 8;
            if (mods.alibi) x = mods.bias(x, rel0 + static_cast<float>(offset));
          }
    }
    const int full_lo = kBoundsInSmem ? *static_cast<volatile int*>(&s_full_keys[0]) : last.lo;
    const int full_hi = kBoundsInSmem ? *static_cast<volatile int*>(&s_full_keys[1]) : first.hi;
    if (n0 < full_lo || n0 + kBlockN > full_hi) {
      // Boundary step: ElementMask (core/score_mod.h) for the thread's elements, key
      // n0 + 2t + nf·8 + j of row m0 + warp_row0 + g + mf·16 + half·8.
      const ElementMask mask(n0, 2 * t, where().m0 + warp_row0 + g, seq.len_q, seq.len_k,
                             p.window_left, p.window_right);
#pragma unroll
      for (int mf = 0; mf < kMFrags; ++mf)
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
          for (int nf = 0; nf < kNFrags; ++nf)
#pragma unroll
            for (int j = 0; j < 2; ++j)
              if (mask.masked(nf * 8 + j, mf * 16 + half * 8)) s[mf][nf][2 * half + j] = -INFINITY;
    }
  };

  // Online softmax: S → P (unnormalised, fp32, in place), the row statistics and O's scale
  // advanced. O's rows are rescaled only when some lane of the warp raised that row fragment's
  // max: past the first few steps the max rarely moves, and the rescale (2·kDFrags FMULs per row
  // pair) is the largest non-MMA cost of a step. A skipped factor is 2^0 = 1 (or multiplies an O
  // that is still 0), so skipping changes no bit of the result. The plain d 256 step (sm_80–
  // sm_89; 16-row warps, one CTA per SM) rescales O every step, as FlashAttention-2 does: without
  // the vote's branch the step is one block of code for the scheduler (H100, A/B in one call:
  // d 256 +0.4 to +1.9% at s <= 4k, even above; d 64 and 128 lost up to 1.8%). The pipelined
  // d 256 step runs the softmax beside the other warp half's MMAs, where the skipped FMULs count
  // and the branch costs nothing: there the vote is back (+1.1 to +2.2% on every d 256 cell).
  //
  // A thread holds kMFrags·2 row fragments (mf, half). With 128-key steps (d 64 on sm_90a) each
  // fragment's max chain, shuffles and 32 exponentials are long, so the fragments go through
  // each phase together (max, shuffles, correction, rescale, exponentials) and their latencies
  // overlap instead of queueing behind one another's vote and branch; the row sum runs as two
  // partial sums. With 64-key steps the extra live values cost more than the overlap gains, and
  // each fragment goes through all phases before the next. H100, A/B in one call: d 64 +0.4 to
  // +2.9% on every cell; the same at d 128 and 256 −0 to −2.4%.
  // Rows' maxima move lazily (advance_row_max) wherever O's rescale is voted on.
  constexpr bool kLazyMax = !Cfg::kPlainD256;
  auto softmax = [&](STile& s) {
    if constexpr (kNFrags >= 16) {
      constexpr int kRowFrags = kMFrags * 2;  // fragment f: mf = f / 2, half = f % 2
      float mx[kRowFrags], base[kRowFrags], correction[kRowFrags];
#pragma unroll
      for (int f = 0; f < kRowFrags; ++f) {
        mx[f] = -INFINITY;
#pragma unroll
        for (int nf = 0; nf < kNFrags; ++nf)
          mx[f] = fmaxf(mx[f], fmaxf(s[f / 2][nf][2 * (f % 2)], s[f / 2][nf][2 * (f % 2) + 1]));
      }
      quad_row_max(mx);
      bool moved[kRowFrags];
#pragma unroll
      for (int f = 0; f < kRowFrags; ++f) {
        const MaxStep step =
            advance_row_max<kLazyMax>(stats.max(f / 2, f % 2), mx[f] * p.scale_log2);
        base[f] = step.base;
        correction[f] = step.correction;
        moved[f] = step.moved;
      }
#pragma unroll
      for (int f = 0; f < kRowFrags; ++f)
        if (__any_sync(0xffffffffu, moved[f])) {
#pragma unroll
          for (int df = 0; df < kDFrags; ++df) {
            acc_o[f / 2][df][2 * (f % 2)] *= correction[f];
            acc_o[f / 2][df][2 * (f % 2) + 1] *= correction[f];
          }
        }
#pragma unroll
      for (int f = 0; f < kRowFrags; ++f) {
        float sum[2] = {0.0f, 0.0f};
#pragma unroll
        for (int nf = 0; nf < kNFrags; ++nf)
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            float& x = s[f / 2][nf][2 * (f % 2) + j];
            x = ptx::exp2_approx(fmaf(x, p.scale_log2, -base[f]));
            sum[nf % 2] += x;
          }
        stats.sum(f / 2, f % 2) = stats.sum(f / 2, f % 2) * correction[f] + (sum[0] + sum[1]);
      }
    } else {
#pragma unroll
      for (int mf = 0; mf < kMFrags; ++mf)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float mx = -INFINITY;
#pragma unroll
          for (int nf = 0; nf < kNFrags; ++nf)
            mx = fmaxf(mx, fmaxf(s[mf][nf][2 * half], s[mf][nf][2 * half + 1]));
          const auto [base, correction, moved] =
              advance_row_max<kLazyMax>(stats.max(mf, half), quad_row_max(mx) * p.scale_log2);
          if (Cfg::kPlainD256 || __any_sync(0xffffffffu, moved)) {
#pragma unroll
            for (int df = 0; df < kDFrags; ++df) {
              acc_o[mf][df][2 * half] *= correction;
              acc_o[mf][df][2 * half + 1] *= correction;
            }
          }
          float sum = 0.0f;
#pragma unroll
          for (int nf = 0; nf < kNFrags; ++nf)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
              const float pr = ptx::exp2_approx(fmaf(s[mf][nf][2 * half + j], p.scale_log2, -base));
              s[mf][nf][2 * half + j] = pr;
              sum += pr;
            }
          stats.sum(mf, half) = stats.sum(mf, half) * correction + sum;
        }
    }
  };

  auto pack_p = [&](const STile& s, PTile& p16) {
#pragma unroll
    for (int mf = 0; mf < kMFrags; ++mf)
#pragma unroll
      for (int nf = 0; nf < kNFrags; ++nf)
#pragma unroll
        for (int half = 0; half < 2; ++half)
          p16[mf][nf][half] = ptx::pack2<Element>(s[mf][nf][2 * half], s[mf][nf][2 * half + 1]);
  };

  // Dropout after the row sum: LSE and the normaliser are those of the undropped softmax.
  // The Philox draws run in a rolled loop that only sets bits of `keep`: unrolled, the
  // compiler interleaves dozens of independent draws and spills S and O to make room.
  // Early-rounded tiles draw row by row (a loop per row, a shorter-lived mask; one loop over
  // every row spills 8 bytes at d 128 on sm_90a) and clear a dropped element of the
  // early-rounded P in its packed half (zero has all bits zero in fp16 and bf16: what rounding
  // a zeroed fp32 value gives).
  auto dropout = [&](STile& s, PTile& p16, int n0) {
    constexpr int kRowGroups = kPackEarly ? kMFrags * 2 : 1;  // rows (mf, half) per loop: all or 1
    constexpr int kGroupDraws = kMFrags * 2 * kNFrags / kRowGroups;
    static_assert(kGroupDraws * 2 <= 64, "a loop's keep mask must fit in 64 bits");
    using KeepMask = std::conditional_t<kGroupDraws * 2 <= 32, uint32_t, uint64_t>;  // registers
    const Where at = where();
    const uint32_t bh = static_cast<uint32_t>(at.batch * p.heads_q + at.head);
    const int row0 = at.m0;
#pragma unroll
    for (int grp = 0; grp < kRowGroups; ++grp) {
      KeepMask keep = 0;  // bit 2·i + j: draw i of this group, column j of its pair
#pragma unroll 1
      for (int i = 0; i < kGroupDraws; ++i) {
        const int idx = grp * kGroupDraws + i;  // idx = (mf·2 + half)·kNFrags + nf
        const int row = row0 + warp_row0 + (idx / (2 * kNFrags)) * 16 +
                         ((idx / kNFrags) & 1) * 8 + g;
        const int col = n0 + (idx % kNFrags) * 8 + 2 * t;  // even: one draw covers both
        const Philox4 r = dropout_words(p.seed, p.offset, bh, static_cast<uint32_t>(row),
                                        static_cast<uint32_t>(col) >> 2);
        const bool k0 = dropout_uniform(philox_word(r, col & 3)) >= p.dropout_p;
        const bool k1 = dropout_uniform(philox_word(r, (col & 3) + 1)) >= p.dropout_p;
        keep |= (KeepMask{k0} | KeepMask{k1} << 1) << (2 * i);
      }
#pragma unroll
      for (int i = 0; i < kGroupDraws; ++i) {
        const int idx = grp * kGroupDraws + i;
        const int mf = idx / (2 * kNFrags), half = (idx / kNFrags) & 1, nf = idx % kNFrags;
        if constexpr (kPackEarly) {
          p16[mf][nf][half] &= ((keep >> (2 * i)) & 1u ? 0x0000ffffu : 0u) |
                               ((keep >> (2 * i + 1)) & 1u ? 0xffff0000u : 0u);
        } else {
#pragma unroll
          for (int j = 0; j < 2; ++j)
            if (!((keep >> (2 * i + j)) & 1u)) s[mf][nf][2 * half + j] = 0.0f;
        }
      }
    }
  };

  // O += P·V for the V tile at lane address v_lane; P's A fragment for keys 16·kk.. is two n8
  // fragments of S.
  auto pv_product = [&](const STile& s, const PTile& p16, uint32_t v_lane) {
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      uint32_t pa[kMFrags][4];
#pragma unroll
      for (int mf = 0; mf < kMFrags; ++mf) {
        if constexpr (kPackEarly) {
          pa[mf][0] = p16[mf][2 * kk][0];
          pa[mf][1] = p16[mf][2 * kk][1];
          pa[mf][2] = p16[mf][2 * kk + 1][0];
          pa[mf][3] = p16[mf][2 * kk + 1][1];
        } else {
          pa[mf][0] = ptx::pack2<Element>(s[mf][2 * kk][0], s[mf][2 * kk][1]);
          pa[mf][1] = ptx::pack2<Element>(s[mf][2 * kk][2], s[mf][2 * kk][3]);
          pa[mf][2] = ptx::pack2<Element>(s[mf][2 * kk + 1][0], s[mf][2 * kk + 1][1]);
          pa[mf][3] = ptx::pack2<Element>(s[mf][2 * kk + 1][2], s[mf][2 * kk + 1][3]);
        }
      }
#pragma unroll
      for (int dp = 0; dp < kHeadDim / 16; ++dp) {
        uint32_t bv[4];
        ptx::ldmatrix_x4_trans(bv, v_lane + (kk * 16 * kStride + dp * 16) * 2);
#pragma unroll
        for (int mf = 0; mf < kMFrags; ++mf) {
          ptx::mma_m16n8k16<Element>(acc_o[mf][2 * dp], pa[mf], bv[0], bv[1]);
          ptx::mma_m16n8k16<Element>(acc_o[mf][2 * dp + 1], pa[mf], bv[2], bv[3]);
        }
      }
    }
  };

  if constexpr (!Cfg::kPipelineS) {
    ptx::cp_async_wait<0>();
    __syncthreads();

    for (int n = n_begin; n < n_end;) {
      const int n0 = n * kBlockN;
      load_tile<Cfg, kBlockN>(sV, kStepPointers ? gV : gV + int64_t{n0} * p.v_row_stride,
                              p.v_row_stride, seq.len_k - n0, d, vec, tid);
      if constexpr (kStepPointers) gV += kBlockN * p.v_row_stride;
      ptx::cp_async_commit();

      STile s;
      qk_product(s, sK_lane, nothing);
      modify_and_mask(s, n0);
      softmax(s);
      PTile p16;
      if constexpr (kPackEarly) pack_p(s, p16);
      if (p.dropout_p > 0.0f) dropout(s, p16, n0);

      ptx::cp_async_wait<0>();
      __syncthreads();  // V_j has landed; every warp is done reading K_j
      const int n_next = next_step(n + 1);
      if constexpr (kStepPointers) {
        gK += int64_t{n_next - n} * kBlockN * p.k_row_stride;
        gV += int64_t{n_next - n - 1} * kBlockN * p.v_row_stride;  // one step already taken
      }
      if (n_next < n_end)
        load_tile<Cfg, kBlockN>(
            sK, kStepPointers ? gK : gK + int64_t{n_next} * kBlockN * p.k_row_stride,
            p.k_row_stride, seq.len_k - n_next * kBlockN, d, vec, tid);
      ptx::cp_async_commit();

      pv_product(s, p16, sV_lane);

      ptx::cp_async_wait<0>();
      __syncthreads();  // K_{j+1} has landed; every warp is done reading V_j
      n = n_next;
    }
  } else {
    // Pipelined step (d 256 on sm_90a). Three changes to the order above, together +7 to +12% on
    // every d 256 cell of the H100 grid (fwd_notes.md, v12):
    // - S_{j+1} = Q·K_{j+1}ᵀ is formed in step j, beside the softmax of S_j, so a warp has MMAs
    //   that do not wait for its softmax. K and V are double-buffered: K_j and V_j in buffer
    //   (j − n_begin) % 2. Step j opens with its only barrier: K_{j+1} and V_j have landed and
    //   every warp is done with step j − 1 (K_j's buffer, read for S_j then, and V_{j−1}'s), so
    //   K_{j+2} and V_{j+1} can go out at once and have the whole step to land.
    // - The two halves of the warps take the two parts in opposite orders: warps 0–3 form
    //   S_{j+1} and then the softmax, warps 4–7 the softmax first. Warp w runs on scheduler w % 4,
    //   so each scheduler has one warp on the tensor cores while the other does its exponentials
    //   and O's rescale; in lockstep (every warp leaves the barrier together) both do the softmax
    //   at once and the tensor cores idle. The branch also keeps ptxas from hoisting the MMAs
    //   above the softmax, which it does to a softmax written between them.
    // - Each thread's copies (kCopyChunks of K_{j+2}, as many of V_{j+1}, one 16-byte chunk per
    //   row kRowStep apart at a fixed column) go out one after each k slice of Q·K_{j+1}ᵀ rather
    //   than as a burst: after a burst the next instruction that reuses a copy's address
    //   registers waits for the queue to read them, behind the ldmatrix traffic of eight warps.
    //   Tiles that are not whole (ragged end, unaligned or padded rows) still go as a burst.
    constexpr int kCpr = Cfg::kChunksPerRow, kRowStep = Cfg::kThreads / kCpr;
    constexpr int kCopyChunks = kBlockN / kRowStep;  // per thread and tile
    static_assert(Cfg::kThreads % kCpr == 0 && 2 * kCopyChunks == kHeadDim / 16,
                  "the pipelined step places one chunk of K or V after each k slice");
    auto k_src = [&](int n) { return gK + int64_t{n} * kBlockN * p.k_row_stride; };
    auto v_src = [&](int n) { return gV + int64_t{n} * kBlockN * p.v_row_stride; };
    const bool whole_rows = vec && d == kHeadDim;
    // Steps j + 1 and j + 2 of the walk (block-sparse: the next ones on, not n + 1 and n + 2).
    int n_next = next_step(n_begin + 1);
    if (n_next < n_end)
      load_tile<Cfg, kBlockN>(sK + kBlockN * kStride, k_src(n_next), p.k_row_stride,
                              seq.len_k - n_next * kBlockN, d, vec, tid);
    if (n_begin < n_end)
      load_tile<Cfg, kBlockN>(sV, v_src(n_begin), p.v_row_stride, seq.len_k - n_begin * kBlockN,
                              d, vec, tid);
    ptx::cp_async_commit();
    ptx::cp_async_wait<1>();
    __syncthreads();  // Q and K_0 have landed

    STile s;
    if (n_begin < n_end) qk_product(s, sK_lane, nothing);
    for (int n = n_begin, it = 0; n < n_end; ++it) {
      const int n0 = n * kBlockN;
      const uint32_t buf = it & 1;
      const int n_after = next_step(n_next + 1);
      ptx::cp_async_wait<0>();
      __syncthreads();  // K_{j+1} and V_j have landed; step j − 1 is done everywhere

      // The copies' per-thread offsets come from a volatile thread index: derived from tid,
      // ptxas holds them across the loop and spills.
      const int tid_v = ptx::thread_index_volatile();
      const bool spread_k = whole_rows && (n_after + 1) * kBlockN <= seq.len_k;
      const bool spread_v = whole_rows && (n_next + 1) * kBlockN <= seq.len_k;
      if (!spread_k && n_after < n_end)
        load_tile<Cfg, kBlockN>(sK + buf * kBlockN * kStride, k_src(n_after), p.k_row_stride,
                                seq.len_k - n_after * kBlockN, d, vec, tid_v);
      if (!spread_v && n_next < n_end)
        load_tile<Cfg, kBlockN>(sV + (buf ^ 1) * kBlockN * kStride, v_src(n_next),
                                p.v_row_stride, seq.len_k - n_next * kBlockN, d, vec, tid_v);
      const int row0 = tid_v / kCpr, col0 = (tid_v % kCpr) * 8;
      const Element* const k_from = k_src(n_after) + row0 * p.k_row_stride + col0;
      const Element* const v_from = v_src(n_next) + row0 * p.v_row_stride + col0;
      const uint32_t k_to = ptx::smem_addr(sK + (buf * kBlockN + row0) * kStride + col0);
      const uint32_t v_to = ptx::smem_addr(sV + ((buf ^ 1) * kBlockN + row0) * kStride + col0);
      // After k slice kk: chunk kk of K_{j+2}, or chunk kk − kCopyChunks of V_{j+1}. Predicated,
      // not branched, so the slices stay one block of code.
      auto spread_copy = [&](int kk) {
        if (kk < kCopyChunks)
          ptx::cp_async_16_if(spread_k, k_to + kk * kRowStep * kStride * 2,
                              k_from + int64_t{kk * kRowStep} * p.k_row_stride);
        else
          ptx::cp_async_16_if(spread_v, v_to + (kk - kCopyChunks) * kRowStep * kStride * 2,
                              v_from + int64_t{(kk - kCopyChunks) * kRowStep} * p.v_row_stride);
      };

      modify_and_mask(s, n0);
      PTile p16;
      if (n_next < n_end) {
        const bool softmax_first = ptx::thread_index_volatile() >= Cfg::kThreads / 2;
        STile s_next;
        if (softmax_first) softmax(s);
        qk_product(s_next, sK_lane + (buf ^ 1) * kTileBytes, spread_copy);
        if (!softmax_first) softmax(s);
        pack_p(s, p16);
#pragma unroll
        for (int mf = 0; mf < kMFrags; ++mf)
#pragma unroll
          for (int nf = 0; nf < kNFrags; ++nf)
#pragma unroll
            for (int i = 0; i < 4; ++i) s[mf][nf][i] = s_next[mf][nf][i];
      } else {
        softmax(s);
        pack_p(s, p16);
      }
      ptx::cp_async_commit();
      if (p.dropout_p > 0.0f) dropout(s, p16, n0);
      pv_product(s, p16, sV_lane + buf * kTileBytes);
      n = n_next;
      n_next = n_after;
    }
  }

  // Epilogue: normalise, write LSE, stage O through this warp's own rows of sQ (no other warp
  // reads them), then store 16-byte chunks.
  const Where out = where();
  const int out_m0 = out.m0;
  const SequenceInfo out_seq = kGrouped ? sequence_info(p, out.batch) : seq;
  const int out_rows = kGrouped ? min(kBlockM, out_seq.len_q - out_m0) : rows_q;
  float* lse_row = p.lse + out.batch * p.lse_batch_stride + out.head * p.lse_head_stride +
                   out_seq.q_row0 + out_m0;
  // Non-finite inputs (cuda/nonfinite_fixup.cuh). A row with no positive sum that sees every key
  // (no window) had only −inf scores, or a NaN one: the reference's softmax is NaN there, so O and
  // LSE are NaN. Under a window the P·V product may have multiplied a masked key's ±Inf/NaN V by
  // P = 0: a row whose O comes out non-finite gets LSE = NaN, which has the forward fixup kernel
  // (launched after this one under windows) recompute it exactly, as it does the rows left with
  // LSE = −inf that see a key.
  const FinishedRow finish(p, out_seq.len_k);
#pragma unroll
  for (int mf = 0; mf < kMFrags; ++mf)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float l = stats.sum(mf, half);
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const float inv = finish.scale(l, p.dropout_scale);
      const int r = warp_row0 + mf * 16 + half * 8 + g;
      float probe = 0.0f;
#pragma unroll
      for (int df = 0; df < kDFrags; ++df) {
        const float o0 = acc_o[mf][df][2 * half] * inv, o1 = acc_o[mf][df][2 * half + 1] * inv;
        probe = nonfinite_probe(nonfinite_probe(probe, o0), o1);
        *reinterpret_cast<uint32_t*>(sQ + r * kStride + df * 8 + 2 * t) =
            ptx::pack2<Element>(o0, o1);
      }
      probe += __shfl_xor_sync(0xffffffffu, probe, 1);  // the row's four lanes
      probe += __shfl_xor_sync(0xffffffffu, probe, 2);
      if (t == 0 && r < out_rows)
        lse_row[r] = finish.lse(l, stats.max(mf, half), probe);
    }
  __syncwarp();

  Element* gO = static_cast<Element*>(p.o) + out.batch * p.o_batch_stride +
                (out_seq.q_row0 + out_m0) * p.o_row_stride + out.head * p.o_head_stride;
  constexpr int kWarpChunks = Cfg::kWarpRows * Cfg::kChunksPerRow;
  // d ≤ 128 and the pipelined and short-walk d 256 tiles: whole rows of the warp go out as one
  // 16-byte copy per chunk with no tests: short code for a part that runs once per CTA, from a
  // cold instruction cache (H100, A/B in one call: d ≤ 128 +1 to +4.6% at s ≤ 2k; pipelined d 256
  // +1.2 to +4.3% at s ≤ 1k, +0.5 to +0.9% at 2k-4k, even above). The plain d 256 step measured
  // 1% slower with it and keeps the general loop alone.
  if constexpr (kHeadDim <= 128 || (kHeadDim == 256 && !Cfg::kPlainD256)) {
    if (vec && warp_row0 + Cfg::kWarpRows <= out_rows && d == kHeadDim) {
#pragma unroll
      for (int c = lane; c < kWarpChunks; c += 32) {
        const int r = warp_row0 + c / Cfg::kChunksPerRow;
        const int col = (c % Cfg::kChunksPerRow) * 8;
        *reinterpret_cast<uint4*>(gO + r * p.o_row_stride + col) =
            *reinterpret_cast<const uint4*>(sQ + r * kStride + col);
      }
      return;
    }
  }
#pragma unroll
  for (int c = lane; c < kWarpChunks; c += 32) {
    const int r = warp_row0 + c / Cfg::kChunksPerRow;
    const int col = (c % Cfg::kChunksPerRow) * 8;
    if (r >= out_rows || col >= d) continue;
    const Element* src = sQ + r * kStride + col;
    Element* dst = gO + r * p.o_row_stride + col;
    if (vec) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    } else {
      for (int e = 0; e < 8 && col + e < d; ++e) dst[e] = src[e];
    }
  }
}

template <DType kDType, int kHeadDim, bool kGrouped, bool kShort>
Status launch_forward_order(const AttentionParams& p, int tile_group, cudaStream_t stream) {
  using Cfg = FwdConfig<kDType, kHeadDim, false, kShort>;
  using PreHopperCfg = FwdConfig<kDType, kHeadDim, true, kShort>;
  const int64_t m_blocks = (int64_t{p.seqlen_q} + Cfg::kBlockM - 1) / Cfg::kBlockM;
  if (m_blocks == 0 || p.batch == 0) return {};
  if (p.batch > 65535)
    return Status::unsupported("q: batch = " + std::to_string(p.batch) +
                               " exceeds the CUDA forward's maximum 65535 (grid z)");
  auto* kernel = attention_forward_kernel<kDType, kHeadDim, kGrouped, kShort>;
  // The device code this device runs was compiled for sm_80–sm_89 (PTX below 9.0: sm_80 itself, or
  // compute_80 compiled just in time on a later GPU) or for sm_90a; size shared memory for it, so
  // a device that allows less than the sm_90a plan still runs the sm_80 one.
  int smem = Cfg::kSmemBytes;
  const auto fail = [](const Status& s) {
    return Status::device_error("forward (head_dim bucket " + std::to_string(kHeadDim) + "): " +
                                s.message());
  };
  if constexpr (PreHopperCfg::kSmemBytes != Cfg::kSmemBytes) {
    int ptx = 0;
    if (const Status s = kernel_ptx_version(reinterpret_cast<const void*>(kernel), &ptx); !s.ok())
      return fail(s);
    if (ptx < 90) smem = PreHopperCfg::kSmemBytes;
  }
  if (const Status s = allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem); !s.ok())
    return fail(s);
  const dim3 grid(static_cast<unsigned>(m_blocks), static_cast<unsigned>(p.heads_q),
                  static_cast<unsigned>(p.batch));
  kernel<<<grid, Cfg::kThreads, smem, stream>>>(p, tile_group);
  return launch_status("forward", [] {
    return "kernel (head_dim bucket " + std::to_string(kHeadDim) + ")";
  });
}

}  // namespace flare::cuda::sm80
