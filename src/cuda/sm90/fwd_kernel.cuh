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
//       score modifiers and mask (on boundary steps), online softmax on S in registers (the
//       accumulator layout is mma.sync's, so the row max and sum are quad shuffles as in sm80)
//       O += P·V_j   wgmma m64n{d}k16, P from registers (the accumulator rounded in place), V from
//       shared memory (MN-major)
//     with no CTA-wide barrier: warpgroups drift apart, so one's softmax runs beside another's
//     products.
// Two kernels run these steps, through the same functions (load_steps on the producer's side,
// attend_steps and write_tile on the consumers'): attention_forward_sm90_kernel runs one CTA per
// query tile. The persistent attention_forward_sm90_persistent_kernel runs one CTA per SM, each
// walking tiles (ForwardTiles) one after another, so that a tile's start (its Q load, its first
// K/V loads) overlaps the previous tile's last steps and epilogue instead of waiting for a CTA to
// retire and the next to start; the K/V ring runs on across tiles and Q has two buffers. It runs
// where that was measured faster (fwd90_row, fwd_tiles.h): short sequences, where a tile
// has few steps to hide its start behind.
// Shared memory holds every tile in the 128-byte swizzle TMA writes and wgmma reads (panels of 64
// columns, see ptx/wgmma.cuh). Rows past a sequence end and columns past head_dim are zero-filled
// by TMA, or in a packed batch (one map over every sequence's rows) are the next sequence's rows;
// the mask keeps those keys out of the softmax, and the rows past the last query are not written.
// A hidden key's ±Inf/NaN V still reaches P·V with P = 0: the fixup kernel recomputes such rows
// (fwd_fixup.h). The products run at the bucket's width
// (fwd_tiles.h): at d 80 and 96, S = Q·Kᵀ reads the last panel's first 16 or 32 columns and
// P·V is m64n80 or m64n96 (V's second panel partly read).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
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
#include "cuda/block_walk.cuh"
#include "cuda/nonfinite_fixup.cuh"
#include "cuda/online_softmax.cuh"
#include "cuda/ptx/fast_math.cuh"
#include "cuda/ptx/ldmatrix.cuh"
#include "cuda/ptx/mma.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/ptx/wgmma.cuh"
#include "cuda/sm90/common.cuh"
#include "cuda/sm90/fwd_launch.h"
#include "cuda/sm90/fwd_tiles.h"
#include "cuda/sm90/tensor_map.h"
#include "cuda/sm90/tile_counter.h"

namespace flare::cuda::sm90 {

template <DType kDType, int kBucket, bool kPersistent>
struct Fwd90Config {
  using Element = ElementOf<kDType>;
  static constexpr int kHeadDim = kBucket;
  static constexpr Fwd90Tile kTile = fwd90_tile(kHeadDim, kPersistent);
  static_assert(kTile.head_dim == kHeadDim, "head-dim bucket missing from kFwd90Tiles");
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kConsumers = kTile.consumers;
  static constexpr int kStages = kTile.stages;
  static constexpr bool kBlockSparse = fwd90_takes_block_mask(kTile);  // fwd_tiles.h
  static constexpr bool kOverlapSteps = kTile.overlap_steps;
  // Each consumer warpgroup runs only the steps its own rows need (warpgroup_steps): where a
  // step is narrower than the tile, so that under a causal mask the warpgroups' last steps
  // differ. With 128-row tiles of 128-key steps they never do (only a ragged last tile would
  // gain), and there the range code measured slower (sm90/notes.md, "Each consumer warpgroup
  // runs its own key steps").
  static constexpr bool kWarpgroupSteps = kBlockM > kBlockN;
  static constexpr int kThreads = 128 * (kConsumers + 1);
  // 64-column panels of a tile; at d 80 and 96 the last is partly used (TMA zero-fills it).
  static constexpr int kPanels = (kHeadDim + 63) / 64;
  static constexpr uint32_t kQPanelBytes = kBlockM * 128;
  static constexpr uint32_t kQBytes = kPanels * kQPanelBytes;
  static constexpr uint32_t kKVPanelBytes = kBlockN * 128;
  static constexpr uint32_t kKVBytes = kPanels * kKVPanelBytes;  // one K or V tile
  // Q buffers: the persistent kernel keeps two where they fit beside the K/V rings (the next
  // tile's Q lands while this tile runs), else one (the next Q waits for this tile's epilogue; its
  // K/V do not).
  static constexpr uint32_t kRingBytes = 2 * kStages * kKVBytes;
  static constexpr int kQBuffers =
      kPersistent && 2 * kQBytes + kRingBytes + 2048 <= kSmemOptinBytes ? 2 : 1;
  // Dynamic shared memory: the Q buffers, the K ring, the V ring, and 1 KiB to align the start
  // to 1024 bytes.
  static constexpr int kSmemBytes = static_cast<int>(kQBuffers * kQBytes + kRingBytes) + 1024;
  // Registers per thread after setmaxnreg (within launch_regs: common.cuh). The persistent
  // producer's tile walk needs more than the 24 that suffice for one tile.
  static constexpr int kProducerRegs = !kPersistent ? 24 : kConsumers == 2 ? 40 : 32;
  static constexpr int kConsumerRegs = kConsumers == 2 ? (kPersistent ? 232 : 240) : 160;
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumers <=
                    launch_regs(kThreads) * kThreads,
                "setmaxnreg split exceeds the CTA's registers");
  static_assert(kHeadDim % 16 == 0 && kBlockN % 16 == 0 && kBlockM == 64 * kConsumers,
                "tile shape");
};

// One query tile's work: its rows and the key tiles they see.
struct TileWork {
  int b, h, m0, rows_q;
  int n_begin, n_end;     // key tiles [n_begin, n_end)
  int last_lo, first_hi;  // keys every row of the tile sees: a step inside needs no mask
  int len_q, len_k;       // the sequence's lengths
  // Where the sequence lies in the tensor maps: its first query and key rows and its batch
  // coordinate (packed batches: cu_seqlens rows of one batch; else rows 0 of batch b).
  int q_row0, k_row0, tma_b;
};

// A query tile: rows m0.. of head h of sequence b (b < 0: none).
struct TilePlace {
  int b, h, m0;
};

// The work of the query tile at rows m0.. of head h of sequence b, whose lengths and rows `seq`
// gives (packed: in the one batch of every sequence's rows).
template <int kBlockM, int kBlockN>
__device__ __forceinline__ TileWork tile_work(const AttentionParams& p, int b, int h, int m0,
                                              const SequenceInfo& seq, bool packed) {
  TileWork w;
  w.b = b;
  w.h = h;
  w.m0 = m0;
  w.len_q = seq.len_q;
  w.len_k = seq.len_k;
  w.q_row0 = static_cast<int>(seq.q_row0);
  w.k_row0 = static_cast<int>(seq.k_row0);
  w.tma_b = packed ? 0 : b;
  w.rows_q = min(kBlockM, seq.len_q - m0);
  const int len_q = seq.len_q, len_k = seq.len_k;
  const KeyRange first = visible_keys(m0, len_q, len_k, p.window_left, p.window_right);
  const KeyRange last =
      visible_keys(m0 + w.rows_q - 1, len_q, len_k, p.window_left, p.window_right);
  w.n_begin = first.lo / kBlockN;
  w.n_end = last.hi > first.lo ? (last.hi + kBlockN - 1) / kBlockN : w.n_begin;
  w.last_lo = last.lo;
  w.first_hi = first.hi;
  return w;
}

