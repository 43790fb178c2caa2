// flash.cpp — the CPU flash backend: tiled online-softmax forward, recomputing backward.
//
// What. Exact attention in fp32 arithmetic on fp32/fp16/bf16 tensors, with every feature of
// AttentionParams (varlen, GQA/MQA, any head_dim 1..256, s_q != s_k, strides, causal/sliding
// window, softcap, ALiBi, dropout), never materialising an s_q × s_k matrix. Extra memory is the
// per-thread tiles below plus, in the backward, one fp32 per (query row, head) for
// D = rowsum(dO∘O) and, when the backward runs in one pass, an fp32 dQ of the heads a thread
// works on: O(seqlen).
//
// One micro-kernel. Every matrix product is C(R, N·lanes) (=, +=, or ·col_scale +=) A · B with
// A's elements broadcast from memory at any row and inner stride and B read as rows of
// contiguous vectors (mm_block). R × N accumulators stay in registers (6 × 2 ymm with AVX2: 12
// accumulators cover the FMA latency of two pipes, and one step loads 2 B vectors and 6
// broadcasts for 12 FMAs; 6 × 4 zmm with AVX-512); the B vectors are pinned in registers, since
// GCC otherwise folds their load into each FMA (one load per row, and the kernel is load-bound:
// that was the previous kernels' 2 × 4 blocks at 33% of the FMA peak).
//
// Forward: queries in lanes. A task is one block of kFwdQ query rows; Qᵀ (d, kFwdQ) is packed
// once per task, and each key tile of kFwdK keys is used in place (fp32, or converted once):
//   Sᵀ(key, q) = K · Qᵀ          rows are keys, K broadcast: no transpose of K
//   softmax down the columns      running max, sum and rescale factor are vectors of 8 queries,
//                                 so the row maxima and sums need no horizontal reductions, and
//                                 keys no query of a vector sees are skipped, not exponentiated
//   Oᵀ(dim, q) = α·Oᵀ + Vᵀ · Pᵀ    V broadcast in place, α folded into the kernel's store
// and Oᵀ is transposed into O once per task.
// Backward: keys in lanes, one pass when the heads balance the threads. A task is one (batch,
// kv head): for each key block it packs Kᵀ, Vᵀ (d, kBwdK) once, then for every query head of
// the group and query block that sees the block computes S = Q Kᵀ, dP = dO Vᵀ, dS, and
// dV += P̃ᵀ dO, dK += dSᵀ Q (complete when the block ends) and dQ += dS K into an fp32 dQ of the
// task's heads: 10 of FlashAttention's s_q·s_k·d FLOP units. When (batch, kv head) tasks are too
// few to keep the threads busy (one head, or MQA with batch 1) it runs two passes instead: a
// task per key block for dK and dV, then one per query block for dQ (14 units, but as many
// tasks as blocks). Both run the same pair function over the same aligned blocks in the same
// order, so every output element is summed in one fixed order whichever runs and whatever the
// thread count (a test checks the bits across thread counts and modes).
// Scores stay in natural units and the weights are p = exp(s − m); the backward recomputes the
// bit-identical fp32 score (the same FMA chain over the head dim from 0: fma is symmetric in its
// product's operands, so K·Qᵀ and Q·Kᵀ agree) and forms exp(s − LSE), so for magnitude-1e3
// inputs, whose softmax is one-hot, the winning key gets exactly P = 1 in both passes, and
// D = dO·O is summed exactly as dP is, so dP − D cancels to 0 there as it does in exact
// arithmetic. Against the float64 reference, fp32 errors stay within the tolerance rule of
// docs/architecture.md (final O scaling and LSE in double, FMA products throughout).
// Key tiles outside the union of a query block's visible ranges are never visited, and within a
// tile only the rows (forward: the vectors of rows) that see one of its keys are computed
// (visible ranges grow with the row, so those rows are contiguous).
//
// NaN and ±Inf propagate as in the reference (tests/test_cpu_nonfinite.cpp): exp keeps NaN; a row
// that sees keys gets NaN when its sum is NaN or 0 (all visible scores −inf: 0/0); keys a row does
// not see get probability and dS exactly 0 by select, never by a product. A product of those
// zeros with an infinite V, dO, Q or K entry would still be NaN (0·Inf) inside the tile's matrix
// products, so a tile whose operand holds a non-finite value (checked only on tiles with masked
// entries, 1/rows of the product's cost) takes a per-row path that sums the visible keys alone.
//
// Threads (OpenMP, dynamic schedule). Tasks are counted from each sequence's own lengths, so a
// varlen call costs what its tokens cost whatever its max_seqlen; cpu/flash_tasks.h counts the
// units of work (one per sequence, head and block of each pass, in either backward mode) for
// tests. Forward: one task per (batch, query head, query block), heaviest (last) blocks first for
// causal balance. Backward: D_i = dO_i·O_i first, then the pass(es) above; deterministic by
// construction.
//
// Measured on an AMD EPYC VM, 2 cores, AVX2+FMA with a 128-bit FPU (one 256-bit FMA per cycle:
// an fp32 peak of 40 GFLOP/s per core, 80 on 2 threads), GCC 12 -O3, fp32, b=1, h=8: the 6 × 2
// micro-kernel alone runs at 93% of the peak on L1-resident tiles; whole calls at 60-75% (50-60
// GFLOP/s on 2 threads, bench/cpu_compare.py), the rest being the softmax's exp (a sixth of the
// forward at d=64, an eighth of the backward), tile copies and row tails. Each step's
// before/after is in its commit message.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <numeric>
#include <type_traits>
#include <vector>

#include "core/backends.h"
#include "core/numeric.h"
#include "core/params.h"
#include "core/philox.h"
#include "core/score_mod.h"
#include "cpu/flash_simd.h"
#include "cpu/flash_tasks.h"
#include "cpu/head_location.h"
#include "cpu/key_rows.h"
#include "cpu/row_finish.h"

// Compiled once per instruction-set level, each copy in its own namespace and with its own
// target (flash_simd.h); flash_dispatch.cpp defines cpu::flash_forward / flash_backward and calls
// the copy for this CPU.
FLARE_SIMD_BEGIN
namespace flare::cpu::FLARE_SIMD_NAMESPACE {
namespace {

using simd::IVec;
using simd::kLanes;
using simd::Vec;

// ---- tile sizes -------------------------------------------------------------------------------
// Register block of the micro-kernel: R rows × N vectors of accumulators, with N B vectors and
// one broadcast beside them (16 registers with AVX2: 12 + 2 + 1; 32 with AVX-512: 24 + 4 + 1).
constexpr int kMicroRows = 6;
constexpr int kMicroVecs = simd::kRegisters == 32 ? 4 : 2;
// Measured single-threaded (CPU time, s=1024, h=8) on the 2-core AMD EPYC (AVX2): kFwdQ 256 over
// 128 halves the K/V tile copies of the forward (memcpy 7.7% -> 3.3% of its samples, d=128 -3%);
// kBwdK 128 over 64 halves the Q/dO re-reads of the backward (d=128 full -4%, others level);
// kBwdQ 32 over 64 no better.
constexpr int kFwdQ = 256;  // query rows per forward task (Qᵀ, Sᵀ, Oᵀ are kFwdQ wide)
constexpr int kFwdK = 64;   // keys per forward tile
constexpr int kBwdQ = 64;   // query rows per backward block
constexpr int kBwdK = 128;  // keys per backward block (S, dP are kBwdK wide)
// Row strides of the tiles are padded by one cache line: at 256 or 512 bytes (64 or 128 floats) a
// column slice of a tile falls into a few L1 sets and evicts itself (8 ways of 64 sets).
constexpr int kPad = 16;
constexpr int kFwdLd = kFwdQ + kPad;  // Qᵀ, Sᵀ, Oᵀ, the dropout tile
constexpr int kBwdLd = kBwdK + kPad;  // Kᵀ, Vᵀ, S, dP
int rows_ld(int dpad) { return dpad + kPad; }  // tiles of rows of the head dim
constexpr float kInf = std::numeric_limits<float>::infinity();
static_assert(kFwdQ % kLanes == 0 && kBwdK % kLanes == 0, "tiles are whole vectors wide");

int round_up(int x, int m) { return (x + m - 1) / m * m; }
int ceil_div(int x, int m) { return (x + m - 1) / m; }

// ---- micro-kernel -------------------------------------------------------------------------------

// Keeps a loaded vector in a register: without it GCC folds the load into every FMA that uses it.
inline void pin(Vec& v) {
#if (defined(__x86_64__) || defined(__i386__)) && FLARE_SIMD_LANES == 16
  __asm__("" : "+v"(v));
#elif defined(__x86_64__) || defined(__i386__)
  __asm__("" : "+x"(v));
#else
  (void)v;
#endif
}

// How a product meets its destination: C = AB, C += AB, or C = C·col_scale + AB (col_scale one
// value per column: the forward's rescale of Oᵀ by α).
enum class Store { kSet, kAdd, kScaleAdd };

// C(rows, vecs·lanes) op= A(rows, inner) · B(inner, vecs·lanes), where A(r, i) = a[r·a_row +
// i·a_inner] (so one kernel reads A by rows or down its columns) and B's row i starts at b + i·ldb.
struct Product {
  const float* a;
  int64_t a_row, a_inner;
  const float* b;
  int64_t ldb;
  int inner;
  float* c;
  int64_t ldc;
  const float* col_scale;  // kScaleAdd only
};

// One register block: R rows, N vectors. The sum over `inner` is one FMA chain per element,
// starting from 0, in order; the destination is met once at the end. Not inlined, and its
// fixed-count loops unrolled with the destination's fields read once, so the accumulators never
// leave the registers: inlined into the forward's loop, GCC stored the pinned B vectors to the
// stack on every step (4 stores per 24 FMAs), and the epilogue's loop over rows, not unrolled,
// sent every accumulator through the stack and reloaded m.c and m.ldc for each store.
template <Store kMode, int R, int N>
[[gnu::noinline]] void mm_block(const Product& m) {
  float* const c = m.c;
  const int64_t ldc = m.ldc;
  const float* const col_scale = m.col_scale;
  Vec acc[R][N];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int n = 0; n < N; ++n) acc[r][n] = Vec{};
  const float* a = m.a;
  const float* b = m.b;
  for (int i = 0; i < m.inner; ++i, a += m.a_inner, b += m.ldb) {
    Vec bv[N];
#pragma GCC unroll 8
    for (int n = 0; n < N; ++n) {
      bv[n] = simd::load(b + n * kLanes);
      pin(bv[n]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const Vec x = simd::splat(a[r * m.a_row]);
#pragma GCC unroll 8
      for (int n = 0; n < N; ++n) acc[r][n] = simd::fma(x, bv[n], acc[r][n]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int n = 0; n < N; ++n) {
      float* out = c + r * ldc + n * kLanes;
      if constexpr (kMode == Store::kSet) {
        simd::store(out, acc[r][n]);
      } else if constexpr (kMode == Store::kAdd) {
        simd::store(out, simd::load(out) + acc[r][n]);
      } else {
        simd::store(out, simd::load(out) * simd::load(col_scale + n * kLanes) + acc[r][n]);
      }
    }
}

// The register-block walk of a product, shared by the fp32 and the bf16-pair kernels: column
// groups outer (a group's B columns stay in L1 across the row blocks), full kMicroRows ×
// kMicroVecs blocks, then the tails. Kernel::block<R, N>(m) runs one block; a product `m` has
// a (advanced by a_row per row), b and c (c by ldc per row), and col_scale (null, or moved with
// its column group).
template <class Kernel, int N, int R, class P>
void row_tail(int rest, const P& m) {
  if constexpr (R > 0) {
    if (rest == R) {
      Kernel::template block<R, N>(m);
    } else {
      row_tail<Kernel, N, R - 1>(rest, m);
    }
  }
}

template <class Kernel, int N, class P>
void block_rows(int rows, P m) {
  int r = 0;
  for (; r + kMicroRows <= rows; r += kMicroRows) {
    Kernel::template block<kMicroRows, N>(m);
    m.a += kMicroRows * m.a_row;
    m.c += kMicroRows * m.ldc;
  }
  row_tail<Kernel, N, kMicroRows - 1>(rows - r, m);
}

template <class Kernel, int N, class P>
void vec_tail(int rest, int rows, const P& m) {
  if constexpr (N > 0) {
    if (rest == N) {
      block_rows<Kernel, N>(rows, m);
    } else {
      vec_tail<Kernel, N - 1>(rest, rows, m);
    }
  }
}

template <class Kernel, class P>
void walk_blocks(int rows, int vecs, P m) {
  if (rows <= 0 || vecs <= 0) return;
  for (int v = 0; v < vecs; v += kMicroVecs) {
    P g = m;
    g.b += v * kLanes;
    g.c += v * kLanes;
    if (g.col_scale != nullptr) g.col_scale += v * kLanes;
    if (vecs - v >= kMicroVecs) {
      block_rows<Kernel, kMicroVecs>(rows, g);
    } else {
      vec_tail<Kernel, kMicroVecs - 1>(vecs - v, rows, g);
    }
  }
}

template <Store kMode>
struct FmaBlocks {
  template <int R, int N>
  static void block(const Product& m) {
    mm_block<kMode, R, N>(m);
  }
};

// The whole product C op= A·B.
template <Store kMode>
void matmul(int rows, int vecs, Product m) {
  walk_blocks<FmaBlocks<kMode>>(rows, vecs, m);
}

#if FLARE_SIMD_BF16
// ---- bf16 pair products (AVX-512 BF16) ----------------------------------------------------------

// C(rows, vecs·lanes) op= A(rows, inner) · B(inner, vecs·lanes) for bf16 A and B, fp32 C, with
// the inner dimension in pairs: A's row r pair i is the 32-bit word a[r·a_row + i·a_inner] (two
// bf16, the even-indexed one in the low half, as a row of bf16 holds them), B's pair row i the
// words at b + i·ldb (lane j: the two elements of column j). One vdpbf16ps per (row, vector,
// pair) does two FMAs per lane: the products of bf16 values are exact in fp32, as in the fp32
// kernel's FMA chain; the sum runs pair by pair (the odd element first), from 0, the destination
// met once at the end, as Store says.
struct PairProduct {
  const uint32_t* a;
  int64_t a_row, a_inner;
  const uint32_t* b;
  int64_t ldb;
  int pairs;
  float* c;
  int64_t ldc;
  const float* col_scale;  // kScaleAdd only
};

template <Store kMode, int R, int N>
[[gnu::noinline]] void mm_pairs_block(const PairProduct& m) {
  float* const c = m.c;
  const int64_t ldc = m.ldc, a_row = m.a_row;
  __m512 acc[R][N];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int n = 0; n < N; ++n) acc[r][n] = _mm512_setzero_ps();
  const uint32_t* a = m.a;
  const uint32_t* b = m.b;
  for (int i = 0; i < m.pairs; ++i, a += m.a_inner, b += m.ldb) {
    __m512i bv[N];
#pragma GCC unroll 8
    for (int n = 0; n < N; ++n) {
      bv[n] = _mm512_loadu_si512(b + n * kLanes);
      __asm__("" : "+v"(bv[n]));  // one load per vector, kept in a register (see pin)
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i x = _mm512_set1_epi32(static_cast<int>(a[r * a_row]));
#pragma GCC unroll 8
      for (int n = 0; n < N; ++n)
        acc[r][n] = _mm512_dpbf16_ps(acc[r][n], reinterpret_cast<__m512bh>(x),
                                     reinterpret_cast<__m512bh>(bv[n]));
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int n = 0; n < N; ++n) {
      float* out = c + r * ldc + n * kLanes;
      if constexpr (kMode == Store::kSet) {
        _mm512_storeu_ps(out, acc[r][n]);
      } else if constexpr (kMode == Store::kAdd) {
        _mm512_storeu_ps(out, _mm512_add_ps(_mm512_loadu_ps(out), acc[r][n]));
      } else {
        const __m512 scale = _mm512_loadu_ps(m.col_scale + n * kLanes);
        _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_loadu_ps(out), scale, acc[r][n]));
      }
    }
}

template <Store kMode>
struct PairBlocks {
  template <int R, int N>
  static void block(const PairProduct& m) {
    mm_pairs_block<kMode, R, N>(m);
  }
};

template <Store kMode>
void matmul_pairs(int rows, int vecs, PairProduct m) {
  walk_blocks<PairBlocks<kMode>>(rows, vecs, m);
}

// Pair tiles of the backward's dV, dK and dQ products, whose inner dimension (query rows for dV
// and dK, keys for dQ) runs down a tile's columns or along its rows. The shifts and widening take
// the zero-masked intrinsics with every lane on: GCC 12 warns that the plain ones' undefined
// pass-through is used uninitialised.
constexpr __mmask16 kEveryLane = 0xFFFF;

// fp32 rows holding bf16 values exactly (Q, dO and K as the tiles hold them, converted from the
// user's bf16) as pair rows: word (i, j) of dst (row stride ld) pairs column j of rows 2i and
// 2i + 1, for `vecs` vectors of columns; an odd last row pairs with 0. The bf16 bits are the fp32
// bits' high half.
void interleave_rows(const float* src, int64_t lds, int rows, int vecs, uint32_t* dst, int64_t ld) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int i = 0; i < rows; i += 2, src += 2 * lds, dst += ld)
    for (int n = 0; n < vecs; ++n) {
      const __m512i even =
          _mm512_maskz_srli_epi32(kEveryLane, _mm512_loadu_si512(src + n * kLanes), 16);
      const __m512i odd = i + 1 < rows
                              ? _mm512_and_si512(_mm512_loadu_si512(src + lds + n * kLanes), high)
                              : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + n * kLanes, _mm512_or_si512(even, odd));
    }
}

