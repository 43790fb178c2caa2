// bwd_kernel.cuh — the Hopper backward main kernel (sm_90a: wgmma, TMA, warp specialisation), fp16
// and bf16, and its launcher. The preprocess (D = rowsum(dO∘O), dQ accumulator zeroed) and convert
// (dq = scale · accumulator) kernels are the sm80 ones (sm80/bwd_prepost.cu), on the same
// workspace.
//
// One CTA owns kBlockN = 128 keys of one (kv head, batch): K and V are loaded once, dK and dV live
// in registers and are written once, and the CTA walks every query block of every query head of
// the kv head's group that sees one of its keys (as the sm80 kernel does). Warpgroup 0 is the
// producer: one thread issues the TMA loads (K and V once; Q_i and dO_i into a ring of kStages
// buffers, beside each its step's query block and head). The consumers copy each step's LSE (base
// 2, +inf for rows that see nothing) and D into shared memory beside them one step ahead, and
// arrive on the same `full` barrier as the TMA loads. Warpgroups 1 and 2 each own 64 of the keys
// and per step run
//   Sᵀ  = K·Q_iᵀ, dPᵀ = V·dO_iᵀ        wgmma, both operands K-major in shared memory
//   Pᵀ  = 2^(Sᵀ·scale·log2e − LSE₂)      masked on boundary steps; softcap and ALiBi on Sᵀ first
//   dSᵀ = Pᵀ∘(z·dPᵀ − D)                 times the softcap's 1 − tanh²; z the dropout mask's
//                                         1/(1 − p) or 0 (1 without dropout), P̃ᵀ = Pᵀ·z
//   dV += P̃ᵀ·dO_i, dK += dSᵀ·Q_i          wgmma with Pᵀ, dSᵀ in registers (the accumulator layout
//                                         rounded in place is the A fragment), B MN-major
//   dSᵀ → shared memory; the two warpgroups meet at a named barrier
//   dQ_i += dS·K                          one 64×64 tile of dQ per warpgroup (both operands
//                                         MN-major: dSᵀ's rows and K's rows are the reduction
//                                         dimension),
//                                         staged in shared memory (d <= 128: a buffer of the
//                                         warpgroup's own) and added to the fp32 accumulator by
//                                         TMA reductions
// dSᵀ is double-buffered, so one named barrier per step orders both its write-after-read and its
// read-after-write. dK is scaled by the softmax scale on the way out, dQ by the convert kernel.
// d 256 splits the head dim between the warpgroups instead (Bwd90Config::kSplitD).
//
// Deterministic mode (w.dq_turns set): the reductions into one query block's dQ rows come from
// every key block that sees it, in whatever order the CTAs get there, and fp32 addition does not
// commute bit for bit. So they take turns: key block n adds its tile after the key blocks that see
// the block and come before it in the turn order, counted per (dQ slice, query head, query block)
// in w.dq_turns (one count per warpgroup's tile). At d <= 128 an idle thread of the producer
// warpgroup keeps the turns: it walks the steps as the producer does and, once a step's count is
// reached, grants the turn. At d <= 128 it grants it to a third, the dQ reducer, which takes the
// consumers' staged tiles and adds them once their turn has come, so the consumers compute on
// while a turn is pending and a chain of turns costs the adds alone. Past d 128 (no staging of the
// warpgroup's own) it gives the step's `full` barrier the one arrival it waits for beyond the
// loads (a wait in the consumers' own code made ptxas spill at d 64). The turn order follows the
// walks: causal and
// right-windowed walks start a key block's walk at its diagonal, so the key blocks go in
// descending order (the grid reversed, so that CTAs start in that order) and a key block's turn at
// a query block comes while the one above it is already steps further; other walks all start at
// the same query block, and in ascending turns key block n starts n steps late, so they are cut
// into dQ slices of a few key blocks each (w.kv_blocks_per_cta; backward.cpp), with turns in each.
// A CTA waits only for CTAs started before it of its own (kv head, batch), so every wait ends.
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

#include "core/numeric.h"
#include "core/params.h"
#include "core/philox.h"
#include "core/score_mod.h"
#include "cuda/block_walk.cuh"
#include "cuda/nonfinite_fixup.cuh"
#include "cuda/ptx/fast_math.cuh"
#include "cuda/ptx/ldmatrix.cuh"
#include "cuda/ptx/mma.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/ptx/wgmma.cuh"
#include "cuda/sm80/bwd_launch.h"
#include "cuda/sm90/bwd_launch.h"
#include "cuda/sm90/bwd_tiles.h"
#include "cuda/sm90/common.cuh"
#include "cuda/sm90/tensor_map.h"