// The query tiles of one call, numbered in the order a grid of one CTA per tile would start them:
// tile t is (b, h, x), x fastest, so the tiles at work at one time share a few heads' K/V in L2,
// and x counts query blocks from the last, so under a causal mask a head's heaviest tile goes
// first. CTA c starts with tile c; then the producer draws the next from a counter
// (fwd90_tile_count of fwd_tiles.h tiles in all), so a CTA that drew heavy tiles draws fewer.
// Handed out by a fixed rule instead (a snake over rounds of G tiles, or pairs of a heavy and a
// light tile), the tiles left some CTAs running long after the rest: up to 1.7x slower on an
// H200 (causal, s 16k, d 256).
// Packed batches number only the tiles that hold rows: sequence b has ceil(len_b / kBlockM) per
// head, numbered as above after those of sequences 0..b-1, so a call of mixed lengths draws no
// empty tile; `count` is the host's bound (fwd90_tile_count), and a draw past the last real tile
// finds none.
template <int kBlockM, int kBlockN>
struct ForwardTiles {
  int m_blocks, count;

  __device__ explicit ForwardTiles(const AttentionParams& p)
      : m_blocks((p.seqlen_q + kBlockM - 1) / kBlockM),
        count(static_cast<int>(fwd90_tile_count(p, kBlockM))) {}

  // Where tile `tile` (< count) lies; kPacked: p.is_varlen(). Packed batches: a walk over
  // cu_seqlens_q by the 32 lanes of a warp, 32 sequences at a time (every lane calls it with the
  // same tile).
  template <bool kPacked>
  __device__ TilePlace place(const AttentionParams& p, int tile, int lane) const {
    if constexpr (!kPacked) {
      const int x = tile % m_blocks, bh = tile / m_blocks;
      return {bh / p.heads_q, bh % p.heads_q, (m_blocks - 1 - x) * kBlockM};
    }
    int before = 0;  // tiles of the sequences already passed
    for (int b0 = 0; b0 < p.batch; b0 += 32) {
      const int b = b0 + lane;
      const int blocks =
          b < p.batch ? (p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b] + kBlockM - 1) / kBlockM : 0;
      int upto = blocks * p.heads_q;  // the tiles of sequences b0..b: an inclusive scan
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int x = __shfl_up_sync(0xffffffffu, upto, d);
        if (lane >= d) upto += x;
      }
      const unsigned holds = __ballot_sync(0xffffffffu, tile < before + upto);
      if (holds != 0) {
        const int src = __ffs(holds) - 1;
        const int m_blocks_b = __shfl_sync(0xffffffffu, blocks, src);
        const int local = tile - before - __shfl_sync(0xffffffffu, upto - blocks * p.heads_q, src);
        return {b0 + src, local / m_blocks_b, (m_blocks_b - 1 - local % m_blocks_b) * kBlockM};
      }
      before += __shfl_sync(0xffffffffu, upto, 31);
    }
    return {-1, 0, 0};
  }

  template <bool kPacked>
  __device__ TileWork work(const AttentionParams& p, const TilePlace& at) const {
    if constexpr (!kPacked)
      return tile_work<kBlockM, kBlockN>(p, at.b, at.h, at.m0,
                                         SequenceInfo{0, 0, p.seqlen_q, p.seqlen_k}, false);
    else
      return tile_work<kBlockM, kBlockN>(p, at.b, at.h, at.m0, sequence_info(p, at.b), true);
  }
};

// The consumer warpgroup (0..) of thread tid. Where warpgroups run step ranges of their own, the
// index comes through a shuffle, which tells ptxas it is warp-uniform: computed from threadIdx
// alone, the ranges' ring steps and the wgmma descriptors built from them left the uniform
// datapath (R2UR on every step; sm90/notes.md, "Each consumer warpgroup runs its own key
// steps"). Elsewhere it stays as it was, and so does the machine code.
template <class Cfg>
__device__ __forceinline__ int consumer_warpgroup(int tid) {
  if constexpr (Cfg::kWarpgroupSteps) return __shfl_sync(0xffffffffu, tid / 128 - 1, 0);
  return tid / 128 - 1;
}

// The part of a tile's steps [0, steps) that consumer warpgroup c's 64 rows need: steps
// [lo, hi), and the keys all of its rows see (a step inside needs no mask). A warpgroup passes
// the tile's other steps without a product: under a causal mask a 192-row tile's first
// warpgroup needs up to two steps fewer than its last, and a tile's last rows may not reach
// every warpgroup (a 64-row remainder leaves two of three without rows). The warpgroups share
// the SM's tensor cores and MUFU, so the work one skips goes to the others. Block-sparse tiles
// run every step on every warpgroup (their steps are the mask's, not a range).
struct WarpgroupSteps {
  int lo, hi;
  int last_lo, first_hi;
};

template <class Cfg>
__device__ __forceinline__ WarpgroupSteps warpgroup_steps(const AttentionParams& p,
                                                          const TileWork& w, int c, int steps,
                                                          bool sparse) {
  constexpr int kBlockN = Cfg::kBlockN;
  if (!Cfg::kWarpgroupSteps || sparse) return {0, steps, w.last_lo, w.first_hi};
  const int rows = min(64, w.rows_q - 64 * c);
  if (rows <= 0) return {0, 0, w.last_lo, w.first_hi};
  const int i0 = w.m0 + 64 * c;
  const KeyRange first = visible_keys(i0, w.len_q, w.len_k, p.window_left, p.window_right);
  const KeyRange last =
      visible_keys(i0 + rows - 1, w.len_q, w.len_k, p.window_left, p.window_right);
  if (last.hi <= first.lo) return {0, 0, last.lo, first.hi};  // no row sees a key
  const int lo = max(first.lo / kBlockN - w.n_begin, 0);
  const int hi = min((last.hi + kBlockN - 1) / kBlockN - w.n_begin, steps);
  return {lo, max(hi, lo), last.lo, first.hi};
}

// ---- the steps both kernels run ---------------------------------------------------------------

// The K/V ring in shared memory: kStages buffers of K and of V (k, v: the first of each), each
// announced on a `full` barrier by the producer's one arrival (with the bytes its copy brings) and
// released on an `empty` barrier once every consumer thread has arrived: V's when P_j·V_j is
// done; K's on a barrier of its own when S_j is where the steps overlap (K_{j+1} is wanted before
// P_j·V_j), else with V's (one arrival per step: split, d 64 ran 1% slower on an H200). `bars` is
// the first of the ring's kBarriers barriers. Ring step r (the r-th key step the CTA runs, over
// all its tiles) uses stage r % kStages.
template <class Cfg>
struct KvRing {
  static constexpr int kStages = Cfg::kStages, kBarriers = 4 * kStages;
  uint32_t k, v, bars;

