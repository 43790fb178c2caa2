// fwd_kernel.cuh — the Hopper forward kernel (sm_90a: wgmma, TMA, warp specialisation), fp16 and
// bf16, and its launcher.
//
// The algorithm is the sm80 kernel's (online softmax over key steps, exp2 with the scale folded
// into one FFMA, masks only on boundary steps, O and LSE written once); what changes is who moves
// the data and who multiplies:
//   - One producer warpgroup (warpgroup 0) does nothing but issue TMA loads: the CTA's Q tile once,
//     then K_j and V_j into a ring of kStages buffers, each announced on an mbarrier (k_full,
//     v_full) and reused once every consumer has arrived on the buffer's `empty` barrier. It gives
//     its registers back (setmaxnreg) to the consumers.
//   - Each consumer warpgroup owns 64 query rows and runs, per key step,
//       S = Q·K_jᵀ   wgmma m64n{kBlockN}k16, Q and K from shared memory (K-major)
//       mask, online softmax on S in registers (the accumulator layout is mma.sync's, so the
//       row max and sum are quad shuffles as in sm80)
//       O += P·V_j   wgmma m64n{d}k16, P from registers (the accumulator rounded in place), V from
//       shared memory (MN-major)
//     with no CTA-wide barrier: warpgroups drift apart, so one's softmax runs beside another's
//     products.
// Shared memory holds every tile in the 128-byte swizzle TMA writes and wgmma reads (panels of 64
// columns, see ptx/wgmma.cuh). Rows past a sequence end and columns past head_dim are zero-filled
// by TMA; the mask keeps the former out of the softmax.
// Non-finite inputs: the producer's three idle warps probe V_j for ±Inf/NaN on the steps where
// some row of the tile does not see some existing key, and publish the answer on a `v_checked`
// barrier; only there and only then do the consumers form P·V pair by pair with the hidden pairs
// skipped instead of by wgmma (masked_product.cuh: a hidden key's P = 0 times an infinite V would
// be NaN). Every other step reads no more than before.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "core/params.h"
#include "core/score_mod.h"
#include "cuda/masked_product.cuh"
#include "cuda/ptx/fast_math.cuh"
#include "cuda/ptx/ldmatrix.cuh"
#include "cuda/ptx/mma.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/ptx/wgmma.cuh"
#include "cuda/sm90/common.cuh"
#include "cuda/sm90/fwd_launch.h"
#include "cuda/sm90/fwd_tiles.h"
#include "cuda/sm90/tensor_map.h"

namespace flare::cuda::sm90 {

template <DType kDType, int kHeadDim>
struct Fwd90Config {
  using Element = ElementOf<kDType>;
  static constexpr Fwd90Tile kTile = fwd90_tile(kHeadDim);
  static_assert(kTile.head_dim == kHeadDim, "head-dim bucket missing from kFwd90Tiles");
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kConsumers = kTile.consumers;
  static constexpr int kStages = kTile.stages;
  static constexpr int kThreads = 128 * (kConsumers + 1);
  static constexpr int kPanels = kHeadDim / 64;  // 64-column panels of a tile
  static constexpr uint32_t kQPanelBytes = kBlockM * 128;
  static constexpr uint32_t kQBytes = kPanels * kQPanelBytes;
  static constexpr uint32_t kKVPanelBytes = kBlockN * 128;
  static constexpr uint32_t kKVBytes = kPanels * kKVPanelBytes;  // one K or V tile
  // Dynamic shared memory: Q, the K ring, the V ring, and 1 KiB to align the start to 1024 bytes.
  static constexpr int kSmemBytes = static_cast<int>(kQBytes + 2 * kStages * kKVBytes) + 1024;
  // The producer warpgroup's warps 1-3 probe V tiles for non-finite values (see the kernel).
  static constexpr int kCheckerWarps = 3;
  // Registers per thread after setmaxnreg (within launch_regs: common.cuh).
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = kConsumers == 2 ? 240 : 160;
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumers <=
                    launch_regs(kThreads) * kThreads,
                "setmaxnreg split exceeds the CTA's registers");
  static_assert(kHeadDim % 64 == 0 && kBlockN % 16 == 0 && kBlockM == 64 * kConsumers, "tile shape");
};

inline constexpr float kLn2f = 0.6931471805599453f;