namespace flare::cuda::sm90 {

template <DType kDType, int kHeadDim>
struct Bwd90Config {
  using Element = ElementOf<kDType>;
  static constexpr Bwd90Tile kTile = bwd90_tile(kHeadDim);
  static_assert(kTile.head_dim == kHeadDim, "head-dim bucket missing from kBwd90Tiles");
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kStages = kTile.stages;
  static constexpr int kConsumers = 2;
  static constexpr int kThreads = 128 * (kConsumers + 1);
  static constexpr int kPanels = kHeadDim / 64;
  // d 256 splits the head dim between the warpgroups (dK and dV of 64 keys × 256 columns would
  // take 256 registers): both own all kBlockN = 64 keys; warpgroup c forms Sᵀ and dPᵀ for queries
  // 32c..32c+31 of the step, writes Pᵀ and dSᵀ to shared memory, and after the named barrier
  // computes dV, dK and dQ for columns 128c..128c+127 with every operand in shared memory.
  // Otherwise warpgroup c owns keys 64c..64c+63 and all columns, and Pᵀ, dSᵀ stay in registers
  // as the A operands of dV and dK.
  static constexpr bool kSplitD = kHeadDim == 256;
  static constexpr int kWgQueries = kSplitD ? kBlockM / 2 : kBlockM;  // Sᵀ columns per warpgroup
  static constexpr int kWgCols = kSplitD ? kHeadDim / 2 : kHeadDim;   // dK/dV columns
  static constexpr int kDqCols = kSplitD ? 128 : 64;                  // dQ tile: 64 × kDqCols
  static constexpr uint32_t kKVPanelBytes = kBlockN * 128;
  static constexpr uint32_t kKVBytes = kPanels * kKVPanelBytes;  // K or V
  static constexpr uint32_t kQPanelBytes = kBlockM * 128;
  static constexpr uint32_t kQBytes = kPanels * kQPanelBytes;  // one Q or dO buffer
  static constexpr uint32_t kDsPanelBytes = kBlockN * 128;     // 64 queries of dSᵀ (or Pᵀ)
  static constexpr uint32_t kDsBytes = (kBlockM / 64) * kDsPanelBytes;
  static constexpr uint32_t kOffV = kKVBytes;
  static constexpr uint32_t kOffQ = 2 * kKVBytes;
  static constexpr uint32_t kOffDo = kOffQ + kStages * kQBytes;
  static constexpr uint32_t kOffDs = kOffDo + kStages * kQBytes;
  static constexpr uint32_t kOffP = kOffDs + 2 * kDsBytes;  // d 256 only
  // d <= 128: each warpgroup's 64 × 64 fp32 dQ tile is staged for the TMA reductions in a buffer
  // of its own, so a step need not wait for the copy engine to read it (d 256: no room; it stages
  // in the step's Q and dO panels).
  static constexpr uint32_t kDqBoxBytes = 32 * 32 * 4;  // one TMA reduction: 32 rows × 32 fp32
  static constexpr uint32_t kDqStageBytes = 64 * 64 * 4;
  static constexpr uint32_t kOffDqStage = kOffP;  // d <= 128 only
  static constexpr int kSmemBytes =
      static_cast<int>(kOffP + (kSplitD ? 2 * kDsBytes : kConsumers * kDqStageBytes)) + 1024;
  static_assert(kSplitD ? kBlockM == 64 && kBlockN == 64
                        : kBlockN == 128 && (kBlockM / 64) * (kHeadDim / 64) == kConsumers,
                "d 256: 64 × 64 tiles; else one 64 × 64 dQ tile per warpgroup");
  // Registers per thread after setmaxnreg (within launch_regs: common.cuh). At 24 the producer's
  // one loop fits.
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;  // at 232 ptxas serialises the wgmmas
  static_assert(kStages == 2, "LSE and D are double-buffered beside the Q/dO ring");
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumers <=
                    launch_regs(kThreads) * kThreads,
                "setmaxnreg split exceeds the CTA's registers");
};

// The consumers' named barriers (0 is __syncthreads).
enum Bwd90Barrier : int {
  kBothConsumersStep = 1,  // both warpgroups' dSᵀ (and Pᵀ) of the step are in shared memory
  kBothConsumersDone = 2,  // both warpgroups are past their last step (the epilogue reuses K, V)
  kOwnDqStage = 3,         // + c: warpgroup c's dQ staging (its own 128 threads)
};

// Deterministic mode: the counters of a CTA's dQ slice and sequence; query block m of head h
// counts at [h * w.dq_turn_stride + m]. Per query head, the blocks of the sequences one after
// another with a block of room after each (ws_row0 / block_m + b never meets the previous
// sequence's blocks).
__device__ __forceinline__ int* dq_turns_of(const sm80::BwdWorkspace& w, int heads_q, int slice,
                                            int64_t ws_row0, int block_m, int b) {
  return w.dq_turns + (int64_t{slice} * heads_q) * w.dq_turn_stride + ws_row0 / block_m + b;
}