  __device__ uint32_t k_tile(int stage) const { return k + stage * Cfg::kKVBytes; }
  __device__ uint32_t v_tile(int stage) const { return v + stage * Cfg::kKVBytes; }
  __device__ uint32_t k_full(int stage) const { return bars + 8u * stage; }
  __device__ uint32_t v_full(int stage) const { return bars + 8u * (kStages + stage); }
  __device__ uint32_t k_empty(int stage) const {
    return Cfg::kOverlapSteps ? bars + 8u * (2 * kStages + stage) : v_empty(stage);
  }
  __device__ uint32_t v_empty(int stage) const { return bars + 8u * (3 * kStages + stage); }

  // By one thread before the CTA's first barrier.
  __device__ void init() const {
    for (int s = 0; s < kStages; ++s) {
      ptx::mbarrier_init(k_full(s), 1);
      ptx::mbarrier_init(v_full(s), 1);
      if (Cfg::kOverlapSteps) ptx::mbarrier_init(k_empty(s), 128 * Cfg::kConsumers);
      ptx::mbarrier_init(v_empty(s), 128 * Cfg::kConsumers);
    }
  }

  // Producer: K (is_k) or V of key tile n into ring step r's buffer, once it is free. A K load
  // writes n into step_tile[stage] first where there is one (block-sparse: the consumers read the
  // step's key tile there, published by K's barrier). Key rows count from row0 of batch
  // coordinate b in the map.
  __device__ void load(bool is_k, int r, int n, const CUtensorMap* tm, int hk, int row0, int b,
                       int* step_tile) const {
    const int stage = r % kStages, round = r / kStages;
    if (round > 0) ptx::mbarrier_wait(is_k ? k_empty(stage) : v_empty(stage), (round - 1) & 1);
    if (is_k && step_tile != nullptr) step_tile[stage] = n;
    const uint32_t dst = is_k ? k_tile(stage) : v_tile(stage);
    const uint32_t full = is_k ? k_full(stage) : v_full(stage);
    ptx::mbarrier_arrive_expect_tx(full, Cfg::kKVBytes);
#pragma unroll
    for (int pnl = 0; pnl < Cfg::kPanels; ++pnl)
      ptx::tma_load_4d(dst + pnl * Cfg::kKVPanelBytes, tm, full, pnl * 64, row0 + n * Cfg::kBlockN,
                       hk, b);
  }
};

// Producer: a tile's `steps` key steps from ring step r_first on, in the order the consumers use
// them (attend_steps): where the bucket overlaps its steps, K one step ahead of V (K_0, K_1, V_0,
// K_2, V_1, …), else K_j, V_j. Serial steps with K loaded ahead made V_j wait for
// K_{j+1-kStages}'s release, a step later than V's buffer is free: d 64 (two stages) up to 5%
// slower on an H200 (sm90/notes.md). n_first is the first step's key tile and next_on(n) the
// first key tile from n on that the tile runs; before_step(j) runs before step j's loads (the
// persistent kernel's Q load, where it waits).
template <class Cfg, typename NextOn, typename BeforeStep>
__device__ __forceinline__ void load_steps(const KvRing<Cfg>& ring, int r_first, int steps,
                                           int n_first, NextOn next_on, BeforeStep before_step,
                                           const CUtensorMap* tm_k, const CUtensorMap* tm_v, int hk,
                                           int row0, int b, int* step_tile) {
  int n = n_first;
  if constexpr (!Cfg::kOverlapSteps) {
    for (int j = 0; j < steps; ++j) {
      before_step(j);
      ring.load(true, r_first + j, n, tm_k, hk, row0, b, step_tile);
      ring.load(false, r_first + j, n, tm_v, hk, row0, b, step_tile);
      if (j + 1 < steps) n = next_on(n + 1);
    }
    return;
  }
  if (steps > 0) ring.load(true, r_first, n, tm_k, hk, row0, b, step_tile);
  for (int j = 0; j < steps; ++j) {
    before_step(j);
    const int n_next = j + 1 < steps ? next_on(n + 1) : n;
    if (j + 1 < steps) ring.load(true, r_first + j + 1, n_next, tm_k, hk, row0, b, step_tile);
    ring.load(false, r_first + j, n, tm_v, hk, row0, b, step_tile);
    n = n_next;
  }
}

// Consumer: ring steps [r_first + begin, r_first + end) passed without a product (steps outside
// the warpgroup's WarpgroupSteps): each buffer goes back once its load has landed. The wait keeps
// the arrival in its own phase of the empty barrier (a warpgroup passing several steps would
// otherwise count toward a stage's earlier phase) and keeps a buffer from being released while its
// copy is still in flight.
template <class Cfg>
__device__ __forceinline__ void pass_steps(const KvRing<Cfg>& ring, int r_first, int begin,
                                           int end) {
  constexpr int kStages = Cfg::kStages;
  for (int j = begin; j < end; ++j) {
    const int r = r_first + j, stage = r % kStages;
    ptx::mbarrier_wait(ring.k_full(stage), (r / kStages) & 1);
    ptx::mbarrier_wait(ring.v_full(stage), (r / kStages) & 1);
    if constexpr (Cfg::kOverlapSteps) ptx::mbarrier_arrive(ring.k_empty(stage));
    ptx::mbarrier_arrive(ring.v_empty(stage));
  }
}