// bf16 bits of 16 fp32 values, rounded to nearest even, one per 32-bit lane (high half 0).
inline __m512i bf16_lanes(__m512 x) {
  return _mm512_maskz_cvtepu16_epi32(kEveryLane, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)));
}

// The same pairing for fp32 values that are not bf16 (P, P̃ and dS), rounded to bf16 as a
// low-precision kernel rounds them before their products: word (i, c) of dst (row stride ldd)
// pairs column c of rows a0 + 2i and a0 + 2i + 1 of src (row stride lds), a0 = a rounded down
// to even, for the rows [a, e); rows outside them count as 0 (never read).
void round_row_pairs(const float* src, int64_t lds, int a, int e, int vecs, uint32_t* dst,
                     int64_t ldd) {
  auto row = [&](int r, int n) {
    return r >= a && r < e ? bf16_lanes(_mm512_loadu_ps(src + r * lds + n * kLanes))
                           : _mm512_setzero_si512();
  };
  for (int r = a & ~1; r < e; r += 2, dst += ldd)
    for (int n = 0; n < vecs; ++n) {
      const __m512i odd = _mm512_maskz_slli_epi32(kEveryLane, row(r + 1, n), 16);
      _mm512_storeu_si512(dst + n * kLanes, _mm512_or_si512(row(r, n), odd));
    }
}

// Rows of src (row stride lds) rounded to bf16, their columns [0, cols) in pairs along the row:
// word (r, k) of dst (row stride ld) pairs columns 2k and 2k + 1; columns from `cols` on count
// as 0 (never read from src: lanes past a block's keys hold no defined value).
void round_column_pairs(const float* src, int64_t lds, int rows, int cols, uint32_t* dst,
                        int64_t ld) {
  auto lanes_below = [](int n) {
    return n >= kLanes ? static_cast<__mmask16>(0xFFFF)
                       : static_cast<__mmask16>(n <= 0 ? 0 : (1u << n) - 1);
  };
  for (int r = 0; r < rows; ++r, src += lds, dst += ld)
    for (int c = 0; c < cols; c += 2 * kLanes) {
      const __m512 lo = _mm512_maskz_loadu_ps(lanes_below(cols - c), src + c);
      const __m512 hi = _mm512_maskz_loadu_ps(lanes_below(cols - c - kLanes), src + c + kLanes);
      _mm512_storeu_si512(dst + c / 2, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    }
}
#endif  // FLARE_SIMD_BF16

// Which products take bf16 pairs straight from the user's rows: bf16 on a CPU with AVX-512 BF16,
// an even head dim, and both operands' rows starting on 32-bit words (4-byte aligned data, even
// strides). Scores S = QKᵀ, in every forward and in the backward alike (the backward's P =
// exp(S − LSE) needs the forward's bits: a score of 1e6 that moves by an ulp moves P by 6%);
// dP = dO·Vᵀ in the backward, with D = dO·O summed in the same order (delta_block), so that
// dP − D cancels to 0 exactly where O is one V row.
bool pair_rows(const void* data, std::initializer_list<int64_t> strides) {
  if (reinterpret_cast<uintptr_t>(data) % 4 != 0) return false;
  for (int64_t stride : strides)
    if (stride % 2 != 0) return false;
  return true;
}
bool pairs_possible(const AttentionParams& p) {
  return FLARE_SIMD_BF16 && p.dtype == DType::kBFloat16 && p.head_dim % 2 == 0;
}
bool score_pairs(const AttentionParams& p) {
  return pairs_possible(p) &&
         pair_rows(p.q, {p.q_batch_stride, p.q_row_stride, p.q_head_stride}) &&
         pair_rows(p.k, {p.k_batch_stride, p.k_row_stride, p.k_head_stride});
}
bool dp_pairs(const AttentionParams& p) {
  return pairs_possible(p) &&
         pair_rows(p.dout, {p.do_batch_stride, p.do_row_stride, p.do_head_stride}) &&
         pair_rows(p.v, {p.v_batch_stride, p.v_row_stride, p.v_head_stride});
}
// The products of what the kernel forms, in pairs: the forward's P·V and the backward's dV =
// P̃ᵀdO, dK = dSᵀQ and dQ = dS·K, with P, P̃ and dS rounded to bf16 first (as the tolerance
// rule's low-precision kernel rounds them), for any bf16 layout: their pair tiles are built from
// the fp32 tiles (interleave_rows, round_row_pairs, round_column_pairs), not read from the user's
// rows.
bool bf16_products(const AttentionParams& p) {
  return FLARE_SIMD_BF16 && p.dtype == DType::kBFloat16;
}

// ---- tile loads and stores ----------------------------------------------------------------------

// Converts `d` elements of a user tensor, starting at element `offset`, to fp32.
void load_row(const void* src, DType dtype, int64_t offset, int d, float* dst) {
  if (dtype == DType::kFloat32) {
    std::memcpy(dst, static_cast<const float*>(src) + offset, sizeof(float) * d);
  } else if (dtype == DType::kBFloat16) {
    const uint16_t* s = static_cast<const uint16_t*>(src) + offset;
    for (int c = 0; c < d; ++c) dst[c] = bf16_to_float(s[c]);
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src) + offset;
    for (int c = 0; c < d; ++c) dst[c] = half_to_float(s[c]);
  }
}

// `rows` rows (row stride `stride`) into a dense tile with row stride ld, columns [d, ld) zeroed.
void load_rows(const void* src, DType dtype, int64_t offset, int64_t stride, int rows, int d,
               float* dst, int ld) {
  for (int r = 0; r < rows; ++r) {
    load_row(src, dtype, offset + r * stride, d, dst + r * ld);
    std::fill(dst + r * ld + d, dst + (r + 1) * ld, 0.0f);
  }
}

// `rows` rows into columns [0, rows) of a transposed tile (d rows, row stride width). fp32 rows go
// kLanes × kLanes blocks at a time through registers (simd::transpose): a row scattered element
// by element touches d lines of the tile for every row, and was the decoding path's main cost.
void transpose_rows(const void* src, DType dtype, int64_t offset, int64_t stride, int rows, int d,
                    float* dst, int width, float* row_buffer) {
  int r = 0;
  if (dtype == DType::kFloat32) {
    const float* s = static_cast<const float*>(src) + offset;
    const int d_blocks = d - d % kLanes;
    for (; r + kLanes <= rows; r += kLanes) {
      for (int c = 0; c < d_blocks; c += kLanes) {
        Vec block[kLanes];
        for (int k = 0; k < kLanes; ++k) block[k] = simd::load(s + (r + k) * stride + c);
        simd::transpose(block);
        for (int k = 0; k < kLanes; ++k) simd::store(dst + (c + k) * width + r, block[k]);
      }
      for (int k = 0; k < kLanes; ++k)
        for (int c = d_blocks; c < d; ++c) dst[c * width + r + k] = s[(r + k) * stride + c];
    }
  }
  for (; r < rows; ++r) {
    load_row(src, dtype, offset + r * stride, d, row_buffer);
    for (int c = 0; c < d; ++c) dst[c * width + r] = row_buffer[c];
  }
}

// Columns [cols, width) of a (d, width) tile zeroed: the lanes past its last row or key.
void zero_columns(float* dst, int cols, int d, int width) {
  if (cols < width)
    for (int c = 0; c < d; ++c) std::fill(dst + c * width + cols, dst + (c + 1) * width, 0.0f);
}

// `rows` rows into a transposed tile (d, width); columns [rows, width) zeroed.
void load_transposed(const void* src, DType dtype, int64_t offset, int64_t stride, int rows, int d,
                     float* dst, int width, float* row_buffer) {
  transpose_rows(src, dtype, offset, stride, rows, d, dst, width, row_buffer);
  zero_columns(dst, rows, d, width);
}

