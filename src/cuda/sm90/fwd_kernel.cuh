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

#include "core/block_mask.h"
#include "core/numeric.h"
#include "core/params.h"
#include "core/score_mod.h"
#include "cuda/block_walk.cuh"
#include "cuda/nonfinite_fixup.cuh"
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
  static constexpr bool kBlockSparse = fwd90_takes_block_mask(kHeadDim);  // fwd_tiles.h
  static constexpr int kThreads = 128 * (kConsumers + 1);
  static constexpr int kPanels = kHeadDim / 64;  // 64-column panels of a tile
  static constexpr uint32_t kQPanelBytes = kBlockM * 128;
  static constexpr uint32_t kQBytes = kPanels * kQPanelBytes;
  static constexpr uint32_t kKVPanelBytes = kBlockN * 128;
  static constexpr uint32_t kKVBytes = kPanels * kKVPanelBytes;  // one K or V tile
  // Dynamic shared memory: Q, the K ring, the V ring, and 1 KiB to align the start to 1024 bytes.
  static constexpr int kSmemBytes = static_cast<int>(kQBytes + 2 * kStages * kKVBytes) + 1024;
  // Registers per thread after setmaxnreg (within launch_regs: common.cuh).
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = kConsumers == 2 ? 240 : 160;
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumers <=
                    launch_regs(kThreads) * kThreads,
                "setmaxnreg split exceeds the CTA's registers");
  static_assert(kHeadDim % 64 == 0 && kBlockN % 16 == 0 && kBlockM == 64 * kConsumers, "tile shape");
};


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
  __shared__ __align__(8) uint64_t bars[1 + 3 * kStages];  // q_full, k_full[], v_full[], empty[]
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
  // Block-sparse (core/block_mask.h; kernels whose tile lies in one mask row block): the steps
  // are the key tiles whose block is on. The CTA counts them first; the producer walks the mask
  // and writes each step's tile beside its K buffer (published by the K load's barrier), so the
  // consumers read no mask. Dense, step it is tile n_begin + it.
  auto sparse = [&] { return Cfg::kBlockSparse && p.block_mask != nullptr; };
  __shared__ int s_steps;
  __shared__ int s_step_tile[kStages];
  const int steps =
      sparse() ? count_on_tiles<Cfg::kThreads>(
                     1, n_begin, n_end, p.block_n / kBlockN,
                     [&](int, int c) { return block_on(p, b, h, m0 / p.block_m, c); }, &s_steps)
               : n_end - n_begin;

  if (tid == 0) {
    ptx::mbarrier_init(q_full, 1);
    for (int s = 0; s < kStages; ++s) {
      ptx::mbarrier_init(k_full(s), 1);
      ptx::mbarrier_init(v_full(s), 1);
      ptx::mbarrier_init(empty(s), 128 * Cfg::kConsumers);
    }
    ptx::mbarrier_init_fence();
  }
  __syncthreads();

  if (tid < 128) {
    // Producer warpgroup: one thread issues every load.
    ptx::setmaxnreg_dec<Cfg::kProducerRegs>();
    if (tid == 0) {
      const int hk = h / p.head_group;
      ptx::tma_prefetch_descriptor(&tm_q);
      ptx::tma_prefetch_descriptor(&tm_k);
      ptx::tma_prefetch_descriptor(&tm_v);
      ptx::mbarrier_arrive_expect_tx(q_full, Cfg::kQBytes);
#pragma unroll
      for (int pnl = 0; pnl < Cfg::kPanels; ++pnl)
        ptx::tma_load_4d(sQ + pnl * Cfg::kQPanelBytes, &tm_q, q_full, pnl * 64, m0, h, b);
      const int row_block = sparse() ? m0 / p.block_m : 0;
      auto next_on = [&](int n) {
        return sparse() ? next_key_tile_on(p, b, h, row_block, row_block, n, n_end, kBlockN) : n;
      };
      for (int n = next_on(n_begin), step = 0; step < steps; n = next_on(n + 1), ++step) {
        const int stage = step % kStages, round = step / kStages;
        if (round > 0) ptx::mbarrier_wait(empty(stage), (round - 1) & 1);
        if (sparse()) s_step_tile[stage] = n;
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

  for (int step = 0; step < steps; ++step) {
    const int stage = step % kStages;
    const uint32_t parity = (step / kStages) & 1;
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
    const int n0 =
        (sparse() ? *static_cast<volatile int*>(&s_step_tile[stage]) : n_begin + step) * kBlockN;
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

    // O += P·V_j; V's rows are the reduction dimension (MN-major B).
    ptx::mbarrier_wait(v_full(stage), parity);
    ptx::fence_operands(acc_o);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const uint64_t db = ptx::wgmma_desc_mn_major(v_tile + kk * kSlice16Bytes, Cfg::kKVPanelBytes);
      ptx::wgmma_rs<kHeadDim, Element>(acc_o, pa[kk], db, 1);
    }
    ptx::wgmma_commit();
    ptx::wgmma_wait<0>();
    ptx::fence_operands(acc_o);
    ptx::mbarrier_arrive(empty(stage));
  }

  // Epilogue: normalise, write LSE, stage O (rounded) in this warp's own rows of the Q tile, in
  // the same swizzle (eight rows of one chunk column hit eight bank quads), then 16-byte stores.
  // Non-finite inputs (cuda/nonfinite_fixup.cuh): as in the sm80 kernel, a row with no positive
  // sum that sees every key (no window) is NaN, and under a window a row whose O comes out
  // non-finite gets LSE = NaN, for the forward fixup kernel to recompute exactly.
  float* lse_row = p.lse + b * p.lse_batch_stride + h * p.lse_head_stride + m0;
  const bool windowed = p.window_left >= 0 || p.window_right >= 0;
  const bool every_key_visible = !windowed && p.block_mask == nullptr && len_k > 0;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float l = row_sum[half];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const float inv = l > 0.0f ? 1.0f / l : every_key_visible ? NAN : 0.0f;
    const int r = r0 + half * 8;
    float probe = 0.0f;
#pragma unroll
    for (int j = 0; j < kHeadDim / 8; ++j) {
      const float o0 = acc_o[4 * j + 2 * half] * inv, o1 = acc_o[4 * j + 2 * half + 1] * inv;
      probe = nonfinite_probe(nonfinite_probe(probe, o0), o1);
      *reinterpret_cast<uint32_t*>(smem + swizzled(r, j, Cfg::kQPanelBytes) + 4 * t) =
          ptx::pack2<Element>(o0, o1);
    }
    probe += __shfl_xor_sync(0xffffffffu, probe, 1);  // the row's four lanes
    probe += __shfl_xor_sync(0xffffffffu, probe, 2);
    if (t == 0 && r < rows_q)
      lse_row[r] = windowed && probe_found(probe) ? NAN
                   : l > 0.0f         ? row_max[half] * kLn2 + logf(l)
                   : every_key_visible ? NAN
                                       : -INFINITY;
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