// Consumer: a warpgroup's 64 query rows (at q_rows) through a tile's `steps` key steps, from
// ring step r_first on, into this thread's acc_o, row_max and row_sum: per step S_j = Q·K_jᵀ, the
// mask, the online softmax and O += P_j·V_j. key_tile(stage, j) names step j's key tile, read
// once K_j has landed; keys in [last_lo, first_hi) are visible to every row of the tile, so a
// step inside needs no mask. `slope` is the head's ALiBi slope (alibi_slope, core/score_mod.h).
// Where the bucket overlaps its steps (Fwd90Tile::overlap_steps), iteration j issues S_j, then
// O += P_{j-1}·V_{j-1}, and runs step j's mask and softmax while the tensor cores work on the
// latter; once that is done, O is rescaled for step j and P_j rounded for the next iteration, so
// the softmax's exponentials do not wait for the products of the same rows. Elsewhere the steps
// run one after another, and the overlap is only between warpgroups.
// kScoreMods: the problem has softcap or ALiBi (a kernel of its own, so that the plain steps keep
// the code they had: with a runtime branch they ran 2% slower, d 64 and 256, H200). kDropout:
// dropout too (kernels of their own, which take the score modifiers as well); `bh` is the
// (sequence, query head) index of the Philox mask (core/philox.h).
template <class Cfg, bool kScoreMods, bool kDropout, typename KeyTile>
__device__ __forceinline__ void attend_steps(float (&acc_o)[Cfg::kHeadDim / 2], float (&row_max)[2],
                                             float (&row_sum)[2], const AttentionParams& p,
                                             const KvRing<Cfg>& ring, int r_first, int steps,
                                             uint32_t q_rows, KeyTile key_tile, int last_lo,
                                             int first_hi, int m0, int len_q, int len_k,
                                             float slope, uint32_t bh, int r0, int t) {
  using Element = typename Cfg::Element;
  constexpr int kHeadDim = Cfg::kHeadDim, kBlockN = Cfg::kBlockN, kStages = Cfg::kStages;
  const ScoreMods mods(p, slope);
  float s[kBlockN / 2];          // S_j, then exp2 of it
  uint32_t pa[kBlockN / 16][4];  // P_j rounded: the A fragments of O += P·V (k slice kk is n8
                                 // blocks 2kk and 2kk + 1)
  // The waits for K_j and V_j come before the wgmma fence that opens the products they feed: a
  // wait (a loop) between the fence and the wgmmas makes ptxas inject warpgroup.arrive (C7519),
  // measured 2-7% slower at d 64.
  // K_j has landed; returns step j's first key.
  auto k_landed = [&](int j) {
    const int r = r_first + j, stage = r % kStages;
    ptx::mbarrier_wait(ring.k_full(stage), (r / kStages) & 1);
    return key_tile(stage, j) * kBlockN;
  };
  auto v_landed = [&](int j) {
    const int r = r_first + j;
    ptx::mbarrier_wait(ring.v_full(r % kStages), (r / kStages) & 1);
  };
  // S_j (64 × kBlockN per warpgroup).
  auto issue_scores = [&](int j) {
    const uint32_t k_tile = ring.k_tile((r_first + j) % kStages);
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const uint32_t k_off = (kk % 4) * 32u;  // k slice within the 128-byte row
      const uint64_t da = ptx::wgmma_desc_k_major(q_rows + (kk / 4) * Cfg::kQPanelBytes + k_off);
      const uint64_t db = ptx::wgmma_desc_k_major(k_tile + (kk / 4) * Cfg::kKVPanelBytes + k_off);
      ptx::wgmma_ss<kBlockN, Element>(s, da, db, kk > 0 ? 1 : 0);
    }
    ptx::wgmma_commit();
  };
  // O += P_j·V_j; V's rows are the reduction dimension (MN-major B).
  auto issue_product = [&](int j) {
    const uint32_t v_tile = ring.v_tile((r_first + j) % kStages);
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const uint64_t db = ptx::wgmma_desc_mn_major(v_tile + kk * kSlice16Bytes, Cfg::kKVPanelBytes);
      ptx::wgmma_rs<kHeadDim, Element>(acc_o, pa[kk], db, 1);
    }
    ptx::wgmma_commit();
  };
  // S_j is done: K_j's buffer goes back; the score modifiers, the mask on boundary steps
  // (ScoreMods, ElementMask: core/score_mod.h) and the online softmax for the thread's two rows,
  // with `correction` the factor O waits for.
  auto softmax = [&](int j, int n0, float (&correction)[2]) {
    ptx::fence_operands(s);
    if constexpr (Cfg::kOverlapSteps) ptx::mbarrier_arrive(ring.k_empty((r_first + j) % kStages));
    const bool boundary = n0 < last_lo || n0 + kBlockN > first_hi;
    if (kScoreMods || boundary) {
      // Element 4jj + i: key n0 + 2t + 8jj + i % 2, row r0 + 8·(i / 2) of the tile.
      const ElementMask mask(n0, 2 * t, m0 + r0, len_q, len_k, p.window_left, p.window_right);
      if constexpr (kScoreMods) {
        // Each modifier a loop of its own (ScoreMods): no branch between the elements.
        if (mods.capped) {
#pragma unroll
          for (int e = 0; e < kBlockN / 2; ++e) s[e] = mods.cap(s[e]);
        }
        if (mods.alibi) {
          const float rel0 = static_cast<float>(mask.rel(0, 0));
#pragma unroll
          for (int jj = 0; jj < kBlockN / 8; ++jj)
#pragma unroll
            for (int i = 0; i < 4; ++i)
              s[4 * jj + i] = mods.bias(s[4 * jj + i],
                                        rel0 + static_cast<float>(jj * 8 + (i & 1) - (i >> 1) * 8));
        }
      }
      if (boundary) {
#pragma unroll
        for (int jj = 0; jj < kBlockN / 8; ++jj)
#pragma unroll
          for (int i = 0; i < 4; ++i)
            if (mask.masked(jj * 8 + (i & 1), (i >> 1) * 8)) s[4 * jj + i] = -INFINITY;
      }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float mx = -INFINITY;
#pragma unroll
      for (int jj = 0; jj < kBlockN / 8; ++jj)
        mx = fmaxf(mx, fmaxf(s[4 * jj + 2 * half], s[4 * jj + 2 * half + 1]));
      const MaxStep step = advance_row_max<false>(row_max[half], quad_row_max(mx) * p.scale_log2);
      const float sub = step.base;
      correction[half] = step.correction;
      float sum = 0.0f;
#pragma unroll
      for (int jj = 0; jj < kBlockN / 8; ++jj)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[4 * jj + 2 * half + e];
          x = ptx::exp2_approx(fmaf(x, p.scale_log2, -sub));
          sum += x;
        }
      row_sum[half] = row_sum[half] * correction[half] + sum;
      if constexpr (kDropout) {
        // Dropout on P for P·V, after the row sum (the 1/(1 − p) comes in write_tile): keys
        // n0 + 2t + 8jj and the next share one Philox draw. A branch per draw, though the kernel
        // runs with dropout only, keeps ptxas from interleaving the draws (as in the backward).
        const auto row = static_cast<uint32_t>(m0 + r0 + 8 * half);
#pragma unroll
        for (int jj = 0; jj < kBlockN / 8; ++jj) {
          if (p.dropout_p > 0.0f) {
            const auto col = static_cast<uint32_t>(n0 + 2 * t + 8 * jj);
            const Philox4 w = dropout_words(p.seed, p.offset, bh, row, col >> 2);
            if (dropout_uniform(philox_word(w, col & 3u)) < p.dropout_p) s[4 * jj + 2 * half] = 0.0f;
            if (dropout_uniform(philox_word(w, (col & 3u) + 1)) < p.dropout_p)
              s[4 * jj + 2 * half + 1] = 0.0f;
          }
        }
      }
    }
  };
  // P_j·V_j is done: V_j's buffer goes back.
  auto product_done = [&](int j) {
    ptx::wgmma_wait<0>();
    ptx::fence_operands(acc_o);
    ptx::mbarrier_arrive(ring.v_empty((r_first + j) % kStages));
  };
  auto rescale_o = [&](const float (&correction)[2]) {
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int jj = 0; jj < kHeadDim / 8; ++jj) {
        acc_o[4 * jj + 2 * half] *= correction[half];
        acc_o[4 * jj + 2 * half + 1] *= correction[half];
      }
  };
  auto round_p = [&] {
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      pa[kk][0] = ptx::pack2<Element>(s[8 * kk + 0], s[8 * kk + 1]);
      pa[kk][1] = ptx::pack2<Element>(s[8 * kk + 2], s[8 * kk + 3]);
      pa[kk][2] = ptx::pack2<Element>(s[8 * kk + 4], s[8 * kk + 5]);
      pa[kk][3] = ptx::pack2<Element>(s[8 * kk + 6], s[8 * kk + 7]);
    }
  };

  if constexpr (Cfg::kOverlapSteps) {
    // The first and last steps are peeled off: with their conditions inside one loop, ptxas
    // serialises every wgmma (C7514).
    if (steps > 0) {  // step 0: nothing to overlap with, and O is still 0
      const int n0 = k_landed(0);
      ptx::wgmma_fence();
      issue_scores(0);
      ptx::wgmma_wait<0>();
      float correction[2];
      softmax(0, n0, correction);
      round_p();
    }
    for (int j = 1; j < steps; ++j) {
      const int n0 = k_landed(j);
      v_landed(j - 1);
      ptx::fence_operands(acc_o);
      ptx::wgmma_fence();
      issue_scores(j);
      issue_product(j - 1);
      ptx::wgmma_wait<1>();  // S_j done; the product may still run
      float correction[2];
      softmax(j, n0, correction);
      product_done(j - 1);
      rescale_o(correction);
      round_p();
    }
    if (steps > 0) {
      v_landed(steps - 1);
      ptx::fence_operands(acc_o);
      ptx::wgmma_fence();
      issue_product(steps - 1);
      product_done(steps - 1);
    }
  } else {
    for (int j = 0; j < steps; ++j) {
      const int n0 = k_landed(j);
      ptx::wgmma_fence();
      issue_scores(j);
      ptx::wgmma_wait<0>();
      float correction[2];
      softmax(j, n0, correction);
      rescale_o(correction);
      round_p();
      v_landed(j);
      ptx::fence_operands(acc_o);
      ptx::wgmma_fence();
      issue_product(j);
      product_done(j);
    }
  }
}