// Asks for `rows` rows of d elements (row stride `stride`) to be brought into the cache: the next
// tile's, while this one is computed. Rows of one head lie a whole token apart (4 KiB for 8 heads
// of 128), a stride the hardware prefetchers do not follow, and each tile re-reads them from L3.
void prefetch_rows(const void* src, DType dtype, int64_t offset, int64_t stride, int rows, int d) {
  const int64_t size = dtype == DType::kFloat32 ? 4 : 2;
  const char* base = static_cast<const char*>(src);
  for (int r = 0; r < rows; ++r) {
    const char* row = base + (offset + r * stride) * size;
    for (int64_t byte = 0; byte < d * size; byte += 64) __builtin_prefetch(row + byte);
    __builtin_prefetch(row + d * size - 1);
  }
}

// Keys [j0, j0 + nk) of one (sequence, kv head) into dense K and V tiles, found run by run
// through `keys` (key_rows.h): V in fp32 (row stride d); K in fp32 too, or with `k_pairs` as bf16
// pairs for score_pairs (each row's d / 2 words, row stride d / 2). Copied even from fp32: read in
// place at the tensor's row stride (4 KiB for 8 heads of 128), a tile's rows would share a few L1
// sets.
void load_key_tiles(const AttentionParams& p, const KeyRows& keys, const HeadLocation& at, int j0,
                    int nk, bool k_pairs, float* ktile, float* vtile) {
  const int d = p.head_dim;
  for (int j = j0; j < j0 + nk;) {  // all of K first, then V, as the tiles are used
    const KeyRun run = key_run(p, keys, at, j0, j, j0 + nk);
    for (int r = 0; r < run.n; ++r) {
      const int64_t row = run.r0 + r, from = run.k + r * run.k_stride;
      if (k_pairs)
        std::memcpy(reinterpret_cast<uint32_t*>(ktile) + row * (d / 2),
                    static_cast<const uint32_t*>(p.k) + from / 2, sizeof(uint32_t) * (d / 2));
      else
        load_row(p.k, p.dtype, from, d, ktile + row * d);
    }
    j += run.n;
  }
  for (int j = j0; j < j0 + nk;) {
    const KeyRun run = key_run(p, keys, at, j0, j, j0 + nk);
    for (int r = 0; r < run.n; ++r)
      load_row(p.v, p.dtype, run.v + r * run.v_stride, d, vtile + int64_t{run.r0 + r} * d);
    j += run.n;
  }
}

// The K and V rows of keys [j0, j0 + nk) asked into the cache (prefetch_rows), run by run.
void prefetch_keys(const AttentionParams& p, const KeyRows& keys, const HeadLocation& at, int j0,
                   int nk) {
  for (int j = j0; j < j0 + nk;) {
    const KeyRun run = key_run(p, keys, at, j0, j, j0 + nk);
    prefetch_rows(p.k, p.dtype, run.k, run.k_stride, run.n, p.head_dim);
    prefetch_rows(p.v, p.dtype, run.v, run.v_stride, run.n, p.head_dim);
    j += run.n;
  }
}

// `rows` rows of a dense tile (row stride ld), times `factor` (rounded once), into a user tensor.
void store_rows(const float* src, int ld, double factor, int rows, int d, void* dst, DType dtype,
                int64_t offset, int64_t stride) {
  for (int r = 0; r < rows; ++r) {
    const float* s = src + r * ld;
    const int64_t o = offset + r * stride;
    if (dtype == DType::kFloat32) {
      float* out = static_cast<float*>(dst) + o;
      for (int c = 0; c < d; ++c) out[c] = static_cast<float>(s[c] * factor);
    } else {
      for (int c = 0; c < d; ++c)
        store_from_float(dst, o + c, dtype, static_cast<float>(s[c] * factor));
    }
  }
}

// Whether `rows` rows of n floats (row stride ld) are all finite: x·0 is 0 for finite x and NaN
// for ±Inf and NaN. Run on a tile with masked entries, it costs one multiply-add per vector,
// 1/rows of the matrix product that reads it.
bool all_finite(const float* x, int64_t ld, int rows, int n) {
  Vec acc = Vec{};
  float tail = 0.0f;
  for (int r = 0; r < rows; ++r) {
    const float* row = x + r * ld;
    int i = 0;
    for (; i + kLanes <= n; i += kLanes) acc += simd::load(row + i) * 0.0f;
    for (; i < n; ++i) tail += row[i] * 0.0f;
  }
  return simd::reduce_sum(acc) + tail == 0.0f;
}

// ---- scores -------------------------------------------------------------------------------------

// Where one (batch, query head) lives (head_location.h) and how its raw dot products become
// scores.
struct Head : HeadLocation {
  float scale = 0.0f;
  float softcap = 0.0f, inv_softcap = 0.0f;
  bool plain = true;  // neither softcap nor ALiBi
  int shift = 0;      // len_k − len_q: row i sits at key position i + shift
};

Head make_head(const AttentionParams& p, int b, int h) {
  Head hd{locate_head(p, b, h)};
  hd.scale = p.scale;
  hd.softcap = p.softcap;
  hd.inv_softcap = p.softcap > 0.0f ? 1.0f / p.softcap : 0.0f;
  hd.plain = !p.has_score_mods();
  hd.shift = hd.seq.len_k - hd.seq.len_q;
  return hd;
}

// Scores (natural units) of raw dot products, in attention.h's order: scale, softcap, ALiBi.
// `dist` is row + shift − key per lane (read only with ALiBi). *dcap receives the softcap
// chain-rule factor 1 − tanh² (left alone when softcap is off). The forward (queries in lanes)
// and the backward (keys in lanes) both come here, so a score is the same bits in both.
inline Vec modified_scores(Vec raw, const Head& hd, IVec dist, Vec* dcap) {
  Vec s = raw * hd.scale;
  if (!hd.plain) {
    if (hd.softcap > 0.0f) {
      const Vec th = simd::tanh(s * hd.inv_softcap);
      s = th * hd.softcap;
      *dcap = 1.0f - th * th;
    }
    if (hd.slope != 0.0f) s = s - hd.slope * simd::abs(__builtin_convertvector(dist, Vec));
  }
  return s;
}

// z[c] = keep_value where key j0 + c of `row` survives dropout, else 0; zero from n to width.
void dropout_row(const AttentionParams& p, uint32_t bh, int row, int j0, int n, float keep_value,
                 float* z, int width) {
  int c = 0;
  while (c < n) {
    const int j = j0 + c;
    const Philox4 w = dropout_words(p.seed, p.offset, bh, static_cast<uint32_t>(row),
                                    static_cast<uint32_t>(j) >> 2);
    for (int lane = j & 3; lane < 4 && c < n; ++lane, ++c)
      z[c] = dropout_uniform(philox_word(w, lane)) >= p.dropout_p ? keep_value : 0.0f;
  }
  std::fill(z + n, z + width, 0.0f);
}

// Visible key range of every row of a query block, and its union [*klo, *khi) (empty: klo ≥ khi).
void block_ranges(const AttentionParams& p, const Head& hd, int i0, int rows, int* lo, int* hi,
                  int* klo, int* khi) {
  *klo = hd.seq.len_k;
  *khi = 0;
  for (int r = 0; r < rows; ++r) {
    const KeyRange kr = visible_keys(i0 + r, hd.seq.len_q, hd.seq.len_k, p.window_left,
                                     p.window_right);
    lo[r] = kr.lo;
    hi[r] = kr.hi;
    if (kr.lo < kr.hi) {
      *klo = std::min(*klo, kr.lo);
      *khi = std::max(*khi, kr.hi);
    }
  }
}

// Rows [*ra, *rb) of a block that see a key in [j0, j1). Visible ranges grow with the row and
// empty rows come first, so these rows are contiguous.
void rows_meeting(const int* lo, const int* hi, int rows, int j0, int j1, int* ra, int* rb) {
  int a = 0;
  while (a < rows && !(hi[a] > j0 && lo[a] < hi[a])) ++a;
  int b = a;
  while (b < rows && lo[b] < j1) ++b;
  *ra = a;
  *rb = b;
}

// Whether some row of [ra, rb) (each seeing a key of [j0, j1)) misses a key of [j0, j1): its
// probabilities there are 0, which the tile's matrix products multiply like any other. Visible
// ranges grow with the row, so the first row has the smallest hi and the last the largest lo.
bool tile_masked(const int* lo, const int* hi, int ra, int rb, int j0, int j1) {
  return lo[rb - 1] > j0 || hi[ra] < j1;
}

// First query row of [0, len) for which pred holds, given pred is false…false true…true.
template <typename Pred>
int first_row(int len, Pred pred) {
  int a = 0, b = len;
  while (a < b) {
    const int mid = a + (b - a) / 2;
    if (pred(mid)) {
      b = mid;
    } else {
      a = mid + 1;
    }
  }
  return a;
}

// Per-thread fp32 scratch carved into 64-byte aligned tiles.
class Carver {
 public:
  explicit Carver(float* base) : next_(align(base)) {}
  float* take(int64_t n) {
    float* t = next_;
    next_ += (n + 15) / 16 * 16;
    return t;
  }
  static int64_t size(std::initializer_list<int64_t> tiles) {
    int64_t s = 16;
    for (int64_t n : tiles) s += (n + 15) / 16 * 16;
    return s;
  }

 private:
  static float* align(float* p) {
    const auto u = reinterpret_cast<uintptr_t>(p);
    return reinterpret_cast<float*>((u + 63) & ~uintptr_t{63});
  }
  float* next_;
};

// One fp32 buffer per thread; false when the allocation fails.
bool allocate_scratch(int threads, int64_t floats, std::vector<std::vector<float>>* scratch) {
  try {
    scratch->assign(threads, std::vector<float>(static_cast<size_t>(floats)));
  } catch (const std::bad_alloc&) {
    return false;
  }
  return true;
}

// ---- tasks --------------------------------------------------------------------------------------

// The tasks of one pass: one per (sequence, head, block) for the blocks each sequence has. Counted
// from the sequence lengths themselves, so that a varlen call costs time in proportion to its
// tokens, not to max_seqlen (only an upper bound on the CPU, where cu_seqlens can be read).
class BlockTasks {
 public:
  struct Task {
    int b, h;
    int block;   // in [0, blocks)
    int blocks;  // of this sequence
  };

  BlockTasks() = default;  // no tasks

  // `block` rows per block of the query side (`query_side`) or of the keys; `heads` per sequence.
  // Throws std::bad_alloc (one entry per sequence).
  BlockTasks(const AttentionParams& p, int heads, int block, bool query_side) : heads_(heads) {
    first_.resize(static_cast<size_t>(p.batch) + 1);
    first_[0] = 0;
    for (int b = 0; b < p.batch; ++b) {
      const SequenceInfo seq = sequence_info(p, b);
      first_[b + 1] = first_[b] + int64_t{heads} * ceil_div(query_side ? seq.len_q : seq.len_k, block);
    }
  }

  int64_t size() const { return first_.back(); }

  Task operator[](int64_t task) const {
    // The last sequence starting at or before `task` (sequences without blocks start where the
    // next one does, so they are never chosen).
    const int b = static_cast<int>(std::upper_bound(first_.begin(), first_.end(), task) -
                                   first_.begin()) - 1;
    const int64_t local = task - first_[b];
    const int blocks = static_cast<int>((first_[b + 1] - first_[b]) / heads_);
    return {b, static_cast<int>(local / blocks), static_cast<int>(local % blocks), blocks};
  }

 private:
  std::vector<int64_t> first_{0};  // first task of sequence b; first_[batch] = all tasks
  int heads_ = 1;
};

// ---- forward ------------------------------------------------------------------------------------

// Row stride of the forward's V pair tile (bf16_products): whole vectors of the head dim.
int v_pairs_ld(int d) { return round_up(d, kLanes) + kPad; }

int64_t forward_scratch_floats(int d) {
  return Carver::size({int64_t{d} * kFwdLd, int64_t{kFwdK} * kFwdLd, int64_t{d} * kFwdLd,
                       int64_t{kFwdK} * d, int64_t{kFwdK} * d, int64_t{kFwdK} * kFwdLd, kFwdLd,
                       kFwdLd, kFwdLd, round_up(std::max(d, kFwdK), kLanes),
                       int64_t{kFwdK / 2} * v_pairs_ld(d), int64_t{kFwdK / 2} * kFwdLd});
}

