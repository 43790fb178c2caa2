// bwd_kernel.cuh — the FlashAttention-2 backward main kernel for sm_80 and later (mma.sync,
// ldmatrix, cp.async), fp16 and bf16, and its launcher.
//
// Work partitioning (FlashAttention-2, Dao 2023, Algorithm 2). One CTA owns kBlockN keys of one
// (batch, kv head): K_j and V_j stay in shared memory while the CTA walks every query block that
// can see them, for every query head of the kv head's group (GQA/MQA), so dK_j and dV_j are sums
// formed in registers and written once, without atomics. Per query block (Q, dO, LSE, D loaded;
// the next block's copy is in flight while this one computes):
//   Sᵀ  = K·Qᵀ,  dPᵀ = V·dOᵀ           each warp: its 16 keys × kBlockM/col_splits queries,
//                                       in passes of 32 queries where registers are short
//   P   = 2^(S·scale·log2e − LSE·log2e) the forward's LSE; softcap / ALiBi as a runtime branch
//   mask                                only on tiles that straddle the ragged end or a window
//   dropout                             z = keep/(1−p) from the shared Philox mask:
//                                       P̃ = P·z, dP ← z·dP
//   dS  = P∘(dP − D) [· (1 − tanh²)]    D = rowsum(dO∘O) from the preprocess kernel
//   P̃ᵀ, dSᵀ → shared memory (fp16/bf16), then
//   dV += P̃ᵀ·dO,  dK += dSᵀ·Q           each warp: its 16 keys × d/col_splits columns
//   dQ += dS·K                           each warp: 16 queries × d/2 columns, added into the
//                                        fp32 accumulator (red.global.add; float2 on sm_90)
// dK is scaled by the softmax scale on the way out, dQ by the convert kernel.
//
// Keeping every product's operands in one layout is what makes this cheap: S and dP are computed
// transposed (keys as rows), so P̃ᵀ and dSᵀ land in shared memory as row-major (key, query) tiles —
// the A operand of dV and dK as stored, and through ldmatrix.trans the A operand of dQ. K serves as
// the A operand of Sᵀ and, transposed, as the B operand of dQ; Q and dO likewise. Shared tiles are
// XOR-swizzled (16-byte chunk ^ row % 8) so each ldmatrix's eight row addresses hit distinct banks
// without padding: the d 128 plan is 160 KiB, which fits the A100's limit only unpadded.
//
// Rows that see no key (LSE = −inf) form P with LSE = +inf, so their P is exactly 0 and every
// gradient they feed is 0, never NaN; rows past the sequence end get the same treatment and D = 0.
//
// Where the cycles go (ncu on an H100, b=1 s=4k h=16 d=128 bf16): one CTA of 8 warps per SM
// (255 registers: the dK/dV accumulators), so each scheduler has two warps and every issue slot
// counts. Two choices came from that profile. The common tile (no softcap, ALiBi, dropout or mask)
// takes a branch-free elementwise path: with the feature branches per element, warps stalled
// mostly on instruction fetch (2.9 of 9.3 cycles per instruction), and hoisting them took
// b=2 s=8k h=16 d=128 from 132 to 215 TFLOP/s (PyTorch's flash backward: 297 on the same kind of
// card, in the same run).
// And fragment addresses are one per-lane base per operand stream, stepped by an XOR and an
// immediate, rather than a swizzle recomputed per ldmatrix.
//
// Determinism. By default CTAs of different key blocks add into one dQ accumulator with atomics:
// the sum is exact up to fp32 rounding but its order varies. In deterministic mode the launcher
// gives each CTA a run of consecutive key blocks and its own accumulator slice (dq_split_stride);
// within a slice each element is added by one thread in program order, and the convert kernel sums
// the slices in index order, so two runs agree bit for bit.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "core/params.h"
#include "core/philox.h"
#include "core/score_mod.h"
#include "cuda/ptx/cp_async.cuh"
#include "cuda/sm80/chunk_copy.cuh"
#include "cuda/ptx/fast_math.cuh"
#include "cuda/ptx/ldmatrix.cuh"
#include "cuda/ptx/mma.cuh"
#include "cuda/sm80/bwd_launch.h"
#include "cuda/sm80/bwd_tiles.h"