// Consumer, after a tile's last step: normalise, write LSE, stage O (rounded) in this warp's own
// rows of the Q tile at `smem_q`, in
// the same swizzle (eight rows of one chunk column hit eight bank quads), then 16-byte stores.
// Non-finite inputs (cuda/nonfinite_fixup.cuh): as in the sm80 kernel, a row with no positive
// sum that sees every key (no window) is NaN, and under a window a row whose O comes out
// non-finite gets LSE = NaN, to be recomputed exactly. Returns whether this lane finished a row
// that needs recomputing where the kernel does that itself (sm90_forward_fixes_rows_itself);
// else the fixup kernel follows.
template <class Cfg, bool kDropout>
__device__ __forceinline__ bool write_tile(const float (&acc_o)[Cfg::kHeadDim / 2],
                                           const float (&row_max)[2], const float (&row_sum)[2],
                                           const AttentionParams& p, unsigned char* smem_q, int b,
                                           int h, int q_row0, int m0, int rows_q, int len_q,
                                           int len_k, int r0, int t, int c, int warp, int lane) {
  using Element = typename Cfg::Element;
  constexpr int kHeadDim = Cfg::kHeadDim;
  float* lse_row = p.lse + b * p.lse_batch_stride + h * p.lse_head_stride + q_row0 + m0;
  const FinishedRow finish(p, len_k);
  const bool fixes_rows = !kDropout && finish.marks && sm90_forward_fixes_rows_itself(p);
  bool needs_fix = false;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float l = row_sum[half];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const float inv = finish.scale(l, kDropout ? p.dropout_scale : 1.0f);
    const int r = r0 + half * 8;
    float probe = 0.0f;
#pragma unroll
    for (int j = 0; j < kHeadDim / 8; ++j) {
      const float o0 = acc_o[4 * j + 2 * half] * inv, o1 = acc_o[4 * j + 2 * half + 1] * inv;
      probe = nonfinite_probe(nonfinite_probe(probe, o0), o1);
      *reinterpret_cast<uint32_t*>(smem_q + swizzled(r, j, Cfg::kQPanelBytes) + 4 * t) =
          ptx::pack2<Element>(o0, o1);
    }
    probe += __shfl_xor_sync(0xffffffffu, probe, 1);  // the row's four lanes
    probe += __shfl_xor_sync(0xffffffffu, probe, 2);
    if (t == 0 && r < rows_q) {
      const float lse = finish.lse(l, row_max[half], probe);
      lse_row[r] = lse;
      if (fixes_rows && !(fabsf(lse) < INFINITY))
        needs_fix |= forward_row_marked(p, b, h, SequenceInfo{0, 0, len_q, len_k}, m0 + r, lse);
    }
  }
  __syncwarp();

  Element* gO = static_cast<Element*>(p.o) + b * p.o_batch_stride +
                int64_t{q_row0 + m0} * p.o_row_stride + h * p.o_head_stride;
  store_rows<kHeadDim / 8>(gO, p.o_row_stride, smem_q, Cfg::kQPanelBytes, c * 64 + warp * 16, 0,
                           rows_q, p.head_dim, lane);
  return needs_fix;
}

// One CTA per query tile: the Q tile, then the tile's steps (load_steps, attend_steps) and its
// epilogue (write_tile), as the persistent kernel runs them for each of its tiles.
template <DType kDType, int kHeadDim, bool kScoreMods, bool kDropout>
__global__ void __launch_bounds__(Fwd90Config<kDType, kHeadDim, false>::kThreads, 1)
    attention_forward_sm90_kernel(const __grid_constant__ AttentionParams p,
                                  const __grid_constant__ CUtensorMap tm_q,
                                  const __grid_constant__ CUtensorMap tm_k,
                                  const __grid_constant__ CUtensorMap tm_v) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Cfg = Fwd90Config<kDType, kHeadDim, false>;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kStages = Cfg::kStages;

  extern __shared__ unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t bars[1 + KvRing<Cfg>::kBarriers];  // q_full, the ring's
  const uint32_t raw = ptx::smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* const smem = smem_raw + (base - raw);
  const uint32_t sQ = base;
  const uint32_t q_full = ptx::smem_addr(bars);
  const KvRing<Cfg> ring{sQ + Cfg::kQBytes, sQ + Cfg::kQBytes + kStages * Cfg::kKVBytes,
                         q_full + 8u};

  const int tid = threadIdx.x;
  const int m_block = gridDim.x - 1 - blockIdx.x;  // heaviest first under a causal mask
  const int h = blockIdx.y, b = blockIdx.z;
  const TileWork w = tile_work<kBlockM, kBlockN>(p, b, h, m_block * kBlockM,
                                                 SequenceInfo{0, 0, p.seqlen_q, p.seqlen_k}, false);
  const int m0 = w.m0, rows_q = w.rows_q, n_begin = w.n_begin, n_end = w.n_end;
  // Block-sparse (core/block_mask.h; kernels whose tile lies in one mask row block): the steps
  // are the key tiles whose block is on. The CTA counts them first; the producer walks the mask
  // and writes each step's tile beside its K buffer (published by the K load's barrier), so the
  // consumers read no mask. Dense, step j is tile n_begin + j.
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
    ring.init();
    ptx::mbarrier_init_fence();
  }
  __syncthreads();

  if (tid < 128) {
    // Producer warpgroup: one thread issues every load.
    ptx::setmaxnreg_dec<Cfg::kProducerRegs>();
    if (tid == 0) {
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
      load_steps<Cfg>(
          ring, 0, steps, next_on(n_begin), next_on, [](int) {}, &tm_k, &tm_v, h / p.head_group, 0,
          b, sparse() ? s_step_tile : nullptr);
    }
    return;
  }

  // Consumer warpgroup c: query rows 64c..64c+63 of the tile; this thread's two rows are r0 and
  // r0 + 8 (the accumulator layout, ptx/wgmma.cuh).
  ptx::setmaxnreg_inc<Cfg::kConsumerRegs>();
  const int c = consumer_warpgroup<Cfg>(tid);
  const int warp = (tid / 32) % 4, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int r0 = c * 64 + warp * 16 + g;

  float acc_o[kHeadDim / 2];
