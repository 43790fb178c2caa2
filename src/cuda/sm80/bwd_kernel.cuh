// bwd_kernel.cuh — the FlashAttention-2 backward main kernel for sm_80 and later (mma.sync,
// ldmatrix, cp.async), fp16 and bf16, and its launcher.
//
// Work partitioning (FlashAttention-2, Dao 2023, Algorithm 2). One CTA owns kBlockN keys of one
// (batch, kv head): K_j and V_j stay in shared memory while the CTA walks every query block that
// can see them, for every query head of the kv head's group (GQA/MQA), so dK_j and dV_j are sums
// formed in registers and written once, without atomics. Per query block (Q, dO, LSE, D loaded;
// the next block's copy is in flight while this one computes):
//   Sᵀ  = K·Qᵀ,  dPᵀ = V·dOᵀ           each warp: s_keys keys × its slice of the queries,
//                                       in passes of at most 32 queries (bwd_tiles.h)
//   P   = 2^(S·scale·log2e − LSE·log2e) the forward's LSE; softcap / ALiBi as a runtime branch
//   mask                                only on tiles that straddle the ragged end or a window
//   dropout                             z = keep/(1−p) from the shared Philox mask:
//                                       P̃ = P·z, dP ← z·dP
//   dS  = P∘(dP − D) [· (1 − tanh²)]    D = rowsum(dO∘O) from the preprocess kernel
//   P̃ᵀ, dSᵀ → shared memory (fp16/bf16), then
//   dV += P̃ᵀ·dO,  dK += dSᵀ·Q           each warp: kv_keys keys × its slice of the columns
//   dQ += dS·K                           each warp: dq_rows queries × its columns, added into the
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
// Skewed steps (d 32, 96 and 128 where the device has sm_90's shared memory): three Q/dO buffers
// and two P/dS buffers let a step's two phases (Sᵀ/dPᵀ → P̃ᵀ, dSᵀ; then dV, dK, dQ) run under one
// barrier per step, with warps 4-7 a phase ahead of warps 0-3 (see the loop).
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
#include "cuda/device_probe.h"
#include "cuda/element_type.cuh"
#include "cuda/nonfinite_fixup.cuh"
#include "cuda/ptx/cp_async.cuh"
#include "cuda/ptx/fast_math.cuh"
#include "cuda/ptx/ldmatrix.cuh"
#include "cuda/ptx/mma.cuh"
#include "cuda/ptx/thread_index.cuh"
#include "cuda/sm80/bwd_launch.h"
#include "cuda/sm80/bwd_tiles.h"
#include "cuda/sm80/chunk_copy.cuh"
#include "cuda/sm80/tile_order.cuh"