namespace flare::cuda::sm80 {

template <DType kDType>
using BwdElement = std::conditional_t<kDType == DType::kFloat16, __half, __nv_bfloat16>;

template <int kHeadDim>
struct BwdConfig {
  static constexpr BwdTile kTile = bwd_tile(kHeadDim);
  static_assert(kTile.head_dim == kHeadDim, "head-dim bucket missing from kBwdTiles");
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kWarps = kTile.warps;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kStages = kTile.stages;
  static constexpr int kColSplits = kTile.col_splits;
  static constexpr int kKeyGroups = kBlockN / 16;        // 16-key groups of dK/dV and Sᵀ
  static constexpr int kSCols = kBlockM / kColSplits;    // queries of a warp's Sᵀ tile
  static constexpr int kKVCols = kHeadDim / kColSplits;  // columns of a warp's dK/dV rows
  static constexpr int kDqRowGroups = kBlockM / 16;      // 16-query groups of dQ
  static constexpr int kDqCols = kHeadDim / (kWarps / kDqRowGroups);  // columns per dQ warp
  // dQ is produced in column chunks so its accumulator stays at 32 registers (16 at d 256, where
  // 32 spill beside the 128 dK/dV accumulators).
  static constexpr int kDqChunk = kHeadDim >= 256 ? 32 : (kDqCols < 64 ? kDqCols : 64);
  // Sᵀ and dPᵀ are produced in passes of 32 queries (16 + 16 registers) where the dK/dV
  // accumulators leave no room for more (d > 64); at d 64 one pass covers the warp's queries.
  static constexpr int kSPass = kHeadDim <= 64 || kSCols < 32 ? kSCols : 32;
  // The k loops of the products are unrolled by 2, not fully: full unrolling lets ptxas preload
  // fragments until it spills (8 to 32 bytes at d 128 and 256). At d 256 the dK/dV loop, with 16
  // B fragments per k step, must stay rolled to spill nothing on sm_80 and sm_90a.
  static constexpr int kKVUnroll = kHeadDim >= 256 ? 1 : 2;
  // Even/odd k-step accumulator pairs (see the Sᵀ and dQ loops), where registers allow them
  // without spilling on sm_80 and sm_90a and they measured no slower (H100, b=2 s=8k bf16):
  // dQ at d 64 (182 → 188 TFLOP/s) and everything at d 256 (169). At d 128 the Sᵀ pair measured
  // 207 against 215 without, and the dQ pair spills.
  static constexpr bool kSplitS = kHeadDim >= 256;
  static constexpr bool kSplitDq = kHeadDim != 128;
  static_assert(kKeyGroups * kColSplits == kWarps, "key groups × column splits must be the warps");
  static_assert(kWarps % kDqRowGroups == 0 && kDqCols % kDqChunk == 0, "dQ warp tiling");
  static_assert(kSCols % kSPass == 0 && kSPass % 16 == 0 && kKVCols % 16 == 0 && kDqChunk % 16 == 0,
                "ldmatrix.x4 loads two n8 fragments at a time");
  static_assert(kHeadDim % 64 == 0 && kBlockM % 64 == 0,
                "swizzled rows need at least eight 16-byte chunks");
  static_assert(kThreads >= kBlockM, "one thread per query row loads LSE and D");
  // Shared-memory plan, in 2-byte elements from the start, then the fp32 row vectors.
  static constexpr int kOffK = 0;                                      // (kBlockN, d)
  static constexpr int kOffV = kOffK + kBlockN * kHeadDim;             // (kBlockN, d)
  static constexpr int kOffQ = kOffV + kBlockN * kHeadDim;             // (stages, kBlockM, d)
  static constexpr int kOffDo = kOffQ + kStages * kBlockM * kHeadDim;  // (stages, kBlockM, d)
  static constexpr int kOffP = kOffDo + kStages * kBlockM * kHeadDim;  // (kBlockN, kBlockM)
  static constexpr int kOffDs = kOffP + kBlockN * kBlockM;             // (kBlockN, kBlockM)
  static constexpr int kElems = kOffDs + kBlockN * kBlockM;
  static constexpr int kSmemBytes = kElems * 2 + 2 * kStages * kBlockM * 4;
  static_assert(kSmemBytes == bwd_smem_bytes(kHeadDim), "shared-memory plan out of sync");
};

inline constexpr float kBwdLog2e = 1.4426950408889634f;

// Element offset of (row, col) in a shared tile of kCols-element rows whose 16-byte chunks are
// XOR-swizzled with row % 8. Chunks stay whole, so cp.async and ldmatrix addresses stay aligned.
template <int kCols>
__device__ __forceinline__ int swz(int row, int col) {
  const int chunk = col >> 3;
  return row * kCols + (((chunk ^ row) & 7) | (chunk & ~7)) * 8 + (col & 7);
}

// ldmatrix lane addressing, as shared-window byte addresses. Pattern X: the A operand from a
// (row, k)-stored tile, or the B operand through .trans from a (k, n)-stored tile. Pattern Y: the
// B operand from an (n, k)-stored tile, or the A operand through .trans from a (k, m)-stored tile.
// A base is computed once per kernel for the lane's row and chunk (r0 % 8 == 0); frag_step then
// moves it by a compile-time (dr, dc) — dr % 8 == 0, dc % 8 == 0 — with one XOR on the chunk bits
// and one add, which is exact because tiles start on 128-byte boundaries, rows are multiples of
// 128 bytes, and the base's own low chunk bits never overlap dc / 8's.
template <int kCols>
__device__ __forceinline__ uint32_t frag_base_x(uint32_t tile, int r0, int c0, int lane) {
  const int row = r0 + (lane & 7) + ((lane >> 3) & 1) * 8;
  const int col = c0 + (lane >> 4) * 8;
  return tile + 2 * swz<kCols>(row, col);
}
template <int kCols>
__device__ __forceinline__ uint32_t frag_base_y(uint32_t tile, int r0, int c0, int lane) {
  const int row = r0 + (lane & 7) + (lane >> 4) * 8;
  const int col = c0 + ((lane >> 3) & 1) * 8;
  return tile + 2 * swz<kCols>(row, col);
}
template <int kCols>
__device__ __forceinline__ uint32_t frag_step(uint32_t base, int dr, int dc) {
  const int chunk = dc >> 3;
  return (base ^ static_cast<uint32_t>((chunk & 7) << 4)) + dr * (kCols * 2) + (chunk & ~7) * 16;
}

// Copies a (rows_valid ≤ kRows, d_valid ≤ kCols) tile of a row-major global tensor into a
// swizzled shared tile, zero-filling the rest. `vec`: rows 16-byte aligned and d_valid % 8 == 0,
// so whole chunks go through cp.async; otherwise elements are read one by one and stored
// synchronously (ordered by the same barriers).
template <int kRows, int kCols, int kThreads, typename Element>
__device__ __forceinline__ void load_tile_swizzled(Element* s, const Element* g, int64_t row_stride,
                                                   int rows_valid, int d_valid, bool vec,
                                                   int tid) {
  constexpr int kChunks = kCols / 8;
  constexpr int kRowStep = kThreads / kChunks;
  static_assert(kThreads % kChunks == 0 && kRows % kRowStep == 0, "tile copy must split evenly");
  const int row0 = tid / kChunks;
  const int col = (tid % kChunks) * 8;
#pragma unroll
  for (int i = 0; i < kRows / kRowStep; ++i) {
    const int row = row0 + i * kRowStep;
    copy_chunk16(s + swz<kCols>(row, col), g + row * row_stride + col, g, row < rows_valid, col,
                 d_valid, vec);
  }
}

// A 4-byte store to a shared-window address, so the P̃ᵀ/dSᵀ stores step their swizzled
// addresses with frag_step like the loads. Kept beside its only user, as is the next one.
__device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t value) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(value) : "memory");
}