#pragma unroll
  for (int i = 0; i < kHeadDim / 2; ++i) acc_o[i] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
  const WarpgroupSteps mine = warpgroup_steps<Cfg>(p, w, c, steps, sparse());
  pass_steps(ring, 0, 0, mine.lo);
  ptx::mbarrier_wait(q_full, 0);
  attend_steps<Cfg, kScoreMods, kDropout>(
      acc_o, row_max, row_sum, p, ring, mine.lo, mine.hi - mine.lo, sQ + c * 64 * 128,
      [&](int stage, int j) {
        return sparse() ? *static_cast<volatile int*>(&s_step_tile[stage]) : n_begin + mine.lo + j;
      },
      mine.last_lo, mine.first_hi, m0, p.seqlen_q, p.seqlen_k, alibi_slope(p, b, h),
      static_cast<uint32_t>(b * p.heads_q + h), r0, t);
  pass_steps(ring, 0, mine.hi, steps);
  const bool needs_fix = write_tile<Cfg, kDropout>(acc_o, row_max, row_sum, p, smem, b, h, 0, m0,
                                                    rows_q, p.seqlen_q, p.seqlen_k, r0, t, c,
                                                    warp, lane);
  // The warp's marked rows, recomputed after its own stores (write_tile), which __syncwarp
  // orders before the recompute's loads and stores.
  if (__any_sync(0xffffffffu, needs_fix)) {
    __syncwarp();
    forward_fix_marked_rows(p, b, h, m0 + c * 64 + warp * 16, 16);
  }
#else
  (void)p;
  (void)tm_q;
  (void)tm_k;
  (void)tm_v;
#endif
}

// The persistent kernel's consumers, after their last tile: the rows any CTA marked
// (write_tile) are recomputed by the CTA whose consumers finish last, once every CTA's O and LSE
// are written; recomputing them tile by tile inside the loop cost the loop its uniform registers
// (nonfinite_fixup.cuh). `counter` [2] counts the CTAs done, [3] is set where a row needs
// recomputing; the last CTA leaves both at 0 for the stream's next launch (tile_counter.h).
// `consumer` is the thread's index among the consumers (0 .. 128·kConsumers).
// The persistent forward's named barriers (0 is __syncthreads).
enum Fwd90Barrier : int {
  kConsumersDone = 1,  // every consumer is past its last tile (fix_rows_after_every_tile)
};

template <class Cfg>
__device__ __forceinline__ void fix_rows_after_every_tile(const AttentionParams& p, int* counter,
                                                          bool needs_fix, int consumer) {
  constexpr int kConsumerThreads = 128 * Cfg::kConsumers, kWarps = kConsumerThreads / 32;
  __shared__ int s_last;
  if (needs_fix) atomicExch(counter + 3, 1);
  __threadfence();  // this thread's O, LSE and flag before the count below
  ptx::named_barrier_sync(kConsumersDone, kConsumerThreads);
  if (consumer == 0)
    s_last = atomicAdd(counter + 2, 1) == static_cast<int>(gridDim.x) - 1;
  ptx::named_barrier_sync(kConsumersDone, kConsumerThreads);
  if (!s_last) return;
  __threadfence();  // every other CTA's stores, counted before ours, are visible from here on
  if (*static_cast<volatile int*>(counter + 3) != 0) {
    // A pass over every row, the fixup kernel's (fwd_fixup.cu) on this CTA's warps: a slow path
    // for inputs with ±Inf/NaN.
    for (int b = 0; b < p.batch; ++b) {
      const int len_q = sequence_info(p, b).len_q;
      for (int h = 0; h < p.heads_q; ++h)
        for (int i0 = consumer / 32 * 32; i0 < len_q; i0 += kWarps * 32)
          forward_fix_marked_rows(p, b, h, i0, 32);
    }
  }
  ptx::named_barrier_sync(kConsumersDone, kConsumerThreads);  // every read of [3] before the reset
  if (consumer == 0) {
    counter[2] = 0;
    counter[3] = 0;
  }
}