// Rows [i0, i0 + kFwdQ) of query head h, queries in lanes (see the top of the file).
void forward_block(const AttentionParams& p, const KeyRows& keys, int b, int h, int qblock,
                   float* scratch) {
  flash_tasks_run.fetch_add(1, std::memory_order_relaxed);
  const Head hd = make_head(p, b, h);
  const int i0 = qblock * kFwdQ;
  if (i0 >= hd.seq.len_q) return;
  const int nq = std::min(kFwdQ, hd.seq.len_q - i0);
  const int d = p.head_dim;
  const int qvecs = ceil_div(nq, kLanes);
  constexpr int ld = kFwdLd;  // row stride of Qᵀ, Sᵀ, Oᵀ and the dropout tile
  const bool dropout = p.dropout_p > 0.0f;

  Carver carve(scratch);
  float* qt = carve.take(int64_t{d} * ld);      // (d, kFwdQ) Qᵀ; columns from nq zeroed
  float* st = carve.take(int64_t{kFwdK} * ld);  // (kFwdK, kFwdQ) Sᵀ → Pᵀ
  float* ot = carve.take(int64_t{d} * ld);      // (d, kFwdQ) unnormalised Oᵀ
  float* ktile = carve.take(int64_t{kFwdK} * d);  // (kFwdK, d) K converted, or in pairs
  float* vtile = carve.take(int64_t{kFwdK} * d);  // (kFwdK, d) V likewise
  float* zt = carve.take(int64_t{kFwdK} * ld);  // (kFwdK, kFwdQ) dropout multipliers
  float* m = carve.take(ld);                    // running max per query, natural units
  float* l = carve.take(ld);                    // running Σ exp(s − m)
  float* alpha = carve.take(ld);                // this tile's rescale of the running sums
  float* row_buffer = carve.take(round_up(std::max(d, kFwdK), kLanes));
#if FLARE_SIMD_BF16
  // With bf16_products: P·V in pairs of keys, V's rows interleaved and Pᵀ's rounded.
  const bool pv_pairs = bf16_products(p);
  const int64_t ldvp = v_pairs_ld(d);
  auto* v_pairs = reinterpret_cast<uint32_t*>(carve.take(int64_t{kFwdK / 2} * ldvp));
  auto* p_pairs = reinterpret_cast<uint32_t*>(carve.take(int64_t{kFwdK / 2} * ld));
#endif
  int lo[kFwdQ], hi[kFwdQ];
  // Per vector of queries: the union of their visible ranges [vis_lo, vis_hi), and the bounds
  // [lo_max, hi_min) that every query of the vector sees.
  constexpr int kVecs = kFwdQ / kLanes;
  int vis_lo[kVecs], vis_hi[kVecs], lo_max[kVecs], hi_min[kVecs];

  int klo, khi;
  block_ranges(p, hd, i0, nq, lo, hi, &klo, &khi);
  std::fill(lo + nq, lo + kFwdQ, 0);  // padding lanes: an empty range, never stored
  std::fill(hi + nq, hi + kFwdQ, 0);
  for (int c = 0; c < qvecs; ++c) {
    vis_lo[c] = hd.seq.len_k;
    vis_hi[c] = 0;
    lo_max[c] = 0;
    hi_min[c] = hd.seq.len_k;
    for (int r = c * kLanes; r < std::min((c + 1) * kLanes, nq); ++r) {
      lo_max[c] = std::max(lo_max[c], lo[r]);
      hi_min[c] = std::min(hi_min[c], hi[r]);
      if (lo[r] < hi[r]) {
        vis_lo[c] = std::min(vis_lo[c], lo[r]);
        vis_hi[c] = std::max(vis_hi[c], hi[r]);
      }
    }
  }
  // Qᵀ, in pairs (its rows' words transposed) where the scores take them (score_pairs).
  const bool pairs = score_pairs(p);
  if (pairs)
    load_transposed(p.q, DType::kFloat32, (hd.q + i0 * p.q_row_stride) / 2, p.q_row_stride / 2, nq,
                    d / 2, qt, ld, row_buffer);
  else
    load_transposed(p.q, p.dtype, hd.q + i0 * p.q_row_stride, p.q_row_stride, nq, d, qt, ld,
                    row_buffer);
  std::fill(m, m + ld, -kInf);
  std::fill(l, l + ld, 0.0f);
  std::fill(ot, ot + int64_t{d} * ld, 0.0f);

  for (int j0 = klo; j0 < khi; j0 += kFwdK) {
    const int nk = std::min(kFwdK, khi - j0), j1 = j0 + nk;
    int ra, rb;
    rows_meeting(lo, hi, nq, j0, j1, &ra, &rb);
    if (ra == rb) continue;
    const int ca = ra / kLanes, cb = ceil_div(rb, kLanes);  // vectors of queries computed
    load_key_tiles(p, keys, hd, j0, nk, pairs, ktile, vtile);
    const float* kr = ktile;
    const float* vr = vtile;
    const int64_t ldk = d, ldv = d;
    if (j1 < khi) prefetch_keys(p, keys, hd, j1, std::min(kFwdK, khi - j1));
    bool masked = false;
    for (int c = ca; c < cb; ++c) masked = masked || lo_max[c] > j0 || hi_min[c] < j1;
    // A masked key's weight is 0, and 0·Inf = NaN: a non-finite value may reach only the rows
    // that see its key, so then each row sums its visible keys alone, as the reference does.
    const bool per_row = masked && !all_finite(vr, ldv, nk, d);
#if FLARE_SIMD_BF16
    if (pv_pairs && !per_row) interleave_rows(vr, ldv, nk, ceil_div(d, kLanes), v_pairs, ldvp);
#endif

    if (dropout)
      for (int r = ca * kLanes; r < std::min(cb * kLanes, nq); ++r) {
        dropout_row(p, hd.bh, i0 + r, j0, nk, 1.0f, row_buffer, nk);
        for (int k = 0; k < nk; ++k) zt[k * ld + r] = row_buffer[k];
      }

    // Online softmax down vector c of queries: Sᵀ becomes Pᵀ (keys no query of the vector
    // sees are 0 without an exp), and α rescales the running sums.
    // Keys [*ka, *kb) of the tile that some query of vector c sees (empty: ka = kb).
    auto seen_keys = [&](int c, int* ka, int* kb) {
      const bool full = lo_max[c] <= j0 && hi_min[c] >= j1;
      *kb = full ? nk : std::clamp(vis_hi[c] - j0, 0, nk);
      *ka = std::min(*kb, full ? 0 : std::clamp(vis_lo[c] - j0, 0, nk));
    };
    // Keys [ga, gb) of the group's products: the others' probabilities are 0 in every vector.
    auto softmax_vector = [&](int c, int ga, int gb) {
      const int q0 = c * kLanes;
      const bool full = lo_max[c] <= j0 && hi_min[c] >= j1;
      int ka, kb;
      seen_keys(c, &ka, &kb);
      IVec lov, hiv;
      std::memcpy(&lov, lo + q0, sizeof lov);
      std::memcpy(&hiv, hi + q0, sizeof hiv);
      const IVec dist0 = simd::splat_int(i0 + q0 + hd.shift - j0) + simd::lane_index();
      Vec vmax = simd::splat(-kInf);
      for (int k = ka; k < kb; ++k) {
        Vec unused_dcap;
        Vec s = modified_scores(simd::load(st + k * ld + q0), hd, dist0 - k, &unused_dcap);
        if (!full) {
          const IVec j = simd::splat_int(j0 + k);
          s = simd::select((lov <= j) & (hiv > j), s, simd::splat(-kInf));
        }
        simd::store(st + k * ld + q0, s);
        vmax = simd::max(vmax, s);
      }
      const Vec m_old = simd::load(m + q0);
      const Vec m_new = simd::max(m_old, vmax);
      // A query that has seen no key yet keeps m = −inf; exponentiating against 0 keeps p = 0.
      const Vec m_use = simd::select(m_new == -kInf, Vec{}, m_new);
      const Vec a = simd::exp(m_old - m_use);
      Vec sum = Vec{};
      for (int k = ga; k < ka; ++k) simd::store(st + k * ld + q0, Vec{});
      for (int k = ka; k < kb; ++k) {
        Vec e = simd::exp(simd::load(st + k * ld + q0) - m_use);
        sum += e;
        if (dropout) e *= simd::load(zt + k * ld + q0);
        simd::store(st + k * ld + q0, e);
      }
      for (int k = kb; k < gb; ++k) simd::store(st + k * ld + q0, Vec{});
      simd::store(l + q0, simd::load(l + q0) * a + sum);
      simd::store(m + q0, m_new);
      simd::store(alpha + q0, a);
    };

    // Column groups of kMicroVecs vectors of queries, each through Sᵀ(key, q) = K · Qᵀ, the
    // softmax and Oᵀ(dim, q) = α·Oᵀ + Vᵀ · Pᵀ while its slice of Sᵀ is in L1.
    // On the causal diagonal only the keys some query of the group sees enter its products.
    for (int g0 = ca; g0 < cb; g0 += kMicroVecs) {
      const int g1 = std::min(cb, g0 + kMicroVecs);
      int ga = nk, gb = 0;
      for (int c = g0; c < g1; ++c) {
        int ka, kb;
        seen_keys(c, &ka, &kb);
        if (ka < kb) {
          ga = std::min(ga, ka);
          gb = std::max(gb, kb);
        }
      }
      ga = std::min(ga, gb);
#if FLARE_SIMD_BF16
      if (pairs)
        matmul_pairs<Store::kSet>(gb - ga, g1 - g0,
                     {reinterpret_cast<const uint32_t*>(kr) + ga * (d / 2), d / 2, 1,
                      reinterpret_cast<const uint32_t*>(qt) + g0 * kLanes, ld, d / 2,
                      st + ga * ld + g0 * kLanes, ld, nullptr});
      else
#endif
        matmul<Store::kSet>(gb - ga, g1 - g0, {kr + ga * ldk, ldk, 1, qt + g0 * kLanes, ld, d,
                                               st + ga * ld + g0 * kLanes, ld, nullptr});
      for (int c = g0; c < g1; ++c) softmax_vector(c, ga, gb);
      if (per_row) continue;
#if FLARE_SIMD_BF16
      if (pv_pairs) {  // pairs of keys from ga rounded down to even; Pᵀ is 0 outside [ga, gb)
        round_row_pairs(st + g0 * kLanes, ld, ga, gb, g1 - g0, p_pairs + g0 * kLanes, ld);
        const int k0 = ga / 2;
        matmul_pairs<Store::kScaleAdd>(
            d, g1 - g0,
            {v_pairs + k0 * ldvp, 1, ldvp, p_pairs + g0 * kLanes, ld, ceil_div(gb, 2) - k0,
             ot + g0 * kLanes, ld, alpha + g0 * kLanes});
        continue;
      }
#endif
      matmul<Store::kScaleAdd>(d, g1 - g0, {vr + ga * ldv, 1, ldv, st + ga * ld + g0 * kLanes, ld,
                                            gb - ga, ot + g0 * kLanes, ld, alpha + g0 * kLanes});
    }
    if (per_row) {
      for (int dim = 0; dim < d; ++dim)
        for (int c = ca; c < cb; ++c) {
          float* o = ot + dim * ld + c * kLanes;
          simd::store(o, simd::load(o) * simd::load(alpha + c * kLanes));
        }
      for (int r = ra; r < rb; ++r) {
        const int a = std::max(lo[r], j0) - j0, e = std::min(hi[r], j1) - j0;
        for (int dim = 0; dim < d; ++dim) {
          float acc = 0.0f;
          for (int k = a; k < e; ++k) acc = simd::fma(st[k * ld + r], vr[k * ldv + dim], acc);
          ot[dim * ld + r] += acc;
        }
      }
    }
  }

  for (int r = 0; r < nq; ++r) {
    const RowFinish end = finish_row(lo[r] < hi[r], m[r], l[r], p.dropout_scale);
    for (int dim = 0; dim < d; ++dim) row_buffer[dim] = ot[dim * ld + r];
    store_rows(row_buffer, d, end.factor, 1, d, p.o, p.dtype,
               hd.o + int64_t{i0 + r} * p.o_row_stride, p.o_row_stride);
    p.lse[hd.lse + i0 + r] = end.lse;
  }
}

// ---- forward of a few query rows (decoding) ------------------------------------------------------
//
// One new token against a long cache fills one lane of the queries-in-lanes forward and reads K
// and V once per query head: s_q = 1, 8k keys, 32/8 heads of 128 ran at 2.3 GFLOP/s, a tenth of
// the memory bound. Where every sequence has at most kDecodeRows query rows (and no dropout), the
// forward turns to keys in lanes, the backward's layout: a task is one (sequence, kv head, set of
// the group's query heads, chunk of keys) and holds every query row of those heads, so each K and
// V row is read once for all of them. Its tiles are the backward's (Kᵀ packed per tile, S = Q·Kᵀ
// by the same micro-kernel), so each score is the same FMA chain as in the other passes, bit for
// bit. Each task leaves a partial (running max, sum, unnormalised O) per row; the merge adds the
// chunks of a row in chunk order. Chunks are sized from the sequence's own length alone, so the
// result does not depend on the thread count.
constexpr int kDecodeRows = 4;         // query rows per sequence, at most, for this path
constexpr int kDecodeTaskRows = 32;    // rows (heads × query rows) one task holds, at most
constexpr int kDecodeTile = 64;        // keys per Kᵀ / V tile
constexpr int kDecodeLd = kDecodeTile + kPad;
constexpr int kDecodePairsLd = kDecodeTile / 2 + kPad;  // P in pairs of keys (bf16_products)
constexpr int kDecodeMinChunk = 512;   // keys per chunk, at least
constexpr int kDecodeMaxChunks = 64;   // chunks per sequence and head set, at most