// 4-byte asynchronous copy global → shared, zero-filling when !valid (4- and 8-byte copies must
// go through L1: .ca).
__device__ __forceinline__ void cp_async_4_zfill(uint32_t smem, const void* gmem, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem), "l"(gmem),
               "r"(valid ? 4 : 0)
               : "memory");
}

// Adds two adjacent fp32 values into global memory; one vector reduction on sm_90.
__device__ __forceinline__ void atomic_add_pair(float* dst, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(dst), make_float2(a, b));
#else
  atomicAdd(dst, a);
  atomicAdd(dst + 1, b);
#endif
}

// Stores columns (col, col + 1) of a gradient row, the second only when `second`; one 4-byte
// store when the pair is aligned.
template <typename Element>
__device__ __forceinline__ void store_pair(Element* dst, float a, float b, bool second,
                                           bool pair_store) {
  if (second && pair_store) {
    *reinterpret_cast<uint32_t*>(dst) = ptx::pack2<Element>(a, b);
    return;
  }
  const uint32_t both = ptx::pack2<Element>(a, b);
  reinterpret_cast<uint16_t*>(dst)[0] = static_cast<uint16_t>(both);
  if (second) reinterpret_cast<uint16_t*>(dst)[1] = static_cast<uint16_t>(both >> 16);
}