template <DType kDType, int kHeadDim, bool kScoreMods, bool kDropout>
__global__ void __launch_bounds__(Fwd90Config<kDType, kHeadDim, true>::kThreads, 1)
    attention_forward_sm90_persistent_kernel(const __grid_constant__ AttentionParams p,
                                             const __grid_constant__ CUtensorMap tm_q,
                                             const __grid_constant__ CUtensorMap tm_k,
                                             const __grid_constant__ CUtensorMap tm_v,
                                             int* tile_counter /* tile_counter.h's four ints */) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Cfg = Fwd90Config<kDType, kHeadDim, true>;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kStages = Cfg::kStages;

  extern __shared__ unsigned char smem_raw[];
  constexpr int kQBuffers = Cfg::kQBuffers;
  // q_full[], q_empty[], the ring's
  __shared__ __align__(8) uint64_t bars[2 * kQBuffers + KvRing<Cfg>::kBarriers];
  const uint32_t raw = ptx::smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* const smem = smem_raw + (base - raw);
  const uint32_t sQ = base;
  const uint32_t sK = sQ + kQBuffers * Cfg::kQBytes;
  const uint32_t bar0 = ptx::smem_addr(bars);
  auto q_full = [&](int qb) { return bar0 + 8u * qb; };
  auto q_empty = [&](int qb) { return bar0 + 8u * (kQBuffers + qb); };
  const KvRing<Cfg> ring{sK, sK + kStages * Cfg::kKVBytes, bar0 + 8u * (2 * kQBuffers)};

  const int tid = threadIdx.x;
  const ForwardTiles<kBlockM, kBlockN> tiles(p);
  // Block-sparse (core/block_mask.h; kernels whose tile lies in one mask row block): a tile's
  // steps are the key tiles whose block is on. The producer counts them (beside the tile's Q
  // buffer, published by the Q load's barrier) and writes each step's key tile beside its K
  // buffer (published by the K load's barrier), so the consumers read no mask. Dense, a tile has
  // n_end - n_begin steps and step `it` is key tile n_begin + it.
  auto sparse = [&] { return Cfg::kBlockSparse && p.block_mask != nullptr; };
  __shared__ TilePlace s_tile[kQBuffers];  // the tile in each Q buffer, b = -1: none left
  __shared__ int s_tile_steps[kQBuffers];
  __shared__ int s_step_tile[kStages];

  if (tid == 0) {
    for (int qb = 0; qb < kQBuffers; ++qb) {
      ptx::mbarrier_init(q_full(qb), 1);
      ptx::mbarrier_init(q_empty(qb), 128 * Cfg::kConsumers);
    }
    ring.init();
    ptx::mbarrier_init_fence();
  }
  __syncthreads();

  if (tid < 128) {
    // Producer warpgroup: its first warp walks the tiles (all lanes count a block-sparse tile's
    // steps), one thread issues every load; the other warps have nothing to do.
    ptx::setmaxnreg_dec<Cfg::kProducerRegs>();
    if (tid >= 32) return;
    if (tid == 0) {
      ptx::tma_prefetch_descriptor(&tm_q);
      ptx::tma_prefetch_descriptor(&tm_k);
      ptx::tma_prefetch_descriptor(&tm_v);
    }
    // The walk is written out for fixed-length and for packed batches: one loop with both ways
    // of finding a tile spilled the producer's 40 registers.
    auto walk_tiles = [&](auto packed) {
      constexpr bool kPacked = decltype(packed)::value;
      auto sparse_walk = [&] { return !kPacked && sparse(); };  // fwd_tiles.h: none packed
      int ring_step = 0;  // K/V loads issued, over every tile so far
      for (int k = 0, tile = blockIdx.x;; ++k) {
        const int qb = k % kQBuffers, use = k / kQBuffers;
        const TilePlace at =
            tile < tiles.count ? tiles.template place<kPacked>(p, tile, tid) : TilePlace{-1, 0, 0};
        if (at.b < 0) {  // none left: the consumers are told through the next Q buffer
          if (tid == 0) {
            if (use > 0) ptx::mbarrier_wait(q_empty(qb), (use - 1) & 1);
            s_tile[qb] = at;
            ptx::mbarrier_arrive(q_full(qb));
            // This CTA's last draw came back empty. The last CTA to get here finds every draw
            // made and leaves the counter at 0 for the stream's next launch (tile_counter.h).
            __threadfence();
            if (atomicAdd(tile_counter + 1, 1) == static_cast<int>(gridDim.x) - 1) {
              atomicExch(tile_counter, 0);
              atomicExch(tile_counter + 1, 0);
            }
          }
          break;
        }
        // The next tile, drawn now so that the atomic's latency hides behind this tile's loads.
        int next = 0;
        if (tid == 0) next = static_cast<int>(gridDim.x) + atomicAdd(tile_counter, 1);
        const TileWork w = tiles.template work<kPacked>(p, at);
        const int row_block = sparse_walk() ? w.m0 / p.block_m : 0;
        const int steps = sparse_walk()
                              ? count_on_tiles_warp(
                                    1, w.n_begin, w.n_end, p.block_n / kBlockN,
                                    [&](int, int c) { return block_on(p, w.b, w.h, row_block, c); })
                              : w.n_end - w.n_begin;
        if (tid == 0) {
          auto load_q = [&] {
            if (use > 0) ptx::mbarrier_wait(q_empty(qb), (use - 1) & 1);
            s_tile[qb] = at;
            if (sparse_walk()) s_tile_steps[qb] = steps;
            ptx::mbarrier_arrive_expect_tx(q_full(qb), Cfg::kQBytes);
#pragma unroll
            for (int pnl = 0; pnl < Cfg::kPanels; ++pnl)
              ptx::tma_load_4d(sQ + qb * Cfg::kQBytes + pnl * Cfg::kQPanelBytes, &tm_q, q_full(qb),
                               pnl * 64, w.q_row0 + w.m0, w.h, w.tma_b);
          };
          // With one Q buffer, the tile's first K/V loads go out before its Q, which waits for
          // the previous tile's epilogue: those of step 0 and K_1 (K_2 needs S_0 done, hence Q).
          const int q_after = kQBuffers == 1 ? min(steps, kStages - 1) : 0;
          if (q_after == 0) load_q();
          auto next_on = [&](int n) {
            return sparse_walk()
                       ? next_key_tile_on(p, w.b, w.h, row_block, row_block, n, w.n_end, kBlockN)
                       : n;
          };
          load_steps<Cfg>(
              ring, ring_step, steps, next_on(w.n_begin), next_on,
              [&](int j) {
                if (j == q_after && j > 0) load_q();
              },
              &tm_k, &tm_v, w.h / p.head_group, w.k_row0, w.tma_b,
              sparse_walk() ? s_step_tile : nullptr);
          if (q_after == steps && steps > 0) load_q();
        }
        ring_step += steps;
        tile = __shfl_sync(0xffffffffu, next, 0);
      }
    };
    if (p.is_varlen())
      walk_tiles(std::true_type{});
    else
      walk_tiles(std::false_type{});
    return;
  }

  // Consumer warpgroup c: query rows 64c..64c+63 of each tile; this thread's two rows are r0 and
  // r0 + 8 (the accumulator layout, ptx/wgmma.cuh).
  ptx::setmaxnreg_inc<Cfg::kConsumerRegs>();
  const int c = consumer_warpgroup<Cfg>(tid);
  const int warp = (tid / 32) % 4, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int r0 = c * 64 + warp * 16 + g;
  int ring_step = 0;       // K/V steps consumed, over every tile so far
  bool needs_fix = false;  // this lane finished a row to recompute (write_tile)

  for (int k = 0;; ++k) {
    const int qb = k % kQBuffers;
    ptx::mbarrier_wait(q_full(qb), (k / kQBuffers) & 1);
    const volatile TilePlace& published = s_tile[qb];
    const TilePlace at{published.b, published.h, published.m0};
    if (at.b < 0) break;
    const TileWork w =
        p.is_varlen() ? tiles.template work<true>(p, at) : tiles.template work<false>(p, at);

    float acc_o[kHeadDim / 2];
#pragma unroll
    for (int i = 0; i < kHeadDim / 2; ++i) acc_o[i] = 0.0f;
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};

    const uint32_t q_tile = sQ + qb * Cfg::kQBytes;
    const uint32_t q_rows = q_tile + c * 64 * 128;
    const int steps =
        sparse() ? *static_cast<volatile int*>(&s_tile_steps[qb]) : w.n_end - w.n_begin;

    const WarpgroupSteps mine = warpgroup_steps<Cfg>(p, w, c, steps, sparse());
    pass_steps(ring, ring_step, 0, mine.lo);
    attend_steps<Cfg, kScoreMods, kDropout>(
        acc_o, row_max, row_sum, p, ring, ring_step + mine.lo, mine.hi - mine.lo, q_rows,
        [&](int stage, int j) {
          return sparse() ? *static_cast<volatile int*>(&s_step_tile[stage])
                          : w.n_begin + mine.lo + j;
        },
        mine.last_lo, mine.first_hi, w.m0, w.len_q, w.len_k, alibi_slope(p, w.b, w.h),
        static_cast<uint32_t>(w.b * p.heads_q + w.h), r0, t);
    pass_steps(ring, ring_step, mine.hi, steps);
    ring_step += steps;

    needs_fix |= write_tile<Cfg, kDropout>(acc_o, row_max, row_sum, p, smem + qb * Cfg::kQBytes,
                                           w.b, w.h, w.q_row0, w.m0, w.rows_q, w.len_q, w.len_k,
                                           r0, t, c, warp, lane);
    // The Q buffer goes back to the producer; its next TMA write (async proxy) must follow this
    // warp's staging through it (generic proxy).
    ptx::fence_proxy_async_shared();
    ptx::mbarrier_arrive(q_empty(qb));
  }
  if constexpr (!kDropout) {
    if (rows_may_meet_hidden_keys(p) && sm90_forward_fixes_rows_itself(p))
      fix_rows_after_every_tile<Cfg>(p, tile_counter, needs_fix, tid - 128);
  }