// kScoreMods: the problem has softcap or ALiBi; kDropout: dropout (kernels of their own, as in the
// forward, so that the plain steps keep their code; the dropout kernel, which also takes softcap
// and ALiBi, draws one Philox per element in the unrolled element loop: drawn in a rolled loop
// of their own, the keep bits made ptxas spill 472 bytes at d 64). kTurns: deterministic mode
// (also kernels of their own: its code in the plain kernel cost that kernel 2-4% at d 128, A/B
// on an H200).
template <DType kDType, int kHeadDim, bool kScoreMods, bool kDropout, bool kTurns>
__global__ void __launch_bounds__(Bwd90Config<kDType, kHeadDim>::kThreads, 1)
    attention_backward_sm90_kernel(const __grid_constant__ AttentionParams p,
                                   const sm80::BwdWorkspace w,
                                   const __grid_constant__ CUtensorMap tm_q,
                                   const __grid_constant__ CUtensorMap tm_k,
                                   const __grid_constant__ CUtensorMap tm_v,
                                   const __grid_constant__ CUtensorMap tm_do,
                                   const __grid_constant__ CUtensorMap tm_dq) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Cfg = Bwd90Config<kDType, kHeadDim>;
  using Element = typename Cfg::Element;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kStages = Cfg::kStages;

  extern __shared__ unsigned char smem_raw[];
  // Deterministic mode at d <= 128: the dQ reducer, a producer thread, issues each step's TMA
  // reductions, waits for them and releases the turn, so that no consumer warp waits for a
  // reduction to complete (the consumer that waited held its warpgroup's next step up by that
  // long). The consumers hand it their staged tile (dq_staged) and get the staging back once it is
  // read (dq_free).
  constexpr bool kReducer = kTurns && !Cfg::kSplitD;
  // kv_full, full[], empty[], at[], and the reducer's dq_staged[], dq_free[] and turns_granted
  __shared__ __align__(8) uint64_t bars[1 + 3 * kStages + (kReducer ? 2 * Cfg::kConsumers + 1 : 0)];
  __shared__ __align__(16) float s_lse[kStages][kBlockM];   // base-2 LSE, +inf: P = 0
  __shared__ __align__(16) float s_dsum[kStages][kBlockM];  // D, 0 past the sequence end
  const uint32_t raw = ptx::smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* const smem = smem_raw + (base - raw);
  const uint32_t sK = base, sV = base + Cfg::kOffV, sQ = base + Cfg::kOffQ,
                 sDo = base + Cfg::kOffDo, sDs = base + Cfg::kOffDs;
  const uint32_t bar0 = ptx::smem_addr(bars);
  const uint32_t kv_full = bar0;
  auto full = [&](int s) { return bar0 + 8u * (1 + s); };
  auto empty = [&](int s) { return bar0 + 8u * (1 + kStages + s); };
  // The producer writes each step's (query block, head) into s_step_at[its buffer] and arrives on
  // at(buffer); the consumers read it from there. It is rewritten only after the buffer's `empty`,
  // i.e. after every consumer is done with the step. Dense too: with the consumers working the
  // step out by division (their LSE/D copies wait on it) the backward ran 1-4% slower at d 64 and
  // 5-13% at d 128 (A/B on an H200, one call).
  auto at = [&](int s) { return bar0 + 8u * (1 + 2 * kStages + s); };
  auto dq_staged = [&](int c) { return bar0 + 8u * (1 + 3 * kStages + c); };
  auto dq_free = [&](int c) { return bar0 + 8u * (1 + 3 * kStages + Cfg::kConsumers + c); };
  // Not a barrier: the steps whose turn the keeper has seen come, a flag the reducer reads (beside
  // the barriers, whose base address the reducer holds anyway).
  const uint32_t turns_granted = bar0 + 8u * (1 + 3 * kStages + 2 * Cfg::kConsumers);
  __shared__ int2 s_step_at[kStages];

  const int tid = threadIdx.x;
  const int n_block = kTurns && w.dq_turns_descending ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int hk = blockIdx.y, b = blockIdx.z;
  const int slice = kTurns ? n_block / w.kv_blocks_per_cta : 0;  // of dQ
  // Packed batches: the sequence's rows in the tensor maps (one batch of every sequence's rows)
  // and in the per-row workspaces; a CTA past its sequence's keys has nothing to do.
  const SequenceInfo seq = sequence_info(p, b);
  const int len_q = seq.len_q, len_k = seq.len_k;
  const int n0 = n_block * kBlockN;
  const int rows_k = min(kBlockN, len_k - n0);
  if (rows_k <= 0) return;
  const bool packed = p.is_varlen();
  const int tma_q0 = static_cast<int>(seq.q_row0), tma_k0 = static_cast<int>(seq.k_row0);
  const int tma_b = packed ? 0 : b;
  const int64_t ws_row0 = packed_q_row0(p, b, seq);  // LSE/D/dQ accumulator rows
  const RowRange rows = rows_seeing(n0, n0 + rows_k, len_q, len_k, p.window_left, p.window_right);
  const int m_begin = rows.lo / kBlockM;
  const int m_count = rows.hi > rows.lo ? (rows.hi + kBlockM - 1) / kBlockM - m_begin : 0;
  const int h0 = hk * p.head_group;
  // The steps are the walk's (cuda/block_walk.cuh): dense, query blocks m_begin.. of head h0, then
  // of h0 + 1, ...; block-sparse, only those whose mask block is on, counted here by the whole CTA.
  const bool sparse = p.block_mask != nullptr;
  const QueryWalk query_walk{
      b, sparse ? n0 / p.block_n : 0, m_begin, m_begin + m_count, h0 + p.head_group, kBlockM};
  __shared__ int s_steps;
  const int steps =
      sparse ? query_walk.count_steps<Cfg::kThreads>(p, h0, &s_steps) : m_count * p.head_group;

  // The consumers read the step count back from shared memory each step (volatile): held in a
  // register across the loop, it spills at d 64.
  __shared__ int s_step_count;
  // Deterministic mode: likewise the first dQ accumulator row of the slice, and the turn
  // counters of the slice and sequence.
  __shared__ int s_slice_row0;
  __shared__ int* s_turns;
  if (tid == 0) {
    s_step_count = steps;
    if constexpr (kTurns) {
      s_slice_row0 = slice * p.heads_q * p.total_q;
      s_turns = dq_turns_of(w, p.heads_q, slice, ws_row0, kBlockM, b);
    }
    ptx::mbarrier_init(kv_full, 1);
    for (int s = 0; s < kStages; ++s) {
      // TMA thread, LSE/D copies, and the turn keeper (deterministic mode past d 128)
      ptx::mbarrier_init(full(s), 1 + 128 * Cfg::kConsumers + (kTurns && !kReducer ? 1 : 0));
      ptx::mbarrier_init(empty(s), 128 * Cfg::kConsumers);
      ptx::mbarrier_init(at(s), 1);
    }
    if constexpr (kReducer) {
      for (int c = 0; c < Cfg::kConsumers; ++c) {
        ptx::mbarrier_init(dq_staged(c), 1);
        ptx::mbarrier_init(dq_free(c), 1);
      }
      ptx::st_release_cta(turns_granted, 0);  // published by the __syncthreads below
    }
    ptx::mbarrier_init_fence();
  }
  __syncthreads();

  if (tid < 128) {
    ptx::setmaxnreg_dec<Cfg::kProducerRegs>();
    if (tid == 0) {
      ptx::tma_prefetch_descriptor(&tm_q);
      ptx::tma_prefetch_descriptor(&tm_do);
      ptx::mbarrier_arrive_expect_tx(kv_full, 2 * Cfg::kKVBytes);
#pragma unroll
      for (int pnl = 0; pnl < Cfg::kPanels; ++pnl) {
        ptx::tma_load_4d(sK + pnl * Cfg::kKVPanelBytes, &tm_k, kv_full, pnl * 64, tma_k0 + n0, hk,
                         tma_b);
        ptx::tma_load_4d(sV + pnl * Cfg::kKVPanelBytes, &tm_v, kv_full, pnl * 64, tma_k0 + n0, hk,
                         tma_b);
      }
      // Step it: Q_i and dO_i of query block m, head h into its buffer.
      auto issue = [&](int it, int m, int h) {
        const int stage = it % kStages, round = it / kStages;
        const int i0 = m * kBlockM;
        if (round > 0) ptx::mbarrier_wait(empty(stage), (round - 1) & 1);
        s_step_at[stage] = make_int2(m, h);
        ptx::mbarrier_arrive(at(stage));
        ptx::mbarrier_arrive_expect_tx(full(stage), 2 * Cfg::kQBytes);
#pragma unroll
        for (int pnl = 0; pnl < Cfg::kPanels; ++pnl) {
          ptx::tma_load_4d(sQ + stage * Cfg::kQBytes + pnl * Cfg::kQPanelBytes, &tm_q, full(stage),
                           pnl * 64, tma_q0 + i0, h, tma_b);
          ptx::tma_load_4d(sDo + stage * Cfg::kQBytes + pnl * Cfg::kQPanelBytes, &tm_do,
                           full(stage), pnl * 64, tma_q0 + i0, h, tma_b);
        }
      };
      int m = m_begin, h = h0;
      query_walk.settle(p, m, h);
      for (int it = 0; it < steps; ++it, query_walk.advance(p, m, h)) issue(it, m, h);
    } else if (kTurns && tid == 32) {
      // The turn keeper (deterministic mode; see the top of the file): the producer's walk, and
      // per step the adds into the query block's dQ rows that come before this key block's: of
      // the key blocks of the slice that see the block, those above this one (descending) or
      // below it (ascending), one per warpgroup. Once they are done the turn is granted: to the
      // dQ reducer (d <= 128), which may be any number of steps behind, or else to the step's
      // `full` barrier.
      // The slice's key blocks: from run_first, or down to run_last in descending turns.
      const int run_first = slice * w.kv_blocks_per_cta;
      const int run_bound =
          w.dq_turns_descending
              ? min(run_first + w.kv_blocks_per_cta, (len_k + kBlockN - 1) / kBlockN) - 1
              : run_first;
      // Counters as an offset from w.dq_turns: 32-bit, which the producer's 24 registers hold.
      const int counts = static_cast<int>(s_turns - w.dq_turns);
      int m = m_begin, h = h0;
      query_walk.settle(p, m, h);
      for (int it = 0; it < steps; ++it, query_walk.advance(p, m, h)) {
        const int stage = it % kStages, round = it / kStages;
        if (!kReducer && round > 0) ptx::mbarrier_wait(empty(stage), (round - 1) & 1);
        const KeyRange keys = keys_seen(m * kBlockM, min((m + 1) * kBlockM, len_q), len_q, len_k,
                                        p.window_left, p.window_right);
        const int before = w.dq_turns_descending
                               ? min((keys.hi - 1) / kBlockN, run_bound) - n_block
                               : n_block - max(keys.lo / kBlockN, run_bound);
        const int* const count = w.dq_turns + counts + h * static_cast<int>(w.dq_turn_stride) + m;
        while (ptx::ld_acquire_gpu(count) < before * Cfg::kConsumers) __nanosleep(64);
        if constexpr (kReducer)
          ptx::st_release_cta(turns_granted, it + 1);
        else
          ptx::mbarrier_arrive(full(stage));
      }
    } else if (kReducer && tid == 64) {
      // The dQ reducer (deterministic mode, d <= 128; see kReducer): per step, the turn awaited
      // here, not before the step's compute, so that a key block's chain of turns costs the adds
      // alone; then each warpgroup's staged 64 × 64 tile added into the slice's accumulator rows,
      // the staging handed back once read, and the turn released once the adds are done and
      // visible.
      // The slice's first row and counters are read back from shared memory each step (volatile):
      // held across the loop beside the walk's state, they spilled at d 64 with score modifiers
      // and dropout.
      int m = m_begin, h = h0;
      query_walk.settle(p, m, h);
      for (int it = 0; it < steps; ++it, query_walk.advance(p, m, h)) {
        const int row0 = h * p.total_q + *static_cast<const volatile int*>(&s_slice_row0) +
                         static_cast<int>(ws_row0) + m * kBlockM;
        while (ptx::ld_acquire_cta(turns_granted) <= it) {
        }
        ptx::fence_proxy_async_global();  // the turn, then these adds
#pragma unroll
        for (int c = 0; c < Cfg::kConsumers; ++c) {
          ptx::mbarrier_wait(dq_staged(c), it & 1);
          const uint32_t stage_c = base + Cfg::kOffDqStage + c * Cfg::kDqStageBytes;
          const int dq_row0 = row0 + (kBlockM == 128 ? c * 64 : 0), col0 = kBlockM == 128 ? 0 : c * 64;
#pragma unroll
          for (int cb = 0; cb < Cfg::kDqCols / 32; ++cb)
#pragma unroll
            for (int rb = 0; rb < 2; ++rb)
              ptx::tma_reduce_add_2d(&tm_dq, stage_c + (cb * 2 + rb) * Cfg::kDqBoxBytes,
                                     col0 + 32 * cb, dq_row0 + 32 * rb);
        }
        ptx::bulk_commit_group();
        ptx::bulk_wait_group_read0();
#pragma unroll
        for (int c = 0; c < Cfg::kConsumers; ++c) ptx::mbarrier_arrive(dq_free(c));
        ptx::bulk_wait_group0();
        ptx::fence_proxy_async_global();
        int* const volatile& counts = s_turns;
        ptx::red_release_gpu_add(counts + h * static_cast<int>(w.dq_turn_stride) + m,
                                 Cfg::kConsumers);
      }
    }
    return;
  }

  ptx::setmaxnreg_inc<Cfg::kConsumerRegs>();
  constexpr int kWgQueries = Cfg::kWgQueries, kWgCols = Cfg::kWgCols, kDqCols = Cfg::kDqCols;
  const int c = tid / 128 - 1;  // consumer warpgroup
  const int warp = (tid / 32) % 4, lane = tid % 32, g = lane / 4, t = lane % 4;
  // This thread's Sᵀ rows are keys key0 and key0 + 8 of the block; its warpgroup's Sᵀ columns
  // start at query q_off of the step's block, its dK/dV columns at col_off, and its dQ tile is
  // queries 64·dq_m.., columns dq_col0.. (ptx/wgmma.cuh has the accumulator layout).
  const int key0 = (Cfg::kSplitD ? 0 : c * 64) + warp * 16 + g;
  const int q_off = Cfg::kSplitD ? c * kWgQueries : 0;
  const int col_off = Cfg::kSplitD ? c * kWgCols : 0;
  const int dq_m = !Cfg::kSplitD && kBlockM == 128 ? c : 0;
  const int dq_col0 = Cfg::kSplitD ? c * 128 : (kBlockM == 128 ? 0 : c * 64);

  float acc_dk[kWgCols / 2], acc_dv[kWgCols / 2];