template <DType kDType, int kHeadDim>
__global__ void __launch_bounds__(BwdConfig<kHeadDim>::kThreads, 1)
    attention_backward_kernel(const __grid_constant__ AttentionParams p, const BwdWorkspace w) {
  using Cfg = BwdConfig<kHeadDim>;
  using Element = BwdElement<kDType>;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kThreads = Cfg::kThreads;
  constexpr int kStages = Cfg::kStages, kSCols = Cfg::kSCols, kKVCols = Cfg::kKVCols;
  constexpr int kDqCols = Cfg::kDqCols, kDqChunk = Cfg::kDqChunk, kSPass = Cfg::kSPass;

  extern __shared__ __align__(128) unsigned char smem[];
  Element* const sK = reinterpret_cast<Element*>(smem) + Cfg::kOffK;
  Element* const sV = reinterpret_cast<Element*>(smem) + Cfg::kOffV;
  Element* const sQ = reinterpret_cast<Element*>(smem) + Cfg::kOffQ;
  Element* const sDo = reinterpret_cast<Element*>(smem) + Cfg::kOffDo;
  Element* const sP = reinterpret_cast<Element*>(smem) + Cfg::kOffP;
  Element* const sDs = reinterpret_cast<Element*>(smem) + Cfg::kOffDs;
  float* const sLse = reinterpret_cast<float*>(smem + 2 * Cfg::kElems);  // (stages, kBlockM)
  float* const sDsum = sLse + kStages * kBlockM;                         // (stages, kBlockM)

  const int hk = blockIdx.y;
  const int b = blockIdx.z;
  const SequenceInfo seq = sequence_info(p, b);
  const int key_blocks = (seq.len_k + kBlockN - 1) / kBlockN;
  const int jb_begin = blockIdx.x * w.kv_blocks_per_cta;
  const int jb_end = min(jb_begin + w.kv_blocks_per_cta, key_blocks);
  if (jb_begin >= jb_end) return;  // varlen: this sequence has fewer keys than the longest

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;  // fragment row group, thread in group
  const int kg = warp % Cfg::kKeyGroups;  // Sᵀ / dK / dV: 16-key group
  const int cs = warp / Cfg::kKeyGroups;  //               query or column slice
  const int qg = warp % Cfg::kDqRowGroups;  // dQ: 16-query group
  const int dcs = warp / Cfg::kDqRowGroups;  //    column slice
  const int d = p.head_dim;
  const int diag = seq.len_k - seq.len_q;  // key position of query row 0 (bottom-right aligned)
  const int64_t q_packed0 =
      p.cu_seqlens_q != nullptr ? seq.q_row0 : static_cast<int64_t>(b) * p.seqlen_q;
  float* const dq_accum = w.dq_accum + blockIdx.x * w.dq_split_stride;
  const bool has_mod = p.softcap > 0.0f || p.alibi_slopes != nullptr;
  const bool has_dropout = p.dropout_p > 0.0f;

  // Per-lane fragment addresses (stage 0 for Q and dO). V, dO and dS sit a fixed multiple of
  // 128 bytes after K, Q and P, so they share the bases (and each step's XOR) of their partners.
  const uint32_t a_k_base = frag_base_x<kHeadDim>(ptx::smem_addr(sK), kg * 16, 0, lane);
  const uint32_t b_q_base = frag_base_y<kHeadDim>(ptx::smem_addr(sQ), cs * kSCols, 0, lane);
  const uint32_t a_p_base = frag_base_x<kBlockM>(ptx::smem_addr(sP), kg * 16, 0, lane);
  const uint32_t bt_q_base = frag_base_x<kHeadDim>(ptx::smem_addr(sQ), 0, cs * kKVCols, lane);
  const uint32_t at_ds_base = frag_base_y<kBlockM>(ptx::smem_addr(sDs), 0, qg * 16, lane);
  const uint32_t bt_k_base = frag_base_x<kHeadDim>(ptx::smem_addr(sK), 0, dcs * kDqCols, lane);
  // Where this lane stores its P̃ᵀ / dSᵀ pairs: row kg·16 + g, column cs·kSCols + 2t.
  const uint32_t st_p_base =
      ptx::smem_addr(sP) + 2 * swz<kBlockM>(kg * 16 + g, cs * kSCols + 2 * t);
  constexpr uint32_t kVAfterK = (Cfg::kOffV - Cfg::kOffK) * 2;
  constexpr uint32_t kDoAfterQ = (Cfg::kOffDo - Cfg::kOffQ) * 2;
  constexpr uint32_t kDsAfterP = (Cfg::kOffDs - Cfg::kOffP) * 2;

  for (int jb = jb_begin; jb < jb_end; ++jb) {
    const int j0 = jb * kBlockN;
    const int rows_k = min(kBlockN, seq.len_k - j0);
    // Query rows that see a key of [j0, j0 + rows_k): key j is visible from row i iff
    // j − right ≤ i + diag ≤ j + left (each side only when bounded).
    int i_lo = 0, i_hi = seq.len_q;
    if (p.window_right >= 0) i_lo = max(0, j0 - p.window_right - diag);
    if (p.window_left >= 0) i_hi = min(seq.len_q, j0 + rows_k + p.window_left - diag);
    const int m_begin = i_lo / kBlockM;
    const int m_count = i_hi > i_lo ? (i_hi + kBlockM - 1) / kBlockM - m_begin : 0;
    const int iters = m_count * p.head_group;

    load_tile_swizzled<kBlockN, kHeadDim, kThreads>(
        sK, static_cast<const Element*>(p.k) + b * p.k_batch_stride +
                (seq.k_row0 + j0) * p.k_row_stride + hk * p.k_head_stride,
        p.k_row_stride, rows_k, d, w.vec, tid);
    load_tile_swizzled<kBlockN, kHeadDim, kThreads>(
        sV, static_cast<const Element*>(p.v) + b * p.v_batch_stride +
                (seq.k_row0 + j0) * p.v_row_stride + hk * p.v_head_stride,
        p.v_row_stride, rows_k, d, w.vec, tid);

    // Step `it` is query block m_begin + it % m_count of query head hk·group + it / m_count.
    auto load_query_block = [&](int it) {
      const int stage = it % kStages;
      const int h = hk * p.head_group + it / m_count;
      const int i0 = (m_begin + it % m_count) * kBlockM;
      const int rows_q = min(kBlockM, seq.len_q - i0);
      load_tile_swizzled<kBlockM, kHeadDim, kThreads>(
          sQ + stage * kBlockM * kHeadDim,
          static_cast<const Element*>(p.q) + b * p.q_batch_stride +
              (seq.q_row0 + i0) * p.q_row_stride + h * p.q_head_stride,
          p.q_row_stride, rows_q, d, w.vec, tid);
      load_tile_swizzled<kBlockM, kHeadDim, kThreads>(
          sDo + stage * kBlockM * kHeadDim,
          static_cast<const Element*>(p.dout) + b * p.do_batch_stride +
              (seq.q_row0 + i0) * p.do_row_stride + h * p.do_head_stride,
          p.do_row_stride, rows_q, d, w.vec, tid);
      if (tid < kBlockM) {
        // Raw LSE and D per query row, copied like the tiles so no thread waits on a global load
        // here; rows past the end are zero-filled (D = 0) and their LSE is fixed up at use.
        const bool in = tid < rows_q;
        cp_async_4_zfill(ptx::smem_addr(sLse + stage * kBlockM + tid),
                         p.lse + b * p.lse_batch_stride + h * p.lse_head_stride + seq.q_row0 +
                             (in ? i0 + tid : 0),
                         in);
        cp_async_4_zfill(ptx::smem_addr(sDsum + stage * kBlockM + tid),
                         w.dsum + h * p.total_q + q_packed0 + (in ? i0 + tid : 0), in);
      }
    };

    for (int s = 0; s < kStages - 1 && s < iters; ++s) load_query_block(s);
    ptx::cp_async_commit();

    float acc_dk[kKVCols / 8][4] = {};  // (16 keys, kKVCols) per warp
    float acc_dv[kKVCols / 8][4] = {};

    for (int it = 0; it < iters; ++it) {
      // The buffer the prefetch overwrites was last read in step it − 1, which ended in a barrier.
      if (it + kStages - 1 < iters) load_query_block(it + kStages - 1);
      ptx::cp_async_commit();
      ptx::cp_async_wait<kStages - 1>();
      __syncthreads();

      const int stage = it % kStages;
      const int h = hk * p.head_group + it / m_count;
      const int i0 = (m_begin + it % m_count) * kBlockM;
      const uint32_t stage_bytes = stage * kBlockM * kHeadDim * 2;
      const float* const sLses = sLse + stage * kBlockM;
      const float* const sDsums = sDsum + stage * kBlockM;

      // A tile needs the mask only where it straddles the ragged key end or a window edge.
      const bool full_tile =
          j0 + kBlockN <= seq.len_k &&
          (p.window_left < 0 || j0 >= i0 + kBlockM - 1 + diag - p.window_left) &&
          (p.window_right < 0 || j0 + kBlockN - 1 <= i0 + diag + p.window_right);
      const float slope = alibi_slope(p, b, h);
      const uint32_t bh = static_cast<uint32_t>(b * p.heads_q + h);
      // The warp's queries go in passes of kSPass columns, which bounds the S and dP registers.
#pragma unroll
      for (int pass = 0; pass < kSCols / kSPass; ++pass) {
        const int q0 = cs * kSCols + pass * kSPass;
        // ---- Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ: keys kg·16 + [0, 16), queries q0 + [0, kSPass).
        // Even and odd k steps accumulate into separate tiles (kSplitS), summed at the end: a
        // tensor-core result then feeds the next product on the same tile only every 16
        // instructions, not 8, a latency the two warps per scheduler cannot hide otherwise.
        float acc_s[kSPass / 8][4] = {}, acc_dp[kSPass / 8][4] = {};
        float odd_s[kSPass / 8][4] = {}, odd_dp[kSPass / 8][4] = {};
#pragma unroll 1
        for (int ks2 = 0; ks2 < kHeadDim / 32; ++ks2) {
#pragma unroll
          for (int parity = 0; parity < 2; ++parity) {
            const int ks = 2 * ks2 + parity;
            float(&sum_s)[kSPass / 8][4] = parity == 0 || !Cfg::kSplitS ? acc_s : odd_s;
            float(&sum_dp)[kSPass / 8][4] = parity == 0 || !Cfg::kSplitS ? acc_dp : odd_dp;
            uint32_t a_k[4], a_v[4];
            const uint32_t a_addr = frag_step<kHeadDim>(a_k_base, 0, ks * 16);
            ptx::ldmatrix_x4(a_k, a_addr);
            ptx::ldmatrix_x4(a_v, a_addr + kVAfterK);
#pragma unroll
            for (int np = 0; np < kSPass / 16; ++np) {
              uint32_t b_q[4], b_do[4];
              const int dr = pass * kSPass + np * 16;
              const uint32_t b_addr = frag_step<kHeadDim>(b_q_base, dr, ks * 16) + stage_bytes;
              ptx::ldmatrix_x4(b_q, b_addr);
              ptx::ldmatrix_x4(b_do, b_addr + kDoAfterQ);
              ptx::mma_m16n8k16<Element>(sum_s[2 * np], a_k, b_q[0], b_q[1]);
              ptx::mma_m16n8k16<Element>(sum_s[2 * np + 1], a_k, b_q[2], b_q[3]);
              ptx::mma_m16n8k16<Element>(sum_dp[2 * np], a_v, b_do[0], b_do[1]);
              ptx::mma_m16n8k16<Element>(sum_dp[2 * np + 1], a_v, b_do[2], b_do[3]);
            }
          }
        }
        if constexpr (Cfg::kSplitS) {
#pragma unroll
          for (int nt = 0; nt < kSPass / 8; ++nt)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              acc_s[nt][r] += odd_s[nt][r];
              acc_dp[nt][r] += odd_dp[nt][r];
            }
        }

        // ---- P, dropout, dS in registers; acc_s becomes P̃ = P·z, acc_dp becomes dS.
        // Per query row m of the block: the LSE in base-2 units — +inf for a row with no visible
        // key (LSE = −inf) or past the sequence end, so its P is exactly 0 and so is every
        // gradient it feeds.
        auto lse2_of = [&](int m) {
          const float lse = sLses[m];
          return i0 + m < seq.len_q && lse != -INFINITY ? lse * kBwdLog2e : INFINITY;
        };
        if (!has_mod && !has_dropout && full_tile) {
          // The common tile, kept free of per-element branches: each one is a taken jump, and
          // in this loop they cost more issue slots than the arithmetic.
#pragma unroll
          for (int nt = 0; nt < kSPass / 8; ++nt) {
            const int m = q0 + nt * 8 + 2 * t;
            const float lse2[2] = {lse2_of(m), lse2_of(m + 1)};
            const float dsum[2] = {sDsums[m], sDsums[m + 1]};
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              const float prob = ptx::exp2_approx(acc_s[nt][r] * p.scale_log2 - lse2[r & 1]);
              acc_s[nt][r] = prob;
              acc_dp[nt][r] = prob * (acc_dp[nt][r] - dsum[r & 1]);
            }
          }
        } else {
#pragma unroll
          for (int nt = 0; nt < kSPass / 8; ++nt) {
            const float lse2[2] = {lse2_of(q0 + nt * 8 + 2 * t), lse2_of(q0 + nt * 8 + 2 * t + 1)};
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              const int n = kg * 16 + g + (r >> 1) * 8;     // key in the block
              const int m = q0 + nt * 8 + 2 * t + (r & 1);  // query in the block
              const int i = i0 + m, j = j0 + n;
              float prob, dtanh = 1.0f;
              if (!has_mod) {
                prob = ptx::exp2_approx(acc_s[nt][r] * p.scale_log2 - lse2[r & 1]);
              } else {
                float x = acc_s[nt][r] * p.scale;
                if (p.softcap > 0.0f) {
                  const float th = tanhf(x / p.softcap);
                  x = p.softcap * th;
                  dtanh = 1.0f - th * th;
                }
                if (p.alibi_slopes != nullptr) x += alibi_bias(slope, i, j, seq.len_q, seq.len_k);
                prob = ptx::exp2_approx(x * kBwdLog2e - lse2[r & 1]);
              }
              if (!full_tile) {
                const int pos = i + diag;
                const bool visible = j < seq.len_k &&
                                     (p.window_left < 0 || j >= pos - p.window_left) &&
                                     (p.window_right < 0 || j <= pos + p.window_right);
                if (!visible) prob = 0.0f;
              }
              float dp = acc_dp[nt][r];
              float prob_dropped = prob;
              if (has_dropout) {
                const float z = dropout_keep(p.seed, p.offset, bh, static_cast<uint32_t>(i),
                                             static_cast<uint32_t>(j), p.dropout_p)
                                    ? p.dropout_scale
                                    : 0.0f;
                prob_dropped = prob * z;
                dp *= z;
              }
              acc_s[nt][r] = prob_dropped;
              acc_dp[nt][r] = prob * (dp - sDsums[m]) * dtanh;
            }
          }
        }
        // P̃ᵀ and dSᵀ to shared memory, rows kg·16 + g (+ 8), columns q0 + nt·8 + 2t (+ 1).
#pragma unroll
        for (int nt = 0; nt < kSPass / 8; ++nt) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const uint32_t addr = frag_step<kBlockM>(st_p_base, half * 8, pass * kSPass + nt * 8);
            st_shared_u32(addr, ptx::pack2<Element>(acc_s[nt][2 * half], acc_s[nt][2 * half + 1]));
            st_shared_u32(addr + kDsAfterP,
                          ptx::pack2<Element>(acc_dp[nt][2 * half], acc_dp[nt][2 * half + 1]));
          }
        }
      }
      __syncthreads();

      // ---- dV += P̃ᵀ·dO, dK += dSᵀ·Q: keys kg·16 + [0, 16), columns cs·kKVCols + [0, kKVCols).