namespace flare::cuda::sm80 {

template <int kHeadDim, int kStagesUsed>
struct BwdConfig {
  static constexpr BwdTile kTile = bwd_tile(kHeadDim);
  static_assert(kTile.head_dim == kHeadDim, "head-dim bucket missing from kBwdTiles");
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kWarps = kTile.warps;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kStages = kStagesUsed;  // kTile.stages, or kTile.min_stages
  static_assert(kStages == kTile.stages || kStages == kTile.min_stages, "stages not in kBwdTiles");
  // Sᵀ/dPᵀ: warps in kSKeyGroups groups of kTile.s_keys keys, each warp kSCols queries.
  static constexpr int kSMt = kTile.s_keys / 16;  // 16-key row tiles of a warp's Sᵀ
  static constexpr int kSKeyGroups = kBlockN / kTile.s_keys;
  static constexpr int kSCols = kBlockM / (kWarps / kSKeyGroups);
  // dK/dV: warps in kKVKeyGroups groups of kTile.kv_keys keys, each warp kKVCols columns.
  static constexpr int kKVMt = kTile.kv_keys / 16;
  static constexpr int kKVKeyGroups = kBlockN / kTile.kv_keys;
  static constexpr int kKVCols = kHeadDim / (kWarps / kKVKeyGroups);
  // dQ: warps in kDqRowGroups groups of kTile.dq_rows queries, each warp kDqCols columns.
  static constexpr int kDqMt = kTile.dq_rows / 16;
  static constexpr int kDqRowGroups = kBlockM / kTile.dq_rows;
  static constexpr int kDqCols = kHeadDim / (kWarps / kDqRowGroups);
  // dQ is produced in column chunks of at most 32 so its accumulator stays at 16·kDqMt registers
  // per 16 columns beside the dK/dV accumulators.
  // d 96 and d 192 give each warp 48 columns: one chunk of 48 (ptxas keeps it spill-free; their
  // dK/dV accumulators are 96 registers, not 128).
  static constexpr int kDqChunk = kDqCols <= 32 || kDqCols % 32 != 0 ? kDqCols : 32;
  // Column pieces. frag_step moves a fragment address by XOR-ing the column's chunk bits inside a
  // swizzle group (kGroupCols columns), which is exact only when the warp's first column leaves
  // those bits free: its slice must start on a group boundary or be no wider than the steps it
  // repeats (d 64-256: 32 or 64 columns in 64-column groups). 48-column slices (d 96 in 32-column
  // groups, d 192 in 64-column ones) do not, so there each warp takes 16-column pieces a group
  // apart (warp c of n: columns 16c + 16n·j), whose chunks differ only above the group's bits.
  static constexpr int kGroupCols = kHeadDim % 64 == 0 ? 64 : 32;
  template <int kCols, int kSlices>
  struct ColumnPieces {
    static constexpr bool kStrided = kGroupCols % kCols != 0 && kCols % kGroupCols != 0;
    static constexpr int kCol0 = kStrided ? 16 : kCols;  // × the warp's column slice
    static constexpr int kPiece = kStrided ? 16 * kSlices : 16;
    static_assert(!kStrided || kPiece == kGroupCols, "strided pieces must sit a group apart");
    // Column of n8 tile nt among the warp's pieces, from its first column.
    __host__ __device__ static constexpr int col(int nt) {
      return (nt / 2) * kPiece + (nt % 2) * 8;
    }
  };
  using KVPieces = ColumnPieces<kKVCols, kWarps / kKVKeyGroups>;
  using DqPieces = ColumnPieces<kDqCols, kWarps / kDqRowGroups>;
  // Sᵀ and dPᵀ are produced in passes of kSPass queries, which bounds their registers (2 · kSMt ·
  // kSPass / 4 per thread). Each pass reloads the warp's K and V fragments, so d ≤ 64 (a 32-key
  // × 64-query warp tile) runs one pass: 16 fewer ldmatrix per warp and step, 11% of them, the
  // difference an ncu profile showed against FlashAttention-2 (bwd_notes.md). That leaves no
  // register for anything the key-block loop keeps across its body (kLeanKeyLoop).
  static constexpr int kSPass = kHeadDim <= 64 ? kSCols : (kSCols < 32 ? kSCols : 32);
  // The key-block loop's bound read from shared memory and the K/V copy offsets computed from a
  // volatile thread index, so that ptxas holds neither across the loop body (at d 64 with one
  // pass they were the only spills, 8-12 bytes). d 128 with two Q/dO buffers (the sm_80 kernel)
  // takes it too since its steps became the phase1/phase2 lambdas (without, 4 bytes on sm_80),
  // and d 96 and 192 (without, 72 and 4 bytes on sm_90a).
  static constexpr bool kLeanKeyLoop =
      kHeadDim <= 96 || kHeadDim == 192 || (kHeadDim == 128 && kStages == 2);
  // Unrolling of the k loops. Fully unrolled, the fragment addresses' swizzle constants and the
  // loop branches disappear, but ptxas may preload fragments until it spills (Sᵀ/dPᵀ and dK/dV at
  // d 128), and at d 64 full unrolling of the Sᵀ/dPᵀ and dK/dV loops measured 2-5% slower on the
  // H100 than unrolling by 2. dQ is unrolled fully everywhere.
  static constexpr int kSUnroll = kHeadDim >= 192 ? kHeadDim / 16 : 2;
  // Sᵀ alone (P's registers are not live yet) fully unrolled from d 128 where ptxas keeps it
  // spill-free: sm_90 (on sm_80 it spills 4 bytes at d 128).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static constexpr int kSFirstUnroll = kHeadDim >= 128 ? kHeadDim / 16 : kSUnroll;
#else
  static constexpr int kSFirstUnroll = kSUnroll;
#endif
  // d 256 (and d 192, the same tile) forms Sᵀ and dPᵀ in one k loop (both products' MMAs
  // interleaved, as the feature path does) and unrolls its dK/dV loop by 2 (fully, it spills 32
  // bytes on sm_90a). H100, A/B in one call: each +0.5 to +1.6% on the d 256 cells; the joint loop
  // cost d 64 up to 1.8% and d 128 0.3%, where Sᵀ first and then P in place keeps.
  static constexpr bool kFusedS = kHeadDim >= 192;
  static constexpr int kKVUnroll = 2;
  // Q/dO copies take the bounds-free path for whole tiles, except at d 256 with one buffer,
  // where its addresses cost the registers that keep the kernel spill-free on sm_90a.
  static constexpr bool kWholeTileLoads = kHeadDim < 256 || kStages == 2;
  static_assert(kSKeyGroups * (kBlockM / kSCols) == kWarps && kBlockN % kTile.s_keys == 0,
                "Sᵀ warp tiling");
  static_assert(kKVKeyGroups * (kHeadDim / kKVCols) == kWarps && kBlockN % kTile.kv_keys == 0,
                "dK/dV warp tiling");
  static_assert(kDqRowGroups * (kHeadDim / kDqCols) == kWarps && kBlockM % kTile.dq_rows == 0,
                "dQ warp tiling");
  static_assert(kDqCols % kDqChunk == 0 && kSCols % kSPass == 0, "passes and chunks");
  static_assert(kSPass % 16 == 0 && kKVCols % 16 == 0 && kDqChunk % 16 == 0,
                "ldmatrix.x4 loads two n8 fragments at a time");
  static_assert(kHeadDim % 32 == 0 && kBlockM % 64 == 0,
                "swizzled rows need whole groups of four (d 96) or eight 16-byte chunks");
  static_assert(kThreads >= kBlockM, "one thread per query row loads LSE and D");
  // Shared-memory plan, in 2-byte elements from the start, then the fp32 row vectors.
  static constexpr int kOffK = 0;                                      // (kBlockN, d)
  static constexpr int kOffV = kOffK + kBlockN * kHeadDim;             // (kBlockN, d)
  static constexpr int kOffQ = kOffV + kBlockN * kHeadDim;             // (stages, kBlockM, d)
  static constexpr int kOffDo = kOffQ + kStages * kBlockM * kHeadDim;  // (stages, kBlockM, d)
  static constexpr int kOffP = kOffDo + kStages * kBlockM * kHeadDim;  // (kBlockN, kBlockM)
  static constexpr int kOffDs = kOffP + kBlockN * kBlockM;             // (kBlockN, kBlockM)
  // Three Q/dO buffers run the skewed steps (see the kernel), which need a second P/dS buffer
  // (P₁, dS₁ after P₀, dS₀, so dS stays kDsAfterP bytes after its P).
  static constexpr bool kSkewed = kStages == 3;
  // Only the two-buffer steps walk a block mask (cuda/block_walk.cuh): its few registers spill the
  // skewed d 128 and one-buffer d 256 kernels on sm_90a, so the launcher runs block-sparse
  // problems with two buffers (backward.cpp).
  static constexpr bool kBlockSparse = kStages == 2;
  static constexpr int kPdsBuffers = kSkewed ? 2 : 1;
  static constexpr uint32_t kPdsBytes = 2 * kBlockN * kBlockM * 2;
  static constexpr int kElems = kOffP + kPdsBuffers * 2 * kBlockN * kBlockM;
  static constexpr int kSmemBytes = kElems * 2 + 2 * kStages * kBlockM * 4;
  static_assert(kSmemBytes == bwd_smem_bytes(kHeadDim, kStages), "shared-memory plan out of sync");
};

// Element offset of (row, col) in a shared tile of kCols-element rows whose 16-byte chunks are
// XOR-swizzled within groups of kSwzGroup: rows that are multiples of 128 bytes XOR each 8-chunk
// group with row % 8; d 96's 192-byte rows XOR each 4-chunk group with (row / 2) % 4 — eight
// consecutive rows then put one chunk column on eight distinct bank quads too (odd rows start 64
// bytes into the banks). Chunks stay whole, so cp.async and ldmatrix addresses stay aligned, and
// the pattern repeats every 8 rows.
template <int kCols>
inline constexpr int kSwzGroup = kCols % 64 == 0 ? 8 : 4;
template <int kCols>
__device__ __forceinline__ int swz(int row, int col) {
  const int chunk = col >> 3;
  if constexpr (kSwzGroup<kCols> == 8)
    return row * kCols + (((chunk ^ row) & 7) | (chunk & ~7)) * 8 + (col & 7);
  else
    return row * kCols + (((chunk ^ (row >> 1)) & 3) | (chunk & ~3)) * 8 + (col & 7);
}

// ldmatrix lane addressing, as shared-window byte addresses. Pattern X: the A operand from a (row,
// k)-stored tile, or the B operand through .trans from a (k, n)-stored tile. Pattern Y: the B
// operand from an (n, k)-stored tile, or the A operand through .trans from a (k, m)-stored tile. A
// base is computed once per kernel for the lane's row and chunk (r0 % 8 == 0); frag_step then moves
// it by a compile-time (dr, dc) — dr % 8 == 0, dc % 8 == 0 — with one XOR on the chunk bits inside
// a swizzle group and one add, which is exact because tiles start on 128-byte boundaries, rows
// are multiples of the group's bytes (128, or 64 for d 96's 4-chunk groups), and the base's own
// low chunk bits never overlap dc / 8's.
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
  constexpr int kMask = kSwzGroup<kCols> - 1;
  const int chunk = dc >> 3;
  return (base ^ static_cast<uint32_t>((chunk & kMask) << 4)) + dr * (kCols * 2) +
         (chunk & ~kMask) * 16;
}

// Rows a tile copy advances per pass: the largest power of two whose rows of kChunks 16-byte chunks
// the threads cover (256 threads: all of them for d 32, 64, 128, 256; 192 for d 96 and 192), so
// rows kRowStep apart share their swizzle and every thread copies the same column.
__host__ __device__ constexpr int copy_row_step(int threads, int chunks) {
  int step = 1;
  while (2 * step * chunks <= threads) step *= 2;
  return step;
}