int decode_chunk_keys(int len_k) {
  return std::max(kDecodeMinChunk, round_up(ceil_div(len_k, kDecodeMaxChunks), kDecodeTile));
}

// Whether the call takes the decoding path: every sequence's actual query length (not the
// max_seqlen bound) within kDecodeRows, and no dropout.
bool use_decode_path(const AttentionParams& p) {
  if (p.dropout_p > 0.0f) return false;
  for (int b = 0; b < p.batch; ++b)
    if (sequence_info(p, b).len_q > kDecodeRows) return false;
  return true;
}

// The tasks: (sequence, kv head, head set, chunk), in that order; `slot` numbers the partial
// results of each task's rows.
struct DecodeTask {
  int b, kvh, h0, heads;  // query heads [h0, h0 + heads) of kv head kvh
  int c0, c1;             // keys [c0, c1) of the sequence
  int64_t slot;           // first partial row of this task
};

struct DecodePlan {
  std::vector<DecodeTask> tasks;
  std::vector<int64_t> first_task;  // per (b, head set index): its first task; chunks follow
  int heads_per_set = 1;
  int64_t rows = 0;  // partial rows in all
};

// Throws std::bad_alloc.
DecodePlan decode_plan(const AttentionParams& p) {
  DecodePlan plan;
  int max_len_q = 1;
  for (int b = 0; b < p.batch; ++b) max_len_q = std::max(max_len_q, sequence_info(p, b).len_q);
  plan.heads_per_set = std::max(1, std::min(p.head_group, kDecodeTaskRows / max_len_q));
  const int sets = ceil_div(p.head_group, plan.heads_per_set);
  for (int b = 0; b < p.batch; ++b) {
    const SequenceInfo seq = sequence_info(p, b);
    const int chunk = decode_chunk_keys(seq.len_k);
    for (int kvh = 0; kvh < p.heads_kv; ++kvh)
      for (int s = 0; s < sets; ++s) {
        const int h0 = kvh * p.head_group + s * plan.heads_per_set;
        const int heads = std::min(plan.heads_per_set, p.head_group - s * plan.heads_per_set);
        plan.first_task.push_back(static_cast<int64_t>(plan.tasks.size()));
        if (seq.len_q == 0) continue;
        // A sequence without keys still has one task: its rows get the no-key result.
        for (int c0 = 0; c0 < std::max(seq.len_k, 1); c0 += chunk) {
          plan.tasks.push_back({b, kvh, h0, heads, c0, std::min(c0 + chunk, seq.len_k), plan.rows});
          plan.rows += int64_t{heads} * seq.len_q;
        }
      }
  }
  plan.first_task.push_back(static_cast<int64_t>(plan.tasks.size()));
  return plan;
}

int64_t decode_scratch_floats(int d) {
  const int dpad = round_up(d, kLanes), ldr = rows_ld(dpad);
  return Carver::size({int64_t{kDecodeTaskRows} * ldr, int64_t{d} * kDecodeLd,
                       int64_t{kDecodeTile} * ldr, int64_t{kDecodeTaskRows} * kDecodeLd,
                       int64_t{kDecodeTaskRows} * ldr, round_up(std::max(d, kDecodeTile), kLanes),
                       int64_t{kDecodeTaskRows} * kDecodePairsLd, int64_t{kDecodeTile / 2} * ldr});
}

// One task: its rows' partial (max, sum, O) into partial[(slot + row)·(dpad + 2)], O first.
void decode_task(const AttentionParams& p, const KeyRows& keys, const DecodeTask& t, float* partial,
                 float* scratch) {
  const int d = p.head_dim, dpad = round_up(d, kLanes), ldr = rows_ld(dpad), dvecs = dpad / kLanes;
  const Head first = make_head(p, t.b, t.h0);
  const int len_q = first.seq.len_q, rows = t.heads * len_q;
  Carver carve(scratch);
  float* q = carve.take(int64_t{kDecodeTaskRows} * ldr);   // (rows, dpad) the rows' queries
  float* kt = carve.take(int64_t{d} * kDecodeLd);          // (d, kDecodeTile) Kᵀ
  float* vt = carve.take(int64_t{kDecodeTile} * ldr);      // (kDecodeTile, dpad) V
  float* s = carve.take(int64_t{kDecodeTaskRows} * kDecodeLd);  // (rows, kDecodeTile) S → P
  float* o = carve.take(int64_t{kDecodeTaskRows} * ldr);   // (rows, dpad) unnormalised O
  float* row_buffer = carve.take(round_up(std::max(d, kDecodeTile), kLanes));
#if FLARE_SIMD_BF16
  // With bf16_products: P·V in pairs of keys, P's rows rounded and V's rows interleaved. V's
  // interleave costs about what a few rows' products save, so a task of fewer than 8 rows keeps
  // fp32 (bf16, 2 threads, d 128: 32 query heads over 8 kv heads, 4 rows a task, ran 0.85x in
  // pairs; bench/results/2026-11-29-cpu-amd-epyc-2t-5117b8a/decode-pv-pairs-ab.txt).
  const bool pv_pairs = bf16_products(p) && rows >= 8;
  auto* p_pairs = reinterpret_cast<uint32_t*>(carve.take(int64_t{kDecodeTaskRows} * kDecodePairsLd));
  auto* v_pairs = reinterpret_cast<uint32_t*>(carve.take(int64_t{kDecodeTile / 2} * ldr));
#endif
  Head heads[kDecodeTaskRows];
  int lo[kDecodeRows], hi[kDecodeRows];
  float m[kDecodeTaskRows], l[kDecodeTaskRows];
  int klo, khi;
  block_ranges(p, first, 0, len_q, lo, hi, &klo, &khi);
  klo = std::max(klo, t.c0);
  khi = std::min(khi, t.c1);
  // The rows' queries, and Kᵀ below, in pairs where the scores take them (score_pairs): each
  // query row's d / 2 words (row stride ldr words), Kᵀ's rows of words.
  const bool pairs = score_pairs(p);
  const int kd = pairs ? d / 2 : d;  // rows of Kᵀ
  for (int g = 0; g < t.heads; ++g) {
    heads[g] = make_head(p, t.b, t.h0 + g);
    if (pairs) {
      for (int r = 0; r < len_q; ++r)
        std::memcpy(reinterpret_cast<uint32_t*>(q) + (g * len_q + r) * int64_t{ldr},
                    static_cast<const uint32_t*>(p.q) + (heads[g].q + r * p.q_row_stride) / 2,
                    sizeof(uint32_t) * (d / 2));
    } else {
      load_rows(p.q, p.dtype, heads[g].q, p.q_row_stride, len_q, d, q + g * len_q * ldr, ldr);
    }
  }
  std::fill(m, m + rows, -kInf);
  std::fill(l, l + rows, 0.0f);
  std::fill(o, o + int64_t{rows} * ldr, 0.0f);

  for (int j0 = klo; j0 < khi; j0 += kDecodeTile) {
    const int nk = std::min(kDecodeTile, khi - j0), kvecs = ceil_div(nk, kLanes);
    const int next = std::min(kDecodeTile, khi - j0 - nk);  // keys of the next tile
    if (keys.in_params()) {
      // One strided run, loaded and prefetched (rows a token apart: the next tile's, while this
      // one is computed) without the run walk: through it, decoding 8k keys with 32/32 heads ran
      // 5% slower on 2 cores (median of 15 alternating runs).
      if (pairs)
        load_transposed(p.k, DType::kFloat32, (first.k + j0 * p.k_row_stride) / 2,
                        p.k_row_stride / 2, nk, kd, kt, kDecodeLd, row_buffer);
      else
        load_transposed(p.k, p.dtype, first.k + j0 * p.k_row_stride, p.k_row_stride, nk, d, kt,
                        kDecodeLd, row_buffer);
      load_rows(p.v, p.dtype, first.v + j0 * p.v_row_stride, p.v_row_stride, nk, d, vt, ldr);
      if (next > 0) {
        prefetch_rows(p.k, p.dtype, first.k + (j0 + nk) * p.k_row_stride, p.k_row_stride, next, d);
        prefetch_rows(p.v, p.dtype, first.v + (j0 + nk) * p.v_row_stride, p.v_row_stride, next, d);
      }
    } else {
      for (int j = j0; j < j0 + nk;) {  // the tile's keys, one strided run at a time
        const KeyRun run = key_run(p, keys, first, j0, j, j0 + nk);
        if (pairs)
          transpose_rows(p.k, DType::kFloat32, run.k / 2, run.k_stride / 2, run.n, kd, kt + run.r0,
                         kDecodeLd, row_buffer);
        else
          transpose_rows(p.k, p.dtype, run.k, run.k_stride, run.n, d, kt + run.r0, kDecodeLd,
                         row_buffer);
        load_rows(p.v, p.dtype, run.v, run.v_stride, run.n, d, vt + int64_t{run.r0} * ldr, ldr);
        j += run.n;
      }
      zero_columns(kt, nk, kd, kDecodeLd);
      if (next > 0) prefetch_keys(p, keys, first, j0 + nk, next);
    }
#if FLARE_SIMD_BF16
    if (pairs)
      matmul_pairs<Store::kSet>(rows, kvecs, {reinterpret_cast<const uint32_t*>(q), ldr, 1,
                                              reinterpret_cast<const uint32_t*>(kt), kDecodeLd,
                                              d / 2, s, kDecodeLd, nullptr});
    else
#endif
      matmul<Store::kSet>(rows, kvecs, {q, ldr, 1, kt, kDecodeLd, d, s, kDecodeLd, nullptr});
    // Keys [ta[r], te[r]) of the tile that query row r sees (every head alike).
    int ta[kDecodeRows], te[kDecodeRows];
    bool masked = false;  // some row does not see some key of the tile
    for (int r = 0; r < len_q; ++r) {
      ta[r] = std::clamp(lo[r] - j0, 0, nk);
      te[r] = std::clamp(hi[r] - j0, 0, nk);
      masked = masked || ta[r] > 0 || te[r] < nk;
    }
    for (int g = 0; g < t.heads; ++g)
      for (int r = 0; r < len_q; ++r) {
        const int row = g * len_q + r;
        const Head& hd = heads[g];
        float* srow = s + row * kDecodeLd;
        const int a = ta[r], e = te[r];
        // Online softmax over the row's keys of the tile: scores, the tile's max, then weights.
        Vec vmax = simd::splat(-kInf);
        for (int n = 0; n < kvecs; ++n) {
          const int j = j0 + n * kLanes;
          Vec dcap;
          Vec sc = modified_scores(simd::load(srow + n * kLanes), hd,
                                   simd::splat_int(r + hd.shift - j) - simd::lane_index(), &dcap);
          const IVec col = simd::lane_index() + j;
          sc = simd::select((col >= j0 + a) & (col < j0 + e), sc, simd::splat(-kInf));
          simd::store(srow + n * kLanes, sc);
          vmax = simd::max(vmax, sc);
        }
        const float m_new = std::max(m[row], simd::reduce_max(vmax));
        const float m_use = softmax_base(m_new);  // no key seen yet: p stays 0
        const float alpha = std::exp(m[row] - m_use);
        Vec sum = Vec{};
        for (int n = 0; n < kvecs; ++n) {
          const Vec e_ = simd::exp(simd::load(srow + n * kLanes) - m_use);
          sum += e_;
          simd::store(srow + n * kLanes, e_);
        }
        for (int k = nk; k < kvecs * kLanes; ++k) srow[k] = 0.0f;  // lanes past the tile
        l[row] = l[row] * alpha + simd::reduce_sum(sum);
        m[row] = m_new;
        float* orow = o + row * ldr;
        for (int n = 0; n < dvecs; ++n) simd::store(orow + n * kLanes, simd::load(orow + n * kLanes) * alpha);
      }
    // O += P·V. A masked key's weight is 0, and 0·Inf = NaN: with a non-finite V in a tile some
    // row does not fully see, each row sums its visible keys alone, as the reference does.
    if (!(masked && !all_finite(vt, ldr, nk, d))) {
#if FLARE_SIMD_BF16
      if (pv_pairs) {
        round_column_pairs(s, kDecodeLd, rows, nk, p_pairs, kDecodePairsLd);
        interleave_rows(vt, ldr, nk, dvecs, v_pairs, ldr);
        matmul_pairs<Store::kAdd>(rows, dvecs, {p_pairs, kDecodePairsLd, 1, v_pairs, ldr,
                                                ceil_div(nk, 2), o, ldr, nullptr});
      } else
#endif
        matmul<Store::kAdd>(rows, dvecs, {s, kDecodeLd, 1, vt, ldr, nk, o, ldr, nullptr});
    } else {
      for (int row = 0; row < rows; ++row) {
        const int r = row % len_q;
        for (int dim = 0; dim < d; ++dim) {
          float acc = 0.0f;
          for (int k = ta[r]; k < te[r]; ++k) acc = simd::fma(s[row * kDecodeLd + k], vt[k * ldr + dim], acc);
          o[row * ldr + dim] += acc;
        }
      }
    }
  }
  for (int row = 0; row < rows; ++row) {
    float* out = partial + (t.slot + row) * int64_t{dpad + 2};
    std::copy(o + row * ldr, o + row * ldr + dpad, out);
    out[dpad] = m[row];
    out[dpad + 1] = l[row];
  }
}