#pragma unroll
  for (int i = 0; i < kWgCols / 2; ++i) acc_dk[i] = acc_dv[i] = 0.0f;

  const uint32_t k_rows = sK + (Cfg::kSplitD ? 0 : c * 64 * 128);
  const uint32_t v_rows = sV + (Cfg::kSplitD ? 0 : c * 64 * 128);
  ptx::mbarrier_wait(kv_full, 0);  // also when there are no steps: the epilogue reuses K and V

  const volatile int& step_count = s_step_count;
  // The (query block, head) of a step, as the producer published it.
  auto step_at = [&](int step) -> int2 {
    ptx::mbarrier_wait(at(step % kStages), (step / kStages) & 1);
    const volatile int2& slot = s_step_at[step % kStages];
    return make_int2(slot.x, slot.y);
  };
  // LSE and D of a step: consumer thread ct (0–255) copies row ct % 128 of the step's query block,
  // of LSE if ct < 128 and of D otherwise (where the row is inside the block), fetched one step
  // ahead and published after the step's named barrier, which proves every consumer done with the
  // buffer's previous step. Each consumer thread arrives on the step's `full` barrier after its
  // copy.
  const int ct = tid - 128, copy_row = ct % 128;
  const bool copy_lse = ct < 128;
  auto fetch = [&](int step) -> float {
    const int2 mh = step_at(step);
    const int h = mh.y, i = mh.x * kBlockM + copy_row;
    if (copy_row >= kBlockM || i >= len_q) return copy_lse ? -INFINITY : 0.0f;
    return copy_lse ? p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + seq.q_row0 + i]
                    : w.dsum[int64_t{h} * p.total_q + ws_row0 + i];
  };
  auto publish = [&](int step, float v) {
    if (copy_row < kBlockM) {
      if (copy_lse)
        s_lse[step % kStages][copy_row] = v == -INFINITY ? INFINITY : v * kLog2e;
      else
        s_dsum[step % kStages][copy_row] = v;
    }
    ptx::mbarrier_arrive(full(step % kStages));
  };
  if (step_count > 0) publish(0, fetch(0));

  for (int it = 0; it < step_count; ++it) {
    const int stage = it % kStages;
    const uint32_t parity = (it / kStages) & 1;
    const bool more = it + 1 < step_count;
    const float next_copy = more ? fetch(it + 1) : 0.0f;
    const int2 mh = step_at(it);
    const int h = mh.y, i0 = mh.x * kBlockM;
    const uint32_t q_tile = sQ + stage * Cfg::kQBytes, do_tile = sDo + stage * Cfg::kQBytes;

    // Sᵀ = K·Q_iᵀ and dPᵀ = V·dO_iᵀ (64 keys × kWgQueries queries per warpgroup).
    float s[kWgQueries / 2], dp[kWgQueries / 2];
    ptx::mbarrier_wait(full(stage), parity);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const uint32_t off = (kk % 4) * 32u;
      ptx::wgmma_ss<kWgQueries, Element>(
          s, ptx::wgmma_desc_k_major(k_rows + (kk / 4) * Cfg::kKVPanelBytes + off),
          ptx::wgmma_desc_k_major(q_tile + q_off * 128 + (kk / 4) * Cfg::kQPanelBytes + off),
          kk > 0 ? 1 : 0);
    }
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const uint32_t off = (kk % 4) * 32u;
      ptx::wgmma_ss<kWgQueries, Element>(
          dp, ptx::wgmma_desc_k_major(v_rows + (kk / 4) * Cfg::kKVPanelBytes + off),
          ptx::wgmma_desc_k_major(do_tile + q_off * 128 + (kk / 4) * Cfg::kQPanelBytes + off),
          kk > 0 ? 1 : 0);
    }
    ptx::wgmma_commit();
    ptx::wgmma_wait<0>();
    ptx::fence_operands(s);
    ptx::fence_operands(dp);

    // Pᵀ and dSᵀ. Element 4j + e: key row key0 + 8·(e / 2), query column q_off + 8j + 2t + e % 2.
    // Boundary steps (some row of the query block does not see every key of the block) mask
    // with ElementMask (visible_keys per element).
    const bool boundary = !tile_sees_all(i0, min(i0 + kBlockM, len_q), n0, n0 + kBlockN, len_q,
                                         len_k, p.window_left, p.window_right);
    // Element 4j + e: key key0 + 8·(e / 2), query i0 + q_off + 2t + 8j + e % 2.
    const ElementMask mask(n0, key0, i0 + q_off + 2 * t, len_q, len_k, p.window_left,
                           p.window_right);
    const float* lse2 = s_lse[stage] + q_off;
    const float* dsum = s_dsum[stage] + q_off;
    // Score modifiers (ScoreMods, core/score_mod.h) on the raw scores, as the forward forms them,
    // with the head's ALiBi slope; rel0 is ElementMask::rel of element 0, the rest a compile-time
    // offset from it.
    constexpr bool kModified = kScoreMods || kDropout;
    const ScoreMods mods(p, kModified ? alibi_slope(p, b, h) : 0.0f);
    const float rel0 = static_cast<float>(mask.rel(0, 0));
    // Dropout (core/philox.h: the mask every backend draws) of element 4j + e: key n0 + key0 +
    // 8·(e / 2), query i0 + q_off + 2t + 8j + e % 2; P̃ᵀ = Pᵀ·z goes to dV and
    // dSᵀ = Pᵀ∘(z·dPᵀ − D), with z = 1/(1 − p) where the element is kept, else 0.
    const uint32_t bh = static_cast<uint32_t>(b * p.heads_q + h);  // read by kDropout only
    // Rounded as they are formed (the fp32 values die block by block, which keeps d 64's 128
    // registers of Sᵀ and dPᵀ from meeting 64 of packed fragments). pa and da are the A fragments
    // of dV and dK (k slice kk = n8 blocks 2kk, 2kk + 1; register 2·(j % 2) + half holds rows
    // key0 + 8·half, columns 8j + 2t..); dSᵀ (and at d 256 Pᵀ) also goes to shared memory as
    // keys × queries in 64-query panels, 128-byte swizzle.
    uint32_t pa[kWgQueries / 16][4], da[kWgQueries / 16][4];
    const uint32_t ds_buf = Cfg::kOffDs + (it & 1) * Cfg::kDsBytes;
    const uint32_t p_buf = Cfg::kOffP + (it & 1) * Cfg::kDsBytes;