// Copies a (rows_valid ≤ kRows, d_valid ≤ kCols) tile of a row-major global tensor into a swizzled
// shared tile, zero-filling the rest. `vec`: rows 16-byte aligned and d_valid % 8 == 0, so whole
// chunks go through cp.async; otherwise elements are read one by one and stored synchronously
// (ordered by the same barriers). kWholeTilePath: a whole aligned tile is copied without bounds.
template <int kRows, int kCols, int kThreads, bool kWholeTilePath, typename Element>
__device__ __forceinline__ void load_tile_swizzled(Element* s, const Element* g, int64_t row_stride,
                                                   int rows_valid, int d_valid, bool vec, int tid) {
  constexpr int kChunks = kCols / 8;
  constexpr int kRowStep = copy_row_step(kThreads, kChunks);
  static_assert(kRows % kRowStep == 0, "tile copy must split evenly");
  if constexpr (kRowStep * kChunks < kThreads) {
    if (tid >= kRowStep * kChunks) return;  // d 192: whole warps left without a chunk
  }
  const int row0 = tid / kChunks;
  const int col = (tid % kChunks) * 8;
  if (kWholeTilePath && vec && rows_valid >= kRows && d_valid == kCols) {
    // Whole tile: no bounds to test; rows kRowStep apart share the swizzle (kRowStep % 8 == 0).
    static_assert(kRowStep % 8 == 0, "rows kRowStep apart must share their swizzle");
    const uint32_t dst = ptx::smem_addr(s + swz<kCols>(row0, col));
    // One per-thread address; the rows after it are warp-uniform byte offsets added to it.
    const char* const src = reinterpret_cast<const char*>(
        g + static_cast<uint64_t>(static_cast<uint32_t>(row0)) * row_stride + col);
#pragma unroll
    for (int i = 0; i < kRows / kRowStep; ++i)
      ptx::cp_async_16_zfill(dst + i * kRowStep * kCols * 2,
                             src + i * kRowStep * row_stride * int64_t{sizeof(Element)}, true);
    return;
  }
#pragma unroll
  for (int i = 0; i < kRows / kRowStep; ++i) {
    const int row = row0 + i * kRowStep;
    copy_chunk16(s + swz<kCols>(row, col), g + row * row_stride + col, g, row < rows_valid, col,
                 d_valid, vec);
  }
}

// Writes rows [0, rows_valid) and columns [0, d_valid) of a swizzled shared tile to a row-major
// global tensor in 16-byte chunks: d_valid % 8 == 0 and 16-byte-aligned rows
// (BwdWorkspace::store16).
template <int kRows, int kCols, int kThreads, typename Element>
__device__ __forceinline__ void store_tile_swizzled(Element* g, int64_t row_stride,
                                                    const Element* s, int rows_valid, int d_valid,
                                                    int tid) {
  constexpr int kChunks = kCols / 8;
  constexpr int kRowStep = copy_row_step(kThreads, kChunks);
  static_assert(kRows % kRowStep == 0, "tile store must split evenly");
  if constexpr (kRowStep * kChunks < kThreads) {
    if (tid >= kRowStep * kChunks) return;
  }
  const int row0 = tid / kChunks;
  const int col = (tid % kChunks) * 8;
  if (col >= d_valid) return;
#pragma unroll
  for (int i = 0; i < kRows / kRowStep; ++i) {
    const int row = row0 + i * kRowStep;
    if (row < rows_valid)
      *reinterpret_cast<uint4*>(g + row * row_stride + col) =
          *reinterpret_cast<const uint4*>(s + swz<kCols>(row, col));
  }
}

// A 4-byte store to a shared-window address, so the P̃ᵀ/dSᵀ stores step their swizzled addresses
// with frag_step like the loads. Kept beside its only user, as is the next one.
__device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t value) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(value) : "memory");
}

// 4-byte asynchronous copy global → shared, zero-filling when !valid (4- and 8-byte copies must go
// through L1: .ca).
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

// Stores columns (col, col + 1) of a gradient row, the second only when `second`; one 4-byte store
// when the pair is aligned.
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

// acc += A·Bᵀ over the head dimension for one pass of the Sᵀ/dPᵀ tile: A, the warp's kMt·16 keys of
// K (or V) from a_base; B, the pass's kPass queries of Q (or dO) from b_base. Each B fragment feeds
// kMt row tiles. kBoth: the second product (acc2, on a_base + a2_off and b_base + b2_off) in the
// same loop.
template <typename Element, int kHeadDim, int kMt, int kPass, bool kBoth, int kUnroll>
__device__ __forceinline__ void s_product(float (&acc)[kMt][kPass / 8][4],
                                          float (&acc2)[kMt][kPass / 8][4], uint32_t a_base,
                                          uint32_t b_base, uint32_t a2_off, uint32_t b2_off) {
  auto step = [&](int ks) {
    uint32_t a[kMt][4], a2[kMt][4];
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt) {
      const uint32_t a_addr = frag_step<kHeadDim>(a_base, mt * 16, ks * 16);
      ptx::ldmatrix_x4(a[mt], a_addr);
      if constexpr (kBoth) ptx::ldmatrix_x4(a2[mt], a_addr + a2_off);
    }
#pragma unroll
    for (int np = 0; np < kPass / 16; ++np) {
      uint32_t bq[4], b2[4];
      const uint32_t b_addr = frag_step<kHeadDim>(b_base, np * 16, ks * 16);
      ptx::ldmatrix_x4(bq, b_addr);
      if constexpr (kBoth) ptx::ldmatrix_x4(b2, b_addr + b2_off);
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) {
        ptx::mma_m16n8k16<Element>(acc[mt][2 * np], a[mt], bq[0], bq[1]);
        ptx::mma_m16n8k16<Element>(acc[mt][2 * np + 1], a[mt], bq[2], bq[3]);
        if constexpr (kBoth) {
          ptx::mma_m16n8k16<Element>(acc2[mt][2 * np], a2[mt], b2[0], b2[1]);
          ptx::mma_m16n8k16<Element>(acc2[mt][2 * np + 1], a2[mt], b2[2], b2[3]);
        }
      }
    }
  };
  // The first step is peeled: its accumulators are known zeros, which the MMA reads as the zero
  // register instead of 16·kMt·kPass/8 cleared registers per pass.
  step(0);
#pragma unroll(kUnroll)
  for (int ks = 1; ks < kHeadDim / 16; ++ks) step(ks);
}

// How a backward tile forms P and dS (see the Sᵀ passes).
inline constexpr int kPlain = 0, kGeneral = 1;
// The order of a warp's phase-2 products: dQ first on warps 4-7 and last on 0-3 (the two-barrier
// steps), dK/dV first, dQ first; and the one the skewed steps use (H100, A/B in one call, d 128:
// dK/dV first +2.4% median over the old loop, by half −0.5%, dQ first −4.5%).
inline constexpr int kByHalf = 0, kDkdvFirst = 1, kDqFirst = 2;
inline constexpr int kSkewOrder = kDkdvFirst;