template <DType kDType, int kHeadDim>
__global__ void __launch_bounds__(Fwd90Config<kDType, kHeadDim>::kThreads, 1)
    attention_forward_sm90_kernel(const __grid_constant__ AttentionParams p,
                                  const __grid_constant__ CUtensorMap tm_q,
                                  const __grid_constant__ CUtensorMap tm_k,
                                  const __grid_constant__ CUtensorMap tm_v) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Cfg = Fwd90Config<kDType, kHeadDim>;
  using Element = typename Cfg::Element;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kStages = Cfg::kStages;

  extern __shared__ unsigned char smem_raw[];
  // q_full, k_full[], v_full[], empty[], v_checked[]
  __shared__ __align__(8) uint64_t bars[1 + 4 * kStages];
  __shared__ int s_v_nonfinite[kStages][Cfg::kCheckerWarps];  // per V buffer and checker warp
  const uint32_t raw = ptx::smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* const smem = smem_raw + (base - raw);
  const uint32_t sQ = base;
  const uint32_t sK = sQ + Cfg::kQBytes;
  const uint32_t sV = sK + kStages * Cfg::kKVBytes;
  const uint32_t bar0 = ptx::smem_addr(bars);
  const uint32_t q_full = bar0;
  auto k_full = [&](int s) { return bar0 + 8u * (1 + s); };
  auto v_full = [&](int s) { return bar0 + 8u * (1 + kStages + s); };
  auto empty = [&](int s) { return bar0 + 8u * (1 + 2 * kStages + s); };
  auto v_checked = [&](int s) { return bar0 + 8u * (1 + 3 * kStages + s); };

  const int tid = threadIdx.x;
  const int m_block = gridDim.x - 1 - blockIdx.x;  // heaviest first under a causal mask
  const int h = blockIdx.y, b = blockIdx.z;
  const int len_q = p.seqlen_q, len_k = p.seqlen_k;
  const int m0 = m_block * kBlockM;
  const int rows_q = min(kBlockM, len_q - m0);
  const KeyRange first = visible_keys(m0, len_q, len_k, p.window_left, p.window_right);
  const KeyRange last = visible_keys(m0 + rows_q - 1, len_q, len_k, p.window_left, p.window_right);
  const int n_begin = first.lo / kBlockN;
  const int n_end = last.hi > first.lo ? (last.hi + kBlockN - 1) / kBlockN : n_begin;
  // Whether the step at key n0 holds keys that exist but some row of the tile does not see: the
  // only steps where a masked pair can meet a non-finite V (keys past the end are zero-filled and
  // hidden from every row). A subset of the masked boundary steps.
  auto hides_keys = [&](int n0) { return n0 < last.lo || min(n0 + kBlockN, len_k) > first.hi; };

  if (tid == 0) {
    ptx::mbarrier_init(q_full, 1);
    for (int s = 0; s < kStages; ++s) {
      ptx::mbarrier_init(k_full(s), 1);
      ptx::mbarrier_init(v_full(s), 1);
      // The checkers arrive too, so the producer never refills a buffer a checker has not passed:
      // that keeps their waits on v_full and the consumers' on v_checked one phase apart at most.
      ptx::mbarrier_init(empty(s), 128 * Cfg::kConsumers + Cfg::kCheckerWarps);
      ptx::mbarrier_init(v_checked(s), Cfg::kCheckerWarps);
    }
    ptx::mbarrier_init_fence();
  }
  __syncthreads();

  if (tid < 128) {
    // Producer warpgroup: one thread issues every load; warps 1-3 probe V tiles.
    ptx::setmaxnreg_dec<Cfg::kProducerRegs>();
    if (tid >= 32) {
      // Checker warps: for every step, wait for V_j; on steps with hidden keys, probe the rows of
      // those keys and vote; then publish the answer on v_checked and release the buffer on
      // `empty`. Each thread keeps one 16-byte chunk column (the swizzle only permutes a row's
      // chunks, and every chunk of a row is probed) and walks rows kRowStep apart: code that fits
      // the producer's 24 registers.
      constexpr int kRowChunks = Cfg::kPanels * 8;
      constexpr int kRowStep = 32 * Cfg::kCheckerWarps / kRowChunks;
      static_assert(32 * Cfg::kCheckerWarps % kRowChunks == 0, "checker threads per row");
      const int ct = tid - 32, row0 = ct / kRowChunks;
      const uint32_t column = (ct % kRowChunks / 8) * Cfg::kKVPanelBytes + (ct % 8) * 16;
#pragma unroll 1
      for (int n = n_begin; n < n_end; ++n) {
        const int it = n - n_begin, stage = it % kStages;
        ptx::mbarrier_wait(v_full(stage), (it / kStages) & 1);
        const int n0 = n * kBlockN;
        bool nonfinite = false;
        if (hides_keys(n0)) {
          // Rows [0, last.lo − n0) and [first.hi − n0, len_k − n0) of the tile.
          const uint32_t tile = sV + stage * Cfg::kKVBytes + column;
          const int seen_by_all = last.lo - n0, hidden_again = first.hi - n0;
          const int rows = min(kBlockN, len_k - n0);
          NonfiniteProbe<Element> probe;
#pragma unroll 1
          for (int row = row0; row < rows; row += kRowStep)
            if (row < seen_by_all || row >= hidden_again) {
              uint4 v;
              asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                           : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                           : "r"(tile + row * 128));
              probe.add(v);
            }
          nonfinite = probe.found();
        }
        nonfinite = __any_sync(0xffffffffu, nonfinite);
        if (tid % 32 == 0) {
          s_v_nonfinite[stage][tid / 32 - 1] = nonfinite;
          ptx::mbarrier_arrive(v_checked(stage));
          ptx::mbarrier_arrive(empty(stage));
        }
      }
      return;
    }
    if (tid == 0) {
      const int hk = h / p.head_group;
      ptx::tma_prefetch_descriptor(&tm_q);
      ptx::tma_prefetch_descriptor(&tm_k);
      ptx::tma_prefetch_descriptor(&tm_v);
      ptx::mbarrier_arrive_expect_tx(q_full, Cfg::kQBytes);
#pragma unroll
      for (int pnl = 0; pnl < Cfg::kPanels; ++pnl)
        ptx::tma_load_4d(sQ + pnl * Cfg::kQPanelBytes, &tm_q, q_full, pnl * 64, m0, h, b);
      // Rolled: unrolled (by the stage count), its addresses no longer fit the 24 registers once
      // the checker warps' loop shares the warpgroup's code (56 bytes of spills at d 128).
#pragma unroll 1
      for (int n = n_begin, it = 0; n < n_end; ++n, ++it) {
        const int stage = it % kStages, round = it / kStages;
        if (round > 0) ptx::mbarrier_wait(empty(stage), (round - 1) & 1);
        const uint32_t k_dst = sK + stage * Cfg::kKVBytes, v_dst = sV + stage * Cfg::kKVBytes;
        ptx::mbarrier_arrive_expect_tx(k_full(stage), Cfg::kKVBytes);
#pragma unroll
        for (int pnl = 0; pnl < Cfg::kPanels; ++pnl)
          ptx::tma_load_4d(k_dst + pnl * Cfg::kKVPanelBytes, &tm_k, k_full(stage), pnl * 64,
                           n * kBlockN, hk, b);
        ptx::mbarrier_arrive_expect_tx(v_full(stage), Cfg::kKVBytes);
#pragma unroll
        for (int pnl = 0; pnl < Cfg::kPanels; ++pnl)
          ptx::tma_load_4d(v_dst + pnl * Cfg::kKVPanelBytes, &tm_v, v_full(stage), pnl * 64,
                           n * kBlockN, hk, b);
      }
    }
    return;
  }

  // Consumer warpgroup c: query rows 64c..64c+63 of the tile; this thread's two rows are r0 and
  // r0 + 8 (the accumulator layout, ptx/wgmma.cuh).
  ptx::setmaxnreg_inc<Cfg::kConsumerRegs>();
  const int c = tid / 128 - 1;
  const int warp = (tid / 32) % 4, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int r0 = c * 64 + warp * 16 + g;

  float acc_o[kHeadDim / 2];