#pragma unroll(Cfg::kKVUnroll)
      for (int ks = 0; ks < kBlockM / 16; ++ks) {
        uint32_t a_p[4], a_ds[4];
        const uint32_t a_addr = frag_step<kBlockM>(a_p_base, 0, ks * 16);
        ptx::ldmatrix_x4(a_p, a_addr);
        ptx::ldmatrix_x4(a_ds, a_addr + kDsAfterP);
#pragma unroll
        for (int np = 0; np < kKVCols / 16; ++np) {
          uint32_t b_do[4], b_q[4];
          const uint32_t b_addr = frag_step<kHeadDim>(bt_q_base, ks * 16, np * 16) + stage_bytes;
          ptx::ldmatrix_x4_trans(b_do, b_addr + kDoAfterQ);
          ptx::ldmatrix_x4_trans(b_q, b_addr);
          ptx::mma_m16n8k16<Element>(acc_dv[2 * np], a_p, b_do[0], b_do[1]);
          ptx::mma_m16n8k16<Element>(acc_dv[2 * np + 1], a_p, b_do[2], b_do[3]);
          ptx::mma_m16n8k16<Element>(acc_dk[2 * np], a_ds, b_q[0], b_q[1]);
          ptx::mma_m16n8k16<Element>(acc_dk[2 * np + 1], a_ds, b_q[2], b_q[3]);
        }
      }

      // ---- dQ += dS·K: queries qg·16 + [0, 16), columns dcs·kDqCols + [0, kDqCols), by chunks.