template <DType kDType, int kHeadDim, int kStagesUsed>
__global__ void __launch_bounds__(BwdConfig<kHeadDim, kStagesUsed>::kThreads, 1)
    attention_backward_kernel(const __grid_constant__ AttentionParams p, const BwdWorkspace w) {
  using Cfg = BwdConfig<kHeadDim, kStagesUsed>;
  using Element = ElementOf<kDType>;
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

  const TileSlot slot = tile_slot(w.tile_group);  // rank 0: key blocks seen by the most queries
  const int hk = slot.head;
  const int b = slot.batch;
  const SequenceInfo seq = sequence_info(p, b);
  const int key_blocks = (seq.len_k + kBlockN - 1) / kBlockN;
  const int jb_begin = slot.rank * w.kv_blocks_per_cta;
  const int jb_end = min(jb_begin + w.kv_blocks_per_cta, key_blocks);
  if (jb_begin >= jb_end) return;  // varlen: this sequence has fewer keys than the longest

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;  // fragment row group, thread in group
  constexpr int kSMt = Cfg::kSMt, kKVMt = Cfg::kKVMt, kDqMt = Cfg::kDqMt;
  const int kg = warp % Cfg::kSKeyGroups;  // Sᵀ: key group (kSMt·16 keys)
  const int cs = warp / Cfg::kSKeyGroups;  //     query slice
  const int d = p.head_dim;
  const int64_t q_packed0 = packed_q_row0(p, b, seq);
  float* const dq_accum = w.dq_accum + slot.rank * w.dq_split_stride;
  const bool has_mod = p.has_score_mods();
  const bool has_dropout = p.dropout_p > 0.0f;

  // Per-lane fragment addresses (stage 0 for Q and dO). V, dO and dS sit a fixed multiple of 128
  // bytes after K, Q and P, so they share the bases (and each step's XOR) of their partners.
  const uint32_t a_k_base = frag_base_x<kHeadDim>(ptx::smem_addr(sK), kg * kSMt * 16, 0, lane);
  const uint32_t b_q_base = frag_base_y<kHeadDim>(ptx::smem_addr(sQ), cs * kSCols, 0, lane);
  // Where thread `th` stores its P̃ᵀ / dSᵀ pairs: row kg·kSMt·16 + g, column cs·kSCols + 2t.
  auto p_store_base = [&](int th) {
    const int l = th & 31, w = th >> 5;
    return ptx::smem_addr(sP) + 2 * swz<kBlockM>((w % Cfg::kSKeyGroups) * kSMt * 16 + (l >> 2),
                                                 (w / Cfg::kSKeyGroups) * kSCols + 2 * (l & 3));
  };
  const uint32_t st_p_base = p_store_base(tid);
  constexpr uint32_t kVAfterK = (Cfg::kOffV - Cfg::kOffK) * 2;
  constexpr uint32_t kDoAfterQ = (Cfg::kOffDo - Cfg::kOffQ) * 2;
  constexpr uint32_t kDsAfterP = (Cfg::kOffDs - Cfg::kOffP) * 2;

  __shared__ int s_jb_end;      // kLeanKeyLoop: the loop bound, read back through a volatile load
  __shared__ int s_walk_steps;  // block-sparse: QueryWalk::count_steps' sum
  __shared__ QueryWalk s_walk;  // block-sparse: this key block's walk
  __shared__ int2 s_step[3];    // kSkewed: (query block, head) of the step in each Q/dO buffer
  auto s_step_read = [&](int stage) {
    const volatile int2* const v = &s_step[stage];
    return make_int2(v->x, v->y);
  };
  if constexpr (Cfg::kLeanKeyLoop) {
    if (tid == 0) s_jb_end = jb_end;
    __syncthreads();
  }
  for (int jb = jb_begin;
       jb < (Cfg::kLeanKeyLoop ? *static_cast<volatile int*>(&s_jb_end) : jb_end); ++jb) {
    const int tid_kv = Cfg::kLeanKeyLoop ? ptx::thread_index_volatile() : tid;
    const int j0 = jb * kBlockN;
    const int rows_k = min(kBlockN, seq.len_k - j0);
    const RowRange rows =
        rows_seeing(j0, j0 + rows_k, seq.len_q, seq.len_k, p.window_left, p.window_right);
    const int m_begin = rows.lo / kBlockM;
    const int m_count = rows.hi > rows.lo ? (rows.hi + kBlockM - 1) / kBlockM - m_begin : 0;
    const int h0 = hk * p.head_group;
    const int m_end = m_begin + m_count;
    // Block-sparse: only the steps whose mask block is on (cuda/block_walk.cuh), the walk kept in
    // shared memory (published by count_steps' first barrier) and read back where it advances.
    const bool sparse = Cfg::kBlockSparse && p.block_mask != nullptr;
    int iters = m_count * p.head_group;
    if (sparse) {
      const QueryWalk walk{b, j0 / p.block_n, m_begin, m_end, h0 + p.head_group, kBlockM};
      if (tid == 0) walk.store(&s_walk);
      iters = walk.count_steps<kThreads>(p, h0, &s_walk_steps);
    }
    // The step after (m, h): the next query block of head h, then the next head's first.
    auto advance = [&](int& m, int& h) {
      if (++m == m_end) m = m_begin, ++h;
      if (Cfg::kBlockSparse && p.block_mask != nullptr) QueryWalk::load(&s_walk).settle(p, m, h);
    };

    load_tile_swizzled<kBlockN, kHeadDim, kThreads, true>(
        sK,
        static_cast<const Element*>(p.k) + b * p.k_batch_stride +
            (seq.k_row0 + j0) * p.k_row_stride + hk * p.k_head_stride,
        p.k_row_stride, rows_k, d, w.vec, tid_kv);
    load_tile_swizzled<kBlockN, kHeadDim, kThreads, true>(
        sV,
        static_cast<const Element*>(p.v) + b * p.v_batch_stride +
            (seq.k_row0 + j0) * p.v_row_stride + hk * p.v_head_stride,
        p.v_row_stride, rows_k, d, w.vec, tid_kv);

    // Steps walk (query block, head) pairs, query blocks fastest, through `walk`; the loop steps
    // the pair rather than dividing, and the prefetch (kStages − 1 ≤ 2 steps ahead) derives its
    // pair from the ones it holds.
    static_assert(kStages >= 1 && kStages <= 3, "the prefetch runs at most two steps ahead");
    auto load_query_block = [&](int it, int m, int h) {
      const int stage = it % kStages;
      const int i0 = m * kBlockM;
      const int tid = ptx::thread_index_volatile();  // keeps per-thread offsets out of the S passes
      if (Cfg::kSkewed && tid == 0) s_step[stage] = make_int2(m, h);
      const int rows_q = min(kBlockM, seq.len_q - i0);
      load_tile_swizzled<kBlockM, kHeadDim, kThreads, Cfg::kWholeTileLoads>(
          sQ + stage * kBlockM * kHeadDim,
          static_cast<const Element*>(p.q) + b * p.q_batch_stride +
              (seq.q_row0 + i0) * p.q_row_stride + h * p.q_head_stride,
          p.q_row_stride, rows_q, d, w.vec, tid);
      load_tile_swizzled<kBlockM, kHeadDim, kThreads, Cfg::kWholeTileLoads>(
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

    int m_first = m_begin, h_first = h0;
    if (sparse) QueryWalk::load(&s_walk).settle(p, m_first, h_first);
    if (kStages == 2 && iters > 0) load_query_block(0, m_first, h_first);
    ptx::cp_async_commit();

    float acc_dk[kKVMt][kKVCols / 8][4] = {};  // (kKVMt·16 keys, kKVCols) per warp
    float acc_dv[kKVMt][kKVCols / 8][4] = {};

    // Phase 1 of a query step (query block m_at of head h, Q/dO buffer `stage`): Sᵀ and dPᵀ, then
    // P̃ᵀ and dSᵀ into the P/dS buffer `pds` bytes after the first.
    auto phase1 = [&](const int stage, const uint32_t pds, const int m_at, const int h) {
      const int i0 = m_at * kBlockM;
      const uint32_t stage_bytes = stage * kBlockM * kHeadDim * 2;
      const float* const sLses = sLse + stage * kBlockM;
      const float* const sDsums = sDsum + stage * kBlockM;

      // A tile needs the mask only where it straddles the ragged key end or a window edge.
      const bool full_tile = tile_sees_all(i0, min(i0 + kBlockM, seq.len_q), j0, j0 + kBlockN,
                                           seq.len_q, seq.len_k, p.window_left, p.window_right);
      // One pass: the warp's Sᵀ/dPᵀ over queries q0 + [0, kPass), q0 = cs·kSCols + q_rel, through P
      // and dS into shared memory; keys kg·kSMt·16 + [0, kSMt·16). Each B fragment (Q, dO) feeds
      // kSMt row tiles. Without score modifier or dropout (kPlain, masked by a select where the
      // tile straddles a mask edge: causal diagonal, window, ragged end) a pass covers kSPass
      // queries, Sᵀ first, then P in place while dPᵀ is formed (so only one product's fragments are
      // live at a time; at d 256 both products share one loop, Cfg::kFusedS). Other tiles
      // (kGeneral) run in passes of 16 queries with both products in one loop: their per-element
      // code needs the registers.
      auto s_pass = [&](auto pass_tag, auto mode_tag, const int q_rel) {
        constexpr int kPass = decltype(pass_tag)::value;
        constexpr int kMode = decltype(mode_tag)::value;
        const int q0 = cs * kSCols + q_rel;
        const uint32_t b_pass = frag_step<kHeadDim>(b_q_base, q_rel, 0) + stage_bytes;
        float acc_s[kSMt][kPass / 8][4] = {}, acc_dp[kSMt][kPass / 8][4] = {};
        // Per query row m of the block: the LSE in base-2 units — +inf for a row with no visible
        // key (LSE = −inf) or past the sequence end, so its P is exactly 0 and so is every gradient
        // it feeds.
        auto lse2_of = [&](int m) {
          const float lse = sLses[m];
          return i0 + m < seq.len_q && lse != -INFINITY ? lse * kLog2e : INFINITY;
        };
        if constexpr (kMode != kGeneral) {
          // Free of per-element branches: each one is a taken jump, and in this loop they cost more
          // issue slots than the arithmetic.
          if constexpr (Cfg::kFusedS)
            s_product<Element, kHeadDim, kSMt, kPass, true, Cfg::kSUnroll>(
                acc_s, acc_dp, a_k_base, b_pass, kVAfterK, kDoAfterQ);
          else
            s_product<Element, kHeadDim, kSMt, kPass, false, Cfg::kSFirstUnroll>(
                acc_s, acc_s, a_k_base, b_pass, 0, 0);
#pragma unroll
          for (int nt = 0; nt < kPass / 8; ++nt) {
            const int m = q0 + nt * 8 + 2 * t;
            const float lse2[2] = {lse2_of(m), lse2_of(m + 1)};
#pragma unroll
            for (int mt = 0; mt < kSMt; ++mt)
#pragma unroll
              for (int r = 0; r < 4; ++r)
                acc_s[mt][nt][r] = ptx::exp2_approx(acc_s[mt][nt][r] * p.scale_log2 - lse2[r & 1]);
          }
          if (!full_tile) {
            // ElementMask (core/score_mod.h) over the lane's elements: key key0 + cj of query
            // i0 + q0 + 2t + nt·8 + (r & 1), cj = mt·16 + (r >> 1)·8, both offsets compile-time.
            // kLeanKeyLoop takes the lane's key row from a volatile thread index, so that ptxas
            // does not hold these per-key-block values from the kernel's start (it spills).
            const int tid_m = Cfg::kLeanKeyLoop ? ptx::thread_index_volatile() : tid;
            const int key0 =
                j0 + ((tid_m >> 5) % Cfg::kSKeyGroups) * kSMt * 16 + ((tid_m & 31) >> 2);
            const ElementMask mask(j0, key0 - j0, i0 + q0 + 2 * t, seq.len_q, seq.len_k,
                                   p.window_left, p.window_right);
#pragma unroll
            for (int nt = 0; nt < kPass / 8; ++nt)
#pragma unroll
              for (int mt = 0; mt < kSMt; ++mt)
#pragma unroll
                for (int r = 0; r < 4; ++r)
                  acc_s[mt][nt][r] = mask.masked(mt * 16 + (r >> 1) * 8, nt * 8 + (r & 1))
                                         ? 0.0f
                                         : acc_s[mt][nt][r];
          }
          if constexpr (!Cfg::kFusedS)
            s_product<Element, kHeadDim, kSMt, kPass, false, Cfg::kSUnroll>(
                acc_dp, acc_dp, a_k_base + kVAfterK, b_pass + kDoAfterQ, 0, 0);
#pragma unroll
          for (int nt = 0; nt < kPass / 8; ++nt) {
            const int m = q0 + nt * 8 + 2 * t;
            const float dsum[2] = {sDsums[m], sDsums[m + 1]};
#pragma unroll
            for (int mt = 0; mt < kSMt; ++mt)
#pragma unroll
              for (int r = 0; r < 4; ++r)
                acc_dp[mt][nt][r] = acc_s[mt][nt][r] * (acc_dp[mt][nt][r] - dsum[r & 1]);
          }
        } else {
          s_product<Element, kHeadDim, kSMt, kPass, true, Cfg::kSUnroll>(
              acc_s, acc_dp, a_k_base, b_pass, kVAfterK, kDoAfterQ);
          const float slope = alibi_slope(p, b, h);
          const uint32_t bh = static_cast<uint32_t>(b * p.heads_q + h);
#pragma unroll
          for (int nt = 0; nt < kPass / 8; ++nt) {
            const float lse2[2] = {lse2_of(q0 + nt * 8 + 2 * t), lse2_of(q0 + nt * 8 + 2 * t + 1)};
#pragma unroll
            for (int mt = 0; mt < kSMt; ++mt)
#pragma unroll
              for (int r = 0; r < 4; ++r) {
                const int n = (kg * kSMt + mt) * 16 + g + (r >> 1) * 8;  // key in the block
                const int m = q0 + nt * 8 + 2 * t + (r & 1);             // query in the block
                const int i = i0 + m, j = j0 + n;
                float prob, dtanh = 1.0f;
                if (!has_mod) {
                  prob = ptx::exp2_approx(acc_s[mt][nt][r] * p.scale_log2 - lse2[r & 1]);
                } else {
                  // 1 / c per element: held across the tile it made ptxas spill at d 64 and 256.
                  const float x = modified_score(
                      acc_s[mt][nt][r] * p.scale, p.softcap, __frcp_rn(p.softcap),
                      p.alibi_slopes != nullptr ? alibi_bias(slope, i, j, seq.len_q, seq.len_k)
                                                : 0.0f,
                      &dtanh);
                  prob = ptx::exp2_approx(x * kLog2e - lse2[r & 1]);
                }
                if (!full_tile) {
                  const ElementMask mask(j, 0, i, seq.len_q, seq.len_k, p.window_left,
                                         p.window_right);
                  if (mask.masked(0, 0)) prob = 0.0f;
                }
                float dp = acc_dp[mt][nt][r];
                float prob_dropped = prob;
                if (has_dropout) {
                  const float z = dropout_keep(p.seed, p.offset, bh, static_cast<uint32_t>(i),
                                               static_cast<uint32_t>(j), p.dropout_p)
                                      ? p.dropout_scale
                                      : 0.0f;
                  prob_dropped = prob * z;
                  dp *= z;
                }
                acc_s[mt][nt][r] = prob_dropped;
                acc_dp[mt][nt][r] = prob * (dp - sDsums[m]) * dtanh;
              }
          }
        }
        // P̃ᵀ and dSᵀ to shared memory, rows (kg·kSMt + mt)·16 + g (+ 8), columns q0 + nt·8 + 2t (+
        // 1). kLeanKeyLoop recomputes the lane's base here from a volatile thread index: held from
        // the kernel's start, it is a value ptxas spills once the warp halves' dQ/dK-dV orders
        // (below) are in.
        const uint32_t st_p =
            (Cfg::kLeanKeyLoop ? p_store_base(ptx::thread_index_volatile()) : st_p_base) + pds;
#pragma unroll
        for (int mt = 0; mt < kSMt; ++mt)
#pragma unroll
          for (int nt = 0; nt < kPass / 8; ++nt) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              const uint32_t addr = frag_step<kBlockM>(st_p, mt * 16 + half * 8, q_rel + nt * 8);
              st_shared_u32(
                  addr, ptx::pack2<Element>(acc_s[mt][nt][2 * half], acc_s[mt][nt][2 * half + 1]));
              st_shared_u32(addr + kDsAfterP, ptx::pack2<Element>(acc_dp[mt][nt][2 * half],
                                                                  acc_dp[mt][nt][2 * half + 1]));
            }
          }
      };
      if (!has_mod && !has_dropout) {
        // Rolled: unrolled, ptxas overlaps the passes (d 64 has two) and spills.
#pragma unroll 1
        for (int q_rel = 0; q_rel < kSCols; q_rel += kSPass)
          s_pass(std::integral_constant<int, kSPass>{}, std::integral_constant<int, kPlain>{},
                 q_rel);
      } else {
#pragma unroll
        for (int q_rel = 0; q_rel < kSCols; q_rel += 16)
          s_pass(std::integral_constant<int, 16>{}, std::integral_constant<int, kGeneral>{}, q_rel);
      }
    };

    // Phase 2: dV, dK and dQ from that step's P/dS buffer. kOrder: the products' order (kByHalf:
    // dQ first on warps 4-7, last on 0-3).
    auto phase2 = [&](const int stage, const uint32_t pds, const int m_at, const int h,
                      auto order_tag) {
      constexpr int kOrder = decltype(order_tag)::value;
      const int i0 = m_at * kBlockM;
      const uint32_t stage_bytes = stage * kBlockM * kHeadDim * 2;

      // The dK/dV and dQ warp tiles and their fragment bases. Recomputed here from the thread
      // index each step (a volatile read, so it is not hoisted), which keeps four registers free
      // during the Sᵀ/dPᵀ passes, where the dK/dV accumulators leave none to spare.
      const int tid2 = ptx::thread_index_volatile(), warp2 = tid2 >> 5, lane2 = tid2 & 31;
      const int kvg = warp2 % Cfg::kKVKeyGroups;  // dK/dV: key group (kKVMt·16 keys)
      const int kvc = warp2 / Cfg::kKVKeyGroups;  //        column slice
      const int qg = warp2 % Cfg::kDqRowGroups;   // dQ: query group (kDqMt·16 queries)
      const int dcs = warp2 / Cfg::kDqRowGroups;  //     column slice
      const uint32_t a_p_base =
          frag_base_x<kBlockM>(ptx::smem_addr(sP), kvg * kKVMt * 16, 0, lane2) + pds;
      const uint32_t bt_q_base =
          frag_base_x<kHeadDim>(ptx::smem_addr(sQ), 0, kvc * Cfg::KVPieces::kCol0, lane2);
      const uint32_t at_ds_base =
          frag_base_y<kBlockM>(ptx::smem_addr(sDs), 0, qg * kDqMt * 16, lane2) + pds;
      const uint32_t bt_k_base =
          frag_base_x<kHeadDim>(ptx::smem_addr(sK), 0, dcs * Cfg::DqPieces::kCol0, lane2);

      // ---- dV += P̃ᵀ·dO, dK += dSᵀ·Q: keys kvg·kKVMt·16 + [0, kKVMt·16), the warp's kKVCols
      // columns (kvc·kKVCols + [0, kKVCols), or strided pieces at d 96 and 192). Each B fragment
      // (dOᵀ, Qᵀ) feeds kKVMt row tiles.
      auto dkdv_product = [&]() {
#pragma unroll(Cfg::kKVUnroll)
        for (int ks = 0; ks < kBlockM / 16; ++ks) {
          uint32_t a_p[kKVMt][4], a_ds[kKVMt][4];
#pragma unroll
          for (int mt = 0; mt < kKVMt; ++mt) {
            const uint32_t a_addr = frag_step<kBlockM>(a_p_base, mt * 16, ks * 16);
            ptx::ldmatrix_x4(a_p[mt], a_addr);
            ptx::ldmatrix_x4(a_ds[mt], a_addr + kDsAfterP);
          }
#pragma unroll
          for (int np = 0; np < kKVCols / 16; ++np) {
            uint32_t b_do[4], b_q[4];
            const uint32_t b_addr =
                frag_step<kHeadDim>(bt_q_base, ks * 16, Cfg::KVPieces::col(2 * np)) + stage_bytes;
            ptx::ldmatrix_x4_trans(b_do, b_addr + kDoAfterQ);
            ptx::ldmatrix_x4_trans(b_q, b_addr);
#pragma unroll
            for (int mt = 0; mt < kKVMt; ++mt) {
              ptx::mma_m16n8k16<Element>(acc_dv[mt][2 * np], a_p[mt], b_do[0], b_do[1]);
              ptx::mma_m16n8k16<Element>(acc_dv[mt][2 * np + 1], a_p[mt], b_do[2], b_do[3]);
              ptx::mma_m16n8k16<Element>(acc_dk[mt][2 * np], a_ds[mt], b_q[0], b_q[1]);
              ptx::mma_m16n8k16<Element>(acc_dk[mt][2 * np + 1], a_ds[mt], b_q[2], b_q[3]);
            }
          }
        }
      };

      // ---- dQ += dS·K: queries qg·kDqMt·16 + [0, kDqMt·16), the warp's kDqCols columns (as
      // dK/dV's), by chunks. Each B fragment (Kᵀ) feeds kDqMt row tiles.
      auto dq_product = [&]() {
#pragma unroll
        for (int chunk = 0; chunk < kDqCols / kDqChunk; ++chunk) {
          const int n0 = chunk * (kDqChunk / 8);  // the chunk's first n8 tile among the warp's
          const int c0 =
              dcs * Cfg::DqPieces::kCol0 + Cfg::DqPieces::col(n0);  // first column of this chunk
          float acc_dq[kDqMt][kDqChunk / 8][4] = {};
          auto dq_step = [&](int ks) {
            uint32_t a_ds[kDqMt][4];
#pragma unroll
            for (int mt = 0; mt < kDqMt; ++mt)
              ptx::ldmatrix_x4_trans(a_ds[mt], frag_step<kBlockM>(at_ds_base, ks * 16, mt * 16));
#pragma unroll
            for (int np = 0; np < kDqChunk / 16; ++np) {
              uint32_t b_k[4];
              ptx::ldmatrix_x4_trans(
                  b_k, frag_step<kHeadDim>(bt_k_base, ks * 16, Cfg::DqPieces::col(n0 + 2 * np)));
#pragma unroll
              for (int mt = 0; mt < kDqMt; ++mt) {
                ptx::mma_m16n8k16<Element>(acc_dq[mt][2 * np], a_ds[mt], b_k[0], b_k[1]);
                ptx::mma_m16n8k16<Element>(acc_dq[mt][2 * np + 1], a_ds[mt], b_k[2], b_k[3]);
              }
            }
          };
          dq_step(0);  // peeled, as in s_product
#pragma unroll
          for (int ks = 1; ks < kBlockN / 16; ++ks) dq_step(ks);
          // Accumulator rows are kHeadDim wide: columns past head_dim receive zeros (K is
          // zero-filled there) and are never read, so only the row needs a bound.
          const int i_first = i0 + qg * kDqMt * 16 + (lane2 >> 2);
          float* const dq_base =
              dq_accum + (h * p.total_q + q_packed0 + i_first) * kHeadDim + c0 + 2 * (lane2 & 3);
#pragma unroll
          for (int mt = 0; mt < kDqMt; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              if (i_first + mt * 16 + half * 8 >= seq.len_q) continue;
#pragma unroll
              for (int nt = 0; nt < kDqChunk / 8; ++nt)
                atomic_add_pair(dq_base + (mt * 16 + half * 8) * kHeadDim +
                                    (Cfg::DqPieces::col(n0 + nt) - Cfg::DqPieces::col(n0)),
                                acc_dq[mt][nt][2 * half], acc_dq[mt][nt][2 * half + 1]);
            }
        }
      };
      // The two halves of the warps take the two products in opposite orders (warps 4-7 dQ
      // first), so each scheduler (warp w runs on scheduler w % 4) has one warp's dQ reductions
      // beside the other's MMAs, rather than every warp reducing at once before the next barrier
      // (one CTA per SM leaves each barrier in lockstep). H100, A/B in one call: +2.3 to +4.6% on
      // every d 64 and d 128 backward cell, +1 to +2.7% at d 256. (dQ first for every warp
      // measured −2 to −6%, bwd_notes.md v7.)
      if (kOrder == kDqFirst || (kOrder == kByHalf && tid2 >= kThreads / 2)) {
        dq_product();
        dkdv_product();
      } else {
        dkdv_product();
        dq_product();
      }
    };

    if constexpr (!Cfg::kSkewed) {
      int m_at = m_first, h = h_first;  // this step's query block and head
      for (int it = 0; it < iters; ++it) {
        if constexpr (kStages == 1) {
          // This step's own block, into the buffer step it − 1 read (it ended in a barrier).
          load_query_block(it, m_at, h);
          ptx::cp_async_commit();
          ptx::cp_async_wait<0>();
          __syncthreads();
        } else {
          // One barrier both publishes this step's copy (the only one in flight) and tells that
          // every warp is done with step it − 1: its P, dS and its Q/dO buffer, which the prefetch
          // of step it + 1 overwrites. So a step needs no barrier at its end.
          ptx::cp_async_wait<0>();
          __syncthreads();
          if (it + 1 < iters) {
            int m_next = m_at, h_next = h;
            advance(m_next, h_next);
            load_query_block(it + 1, m_next, h_next);
          }
          ptx::cp_async_commit();
        }

        const int stage = it % kStages;
        phase1(stage, 0, m_at, h);
        __syncthreads();
        phase2(stage, 0, m_at, h, std::integral_constant<int, kByHalf>{});
        // With one Q/dO buffer, P, dS and the buffer are free again only after a barrier here.
        if constexpr (kStages == 1) __syncthreads();
        advance(m_at, h);
      }
    } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
      // Three Q/dO buffers and two P/dS buffers need more shared memory than sm_80-sm_89 have;
      // the launcher never runs this code there (it falls back to kTile.min_stages).
      __trap();
#else
      // Skewed steps (three Q/dO buffers, two P/dS buffers, one barrier per step). Between
      // barriers B(k) and B(k + 1) each warp runs phase 2 of step k and phase 1 of step k + 1,
      // warps 4-7 phase 1 first and warps 0-3 phase 2 first, so each scheduler's two warps do
      // different work (Sᵀ/dPᵀ and exponentials beside dK/dV and the dQ reductions) instead of
      // leaving every barrier in lockstep. B(k) proves every warp done with phase 1 of step k (its
      // P/dS buffer full) and with phase 2 of step k − 1 (the other P/dS buffer and step k − 1's
      // Q/dO buffer free: the copy of step k + 2 goes there next); each thread waits for its own
      // copy of step k + 1 before arriving, so B(k) also publishes that block. H100, A/B in one
      // call: +2.4% median over the d 128 backward cells (+3% from s = 4k). Spelled as one loop
      // over alternating phases (one code site per phase; the two orders written out twice spill
      // over 100 bytes), and the halves reach the barrier at different sites. The loop holds
      // only the (block, head) pair of the last copy issued; each step's pair waits in
      // s_step[its Q/dO buffer] for the phases (two steps' pairs in registers spill at d 128).
      int m_last = m_first, h_last = h_first;
      if (iters > 0) load_query_block(0, m_last, h_last);
      ptx::cp_async_commit();
      ptx::cp_async_wait<0>();
      __syncthreads();
      if (iters > 1) {
        advance(m_last, h_last);
        load_query_block(1, m_last, h_last);
      }
      ptx::cp_async_commit();
      // Even u: phase 1 of step u/2. Odd u: phase 2 of step u/2 − late, late = 1 on warps 4-7,
      // which arrive at the barrier after phase 2; warps 0-3 arrive after phase 1.
      const int late = ptx::thread_index_volatile() >= kThreads / 2 ? 1 : 0;
      int k = 0;  // barriers passed
      for (int u = 0; u < 2 * iters + 2; ++u) {
        if ((u & 1) == 0) {
          const int step = u >> 1;
          if (step < iters) {
            const int stage = step % kStages;
            const int2 mh = s_step_read(stage);
            phase1(stage, (step & 1) * Cfg::kPdsBytes, mh.x, mh.y);
          }
        } else {
          const int step = (u >> 1) - late;
          if (step >= 0 && step < iters) {
            const int stage = step % kStages;
            const int2 mh = s_step_read(stage);
            phase2(stage, (step & 1) * Cfg::kPdsBytes, mh.x, mh.y,
                   std::integral_constant<int, kSkewOrder>{});
          }
        }
        if ((u & 1) == late && k < iters) {
          ptx::cp_async_wait<0>();
          __syncthreads();
          if (k + 2 < iters) {
            advance(m_last, h_last);
            load_query_block(k + 2, m_last, h_last);
          }
          ptx::cp_async_commit();
          ++k;
        }
      }
#endif
    }

    // ---- dK (scaled by the softmax scale) and dV of this key block.
    const int kvg = warp % Cfg::kKVKeyGroups, kvc = warp / Cfg::kKVKeyGroups;
    // `probe` turns NaN where this thread's part of dK or dV comes out ±Inf/NaN (a masked pair's
    // P = 0 or dS = 0 meeting an infinite dO or dP in the MMA is NaN): the flag it sets has the
    // backward's fixup kernel recompute the non-finite rows exactly (nonfinite_fixup.cuh). Taken
    // in the store loops, where each accumulator is read last: in a loop of its own before them
    // (every accumulator live, and the probe) the skewed d 128 kernel spilled on sm_90a, as it did
    // with a call to the fixup itself.
    float probe = 0.0f;
    if (w.store16) {
      // Staged through K's and V's buffers (the same shapes and swizzle), then written as whole
      // 16-byte chunks of rows: full sectors and a quarter of the store instructions. With one CTA
      // per SM nothing else runs while a CTA finishes, so at s = 512 this matters.
      ptx::cp_async_wait<0>();  // K/V copies of a block with no visible query were never waited for
      __syncthreads();          // every warp is done reading K and V
      // Per-thread offsets from a volatile thread index, so none is hoisted out of the key-block
      // loop to occupy a register through the steps.
      const int tid3 = ptx::thread_index_volatile(), warp3 = tid3 >> 5, lane3 = tid3 & 31;
      const uint32_t st_kv_base =
          ptx::smem_addr(sK) +
          2 * swz<kHeadDim>((warp3 % Cfg::kKVKeyGroups) * kKVMt * 16 + (lane3 >> 2),
                            (warp3 / Cfg::kKVKeyGroups) * Cfg::KVPieces::kCol0 + 2 * (lane3 & 3));
#pragma unroll
      for (int mt = 0; mt < kKVMt; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
          for (int nt = 0; nt < kKVCols / 8; ++nt) {
            const uint32_t addr =
                frag_step<kHeadDim>(st_kv_base, mt * 16 + half * 8, Cfg::KVPieces::col(nt));
            st_shared_u32(addr, ptx::pack2<Element>(acc_dk[mt][nt][2 * half] * p.scale,
                                                    acc_dk[mt][nt][2 * half + 1] * p.scale));
            st_shared_u32(addr + kVAfterK, ptx::pack2<Element>(acc_dv[mt][nt][2 * half],
                                                               acc_dv[mt][nt][2 * half + 1]));
            probe = nonfinite_probe(nonfinite_probe(probe, acc_dk[mt][nt][2 * half]),
                                    acc_dk[mt][nt][2 * half + 1]);
            probe = nonfinite_probe(nonfinite_probe(probe, acc_dv[mt][nt][2 * half]),
                                    acc_dv[mt][nt][2 * half + 1]);
          }
      if (probe_found(probe)) w.nonfinite[kNonfiniteDkDv] = 1;
      __syncthreads();
      store_tile_swizzled<kBlockN, kHeadDim, kThreads>(
          static_cast<Element*>(p.dk) + b * p.dk_batch_stride +
              (seq.k_row0 + j0) * p.dk_row_stride + hk * p.dk_head_stride,
          p.dk_row_stride, sK, rows_k, d, tid3);
      store_tile_swizzled<kBlockN, kHeadDim, kThreads>(
          static_cast<Element*>(p.dv) + b * p.dv_batch_stride +
              (seq.k_row0 + j0) * p.dv_row_stride + hk * p.dv_head_stride,
          p.dv_row_stride, sV, rows_k, d, tid3);
      __syncthreads();  // the next key block's copies overwrite K and V
      continue;
    }
#pragma unroll
    for (int mt = 0; mt < kKVMt; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int j = j0 + (kvg * kKVMt + mt) * 16 + g + half * 8;
        if (j >= seq.len_k) continue;
        Element* const dk_row = static_cast<Element*>(p.dk) + b * p.dk_batch_stride +
                                (seq.k_row0 + j) * p.dk_row_stride + hk * p.dk_head_stride;
        Element* const dv_row = static_cast<Element*>(p.dv) + b * p.dv_batch_stride +
                                (seq.k_row0 + j) * p.dv_row_stride + hk * p.dv_head_stride;
#pragma unroll
        for (int nt = 0; nt < kKVCols / 8; ++nt) {
          const int col = kvc * Cfg::KVPieces::kCol0 + Cfg::KVPieces::col(nt) + 2 * t;
          if (col >= d) continue;
          store_pair(dk_row + col, acc_dk[mt][nt][2 * half] * p.scale,
                     acc_dk[mt][nt][2 * half + 1] * p.scale, col + 1 < d, w.pair_store);
          store_pair(dv_row + col, acc_dv[mt][nt][2 * half], acc_dv[mt][nt][2 * half + 1],
                     col + 1 < d, w.pair_store);
          probe = nonfinite_probe(nonfinite_probe(probe, acc_dk[mt][nt][2 * half]),
                                  acc_dk[mt][nt][2 * half + 1]);
          probe = nonfinite_probe(nonfinite_probe(probe, acc_dv[mt][nt][2 * half]),
                                  acc_dv[mt][nt][2 * half + 1]);
        }
      }
    if (probe_found(probe)) w.nonfinite[kNonfiniteDkDv] = 1;
    // K/V copies of a block with no visible query were never waited for; the next block reuses the
    // buffers.
    ptx::cp_async_wait<0>();
    __syncthreads();
  }
}