#pragma unroll
    for (int j = 0; j < kWgQueries / 8; ++j) {
      const float2 l2 = *reinterpret_cast<const float2*>(lse2 + 8 * j + 2 * t);
      const float2 dd = *reinterpret_cast<const float2*>(dsum + 8 * j + 2 * t);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[4 * j + e];
        float dcap = 1.0f;  // the softcap's chain-rule factor 1 − tanh²: dTᵀ = dSᵀ·dcap
        if constexpr (kModified) {
          if (mods.capped) {
            const float th = mods.tanh_of(x);
            x = mods.cap_out * th;
            dcap = 1.0f - th * th;
          }
          if (mods.alibi) x = mods.bias(x, rel0 + static_cast<float>(8 * (e / 2) - 8 * j - e % 2));
        }
        float pr = ptx::exp2_approx(fmaf(x, p.scale_log2, -(e % 2 ? l2.y : l2.x)));
        if (boundary) {
          if (mask.masked(8 * (e / 2), 8 * j + (e % 2))) pr = 0.0f;
        }
        float dpz = dp[4 * j + e];
        s[4 * j + e] = pr;
        // A branch per draw, though the kernel runs with dropout only: ptxas then draws one
        // element's Philox at a time; with the draws free to interleave it spilled 176 bytes at
        // d 64 and 260 at d 128.
        if (kDropout && p.dropout_p > 0.0f) {
          const float z =
              dropout_keep(p.seed, p.offset, bh,
                           static_cast<uint32_t>(i0 + q_off + 2 * t + 8 * j + e % 2),
                           static_cast<uint32_t>(n0 + key0 + 8 * (e / 2)), p.dropout_p)
                  ? p.dropout_scale
                  : 0.0f;
          s[4 * j + e] = pr * z;
          dpz *= z;
        }
        dp[4 * j + e] = pr * (dpz - (e % 2 ? dd.y : dd.x));
        if constexpr (kModified) dp[4 * j + e] *= dcap;
      }
      const int chunk = q_off / 8 + j;  // 16-byte chunk of the query columns
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const uint32_t p2 = ptx::pack2<Element>(s[4 * j + 2 * half], s[4 * j + 2 * half + 1]);
        const uint32_t ds = ptx::pack2<Element>(dp[4 * j + 2 * half], dp[4 * j + 2 * half + 1]);
        pa[j / 2][2 * (j % 2) + half] = p2;
        da[j / 2][2 * (j % 2) + half] = ds;
        const int row = key0 + 8 * half;
        const uint32_t off = swizzled(row, chunk, Cfg::kDsPanelBytes) + 4 * t;
        *reinterpret_cast<uint32_t*>(smem + ds_buf + off) = ds;
        if constexpr (Cfg::kSplitD) *reinterpret_cast<uint32_t*>(smem + p_buf + off) = p2;
      }
    }
    ptx::fence_proxy_async_shared();

    float dq[kDqCols / 2];
    ptx::fence_operands(acc_dv);
    ptx::fence_operands(acc_dk);
    if constexpr (!Cfg::kSplitD) {
      // dV += Pᵀ·dO_i, dK += dSᵀ·Q_i from registers; dQ below once both warpgroups' dSᵀ are in.
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockM / 16; ++kk)
        ptx::wgmma_rs<kHeadDim, Element>(
            acc_dv, pa[kk],
            ptx::wgmma_desc_mn_major(do_tile + kk * kSlice16Bytes, Cfg::kQPanelBytes), 1);