#else
  (void)p;
  (void)tm_q;
  (void)tm_k;
  (void)tm_v;
  (void)tile_counter;
#endif
}

template <DType kDType, int kHeadDim>
bool forward_runs_on_device() {
  return runs_sm90a_code(
      reinterpret_cast<const void*>(attention_forward_sm90_kernel<kDType, kHeadDim, false, false>));
}

// The persistent kernel over `tiles` query tiles: one CTA per SM, or one per tile when there are
// fewer, or at most `max_ctas` where that is not 0 (DispatchOverrides::forward_ctas). Its tile
// counter is the stream's (tile_counter.h), or while the stream captures a graph one of the
// launch's own, from the stream-ordered allocator, zeroed and freed in stream order: nothing
// waits for the device.
template <DType kDType, int kHeadDim, bool kScoreMods, bool kDropout>
Status launch_persistent(const AttentionParams& p, const CUtensorMap& tm_q, const CUtensorMap& tm_k,
                         const CUtensorMap& tm_v, int64_t tiles, int max_ctas,
                         cudaStream_t stream) {
  using Cfg = Fwd90Config<kDType, kHeadDim, true>;
  DeviceFacts device;
  FLARE_RETURN_IF_ERROR(current_device_facts(&device));
  const int ctas = max_ctas > 0 ? max_ctas : device.sms;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(tiles, ctas)));
  auto run = [&](int* counter) {
    return launch(attention_forward_sm90_persistent_kernel<kDType, kHeadDim, kScoreMods, kDropout>,
                  "forward",
                  kHeadDim, grid, Cfg::kThreads, Cfg::kSmemBytes, stream, p, tm_q, tm_k, tm_v,
                  counter);
  };
  int* counter = nullptr;
  FLARE_RETURN_IF_ERROR(stream_tile_counter(stream, &counter));
  if (counter != nullptr) return run(counter);
  void* own = nullptr;
  FLARE_RETURN_IF_ERROR(cuda_status("forward", "cudaMallocAsync of the tile counter",
                                    cudaMallocAsync(&own, kTileCounterInts * sizeof(int), stream)));
  Status status = cuda_status("forward", "cudaMemsetAsync of the tile counter",
                              cudaMemsetAsync(own, 0, kTileCounterInts * sizeof(int), stream));
  if (status.ok()) status = run(static_cast<int*>(own));
  const Status freed = cuda_status("forward", "cudaFreeAsync", cudaFreeAsync(own, stream));
  return status.ok() ? freed : status;
}

// The one-CTA or the persistent kernel (fwd90_row), plain, with score modifiers, or with dropout.
template <DType kDType, int kHeadDim, bool kScoreMods, bool kDropout>
Status launch_tiles(const AttentionParams& p, const Fwd90Tile& row, const CUtensorMap& tm_q,
                    const CUtensorMap& tm_k, const CUtensorMap& tm_v, int64_t tiles, int max_ctas,
                    cudaStream_t stream) {
  if constexpr (fwd90_tile(kHeadDim, true).head_dim != 0) {
    if (row.persistent)
      return launch_persistent<kDType, kHeadDim, kScoreMods, kDropout>(p, tm_q, tm_k, tm_v, tiles,
                                                                       max_ctas, stream);
  }
  using Cfg = Fwd90Config<kDType, kHeadDim, false>;
  const int64_t m_blocks = (int64_t{p.seqlen_q} + Cfg::kBlockM - 1) / Cfg::kBlockM;
  const dim3 grid(static_cast<unsigned>(m_blocks), static_cast<unsigned>(p.heads_q),
                  static_cast<unsigned>(p.batch));
  return launch(attention_forward_sm90_kernel<kDType, kHeadDim, kScoreMods, kDropout>, "forward",
                kHeadDim,
                grid, Cfg::kThreads, Cfg::kSmemBytes, stream, p, tm_q, tm_k, tm_v);
}

template <DType kDType, int kHeadDim>
Status launch_forward(const AttentionParams& p, const DispatchOverrides& overrides,
                      cudaStream_t stream) {
  const int max_ctas = overrides.forward_ctas;
  const Fwd90Tile row = fwd90_row(p, max_ctas > 0);  // fwd_tiles.h
  const int64_t tiles = fwd90_tile_count(p, row.block_m);
  if (tiles == 0) return {};
  CUtensorMap tm_q, tm_k, tm_v;
  const TmaRows rows = tma_rows(p);  // packed batches: every sequence's rows, one batch
  const int batch = static_cast<int>(rows.batch);
  Status st = encode_map(&tm_q, kDType, p.q, p.head_dim, static_cast<int>(rows.q), p.heads_q, batch,
                         p.q_row_stride, p.q_head_stride, p.q_batch_stride, row.block_m, "q");
  if (!st.ok()) return st;
  st = encode_map(&tm_k, kDType, p.k, p.head_dim, static_cast<int>(rows.k), p.heads_kv, batch,
                  p.k_row_stride, p.k_head_stride, p.k_batch_stride, row.block_n, "k");
  if (!st.ok()) return st;
  st = encode_map(&tm_v, kDType, p.v, p.head_dim, static_cast<int>(rows.k), p.heads_kv, batch,
                  p.v_row_stride, p.v_head_stride, p.v_batch_stride, row.block_n, "v");
  if (!st.ok()) return st;
  if (p.dropout_p > 0.0f)
    return launch_tiles<kDType, kHeadDim, true, true>(p, row, tm_q, tm_k, tm_v, tiles, max_ctas,
                                                      stream);
  if (p.has_score_mods())
    return launch_tiles<kDType, kHeadDim, true, false>(p, row, tm_q, tm_k, tm_v, tiles, max_ctas,
                                                       stream);
  return launch_tiles<kDType, kHeadDim, false, false>(p, row, tm_q, tm_k, tm_v, tiles, max_ctas,
                                                      stream);
}

}  // namespace flare::cuda::sm90