// Row r of query head h of sequence b from its chunks' partials, in chunk order: O and LSE as
// forward_block writes them.
void decode_merge(const AttentionParams& p, const DecodePlan& plan, const float* partial, int b,
                  int h, int r, int64_t set_index, double* acc) {
  const int d = p.head_dim, dpad = round_up(d, kLanes);
  const Head hd = make_head(p, b, h);
  const DecodeTask& head_task = plan.tasks[plan.first_task[set_index]];
  const int row_in_task = (h - head_task.h0) * hd.seq.len_q + r;
  float m = -kInf;
  for (int64_t i = plan.first_task[set_index]; i < plan.first_task[set_index + 1]; ++i)
    m = std::max(m, partial[(plan.tasks[i].slot + row_in_task) * int64_t{dpad + 2} + dpad]);
  const double m_use = softmax_base(m);
  double l = 0.0;
  std::fill(acc, acc + d, 0.0);
  for (int64_t i = plan.first_task[set_index]; i < plan.first_task[set_index + 1]; ++i) {
    const float* part = partial + (plan.tasks[i].slot + row_in_task) * int64_t{dpad + 2};
    const double w = std::exp(static_cast<double>(part[dpad]) - m_use);  // 0 for a chunk of no key
    l += w * part[dpad + 1];
    for (int dim = 0; dim < d; ++dim) acc[dim] += w * part[dim];
  }
  int lo_r, hi_r, unused_lo, unused_hi;
  block_ranges(p, hd, r, 1, &lo_r, &hi_r, &unused_lo, &unused_hi);
  const RowFinish end = finish_row(lo_r < hi_r, m, l, 1.0);  // decoding has no dropout
  float row[256] = {};  // only d entries are read; zeroed, gcc 13 warns of uninitialised reads
  for (int dim = 0; dim < d; ++dim) row[dim] = static_cast<float>(acc[dim]);
  store_rows(row, d, end.factor, 1, d, p.o, p.dtype, hd.o + int64_t{r} * p.o_row_stride,
             p.o_row_stride);
  p.lse[hd.lse + r] = end.lse;
}

Status decode_forward(const AttentionParams& p, const KeyRows& keys) {
  const int d = p.head_dim, dpad = round_up(d, kLanes);
  DecodePlan plan;
  std::vector<float> partial;
  try {
    plan = decode_plan(p);
    partial.resize(static_cast<size_t>(plan.rows * (dpad + 2)));
  } catch (const std::bad_alloc&) {
    return Status::out_of_memory("cpu flash forward (decoding): partial results");
  }
  const int64_t n_tasks = static_cast<int64_t>(plan.tasks.size());
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(omp_get_max_threads(), n_tasks)));
  std::vector<std::vector<float>> scratch;
  if (!allocate_scratch(threads, decode_scratch_floats(d), &scratch))
    return Status::out_of_memory("cpu flash forward (decoding): per-thread tiles");
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t i = 0; i < n_tasks; ++i)
    decode_task(p, keys, plan.tasks[static_cast<size_t>(i)], partial.data(),
                scratch[omp_get_thread_num()].data());
  // The merge: one unit of work per (sequence, query head), as the task counter counts.
  const int sets = ceil_div(p.head_group, plan.heads_per_set);
#pragma omp parallel num_threads(threads)
  {
    std::vector<double> acc(static_cast<size_t>(d));
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < int64_t{p.batch} * p.heads_q; ++bh) {
      const int b = static_cast<int>(bh / p.heads_q), h = static_cast<int>(bh % p.heads_q);
      const int len_q = sequence_info(p, b).len_q;
      if (len_q == 0) continue;
      flash_tasks_run.fetch_add(1, std::memory_order_relaxed);
      const int kvh = h / p.head_group;
      const int64_t set_index = (int64_t{b} * p.heads_kv + kvh) * sets + (h % p.head_group) / plan.heads_per_set;
      for (int r = 0; r < len_q; ++r) decode_merge(p, plan, partial.data(), b, h, r, set_index, acc.data());
    }
  }
  return {};
}

// ---- backward -----------------------------------------------------------------------------------

// Per-thread tiles of the backward. Row strides: rows_ld(dpad) for the (·, dpad) tiles, kBwdLd
// for the (·, kBwdK) ones.
struct BackwardTiles {
  float* q;      // (kBwdQ, dpad)
  float* dout;   // (kBwdQ, dpad)
  float* kt;     // (d, kBwdK)     Kᵀ
  float* vt;     // (d, kBwdK)     Vᵀ
  float* k;      // (kBwdK, dpad)  K by rows (dQ only)
  float* s;      // (kBwdQ, kBwdK) scores → dropped, rescaled probabilities P̃
  float* dp;     // (kBwdQ, kBwdK) dO Vᵀ → dS
  float* dk;     // (kBwdK, dpad)
  float* dv;     // (kBwdK, dpad)
  float* dq;     // (kBwdQ, dpad)  the two-pass mode's dQ of one block
  float* z;      // (kBwdK)
  float* row_buffer;  // (max(dpad, kBwdK))
  // With bf16_products: pair tiles (32-bit words), row strides as noted.
  uint32_t* p_pairs;   // (kBwdQ/2, kBwdLd)      P̃ᵀ down the query rows
  uint32_t* dst_pairs;  // (kBwdQ/2, kBwdLd)     dSᵀ likewise
  uint32_t* ds_pairs;  // (kBwdQ, kDsPairsLd)     dS along the keys
  uint32_t* q_pairs;   // (kBwdQ/2, ldr)          Q down the rows
  uint32_t* do_pairs;  // (kBwdQ/2, ldr)          dO likewise
  uint32_t* k_pairs;   // (kBwdK/2, ldr)          K down the keys
};

constexpr int kDsPairsLd = kBwdK / 2 + kPad;  // whole 16-word vectors: round_column_pairs
static_assert(kBwdK % (2 * kLanes) == 0 && kBwdQ % 2 == 0, "pair tiles are whole vectors");

int64_t backward_scratch_floats(int d, int dpad) {
  const int ldr = rows_ld(dpad);
  return Carver::size({int64_t{kBwdQ} * ldr, int64_t{kBwdQ} * ldr, int64_t{d} * kBwdLd,
                       int64_t{d} * kBwdLd, int64_t{kBwdK} * ldr, int64_t{kBwdQ} * kBwdLd,
                       int64_t{kBwdQ} * kBwdLd, int64_t{kBwdK} * ldr, int64_t{kBwdK} * ldr,
                       int64_t{kBwdQ} * ldr, kBwdK, std::max(dpad, kBwdK),
                       int64_t{kBwdQ / 2} * kBwdLd, int64_t{kBwdQ / 2} * kBwdLd,
                       int64_t{kBwdQ} * kDsPairsLd, int64_t{kBwdQ / 2} * ldr,
                       int64_t{kBwdQ / 2} * ldr, int64_t{kBwdK / 2} * ldr});
}

BackwardTiles carve_backward(float* scratch, int d, int dpad) {
  const int ldr = rows_ld(dpad);
  Carver carve(scratch);
  BackwardTiles t;
  t.q = carve.take(int64_t{kBwdQ} * ldr);
  t.dout = carve.take(int64_t{kBwdQ} * ldr);
  t.kt = carve.take(int64_t{d} * kBwdLd);
  t.vt = carve.take(int64_t{d} * kBwdLd);
  t.k = carve.take(int64_t{kBwdK} * ldr);
  t.s = carve.take(int64_t{kBwdQ} * kBwdLd);
  t.dp = carve.take(int64_t{kBwdQ} * kBwdLd);
  t.dk = carve.take(int64_t{kBwdK} * ldr);
  t.dv = carve.take(int64_t{kBwdK} * ldr);
  t.dq = carve.take(int64_t{kBwdQ} * ldr);
  t.z = carve.take(kBwdK);
  t.row_buffer = carve.take(std::max(dpad, kBwdK));
  auto words = [&](int64_t n) { return reinterpret_cast<uint32_t*>(carve.take(n)); };
  t.p_pairs = words(int64_t{kBwdQ / 2} * kBwdLd);
  t.dst_pairs = words(int64_t{kBwdQ / 2} * kBwdLd);
  t.ds_pairs = words(int64_t{kBwdQ} * kDsPairsLd);
  t.q_pairs = words(int64_t{kBwdQ / 2} * ldr);
  t.do_pairs = words(int64_t{kBwdQ / 2} * ldr);
  t.k_pairs = words(int64_t{kBwdK / 2} * ldr);
  return t;
}

// Keys [j0, j0 + nk) of one kv head: Kᵀ and Vᵀ for S and dP, K by rows (B of dQ += dS K).
struct KeyBlock {
  int j0 = 0, nk = 0;
  const float* k = nullptr;  // K by rows, dpad readable columns (zero from d)
  int64_t ldk = 0;
};

// `head` is any query head of the kv head (they share its K and V). K by rows only with `rows`.
KeyBlock load_key_block(const AttentionParams& p, const Head& head, int j0, int nk, bool rows,
                        BackwardTiles* t) {
  const int d = p.head_dim, ldr = rows_ld(round_up(d, kLanes));
  KeyBlock kb;
  kb.j0 = j0;
  kb.nk = nk;
  const int64_t k0 = head.k + j0 * p.k_row_stride, v0 = head.v + j0 * p.v_row_stride;
  // Kᵀ and Vᵀ, in pairs where the products take them (score_pairs, dp_pairs): the rows' 32-bit
  // words, moved as fp32 words, transposed.
  if (score_pairs(p))
    load_transposed(p.k, DType::kFloat32, k0 / 2, p.k_row_stride / 2, nk, d / 2, t->kt, kBwdLd,
                    t->row_buffer);
  else
    load_transposed(p.k, p.dtype, k0, p.k_row_stride, nk, d, t->kt, kBwdLd, t->row_buffer);
  if (dp_pairs(p))
    load_transposed(p.v, DType::kFloat32, v0 / 2, p.v_row_stride / 2, nk, d / 2, t->vt, kBwdLd,
                    t->row_buffer);
  else
    load_transposed(p.v, p.dtype, v0, p.v_row_stride, nk, d, t->vt, kBwdLd, t->row_buffer);
  if (rows) {  // copied even from fp32: see key_rows
    load_rows(p.k, p.dtype, k0, p.k_row_stride, nk, d, t->k, ldr);
    kb.k = t->k;
    kb.ldk = ldr;
#if FLARE_SIMD_BF16
    if (bf16_products(p))
      interleave_rows(t->k, ldr, nk, round_up(d, kLanes) / kLanes, t->k_pairs, ldr);
#endif
  }
  return kb;
}

// Rows [i0, i0 + nq) of one query head: Q, dO, LSE, D and visible ranges.
struct QueryBlock {
  int i0 = 0, nq = 0;
  const float* q = nullptr;     // (nq, dpad), row stride rows_ld(dpad)
  const float* dout = nullptr;  // likewise
  // With score_pairs / dp_pairs: the user's rows of Q / dO as 32-bit words (bf16 pairs), row
  // strides in words.
  const uint32_t* q_pairs = nullptr;
  const uint32_t* dout_pairs = nullptr;
  int64_t q_pairs_ld = 0, dout_pairs_ld = 0;
  int klo = 0, khi = 0;  // union of the rows' visible keys
  int lo[kBwdQ], hi[kBwdQ];
  float lse[kBwdQ];      // +inf for rows that see no key
  float delta[kBwdQ];    // D
};