#pragma unroll
      for (int kk = 0; kk < kBlockM / 16; ++kk)
        ptx::wgmma_rs<kHeadDim, Element>(
            acc_dk, da[kk],
            ptx::wgmma_desc_mn_major(q_tile + kk * kSlice16Bytes, Cfg::kQPanelBytes), 1);
      ptx::wgmma_commit();
      ptx::named_barrier_sync(kBothConsumersStep, 128 * Cfg::kConsumers);
      if (more) publish(it + 1, next_copy);
      ptx::wgmma_fence();  // dq was read by the previous step's staging
    } else {
      // Every operand from shared memory once both warpgroups' Pᵀ and dSᵀ are in: dV += Pᵀ·dO_i
      // and dK += dSᵀ·Q_i for this warpgroup's 128 columns (and dQ below).
      (void)pa;
      (void)da;
      ptx::named_barrier_sync(kBothConsumersStep, 128 * Cfg::kConsumers);
      if (more) publish(it + 1, next_copy);
      ptx::wgmma_fence();
      const uint32_t col_panel = col_off / 64;
#pragma unroll
      for (int kk = 0; kk < kBlockM / 16; ++kk)
        ptx::wgmma_ss_bmn<kWgCols, Element>(
            acc_dv, ptx::wgmma_desc_k_major(base + p_buf + kk * 32u),
            ptx::wgmma_desc_mn_major(do_tile + col_panel * Cfg::kQPanelBytes + kk * kSlice16Bytes,
                                     Cfg::kQPanelBytes),
            1);
#pragma unroll
      for (int kk = 0; kk < kBlockM / 16; ++kk)
        ptx::wgmma_ss_bmn<kWgCols, Element>(
            acc_dk, ptx::wgmma_desc_k_major(base + ds_buf + kk * 32u),
            ptx::wgmma_desc_mn_major(q_tile + col_panel * Cfg::kQPanelBytes + kk * kSlice16Bytes,
                                     Cfg::kQPanelBytes),
            1);
    }
    // dQ tile = dS·K over the block's keys (dSᵀ's rows and K's rows are the reduction dimension).
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk)
      ptx::wgmma_ss_mn<kDqCols, Element>(
          dq,
          ptx::wgmma_desc_mn_major(base + ds_buf + dq_m * Cfg::kDsPanelBytes + kk * kSlice16Bytes,
                                   Cfg::kDsPanelBytes),
          ptx::wgmma_desc_mn_major(sK + (dq_col0 / 64) * Cfg::kKVPanelBytes + kk * kSlice16Bytes,
                                   Cfg::kKVPanelBytes),
          kk > 0 ? 1 : 0);
    ptx::wgmma_commit();
    ptx::wgmma_wait<0>();
    ptx::fence_operands(acc_dv);
    ptx::fence_operands(acc_dk);
    ptx::fence_operands(dq);
    // dQ (64 rows × kDqCols columns per warpgroup) goes out through the copy engine: staged as
    // fp32 in 32 × 32 boxes in the 128-byte swizzle, then added into the accumulator by TMA
    // reductions, which keeps the step out of the global-memory queue that one red.global per
    // pair filled (d 256: +4.5% on every cell). Rows of a box past the sequence end hold exact
    // zeros (their P is 0), so adding them into the next rows of the accumulator changes nothing.
    // d <= 128: the warpgroup's own staging buffer. Q_i and dO_i are released at once; the
    // copy engine reads the staging while the next step runs, and only the next staging waits
    // for that read. d 256: the four 64-column panels of this step's Q and dO that only this
    // warpgroup read (2c, 2c + 1; the Sᵀ and dPᵀ products that read every panel are done on both
    // warpgroups), so the read is waited for before the buffer is released.
    auto box = [&](int cb, int rb) -> uint32_t {
      if constexpr (Cfg::kSplitD)
        return (cb < 2 ? q_tile : do_tile) + (2 * c + cb % 2) * Cfg::kQPanelBytes +
               rb * Cfg::kDqBoxBytes;
      else
        return base + Cfg::kOffDqStage + c * Cfg::kDqStageBytes + (cb * 2 + rb) * Cfg::kDqBoxBytes;
    };
    if constexpr (kReducer) {
      ptx::mbarrier_arrive(empty(stage));  // Q_i, dO_i, LSE and D of this buffer are read
      if (it > 0) ptx::mbarrier_wait(dq_free(c), (it - 1) & 1);  // the previous dQ has left
    } else if constexpr (!Cfg::kSplitD) {
      ptx::mbarrier_arrive(empty(stage));  // Q_i, dO_i, LSE and D of this buffer are read
      if (tid % 128 == 0) ptx::bulk_wait_group_read0();  // the previous step's dQ has left
      ptx::named_barrier_sync(kOwnDqStage + c, 128);
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = warp * 16 + g + 8 * half, rr = r % 32;
#pragma unroll
      for (int j = 0; j < kDqCols / 8; ++j) {
        // swizzled(rr, chunk, ·) within one box (chunk < 8), written out: through the helper,
        // ptxas schedules the d 256 kernel differently.
        const int chunk = 2 * (j % 4) + t / 2;
        const uint32_t off =
            box(j / 4, r / 32) - base + rr * 128 + ((chunk ^ (rr % 8)) * 16) + 8 * (t % 2);
        *reinterpret_cast<float2*>(smem + off) =
            make_float2(dq[4 * j + 2 * half], dq[4 * j + 2 * half + 1]);
      }
    }
    ptx::fence_proxy_async_shared();
    ptx::named_barrier_sync(kOwnDqStage + c, 128);
    if constexpr (kReducer) {
      if (tid % 128 == 0) ptx::mbarrier_arrive(dq_staged(c));
    } else if (tid % 128 == 0) {
      int row0 = static_cast<int>(int64_t{h} * p.total_q + ws_row0 + i0 + dq_m * 64);
      if constexpr (kTurns) {
        // The slice's rows; the turn, waited for with the step's `full`, then this reduction.
        row0 += *static_cast<const volatile int*>(&s_slice_row0);
        ptx::fence_proxy_async_global();
      }
#pragma unroll
      for (int cb = 0; cb < kDqCols / 32; ++cb)
#pragma unroll
        for (int rb = 0; rb < 2; ++rb)
          ptx::tma_reduce_add_2d(&tm_dq, box(cb, rb), dq_col0 + 32 * cb, row0 + 32 * rb);
      ptx::bulk_commit_group();
      if constexpr (kTurns) {  // the adds done and visible, then the next key block's turn
        ptx::bulk_wait_group0();
        ptx::fence_proxy_async_global();
        int* const volatile& counts = s_turns;
        ptx::red_release_gpu_add(counts + h * w.dq_turn_stride + i0 / kBlockM, 1);
      }
      if constexpr (Cfg::kSplitD) ptx::bulk_wait_group_read0();
    }
    if constexpr (Cfg::kSplitD) {
      ptx::named_barrier_sync(kOwnDqStage + c, 128);
      ptx::mbarrier_arrive(empty(stage));  // Q_i, dO_i, LSE and D of this buffer are read
    }
  }
  // The last reductions read their staging before the CTA's shared memory goes (the reducer
  // waits for its own).
  if (!kReducer && tid % 128 == 0) ptx::bulk_wait_group_read0();

  // Epilogue: dK (× scale) and dV rounded into this warpgroup's own part of the K and V tiles (the
  // other warpgroup may still be reading K for its last dQ tile: meet first), then 16-byte stores.
  // A thread whose dK or dV came out ±Inf/NaN (a masked pair's P = 0 or dS = 0 times an infinite
  // dO or dP is NaN in the MMA) sets a flag; the backward's fixup kernel then recomputes the
  // non-finite rows exactly (nonfinite_fixup.cuh).
  ptx::named_barrier_sync(kBothConsumersDone, 128 * Cfg::kConsumers);
  float probe = 0.0f;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = key0 + 8 * half;