#pragma unroll
      for (int chunk = 0; chunk < kDqCols / kDqChunk; ++chunk) {
        const int c0 = dcs * kDqCols + chunk * kDqChunk;  // first column of this chunk
        // Even and odd key steps into separate tiles (kSplitDq), as for Sᵀ above.
        float acc_dq[kDqChunk / 8][4] = {}, odd_dq[kDqChunk / 8][4] = {};
#pragma unroll 1
        for (int ks2 = 0; ks2 < kBlockN / 32; ++ks2) {
#pragma unroll
          for (int parity = 0; parity < 2; ++parity) {
            const int ks = 2 * ks2 + parity;
            float(&sum_dq)[kDqChunk / 8][4] = parity == 0 || !Cfg::kSplitDq ? acc_dq : odd_dq;
            uint32_t a_ds[4];
            ptx::ldmatrix_x4_trans(a_ds, frag_step<kBlockM>(at_ds_base, ks * 16, 0));
#pragma unroll
            for (int np = 0; np < kDqChunk / 16; ++np) {
              uint32_t b_k[4];
              ptx::ldmatrix_x4_trans(
                  b_k, frag_step<kHeadDim>(bt_k_base, ks * 16, chunk * kDqChunk + np * 16));
              ptx::mma_m16n8k16<Element>(sum_dq[2 * np], a_ds, b_k[0], b_k[1]);
              ptx::mma_m16n8k16<Element>(sum_dq[2 * np + 1], a_ds, b_k[2], b_k[3]);
            }
          }
        }
        if constexpr (Cfg::kSplitDq) {
#pragma unroll
          for (int nt = 0; nt < kDqChunk / 8; ++nt)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc_dq[nt][r] += odd_dq[nt][r];
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int i = i0 + qg * 16 + g + half * 8;
          if (i >= seq.len_q) continue;
          float* const row = dq_accum + (h * p.total_q + q_packed0 + i) * kHeadDim;
#pragma unroll
          for (int nt = 0; nt < kDqChunk / 8; ++nt) {
            const int col = c0 + nt * 8 + 2 * t;
            if (col < d)
              atomic_add_pair(row + col, acc_dq[nt][2 * half], acc_dq[nt][2 * half + 1]);
          }
        }
      }
      __syncthreads();  // P, dS and this step's Q/dO buffer are free again
    }

    // ---- dK (scaled by the softmax scale) and dV of this key block.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int j = j0 + kg * 16 + g + half * 8;
      if (j >= seq.len_k) continue;
      Element* const dk_row = static_cast<Element*>(p.dk) + b * p.dk_batch_stride +
                              (seq.k_row0 + j) * p.dk_row_stride + hk * p.dk_head_stride;
      Element* const dv_row = static_cast<Element*>(p.dv) + b * p.dv_batch_stride +
                              (seq.k_row0 + j) * p.dv_row_stride + hk * p.dv_head_stride;