// Q and dO come from `rows` (the head's converted rows, see GroupRows) when given, else they are
// converted into the tiles.
void load_query_block(const AttentionParams& p, const Head& hd, int i0, const float* delta,
                      const float* q_rows, const float* dout_rows, BackwardTiles* t,
                      QueryBlock* qb) {
  const int d = p.head_dim, ldr = rows_ld(round_up(d, kLanes));
  qb->i0 = i0;
  qb->nq = std::min(kBwdQ, hd.seq.len_q - i0);
  if (q_rows != nullptr) {
    qb->q = q_rows + int64_t{i0} * ldr;
    qb->dout = dout_rows + int64_t{i0} * ldr;
  } else {
    load_rows(p.q, p.dtype, hd.q + i0 * p.q_row_stride, p.q_row_stride, qb->nq, d, t->q, ldr);
    load_rows(p.dout, p.dtype, hd.dout + i0 * p.do_row_stride, p.do_row_stride, qb->nq, d, t->dout,
              ldr);
    qb->q = t->q;
    qb->dout = t->dout;
  }
  if (score_pairs(p)) {
    qb->q_pairs = static_cast<const uint32_t*>(p.q) + (hd.q + i0 * p.q_row_stride) / 2;
    qb->q_pairs_ld = p.q_row_stride / 2;
  }
  if (dp_pairs(p)) {
    qb->dout_pairs = static_cast<const uint32_t*>(p.dout) + (hd.dout + i0 * p.do_row_stride) / 2;
    qb->dout_pairs_ld = p.do_row_stride / 2;
  }
  for (int r = 0; r < qb->nq; ++r) {
    const float lse = p.lse[hd.lse + i0 + r];
    qb->lse[r] = lse == -kInf ? kInf : lse;  // p = exp(s − (+inf)) = 0 instead of NaN
    qb->delta[r] = delta[hd.lse + i0 + r];
  }
  block_ranges(p, hd, i0, qb->nq, qb->lo, qb->hi, &qb->klo, &qb->khi);
}

// Row r of the S and dP tiles (keys from j0): S becomes P̃ = P·z (for dV) and dP becomes
// dS = P ∘ (z·dP − D), times the softcap factor (for dK, dQ; the softmax scale is applied on
// output). Both are exactly 0 on keys the row does not see: P is 0 there, but z·dP − D need not
// be finite (an Inf in dO, V or O), and a masked key must not turn that into NaN. Vectors of
// keys the row does not see at all are zeroed without an exp.
void backward_row(const AttentionParams& p, const Head& hd, int row, int j0, int nk, int lo, int hi,
                  float lse, float delta, BackwardTiles* t, int r) {
  float* srow = t->s + r * kBwdLd;
  float* dprow = t->dp + r * kBwdLd;
  const bool dropout = p.dropout_p > 0.0f;
  const bool masked = lo > j0 || hi < j0 + nk;  // lanes from nk on are never read
  if (dropout) dropout_row(p, hd.bh, row, j0, nk, p.dropout_scale, t->z, kBwdK);
  for (int n = 0; n < ceil_div(nk, kLanes); ++n) {
    const int j = j0 + n * kLanes;
    if (masked && (j + kLanes <= lo || j >= hi)) {
      simd::store(srow + n * kLanes, Vec{});
      simd::store(dprow + n * kLanes, Vec{});
      continue;
    }
    // Whether some key of the vector is masked (lanes from nk on count as masked: never read).
    const bool partial = masked && (j < lo || j + kLanes > hi);
    const IVec col = simd::lane_index() + j;
    const IVec visible = (col >= lo) & (col < hi);
    Vec dcap = simd::splat(1.0f);
    Vec s = modified_scores(simd::load(srow + n * kLanes), hd,
                            simd::splat_int(row + hd.shift - j) - simd::lane_index(), &dcap);
    if (partial) s = simd::select(visible, s, simd::splat(-kInf));
    const Vec prob = simd::exp(s - lse);
    Vec dpv = simd::load(dprow + n * kLanes);
    Vec pz = prob;
    if (dropout) {
      const Vec zv = simd::load(t->z + n * kLanes);
      dpv *= zv;
      pz *= zv;
    }
    Vec ds = prob * (dpv - delta) * dcap;
    if (partial) {
      pz = simd::select(visible, pz, Vec{});
      ds = simd::select(visible, ds, Vec{});
    }
    simd::store(srow + n * kLanes, pz);
    simd::store(dprow + n * kLanes, ds);
  }
}

// S = Q·Kᵀ or dP = dO·Vᵀ of `rows` query rows into a (·, kBwdLd) tile: from the user's rows in
// pairs (from row `row0` of `pairs`) where the block has them, else from the fp32 rows `a`; bt is
// Kᵀ or Vᵀ in the matching form (load_key_block).
void tile_product(int rows, int kvecs, int d, const float* a, int64_t lda, const uint32_t* pairs,
                  int64_t pairs_ld, int row0, const float* bt, float* out) {
#if FLARE_SIMD_BF16
  if (pairs != nullptr) {
    matmul_pairs<Store::kSet>(rows, kvecs, {pairs + row0 * pairs_ld, pairs_ld, 1,
                                            reinterpret_cast<const uint32_t*>(bt), kBwdLd, d / 2,
                                            out, kBwdLd, nullptr});
    return;
  }
#else
  (void)pairs, (void)pairs_ld, (void)row0;
#endif
  matmul<Store::kSet>(rows, kvecs, {a, lda, 1, bt, kBwdLd, d, out, kBwdLd, nullptr});
}

// The contribution of key block kb to query block qb of head hd, over the rows [ra, rb) of qb
// that see one of its keys: S, dP, P̃ and dS, then dV and dK of the keys (dk, dv: (kBwdK, dpad)
// accumulators, or null) and dQ of the rows (dq: qb's (kBwdQ, dpad) accumulator, or null). Both
// backward modes sum every output element through here, in the same order.
void backward_pair(const AttentionParams& p, const Head& hd, const QueryBlock& qb,
                   const KeyBlock& kb, BackwardTiles* t, float* dk, float* dv, float* dq) {
  const int d = p.head_dim, dpad = round_up(d, kLanes), dvecs = dpad / kLanes;
  const int ldr = rows_ld(dpad);
  const int j0 = kb.j0, nk = kb.nk, j1 = j0 + nk;
  int ra, rb;
  rows_meeting(qb.lo, qb.hi, qb.nq, j0, j1, &ra, &rb);
  if (ra == rb) return;
  const int rows = rb - ra, kvecs = ceil_div(nk, kLanes);
  const float* q = qb.q + ra * ldr;
  const float* dout = qb.dout + ra * ldr;
  float* s = t->s + ra * kBwdLd;
  float* dp = t->dp + ra * kBwdLd;
  tile_product(rows, kvecs, d, q, ldr, qb.q_pairs, qb.q_pairs_ld, ra, t->kt, s);
  tile_product(rows, kvecs, d, dout, ldr, qb.dout_pairs, qb.dout_pairs_ld, ra, t->vt, dp);
  for (int r = ra; r < rb; ++r)
    backward_row(p, hd, qb.i0 + r, j0, nk, qb.lo[r], qb.hi[r], qb.lse[r], qb.delta[r], t, r);
  const bool masked = tile_masked(qb.lo, qb.hi, ra, rb, j0, j1);

  // dV(c, :) += Σ_r P̃(r, c) dO(r, :) and dK(c, :) += Σ_r dS(r, c) Q(r, :), c over the keys, in
  // bf16 pairs of rows where bf16_products holds. P̃ and dS are 0 where row r does not see key
  // c, and 0·Inf = NaN: where dO or Q holds a non-finite value, each key sums the rows that see
  // it alone, as the reference does (in fp32: the ranges need not start on a pair).
  if (dk != nullptr) {
    const bool per_key =
        masked && !(all_finite(q, ldr, rows, dpad) && all_finite(dout, ldr, rows, dpad));
    if (!per_key && bf16_products(p)) {
#if FLARE_SIMD_BF16
      const int pairs = ceil_div(rows, 2);
      round_row_pairs(s, kBwdLd, 0, rows, kvecs, t->p_pairs, kBwdLd);
      round_row_pairs(dp, kBwdLd, 0, rows, kvecs, t->dst_pairs, kBwdLd);
      interleave_rows(dout, ldr, rows, dvecs, t->do_pairs, ldr);
      interleave_rows(q, ldr, rows, dvecs, t->q_pairs, ldr);
      matmul_pairs<Store::kAdd>(nk, dvecs,
                                {t->p_pairs, 1, kBwdLd, t->do_pairs, ldr, pairs, dv, ldr, nullptr});
      matmul_pairs<Store::kAdd>(nk, dvecs,
                                {t->dst_pairs, 1, kBwdLd, t->q_pairs, ldr, pairs, dk, ldr,
                                 nullptr});
#endif
    } else if (!per_key) {
      matmul<Store::kAdd>(nk, dvecs, {s, 1, kBwdLd, dout, ldr, rows, dv, ldr, nullptr});
      matmul<Store::kAdd>(nk, dvecs, {dp, 1, kBwdLd, q, ldr, rows, dk, ldr, nullptr});
    } else {
      for (int c = 0; c < nk; ++c) {
        // Rows [a, e) see key j0 + c: visible ranges grow with the row.
        int a = ra;
        while (a < rb && qb.hi[a] <= j0 + c) ++a;
        int e = a;
        while (e < rb && qb.lo[e] <= j0 + c) ++e;
        const int off = (a - ra) * kBwdLd + c;
        matmul<Store::kAdd>(1, dvecs, {s + off, 1, kBwdLd, qb.dout + a * ldr, ldr, e - a,
                                       dv + c * ldr, ldr, nullptr});
        matmul<Store::kAdd>(1, dvecs, {dp + off, 1, kBwdLd, qb.q + a * ldr, ldr, e - a,
                                       dk + c * ldr, ldr, nullptr});
      }
    }
  }
  // dQ(r, :) += Σ_c dS(r, c) K(c, :); as above, with a non-finite K each row sums its keys alone.
  if (dq != nullptr) {
    const bool per_row = masked && !all_finite(kb.k, kb.ldk, nk, d);
    if (!per_row && bf16_products(p)) {
#if FLARE_SIMD_BF16
      round_column_pairs(dp, kBwdLd, rows, nk, t->ds_pairs, kDsPairsLd);
      matmul_pairs<Store::kAdd>(rows, dvecs, {t->ds_pairs, kDsPairsLd, 1, t->k_pairs, ldr,
                                              ceil_div(nk, 2), dq + ra * ldr, ldr, nullptr});
#endif
    } else if (!per_row) {
      matmul<Store::kAdd>(rows, dvecs, {dp, kBwdLd, 1, kb.k, kb.ldk, nk, dq + ra * ldr, ldr,
                                        nullptr});
    } else {
      for (int r = ra; r < rb; ++r) {
        const int a = std::max(qb.lo[r], j0) - j0, e = std::min(qb.hi[r], j1) - j0;
        matmul<Store::kAdd>(1, dvecs, {t->dp + r * kBwdLd + a, kBwdLd, 1, kb.k + a * kb.ldk, kb.ldk,
                                       e - a, dq + r * ldr, ldr, nullptr});
      }
    }
  }
}

// D_i = dO_i · O_i for rows [i0, i0 + kBwdQ) of one head, summed exactly as the products sum
// dP_ij = dO_i · V_j (fp32 FMA chain in head-dim order from 0). Where a row's probability is 1
// on one key (a single visible key, or inputs of magnitude 1e3), O_i = V_j exactly and
// dP_ij − D_i cancels to 0 as it does in exact arithmetic.
void delta_block(const AttentionParams& p, int b, int h, int qblock, float* delta, float* scratch) {
  flash_tasks_run.fetch_add(1, std::memory_order_relaxed);
  const Head hd = make_head(p, b, h);
  const int i0 = qblock * kBwdQ;
  const int rows = std::min(kBwdQ, hd.seq.len_q - i0);
  const int d = p.head_dim;
  float* o = scratch;
  float* dout = scratch + round_up(d, kLanes);
  for (int r = 0; r < rows; ++r) {
    load_row(p.o, p.dtype, hd.o + int64_t{i0 + r} * p.o_row_stride, d, o);
    load_row(p.dout, p.dtype, hd.dout + int64_t{i0 + r} * p.do_row_stride, d, dout);
    float acc = 0.0f;
    if (dp_pairs(p)) {  // as vdpbf16ps sums a pair: the odd element first
      for (int c = 0; c < d; c += 2) {
        acc = simd::fma(dout[c + 1], o[c + 1], acc);
        acc = simd::fma(dout[c], o[c], acc);
      }
    } else {
      for (int c = 0; c < d; ++c) acc = simd::fma(dout[c], o[c], acc);
    }
    delta[hd.lse + i0 + r] = acc;
  }
}