#pragma unroll
    for (int j = 0; j < kWgCols / 8; ++j) {
      const int chunk = col_off / 8 + j;
      const uint32_t off = swizzled(row, chunk, Cfg::kKVPanelBytes) + 4 * t;
      *reinterpret_cast<uint32_t*>(smem + off) = ptx::pack2<Element>(
          acc_dk[4 * j + 2 * half] * p.scale, acc_dk[4 * j + 2 * half + 1] * p.scale);
      *reinterpret_cast<uint32_t*>(smem + Cfg::kOffV + off) =
          ptx::pack2<Element>(acc_dv[4 * j + 2 * half], acc_dv[4 * j + 2 * half + 1]);
      probe = nonfinite_probe(nonfinite_probe(probe, acc_dk[4 * j + 2 * half]),
                              acc_dk[4 * j + 2 * half + 1]);
      probe = nonfinite_probe(nonfinite_probe(probe, acc_dv[4 * j + 2 * half]),
                              acc_dv[4 * j + 2 * half + 1]);
    }
  }
  if (probe_found(probe)) w.nonfinite[sm80::kNonfiniteDkDv] = 1;
  __syncwarp();
  Element* gdk = static_cast<Element*>(p.dk) + b * p.dk_batch_stride +
                 (seq.k_row0 + n0) * p.dk_row_stride + hk * p.dk_head_stride;
  Element* gdv = static_cast<Element*>(p.dv) + b * p.dv_batch_stride +
                 (seq.k_row0 + n0) * p.dv_row_stride + hk * p.dv_head_stride;
  constexpr int kChunks = kWgCols / 8;
  const int warp_row0 = key0 - g;