#pragma unroll
      for (int nt = 0; nt < kKVCols / 8; ++nt) {
        const int col = cs * kKVCols + nt * 8 + 2 * t;
        if (col >= d) continue;
        store_pair(dk_row + col, acc_dk[nt][2 * half] * p.scale,
                   acc_dk[nt][2 * half + 1] * p.scale, col + 1 < d, w.pair_store);
        store_pair(dv_row + col, acc_dv[nt][2 * half], acc_dv[nt][2 * half + 1], col + 1 < d,
                   w.pair_store);
      }
    }
    // K/V copies of a block with no visible query were never waited for; the next block reuses
    // the buffers.
    ptx::cp_async_wait<0>();
    __syncthreads();
  }
}

template <DType kDType, int kHeadDim>
Status launch_backward_main(const AttentionParams& p, const BwdWorkspace& w, int key_blocks,
                            cudaStream_t stream) {
  using Cfg = BwdConfig<kHeadDim>;
  const auto kernel = attention_backward_kernel<kDType, kHeadDim>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         Cfg::kSmemBytes);
  if (err != cudaSuccess)
    return Status::device_error(std::string("backward: cudaFuncSetAttribute: ") +
                                cudaGetErrorString(err));
  const int ctas = (key_blocks + w.kv_blocks_per_cta - 1) / w.kv_blocks_per_cta;
  const dim3 grid(ctas, p.heads_kv, p.batch);
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p, w);
  err = cudaGetLastError();
  if (err != cudaSuccess)
    return Status::device_error(std::string("backward: kernel launch: ") + cudaGetErrorString(err));
  return {};
}

}  // namespace flare::cuda::sm80