// The one-pass mode's rows of a head group, each (head_group, len_q, dpad) fp32 with row stride
// rows_ld(dpad): Q and dO converted once per task (instead of once per key block, from rows a
// token apart), and the dQ accumulators.
struct GroupRows {
  const float* q = nullptr;
  const float* dout = nullptr;
  float* dq = nullptr;
};

// dK and dV of keys [j0, j0 + kBwdK) of kv head kvh, over every query head of its group and
// every query block that sees them; with `group`, also their dQ contributions (the one-pass
// mode).
void key_block_backward(const AttentionParams& p, int b, int kvh, int kblock, const float* delta,
                        BackwardTiles* t, const GroupRows* group) {
  flash_tasks_run.fetch_add(1, std::memory_order_relaxed);
  const SequenceInfo seq = sequence_info(p, b);
  const int j0 = kblock * kBwdK;
  if (j0 >= seq.len_k) return;
  const int nk = std::min(kBwdK, seq.len_k - j0);
  const int d = p.head_dim, ldr = rows_ld(round_up(d, kLanes));
  const int h0 = kvh * p.head_group;
  const Head first = make_head(p, b, h0);
  const KeyBlock kb = load_key_block(p, first, j0, nk, group != nullptr, t);
  std::fill(t->dk, t->dk + int64_t{kBwdK} * ldr, 0.0f);
  std::fill(t->dv, t->dv + int64_t{kBwdK} * ldr, 0.0f);

  auto range = [&](int i) {
    return visible_keys(i, seq.len_q, seq.len_k, p.window_left, p.window_right);
  };
  // Rows that see a key of the block: hi > j0 (a suffix of rows) and lo < j0 + nk (a prefix).
  const int qa = first_row(seq.len_q, [&](int i) { return range(i).hi > j0; });
  const int qe = std::max(qa, first_row(seq.len_q, [&](int i) { return range(i).lo >= j0 + nk; }));

  QueryBlock qb;
  for (int h = h0; h < h0 + p.head_group; ++h) {
    const Head hd = h == h0 ? first : make_head(p, b, h);
    const int64_t head_rows = int64_t{h - h0} * seq.len_q * ldr;
    for (int i0 = qa / kBwdQ * kBwdQ; i0 < qe; i0 += kBwdQ) {
      if (group != nullptr) {
        load_query_block(p, hd, i0, delta, group->q + head_rows, group->dout + head_rows, t, &qb);
        backward_pair(p, hd, qb, kb, t, t->dk, t->dv, group->dq + head_rows + int64_t{i0} * ldr);
        continue;
      }
      load_query_block(p, hd, i0, delta, nullptr, nullptr, t, &qb);
      if (i0 + kBwdQ < qe) {
        const int next = std::min(kBwdQ, qe - i0 - kBwdQ);
        const int64_t row = i0 + kBwdQ;
        prefetch_rows(p.q, p.dtype, hd.q + row * p.q_row_stride, p.q_row_stride, next, p.head_dim);
        prefetch_rows(p.dout, p.dtype, hd.dout + row * p.do_row_stride, p.do_row_stride, next,
                      p.head_dim);
      }
      backward_pair(p, hd, qb, kb, t, t->dk, t->dv, nullptr);
    }
  }
  store_rows(t->dk, ldr, p.scale, nk, d, p.dk, p.dtype, first.dk + j0 * p.dk_row_stride,
             p.dk_row_stride);
  store_rows(t->dv, ldr, 1.0f, nk, d, p.dv, p.dtype, first.dv + j0 * p.dv_row_stride,
             p.dv_row_stride);
}

// The two-pass mode's second pass: dQ of rows [i0, i0 + kBwdQ) of query head h, over the same
// aligned key blocks, in the same order, as the one-pass mode.
void query_block_backward(const AttentionParams& p, int b, int h, int qblock, const float* delta,
                          BackwardTiles* t) {
  flash_tasks_run.fetch_add(1, std::memory_order_relaxed);
  const Head hd = make_head(p, b, h);
  const int i0 = qblock * kBwdQ;
  if (i0 >= hd.seq.len_q) return;
  const int d = p.head_dim, ldr = rows_ld(round_up(d, kLanes));
  QueryBlock qb;
  load_query_block(p, hd, i0, delta, nullptr, nullptr, t, &qb);
  std::fill(t->dq, t->dq + int64_t{qb.nq} * ldr, 0.0f);
  for (int j0 = qb.klo / kBwdK * kBwdK; j0 < qb.khi; j0 += kBwdK) {
    const int nk = std::min(kBwdK, hd.seq.len_k - j0);
    int ra, rb;
    rows_meeting(qb.lo, qb.hi, qb.nq, j0, j0 + nk, &ra, &rb);
    if (ra == rb) continue;
    const KeyBlock kb = load_key_block(p, hd, j0, nk, true, t);
    backward_pair(p, hd, qb, kb, t, nullptr, nullptr, t->dq);
  }
  store_rows(t->dq, ldr, p.scale, qb.nq, d, p.dq, p.dtype, hd.dq + i0 * p.dq_row_stride,
             p.dq_row_stride);
}

// The one-pass mode's task: the group's Q and dO converted, every key block of kv head kvh of
// sequence b (dK, dV, and dQ into the group's accumulators), then the group's dQ. Counts the same
// units of work as the two passes. `rows`: 3 · head_group · len_q · rows_ld(dpad) floats.
void head_group_backward(const AttentionParams& p, int b, int kvh, const float* delta,
                         BackwardTiles* t, float* rows) {
  const SequenceInfo seq = sequence_info(p, b);
  const int d = p.head_dim, ldr = rows_ld(round_up(d, kLanes));
  const int h0 = kvh * p.head_group;
  const int64_t head_rows = int64_t{seq.len_q} * ldr, group_rows = p.head_group * head_rows;
  float* q = rows;
  float* dout = rows + group_rows;
  GroupRows group{q, dout, rows + 2 * group_rows};
  for (int h = h0; h < h0 + p.head_group; ++h) {
    const Head hd = make_head(p, b, h);
    load_rows(p.q, p.dtype, hd.q, p.q_row_stride, seq.len_q, d, q + (h - h0) * head_rows, ldr);
    load_rows(p.dout, p.dtype, hd.dout, p.do_row_stride, seq.len_q, d,
              dout + (h - h0) * head_rows, ldr);
  }
  std::fill(group.dq, group.dq + group_rows, 0.0f);
  for (int kblock = 0; kblock < ceil_div(seq.len_k, kBwdK); ++kblock)
    key_block_backward(p, b, kvh, kblock, delta, t, &group);
  for (int h = h0; h < h0 + p.head_group; ++h) {
    const Head hd = make_head(p, b, h);
    const float* dq = group.dq + (h - h0) * head_rows;
    for (int i0 = 0; i0 < seq.len_q; i0 += kBwdQ) {
      flash_tasks_run.fetch_add(1, std::memory_order_relaxed);
      store_rows(dq + int64_t{i0} * ldr, ldr, p.scale, std::min(kBwdQ, seq.len_q - i0), d, p.dq,
                 p.dtype, hd.dq + i0 * p.dq_row_stride, p.dq_row_stride);
    }
  }
}

// Whether the one-pass backward finishes first: its (batch, kv head) tasks, heaviest first on the
// least loaded thread, against the two passes' 14/10 of the work spread evenly over the threads
// (their tasks are blocks: many and small). Fills `order` with the tasks, heaviest first.
bool one_pass_is_faster(const AttentionParams& p, int threads, std::vector<int64_t>* order,
                        int64_t* max_len_q) {
  std::vector<double> cost;
  *max_len_q = 0;
  for (int b = 0; b < p.batch; ++b) {
    const SequenceInfo seq = sequence_info(p, b);
    *max_len_q = std::max<int64_t>(*max_len_q, seq.len_q);
    for (int kvh = 0; kvh < p.heads_kv; ++kvh)
      cost.push_back(static_cast<double>(p.head_group) * (seq.len_q + kBwdQ) * (seq.len_k + kBwdK));
  }
  order->resize(cost.size());
  std::iota(order->begin(), order->end(), int64_t{0});
  std::stable_sort(order->begin(), order->end(),
                   [&](int64_t x, int64_t y) { return cost[x] > cost[y]; });
  std::vector<double> load(static_cast<size_t>(std::max(threads, 1)), 0.0);
  double total = 0.0;
  for (int64_t task : *order) {
    *std::min_element(load.begin(), load.end()) += cost[task];
    total += cost[task];
  }
  const double makespan = *std::max_element(load.begin(), load.end());
  return threads <= 1 || 10.0 * makespan <= 14.0 * total / threads;
}

}  // namespace

// ---- entry points -------------------------------------------------------------------------------

Status flash_forward(const AttentionParams& p, const KeyRows& keys) {
  if (use_decode_path(p)) return decode_forward(p, keys);
  const int d = p.head_dim;
  BlockTasks tasks;
  try {
    tasks = BlockTasks(p, p.heads_q, kFwdQ, true);
  } catch (const std::bad_alloc&) {
    return Status::out_of_memory("cpu flash forward: task list");
  }
  if (tasks.size() == 0) return {};
  const int threads = static_cast<int>(std::min<int64_t>(omp_get_max_threads(), tasks.size()));
  std::vector<std::vector<float>> scratch;
  if (!allocate_scratch(threads, forward_scratch_floats(d), &scratch))
    return Status::out_of_memory("cpu flash forward: per-thread tiles");
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t task = 0; task < tasks.size(); ++task) {
    const BlockTasks::Task t = tasks[task];
    forward_block(p, keys, t.b, t.h, t.blocks - 1 - t.block,  // heavy (causal: last) blocks first
                  scratch[omp_get_thread_num()].data());
  }
  return {};
}

Status flash_backward(const AttentionParams& p) {
  const int d = p.head_dim, dpad = round_up(d, kLanes);
  BlockTasks q_tasks, k_tasks;
  std::vector<int64_t> group_order;
  int64_t max_len_q = 0;
  bool one_pass = false;
  try {
    q_tasks = BlockTasks(p, p.heads_q, kBwdQ, true);
    k_tasks = BlockTasks(p, p.heads_kv, kBwdK, false);
    one_pass = one_pass_is_faster(p, omp_get_max_threads(), &group_order, &max_len_q);
  } catch (const std::bad_alloc&) {
    return Status::out_of_memory("cpu flash backward: task lists");
  }
  if (q_tasks.size() == 0 && k_tasks.size() == 0) return {};
  const int threads = static_cast<int>(
      std::min<int64_t>(omp_get_max_threads(), std::max(q_tasks.size(), k_tasks.size())));
  std::vector<std::vector<float>> scratch, group_rows;
  std::vector<float> delta;
  try {
    delta.resize(static_cast<size_t>(p.heads_q) * static_cast<size_t>(p.total_q));
  } catch (const std::bad_alloc&) {
    return Status::out_of_memory("cpu flash backward: D buffer");
  }
  if (!allocate_scratch(threads, backward_scratch_floats(d, dpad), &scratch))
    return Status::out_of_memory("cpu flash backward: per-thread tiles");
  // The one-pass mode's rows of a head group per thread; without the memory, two passes.
  if (one_pass &&
      !allocate_scratch(threads, std::max<int64_t>(3 * int64_t{p.head_group} * max_len_q * rows_ld(dpad), 1),
                        &group_rows))
    one_pass = false;

#pragma omp parallel num_threads(threads)
  {
    const int me = omp_get_thread_num();
    BackwardTiles t = carve_backward(scratch[me].data(), d, dpad);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < q_tasks.size(); ++task) {
      const BlockTasks::Task qt = q_tasks[task];
      delta_block(p, qt.b, qt.h, qt.block, delta.data(), t.q);  // 2·dpad floats of scratch
    }
    if (one_pass) {
#pragma omp for schedule(dynamic, 1)
      for (size_t i = 0; i < group_order.size(); ++i) {
        const int64_t task = group_order[i];
        head_group_backward(p, static_cast<int>(task / p.heads_kv),
                            static_cast<int>(task % p.heads_kv), delta.data(), &t,
                            group_rows[me].data());
      }
    } else {
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < k_tasks.size(); ++task) {
        const BlockTasks::Task kt = k_tasks[task];  // in key order: causal's early keys are heavy
        key_block_backward(p, kt.b, kt.h, kt.block, delta.data(), &t, nullptr);
      }
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < q_tasks.size(); ++task) {
        const BlockTasks::Task qt = q_tasks[task];
        query_block_backward(p, qt.b, qt.h, qt.blocks - 1 - qt.block, delta.data(), &t);
      }
    }
  }
  return {};
}

}  // namespace flare::cpu::FLARE_SIMD_NAMESPACE
FLARE_SIMD_END