#pragma unroll
  for (int idx = lane; idx < 16 * kChunks; idx += 32) {  // dK and dV chunks interleaved
    const int r = warp_row0 + idx / kChunks, cc = col_off / 8 + idx % kChunks;
    if (r < rows_k && cc * 8 < p.head_dim) {
      const uint32_t off = swizzled(r, cc, Cfg::kKVPanelBytes);
      *reinterpret_cast<uint4*>(gdk + r * p.dk_row_stride + cc * 8) =
          *reinterpret_cast<const uint4*>(smem + off);
      *reinterpret_cast<uint4*>(gdv + r * p.dv_row_stride + cc * 8) =
          *reinterpret_cast<const uint4*>(smem + Cfg::kOffV + off);
    }
  }
#else
  (void)p;
  (void)w;
  (void)tm_q;
  (void)tm_k;
  (void)tm_v;
  (void)tm_do;
  (void)tm_dq;
#endif
}

template <DType kDType, int kHeadDim>
Status launch_backward_main(const AttentionParams& p, const sm80::BwdWorkspace& w,
                            cudaStream_t stream) {
  using Cfg = Bwd90Config<kDType, kHeadDim>;
  const int64_t n_blocks = (int64_t{p.seqlen_k} + Cfg::kBlockN - 1) / Cfg::kBlockN;
  if (n_blocks == 0 || p.batch == 0) return {};
  CUtensorMap tm_q, tm_k, tm_v, tm_do, tm_dq;
  const TmaRows rows = tma_rows(p);  // packed batches: every sequence's rows, one batch
  const int rows_q = static_cast<int>(rows.q), rows_k = static_cast<int>(rows.k);
  const int batch = static_cast<int>(rows.batch);
  Status st = encode_map(&tm_q, kDType, p.q, p.head_dim, rows_q, p.heads_q, batch, p.q_row_stride,
                         p.q_head_stride, p.q_batch_stride, Cfg::kBlockM, "q");
  if (st.ok())
    st = encode_map(&tm_do, kDType, p.dout, p.head_dim, rows_q, p.heads_q, batch, p.do_row_stride,
                    p.do_head_stride, p.do_batch_stride, Cfg::kBlockM, "dout");
  if (st.ok())
    st = encode_map(&tm_k, kDType, p.k, p.head_dim, rows_k, p.heads_kv, batch, p.k_row_stride,
                    p.k_head_stride, p.k_batch_stride, Cfg::kBlockN, "k");
  if (st.ok())
    st = encode_map(&tm_v, kDType, p.v, p.head_dim, rows_k, p.heads_kv, batch, p.v_row_stride,
                    p.v_head_stride, p.v_batch_stride, Cfg::kBlockN, "v");
  if (st.ok())
    st = encode_accum_map(&tm_dq, w.dq_accum, w.bucket,
                          int64_t{w.num_splits} * p.heads_q * p.total_q);  // every dQ slice
  if (!st.ok()) return st;
  const dim3 grid(static_cast<unsigned>(n_blocks), static_cast<unsigned>(p.heads_kv),
                  static_cast<unsigned>(p.batch));
  // Deterministic mode has kernels of its own (the turns), one for plain problems and one for
  // the rest (score modifiers and dropout as runtime choices).
  const bool modified = p.dropout_p > 0.0f || p.has_score_mods();
  const auto kernel =
      w.dq_turns != nullptr
          ? (modified ? attention_backward_sm90_kernel<kDType, kHeadDim, true, true, true>
                      : attention_backward_sm90_kernel<kDType, kHeadDim, false, false, true>)
      : p.dropout_p > 0.0f ? attention_backward_sm90_kernel<kDType, kHeadDim, true, true, false>
      : p.has_score_mods() ? attention_backward_sm90_kernel<kDType, kHeadDim, true, false, false>
                           : attention_backward_sm90_kernel<kDType, kHeadDim, false, false, false>;
  return launch(kernel, "backward", kHeadDim, grid, Cfg::kThreads, Cfg::kSmemBytes, stream, p, w,
                tm_q, tm_k, tm_v, tm_do, tm_dq);
}

}  // namespace flare::cuda::sm90