#pragma unroll
  for (int i = 0; i < kHeadDim / 2; ++i) acc_o[i] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};

  const uint32_t q_rows = sQ + c * 64 * 128;
  ptx::mbarrier_wait(q_full, 0);

  for (int n = n_begin, it = 0; n < n_end; ++n, ++it) {
    const int stage = it % kStages;
    const uint32_t parity = (it / kStages) & 1;
    const uint32_t k_tile = sK + stage * Cfg::kKVBytes, v_tile = sV + stage * Cfg::kKVBytes;

    // S = Q·K_jᵀ (64 × kBlockN per warpgroup).
    float s[kBlockN / 2];
    ptx::mbarrier_wait(k_full(stage), parity);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const uint32_t k_off = (kk % 4) * 32u;  // k slice within the 128-byte row
      const uint64_t da = ptx::wgmma_desc_k_major(q_rows + (kk / 4) * Cfg::kQPanelBytes + k_off);
      const uint64_t db = ptx::wgmma_desc_k_major(k_tile + (kk / 4) * Cfg::kKVPanelBytes + k_off);
      ptx::wgmma_ss<kBlockN, Element>(s, da, db, kk > 0 ? 1 : 0);
    }
    ptx::wgmma_commit();
    ptx::wgmma_wait<0>();
    ptx::fence_operands(s);

    // Mask on boundary steps (the sm80 kernel's test: visible_keys per element, as two 32-bit
    // differences against uniform bounds).
    const int n0 = n * kBlockN;
    if (n0 < last.lo || n0 + kBlockN > first.hi) {
      const int col_room = len_k - n0 - 2 * t;
      const int rel0 = n0 + 2 * t - (m0 + r0 + len_k - len_q);
      const int rel_lo = p.window_left >= 0 ? -p.window_left : INT_MIN;
      const int rel_hi = p.window_right >= 0 ? p.window_right : INT_MAX;
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int col = j * 8 + (i & 1);
          const int rel = rel0 + col - (i >> 1) * 8;
          if (col >= col_room || rel < rel_lo || rel > rel_hi) s[4 * j + i] = -INFINITY;
        }
    }

    // Online softmax for the thread's two rows; O rescaled in place.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j)
        mx = fmaxf(mx, fmaxf(s[4 * j + 2 * half], s[4 * j + 2 * half + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_old = row_max[half];
      const float m_new = fmaxf(m_old, mx * p.scale_log2);
      const float sub = m_new == -INFINITY ? 0.0f : m_new;  // no −inf − −inf
      const float correction = ptx::exp2_approx(m_old - sub);
      row_max[half] = m_new;
#pragma unroll
      for (int j = 0; j < kHeadDim / 8; ++j) {
        acc_o[4 * j + 2 * half] *= correction;
        acc_o[4 * j + 2 * half + 1] *= correction;
      }
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[4 * j + 2 * half + e];
          x = ptx::exp2_approx(fmaf(x, p.scale_log2, -sub));
          sum += x;
        }
      row_sum[half] = row_sum[half] * correction + sum;
    }

    // P rounded to the A fragments of O += P·V: k slice kk is n8 blocks 2kk and 2kk + 1.
    uint32_t pa[kBlockN / 16][4];
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      pa[kk][0] = ptx::pack2<Element>(s[8 * kk + 0], s[8 * kk + 1]);
      pa[kk][1] = ptx::pack2<Element>(s[8 * kk + 2], s[8 * kk + 3]);
      pa[kk][2] = ptx::pack2<Element>(s[8 * kk + 4], s[8 * kk + 5]);
      pa[kk][3] = ptx::pack2<Element>(s[8 * kk + 6], s[8 * kk + 7]);
    }

    // O += P·V_j; V's rows are the reduction dimension (MN-major B). On steps with hidden keys,
    // the checkers' verdict on V_j first: a non-finite value there takes the pair-by-pair product.
    ptx::mbarrier_wait(v_full(stage), parity);
    bool v_nonfinite = false;
    if (hides_keys(n0)) {
      ptx::mbarrier_wait(v_checked(stage), parity);
      const volatile int* verdict = s_v_nonfinite[stage];
#pragma unroll
      for (int w = 0; w < Cfg::kCheckerWarps; ++w) v_nonfinite = v_nonfinite || verdict[w] != 0;
    }
    if (v_nonfinite) {
      const KeyRange seen[2] = {
          visible_keys(m0 + r0, len_q, len_k, p.window_left, p.window_right),
          visible_keys(m0 + r0 + 8, len_q, len_k, p.window_left, p.window_right)};
      // P's n8 fragment nf, row half hf is register 2·(nf % 2) + hf of pa[nf / 2].
      auto p_word = [&](int hf, int nf) { return pa[nf / 2][2 * (nf % 2) + hf]; };
      masked_product<2, kHeadDim / 8>(
          min(kBlockN, len_k - n0),
          [&](int hf, int k) { return quad_fragment_at<Element, kBlockN / 8>(p_word, hf, k, lane); },
          [&](int k, int j) {  // columns 8j + 2t, + 1
            return load_shared_pair<Element>(v_tile + swizzled(k, j, Cfg::kKVPanelBytes) + 4 * t);
          },
          [&](int hf, int k) { return n0 + k >= seen[hf].lo && n0 + k < seen[hf].hi; },
          [&](int hf, int c) -> float& { return acc_o[4 * (c / 2) + 2 * hf + c % 2]; });
    } else {
      ptx::fence_operands(acc_o);
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        const uint64_t db = ptx::wgmma_desc_mn_major(v_tile + kk * 2048u, Cfg::kKVPanelBytes);
        ptx::wgmma_rs<kHeadDim, Element>(acc_o, pa[kk], db, 1);
      }
      ptx::wgmma_commit();
      ptx::wgmma_wait<0>();
      ptx::fence_operands(acc_o);
    }
    ptx::mbarrier_arrive(empty(stage));
  }

  // Epilogue: normalise, write LSE, stage O (rounded) in this warp's own rows of the Q tile, in
  // the same swizzle (eight rows of one chunk column hit eight bank quads), then 16-byte stores.
  float* lse_row = p.lse + b * p.lse_batch_stride + h * p.lse_head_stride + m0;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float l = row_sum[half];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int r = r0 + half * 8;
    // l = 0 where every score the row saw was −inf, or where it saw no key: NaN for the first (as
    // the reference's exp(−inf − −inf)), O = 0 and LSE = −inf for the second. A NaN or +inf score
    // left l NaN, which the division and the log carry into O and the LSE.
    float inv = 0.0f, lse = -INFINITY;
    if (l != 0.0f) {
      inv = 1.0f / l;
      lse = row_max[half] * kLn2f + logf(l);
    } else {
      const KeyRange seen = visible_keys(m0 + r, len_q, len_k, p.window_left, p.window_right);
      if (seen.hi > seen.lo) inv = lse = NAN;
    }