template <DType kDType, int kHeadDim, int kStages>
Status launch_backward_stages(const AttentionParams& p, const BwdWorkspace& w, int key_blocks,
                              cudaStream_t stream) {
  using Cfg = BwdConfig<kHeadDim, kStages>;
  if (p.block_mask != nullptr && !Cfg::kBlockSparse)
    return Status::internal("backward: block-sparse problems need the two-buffer kernel, not " +
                            std::to_string(kStages));
  const auto kernel = attention_backward_kernel<kDType, kHeadDim, kStages>;
  if (const Status s = allow_dynamic_smem(reinterpret_cast<const void*>(kernel), Cfg::kSmemBytes);
      !s.ok())
    return Status::device_error("backward: " + s.message());
  const int ctas = (key_blocks + w.kv_blocks_per_cta - 1) / w.kv_blocks_per_cta;
  const dim3 grid(ctas, p.heads_kv, p.batch);
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p, w);
  return launch_status("backward", [] {
    return "kernel (head_dim bucket " + std::to_string(kHeadDim) + ", " + std::to_string(kStages) +
           " stages)";
  });
}

template <DType kDType, int kHeadDim>
Status launch_backward_main(const AttentionParams& p, const BwdWorkspace& w, int key_blocks,
                            cudaStream_t stream) {
  constexpr BwdTile kTile = bwd_tile(kHeadDim);
  if (w.stages == kTile.stages) {
    if constexpr (BwdConfig<kHeadDim, kTile.stages>::kSkewed) {
      // The skewed steps exist only in sm_90 device code: a device that runs code built for an
      // earlier architecture (whatever its shared memory) takes the fallback.
      int ptx = 0;
      if (const Status s =
              kernel_ptx_version(reinterpret_cast<const void*>(
                                     attention_backward_kernel<kDType, kHeadDim, kTile.stages>),
                                 &ptx);
          !s.ok())
        return Status::device_error("backward: " + s.message());
      if (ptx < 90)
        return launch_backward_stages<kDType, kHeadDim, kTile.min_stages>(p, w, key_blocks, stream);
    }
    return launch_backward_stages<kDType, kHeadDim, kTile.stages>(p, w, key_blocks, stream);
  }
  if constexpr (kTile.min_stages != kTile.stages) {
    if (w.stages == kTile.min_stages)
      return launch_backward_stages<kDType, kHeadDim, kTile.min_stages>(p, w, key_blocks, stream);
  }
  return Status::internal("backward: no kernel with " + std::to_string(w.stages) +
                          " Q/dO stages for head-dim bucket " + std::to_string(kHeadDim));
}

}  // namespace flare::cuda::sm80