#pragma unroll
    for (int j = 0; j < kHeadDim / 8; ++j) {
      const uint32_t packed =
          ptx::pack2<Element>(acc_o[4 * j + 2 * half] * inv, acc_o[4 * j + 2 * half + 1] * inv);
      *reinterpret_cast<uint32_t*>(smem + swizzled(r, j, Cfg::kQPanelBytes) + 4 * t) = packed;
    }
    if (t == 0 && r < rows_q) lse_row[r] = lse;
  }
  __syncwarp();

  Element* gO = static_cast<Element*>(p.o) + b * p.o_batch_stride + int64_t{m0} * p.o_row_stride +
                h * p.o_head_stride;
  store_rows<kHeadDim / 8>(gO, p.o_row_stride, smem, Cfg::kQPanelBytes, c * 64 + warp * 16, 0,
                           rows_q, p.head_dim, lane);
#else
  (void)p;
  (void)tm_q;
  (void)tm_k;
  (void)tm_v;
#endif
}


template <DType kDType, int kHeadDim>
bool forward_runs_on_device() {
  return runs_sm90a_code(reinterpret_cast<const void*>(attention_forward_sm90_kernel<kDType, kHeadDim>));
}

template <DType kDType, int kHeadDim>
Status launch_forward(const AttentionParams& p, cudaStream_t stream) {
  using Cfg = Fwd90Config<kDType, kHeadDim>;
  const int64_t m_blocks = (int64_t{p.seqlen_q} + Cfg::kBlockM - 1) / Cfg::kBlockM;
  if (m_blocks == 0 || p.batch == 0) return {};
  CUtensorMap tm_q, tm_k, tm_v;
  Status st = encode_map(&tm_q, kDType, p.q, p.head_dim, p.seqlen_q, p.heads_q, p.batch,
                                 p.q_row_stride, p.q_head_stride, p.q_batch_stride, Cfg::kBlockM,
                                 "q");
  if (!st.ok()) return st;
  st = encode_map(&tm_k, kDType, p.k, p.head_dim, p.seqlen_k, p.heads_kv, p.batch,
                          p.k_row_stride, p.k_head_stride, p.k_batch_stride, Cfg::kBlockN, "k");
  if (!st.ok()) return st;
  st = encode_map(&tm_v, kDType, p.v, p.head_dim, p.seqlen_k, p.heads_kv, p.batch,
                          p.v_row_stride, p.v_head_stride, p.v_batch_stride, Cfg::kBlockN, "v");
  if (!st.ok()) return st;
  const dim3 grid(static_cast<unsigned>(m_blocks), static_cast<unsigned>(p.heads_q),
                  static_cast<unsigned>(p.batch));
  return launch(attention_forward_sm90_kernel<kDType, kHeadDim>, "forward", kHeadDim, grid,
                Cfg::kThreads, Cfg::kSmemBytes, stream, p, tm_q, tm_k, tm_v);
}

}  // namespace flare::cuda::sm90
