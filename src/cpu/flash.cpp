// flash.cpp — the CPU flash backend: tiled online-softmax forward, recomputing backward.
//
// What. Exact attention in fp32 arithmetic on fp32/fp16/bf16 tensors, with every feature of
// AttentionParams (varlen, GQA/MQA, any head_dim 1..256, s_q != s_k, strides, causal/sliding
// window, softcap, ALiBi, dropout), never materialising an s_q × s_k matrix. Extra memory is the
// per-thread tiles below plus, in the backward, one fp32 per (query row, head) for
// D = rowsum(dO∘O): O(seqlen).
//
// Tiling. Query rows come in blocks of kBlockQ = 128, keys in tiles of kBlockK = 4 vectors (64
// with AVX-512). Inputs are converted to fp32 as tiles are loaded; K and V are stored transposed,
// (d, kBlockK), when they are the right-hand side of a score-like product, so that a row of
// scores is an axpy over keys with a broadcast query element. Both products are register-blocked
// micro-kernels on the Vec type of flash_simd.h (the hot loops are zmm FMAs with broadcast
// operands from memory; checked with objdump):
//   rows_times_tile   S(R, kBlockK) = A(R, d) · Bᵀ(d, kBlockK)        S = Q Kᵀ, dP = dO Vᵀ
//   accumulate_block  C(R, V·lanes) += A(R, n) · B(n, V·lanes)        O += P V, dQ += dS K, and,
//                                                                     reading A down its columns,
//                                                                     dV += P̃ᵀ dO, dK += dSᵀ Q
// R = 6 rows with AVX-512: 24 accumulators + 4 operands + 1 broadcast of the 32 registers.
// exp and tanh are vector polynomials (flash_simd.h). Scores stay in natural units and the
// weights are p = exp(s − m); the backward recomputes the bit-identical fp32 score (same kernel,
// same summation order) and forms exp(s − LSE), so for magnitude-1e3 inputs, whose softmax is
// one-hot, the winning key gets exactly P = 1 in both passes, and D = dO·O is summed exactly as
// dP is, so dP − D cancels to 0 there as it does in exact arithmetic.
// Against the float64 reference, fp32 errors are 0.7–0.9× (RMS) those of the naive fp32 kernel
// of the tolerance rule in docs/architecture.md (final O scaling and LSE in double, FMA products
// throughout).
// Key tiles outside the union of a query block's visible ranges are never visited, and within a
// tile only the rows that see one of its keys are computed (visible ranges grow with the row, so
// those rows are contiguous).
//
// NaN and ±Inf propagate as in the reference (tests/test_cpu_nonfinite.cpp): exp keeps NaN; a row
// that sees keys gets NaN when its sum is NaN or 0 (all visible scores −inf: 0/0); keys a row does
// not see get probability and dS exactly 0 by select, never by a product. A product of those
// zeros with an infinite V, dO, Q or K entry would still be NaN (0·Inf) inside the tile's matrix
// products, so a tile whose operand holds a non-finite value (checked as it is loaded, 1/rows of
// the product's cost) takes a per-row path that sums the visible keys alone.
//
// Threads (OpenMP, dynamic schedule). Tasks are counted from each sequence's own lengths, so a
// varlen call costs what its tokens cost whatever its max_seqlen (BlockTasks; the count is kept
// in cpu/flash_tasks.h for tests). Forward: one task per (batch, query head, query block),
// heaviest (last) blocks first for causal balance. Backward, deterministic by construction: each
// output element is summed by one task in a fixed order, whatever the thread count (a test checks
// the bits with 1 and 4 threads):
//   0. D_i = dO_i·O_i for every row (O read from params), into a (heads_q, total_q) buffer.
//   1. one task per (batch, kv head, key tile): loops over the query heads of its group and the
//      query blocks that see the tile, accumulating dK and dV of its keys in tiles.
//   2. one task per (batch, query head, query block): loops over key tiles, accumulating dQ.
// Pass 1 does S, dP, dV, dK (8 of FlashAttention's s_q·s_k·d FLOP units), pass 2 redoes S and dP
// and adds dQ (6), so 14 units are computed where 10 are counted. In exchange there are no
// atomics, no thread-private dQ copies to reduce, and the result does not depend on scheduling.
//
// Measured on an AMD EPYC (Zen 4) VM, 2 cores, AVX-512, GCC 12 -O3 -march=native; fp32, b=1, h=8,
// s_q=s_k=2048, non-causal; FLOPs as FlashAttention counts them (forward 4·b·s²·h·d, backward
// 2.5×); median of 5 calls after a warm-up, timed around attention_forward/attention_backward.
// Other jobs shared the two cores while this was measured (load average 2.6–4), so the
// wall-clock figures are a floor; FLOPs per second of process CPU time show what one core does:
//                 wall, 2 threads (shared)      per core (FLOPs / CPU time)
//     d=64:       forward 63, backward 52      forward 63, backward 52     GFLOP/s
//     d=128:      forward 65, backward 53      forward 73, backward 59     GFLOP/s
// kBlockQ = 128 over 64: +10% forward, +5% backward (fewer K/V tile conversions per query row).

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
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
constexpr int kKeyVecs = 4;                   // vectors per row of a score tile
constexpr int kBlockK = kKeyVecs * kLanes;    // keys per tile (64 with AVX-512)
constexpr int kBlockQ = 128;                  // query rows per tile (64: −10% forward, see top)
constexpr int kMicroRows = (simd::kRegisters - kKeyVecs - 4) / kKeyVecs;  // 6 with AVX-512
constexpr int kDimVecs = 4;                   // head-dim vectors per accumulate register block
constexpr float kInf = std::numeric_limits<float>::infinity();

int round_up(int x, int m) { return (x + m - 1) / m * m; }
int ceil_div(int x, int m) { return (x + m - 1) / m; }

// ---- micro-kernels ------------------------------------------------------------------------------

// c(r, :) = Σ_kk a(r, kk) · bt(kk, :) for R rows: a score row is an axpy of transposed key-tile
// rows with a broadcast query element. bt is (depth, kBlockK); c is (R, kBlockK).
template <int R>
void rows_times_tile(const float* a, int lda, const float* bt, int depth, float* c) {
  Vec acc[R][kKeyVecs];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < kKeyVecs; ++n) acc[r][n] = Vec{};
  for (int kk = 0; kk < depth; ++kk) {
    Vec b[kKeyVecs];
    for (int n = 0; n < kKeyVecs; ++n) b[n] = simd::load(bt + kk * kBlockK + n * kLanes);
    for (int r = 0; r < R; ++r) {
      const Vec x = simd::splat(a[r * lda + kk]);
      for (int n = 0; n < kKeyVecs; ++n) acc[r][n] = simd::fma(x, b[n], acc[r][n]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < kKeyVecs; ++n) simd::store(c + r * kBlockK + n * kLanes, acc[r][n]);
}

// c(r, :) += Σ_i a(r, i) · b(i, :) over `inner` terms, for R rows and V vectors of the head dim.
// a(r, i) = a[r·a_row + i·a_inner], so one kernel serves P·V (a = P by rows) and Pᵀ·dO (a = P
// read down its columns).
template <int R, int V>
void accumulate_block(const float* a, int a_row, int a_inner, const float* b, int ldb, int inner,
                      float* c, int ldc) {
  Vec acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = Vec{};
  for (int i = 0; i < inner; ++i) {
    Vec bv[V];
    for (int v = 0; v < V; ++v) bv[v] = simd::load(b + i * ldb + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const Vec x = simd::splat(a[r * a_row + i * a_inner]);
      for (int v = 0; v < V; ++v) acc[r][v] = simd::fma(x, bv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) {
      float* out = c + r * ldc + v * kLanes;
      simd::store(out, simd::load(out) + acc[r][v]);
    }
}

// accumulate_block over every head-dim vector of R rows.
template <int R>
void accumulate_rows(const float* a, int a_row, int a_inner, const float* b, int ldb, int inner,
                     float* c, int ldc, int dim_vecs) {
  int v = 0;
  for (; v + kDimVecs <= dim_vecs; v += kDimVecs)
    accumulate_block<R, kDimVecs>(a, a_row, a_inner, b + v * kLanes, ldb, inner, c + v * kLanes,
                                  ldc);
  b += v * kLanes;
  c += v * kLanes;
  static_assert(kDimVecs == 4, "the tail below handles 1..3 vectors");
  switch (dim_vecs - v) {
    case 1: accumulate_block<R, 1>(a, a_row, a_inner, b, ldb, inner, c, ldc); break;
    case 2: accumulate_block<R, 2>(a, a_row, a_inner, b, ldb, inner, c, ldc); break;
    case 3: accumulate_block<R, 3>(a, a_row, a_inner, b, ldb, inner, c, ldc); break;
    default: break;
  }
}

template <int R, typename F>
void row_block_tail(int rest, int r0, F& f) {
  if constexpr (R > 0) {
    if (rest == R) {
      f(std::integral_constant<int, R>{}, r0);
    } else {
      row_block_tail<R - 1>(rest, r0, f);
    }
  }
}

// Calls f(integral_constant<R>, r0) over rows [0, rows) in register blocks of kMicroRows rows.
template <typename F>
void for_row_blocks(int rows, F&& f) {
  int r = 0;
  for (; r + kMicroRows <= rows; r += kMicroRows) f(std::integral_constant<int, kMicroRows>{}, r);
  row_block_tail<kMicroRows - 1>(rows - r, r, f);
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

// `rows` rows into a transposed tile (d, kBlockK); key columns [rows, kBlockK) zeroed.
void load_transposed(const void* src, DType dtype, int64_t offset, int64_t stride, int rows, int d,
                     float* dst, float* row_buffer) {
  for (int r = 0; r < rows; ++r) {
    load_row(src, dtype, offset + r * stride, d, row_buffer);
    for (int c = 0; c < d; ++c) dst[c * kBlockK + r] = row_buffer[c];
  }
  if (rows < kBlockK)
    for (int c = 0; c < d; ++c) std::fill(dst + c * kBlockK + rows, dst + (c + 1) * kBlockK, 0.0f);
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

// Whether n floats are all finite: x·0 is 0 for finite x and NaN for ±Inf and NaN. Run on a tile
// just loaded, it costs one multiply-add per vector, 1/rows of the matrix product that reads it.
bool all_finite(const float* x, int64_t n) {
  Vec acc = Vec{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += simd::load(x + i) * 0.0f;
  float tail = 0.0f;
  for (; i < n; ++i) tail += x[i] * 0.0f;
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
  hd.plain = p.softcap <= 0.0f && p.alibi_slopes == nullptr;
  hd.shift = hd.seq.len_k - hd.seq.len_q;
  return hd;
}

// Scores (natural units) of row `row` for kLanes keys from absolute key j, in attention.h's
// order: scale, softcap, ALiBi; keys outside [lo, hi) become −inf. *dcap receives the softcap
// chain-rule factor 1 − tanh² (left alone when softcap is off).
inline Vec scores(Vec raw, const Head& hd, int row, int j, int lo, int hi, Vec* dcap) {
  Vec s = raw * hd.scale;
  if (!hd.plain) {
    if (hd.softcap > 0.0f) {
      const Vec th = simd::tanh(s * hd.inv_softcap);
      s = th * hd.softcap;
      *dcap = 1.0f - th * th;
    }
    if (hd.slope != 0.0f) {
      const IVec dist = simd::splat_int(row + hd.shift - j) - simd::lane_index();
      s = s - hd.slope * simd::abs(__builtin_convertvector(dist, Vec));
    }
  }
  const IVec col = simd::lane_index() + j;
  return simd::select((col >= lo) & (col < hi), s, simd::splat(-kInf));
}

// z[c] = keep_value where key j0 + c of `row` survives dropout, else 0; zero beyond n.
void dropout_row(const AttentionParams& p, uint32_t bh, int row, int j0, int n, float keep_value,
                 float* z) {
  int c = 0;
  while (c < n) {
    const int j = j0 + c;
    const Philox4 w = dropout_words(p.seed, p.offset, bh, static_cast<uint32_t>(row),
                                    static_cast<uint32_t>(j) >> 2);
    for (int lane = j & 3; lane < 4 && c < n; ++lane, ++c)
      z[c] = dropout_uniform(philox_word(w, lane)) >= p.dropout_p ? keep_value : 0.0f;
  }
  std::fill(z + n, z + kBlockK, 0.0f);
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

int64_t forward_scratch_floats(int d, int dpad) {
  return Carver::size({int64_t{kBlockQ} * dpad, int64_t{d} * kBlockK, int64_t{kBlockK} * dpad,
                       int64_t{kBlockQ} * kBlockK, int64_t{kBlockQ} * dpad, kBlockK, kBlockQ,
                       kBlockQ, kBlockQ, kBlockQ, dpad});
}

void forward_block(const AttentionParams& p, int b, int h, int qblock, float* scratch) {
  flash_tasks_run.fetch_add(1, std::memory_order_relaxed);
  const Head hd = make_head(p, b, h);
  const int i0 = qblock * kBlockQ;
  if (i0 >= hd.seq.len_q) return;
  const int nq = std::min(kBlockQ, hd.seq.len_q - i0);
  const int d = p.head_dim, dpad = round_up(d, kLanes), dvecs = dpad / kLanes;

  Carver carve(scratch);
  float* tq = carve.take(int64_t{kBlockQ} * dpad);    // (kBlockQ, dpad)
  float* tkt = carve.take(int64_t{d} * kBlockK);      // (d, kBlockK)
  float* tv = carve.take(int64_t{kBlockK} * dpad);    // (kBlockK, dpad)
  float* ts = carve.take(int64_t{kBlockQ} * kBlockK); // (kBlockQ, kBlockK) scores → probabilities
  float* acc = carve.take(int64_t{kBlockQ} * dpad);   // (kBlockQ, dpad) unnormalised O
  float* z = carve.take(kBlockK);                     // (kBlockK) dropout multipliers
  float* m = carve.take(kBlockQ);                     // (kBlockQ) running max, natural units
  float* l = carve.take(kBlockQ);                     // (kBlockQ) running Σ exp(s − m)
  int lo[kBlockQ], hi[kBlockQ];
  float* row_buffer = carve.take(dpad);

  int klo, khi;
  block_ranges(p, hd, i0, nq, lo, hi, &klo, &khi);
  std::fill(m, m + nq, -kInf);
  std::fill(l, l + nq, 0.0f);
  std::fill(acc, acc + int64_t{nq} * dpad, 0.0f);
  load_rows(p.q, p.dtype, hd.q + i0 * p.q_row_stride, p.q_row_stride, nq, d, tq, dpad);

  for (int j0 = klo; j0 < khi; j0 += kBlockK) {
    const int nk = std::min(kBlockK, khi - j0);
    int ra, rb;
    rows_meeting(lo, hi, nq, j0, j0 + nk, &ra, &rb);
    if (ra == rb) continue;
    load_transposed(p.k, p.dtype, hd.k + j0 * p.k_row_stride, p.k_row_stride, nk, d, tkt,
                    row_buffer);
    load_rows(p.v, p.dtype, hd.v + j0 * p.v_row_stride, p.v_row_stride, nk, d, tv, dpad);
    // A masked key's weight is 0, and 0·Inf = NaN: a non-finite value may reach only the rows
    // that see its key, so then each row sums its visible keys alone, as the reference does.
    const bool per_row = tile_masked(lo, hi, ra, rb, j0, j0 + nk) &&
                         !all_finite(tv, int64_t{nk} * dpad);

    for_row_blocks(rb - ra, [&](auto rows, int r0) {
      constexpr int R = decltype(rows)::value;
      const int r = ra + r0;
      rows_times_tile<R>(tq + r * dpad, dpad, tkt, d, ts + r * kBlockK);
    });

    for (int r = ra; r < rb; ++r) {
      float* srow = ts + r * kBlockK;
      const int row = i0 + r;
      Vec unused_dcap;
      Vec vmax = simd::splat(-kInf);
      for (int n = 0; n < kKeyVecs; ++n) {
        const int j = j0 + n * kLanes;
        const Vec s = scores(simd::load(srow + n * kLanes), hd, row, j, lo[r], hi[r], &unused_dcap);
        simd::store(srow + n * kLanes, s);
        vmax = simd::max(vmax, s);
      }
      const float m_new = std::max(m[r], simd::reduce_max(vmax));
      // A row that has seen no key yet keeps m = −inf; exponentiating against 0 keeps p = 0.
      const float m_use = m_new == -kInf ? 0.0f : m_new;
      const float alpha = std::exp(m[r] - m_use);
      if (p.dropout_p > 0.0f) dropout_row(p, hd.bh, row, j0, nk, 1.0f, z);
      Vec vsum = Vec{};
      for (int n = 0; n < kKeyVecs; ++n) {
        Vec e = simd::exp(simd::load(srow + n * kLanes) - m_use);
        vsum += e;
        if (p.dropout_p > 0.0f) e *= simd::load(z + n * kLanes);
        simd::store(srow + n * kLanes, e);
      }
      l[r] = l[r] * alpha + simd::reduce_sum(vsum);
      m[r] = m_new;
      if (alpha != 1.0f) {
        float* arow = acc + r * dpad;
        for (int v = 0; v < dvecs; ++v)
          simd::store(arow + v * kLanes, simd::load(arow + v * kLanes) * alpha);
      }
    }

    if (!per_row) {
      for_row_blocks(rb - ra, [&](auto rows, int r0) {
        constexpr int R = decltype(rows)::value;
        const int r = ra + r0;
        accumulate_rows<R>(ts + r * kBlockK, kBlockK, 1, tv, dpad, nk, acc + r * dpad, dpad,
                           dvecs);
      });
    } else {
      for (int r = ra; r < rb; ++r) {
        const int a = std::max(lo[r], j0) - j0, e = std::min(hi[r], j0 + nk) - j0;
        accumulate_rows<1>(ts + r * kBlockK + a, kBlockK, 1, tv + a * dpad, dpad, e - a,
                           acc + r * dpad, dpad, dvecs);
      }
    }
  }

  for (int r = 0; r < nq; ++r) {
    // l = 0 for a row that sees keys only when every visible score is −inf: the reference's
    // softmax is then 0/0, NaN. A NaN l (a NaN or +inf score) gives NaN as it stands.
    const bool sees_keys = lo[r] < hi[r];
    const double l_row = l[r] > 0.0f ? l[r] : std::numeric_limits<double>::quiet_NaN();
    const double factor = sees_keys ? static_cast<double>(p.dropout_scale) / l_row : 0.0;
    store_rows(acc + r * dpad, dpad, factor, 1, d, p.o, p.dtype,
               hd.o + int64_t{i0 + r} * p.o_row_stride, p.o_row_stride);
    p.lse[hd.lse + i0 + r] =
        sees_keys ? static_cast<float>(static_cast<double>(m[r]) + std::log(l_row)) : -kInf;
  }
}

// ---- backward -----------------------------------------------------------------------------------

// Tiles shared by both backward passes.
struct BackwardTiles {
  float* q;      // (kBlockQ, dpad)
  float* dout;   // (kBlockQ, dpad)
  float* kt;     // (d, kBlockK)
  float* vt;     // (d, kBlockK)
  float* k;      // (kBlockK, dpad)     pass 2 only
  float* s;      // (kBlockQ, kBlockK)  scores → dropped, rescaled probabilities
  float* dp;     // (kBlockQ, kBlockK)  dO Vᵀ → dS
  float* acc0;   // pass 1: dK (kBlockK, dpad); pass 2: dQ (kBlockQ, dpad)
  float* acc1;   // pass 1: dV (kBlockK, dpad)
  float* z;      // (kBlockK)
  float* lse;    // (kBlockQ) LSE, +inf for rows that see no key
  float* delta;  // (kBlockQ) D
  float* row_buffer;  // (dpad)
};

int64_t backward_scratch_floats(int d, int dpad) {
  const int64_t acc = int64_t{std::max(kBlockQ, kBlockK)} * dpad;
  return Carver::size({int64_t{kBlockQ} * dpad, int64_t{kBlockQ} * dpad, int64_t{d} * kBlockK,
                       int64_t{d} * kBlockK, int64_t{kBlockK} * dpad, int64_t{kBlockQ} * kBlockK,
                       int64_t{kBlockQ} * kBlockK, acc, acc, kBlockK, kBlockQ, kBlockQ, dpad});
}

BackwardTiles carve_backward(float* scratch, int d, int dpad) {
  const int64_t acc = int64_t{std::max(kBlockQ, kBlockK)} * dpad;
  Carver carve(scratch);
  BackwardTiles t;
  t.q = carve.take(int64_t{kBlockQ} * dpad);
  t.dout = carve.take(int64_t{kBlockQ} * dpad);
  t.kt = carve.take(int64_t{d} * kBlockK);
  t.vt = carve.take(int64_t{d} * kBlockK);
  t.k = carve.take(int64_t{kBlockK} * dpad);
  t.s = carve.take(int64_t{kBlockQ} * kBlockK);
  t.dp = carve.take(int64_t{kBlockQ} * kBlockK);
  t.acc0 = carve.take(acc);
  t.acc1 = carve.take(acc);
  t.z = carve.take(kBlockK);
  t.lse = carve.take(kBlockQ);
  t.delta = carve.take(kBlockQ);
  t.row_buffer = carve.take(dpad);
  return t;
}

// Loads the query-side tiles of rows [i0, i0 + nq): Q, dO, LSE and D.
void load_query_side(const AttentionParams& p, const Head& hd, int i0, int nq, int dpad,
                     const float* delta, BackwardTiles* t) {
  const int d = p.head_dim;
  load_rows(p.q, p.dtype, hd.q + i0 * p.q_row_stride, p.q_row_stride, nq, d, t->q, dpad);
  load_rows(p.dout, p.dtype, hd.dout + i0 * p.do_row_stride, p.do_row_stride, nq, d, t->dout, dpad);
  for (int r = 0; r < nq; ++r) {
    const float lse = p.lse[hd.lse + i0 + r];
    t->lse[r] = lse == -kInf ? kInf : lse;  // p = exp(s − (+inf)) = 0 instead of NaN
    t->delta[r] = delta[hd.lse + i0 + r];
  }
}

// Row r of the S and dP tiles (keys from j0): S becomes P̃ = P·z (for dV) and dP becomes
// dS = P ∘ (z·dP − D), times the softcap factor (for dK, dQ; the softmax scale is applied on
// output). Both are exactly 0 on keys the row does not see: P is 0 there, but z·dP − D need not
// be finite (an Inf in dO, V or O), and a masked key must not turn that into NaN.
void backward_row(const AttentionParams& p, const Head& hd, int row, int j0, int nk, int lo, int hi,
                  float lse, float delta, BackwardTiles* t, int r) {
  float* srow = t->s + r * kBlockK;
  float* dprow = t->dp + r * kBlockK;
  const bool dropout = p.dropout_p > 0.0f;
  const bool masked = lo > j0 || hi < j0 + nk;  // lanes from nk on are never read
  if (dropout) dropout_row(p, hd.bh, row, j0, nk, p.dropout_scale, t->z);
  for (int n = 0; n < kKeyVecs; ++n) {
    Vec dcap = simd::splat(1.0f);
    const Vec s =
        scores(simd::load(srow + n * kLanes), hd, row, j0 + n * kLanes, lo, hi, &dcap);
    const Vec prob = simd::exp(s - lse);
    Vec dpv = simd::load(dprow + n * kLanes);
    Vec pz = prob;
    if (dropout) {
      const Vec zv = simd::load(t->z + n * kLanes);
      dpv *= zv;
      pz *= zv;
    }
    Vec ds = prob * (dpv - delta) * dcap;
    if (masked) {
      const IVec col = simd::lane_index() + (j0 + n * kLanes);
      const IVec visible = (col >= lo) & (col < hi);
      pz = simd::select(visible, pz, Vec{});
      ds = simd::select(visible, ds, Vec{});
    }
    simd::store(srow + n * kLanes, pz);
    simd::store(dprow + n * kLanes, ds);
  }
}

// Pass 0: D_i = dO_i · O_i for rows [i0, i0 + kBlockQ) of one head, summed exactly as
// rows_times_tile sums dP_ij = dO_i · V_j (fp32 FMA chain in head-dim order). Where a row's
// probability is 1 on one key (a single visible key, or inputs of magnitude 1e3), O_i = V_j
// exactly and dP_ij − D_i cancels to 0 as it does in exact arithmetic.
void delta_block(const AttentionParams& p, int b, int h, int qblock, float* delta, float* scratch) {
  flash_tasks_run.fetch_add(1, std::memory_order_relaxed);
  const Head hd = make_head(p, b, h);
  const int i0 = qblock * kBlockQ;
  const int rows = std::min(kBlockQ, hd.seq.len_q - i0);
  const int d = p.head_dim;
  float* o = scratch;
  float* dout = scratch + round_up(d, kLanes);
  for (int r = 0; r < rows; ++r) {
    load_row(p.o, p.dtype, hd.o + int64_t{i0 + r} * p.o_row_stride, d, o);
    load_row(p.dout, p.dtype, hd.dout + int64_t{i0 + r} * p.do_row_stride, d, dout);
    float acc = 0.0f;
    for (int c = 0; c < d; ++c) acc = simd::fma(dout[c], o[c], acc);
    delta[hd.lse + i0 + r] = acc;
  }
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

// Pass 1: dK and dV of keys [j0, j0 + kBlockK) of kv head kvh, over every query head of its group.
void key_block_backward(const AttentionParams& p, int b, int kvh, int kblock, const float* delta,
                        float* scratch) {
  flash_tasks_run.fetch_add(1, std::memory_order_relaxed);
  const SequenceInfo seq = sequence_info(p, b);
  const int j0 = kblock * kBlockK;
  if (j0 >= seq.len_k) return;
  const int nk = std::min(kBlockK, seq.len_k - j0);
  const int d = p.head_dim, dpad = round_up(d, kLanes), dvecs = dpad / kLanes;
  BackwardTiles t = carve_backward(scratch, d, dpad);
  const Head first = make_head(p, b, kvh * p.head_group);
  load_transposed(p.k, p.dtype, first.k + j0 * p.k_row_stride, p.k_row_stride, nk, d, t.kt,
                  t.row_buffer);
  load_transposed(p.v, p.dtype, first.v + j0 * p.v_row_stride, p.v_row_stride, nk, d, t.vt,
                  t.row_buffer);
  std::fill(t.acc0, t.acc0 + int64_t{kBlockK} * dpad, 0.0f);
  std::fill(t.acc1, t.acc1 + int64_t{kBlockK} * dpad, 0.0f);
  int lo[kBlockQ], hi[kBlockQ];

  auto range = [&](int i) {
    return visible_keys(i, seq.len_q, seq.len_k, p.window_left, p.window_right);
  };
  // Rows that see a key of the tile: hi > j0 (a suffix of rows) and lo < j0 + nk (a prefix).
  const int qa = first_row(seq.len_q, [&](int i) { return range(i).hi > j0; });
  const int qb = std::max(qa, first_row(seq.len_q, [&](int i) { return range(i).lo >= j0 + nk; }));

  for (int h = kvh * p.head_group; h < (kvh + 1) * p.head_group; ++h) {
    const Head hd = make_head(p, b, h);
    for (int i0 = qa; i0 < qb; i0 += kBlockQ) {
      const int nq = std::min(kBlockQ, qb - i0);
      load_query_side(p, hd, i0, nq, dpad, delta, &t);
      int klo, khi;
      block_ranges(p, hd, i0, nq, lo, hi, &klo, &khi);
      // P̃ and dS are 0 where row r does not see key c, and 0·Inf = NaN: where dO or Q holds a
      // non-finite value, each key sums the rows that see it alone, as the reference does.
      const bool per_key = tile_masked(lo, hi, 0, nq, j0, j0 + nk) &&
                           !(all_finite(t.q, int64_t{nq} * dpad) &&
                             all_finite(t.dout, int64_t{nq} * dpad));
      for_row_blocks(nq, [&](auto rows, int r) {
        constexpr int R = decltype(rows)::value;
        rows_times_tile<R>(t.q + r * dpad, dpad, t.kt, d, t.s + r * kBlockK);
        rows_times_tile<R>(t.dout + r * dpad, dpad, t.vt, d, t.dp + r * kBlockK);
      });
      for (int r = 0; r < nq; ++r)
        backward_row(p, hd, i0 + r, j0, nk, lo[r], hi[r], t.lse[r], t.delta[r], &t, r);
      // dV(c, :) += Σ_r P̃(r, c) dO(r, :) and dK(c, :) += Σ_r dS(r, c) Q(r, :), c over the keys.
      if (!per_key) {
        for_row_blocks(nk, [&](auto rows, int c) {
          constexpr int R = decltype(rows)::value;
          accumulate_rows<R>(t.s + c, 1, kBlockK, t.dout, dpad, nq, t.acc1 + c * dpad, dpad,
                             dvecs);
          accumulate_rows<R>(t.dp + c, 1, kBlockK, t.q, dpad, nq, t.acc0 + c * dpad, dpad, dvecs);
        });
      } else {
        for (int c = 0; c < nk; ++c) {
          // Rows [a, e) of the block see key j0 + c: visible ranges grow with the row.
          int a = 0;
          while (a < nq && hi[a] <= j0 + c) ++a;
          int e = a;
          while (e < nq && lo[e] <= j0 + c) ++e;
          const int a_off = a * kBlockK + c;
          accumulate_rows<1>(t.s + a_off, 1, kBlockK, t.dout + a * dpad, dpad, e - a,
                             t.acc1 + c * dpad, dpad, dvecs);
          accumulate_rows<1>(t.dp + a_off, 1, kBlockK, t.q + a * dpad, dpad, e - a,
                             t.acc0 + c * dpad, dpad, dvecs);
        }
      }
    }
  }
  store_rows(t.acc0, dpad, p.scale, nk, d, p.dk, p.dtype, first.dk + j0 * p.dk_row_stride,
             p.dk_row_stride);
  store_rows(t.acc1, dpad, 1.0f, nk, d, p.dv, p.dtype, first.dv + j0 * p.dv_row_stride,
             p.dv_row_stride);
}

// Pass 2: dQ of rows [i0, i0 + kBlockQ) of query head h.
void query_block_backward(const AttentionParams& p, int b, int h, int qblock, const float* delta,
                          float* scratch) {
  flash_tasks_run.fetch_add(1, std::memory_order_relaxed);
  const Head hd = make_head(p, b, h);
  const int i0 = qblock * kBlockQ;
  if (i0 >= hd.seq.len_q) return;
  const int nq = std::min(kBlockQ, hd.seq.len_q - i0);
  const int d = p.head_dim, dpad = round_up(d, kLanes), dvecs = dpad / kLanes;
  BackwardTiles t = carve_backward(scratch, d, dpad);
  load_query_side(p, hd, i0, nq, dpad, delta, &t);
  std::fill(t.acc0, t.acc0 + int64_t{kBlockQ} * dpad, 0.0f);
  int lo[kBlockQ], hi[kBlockQ];
  int klo, khi;
  block_ranges(p, hd, i0, nq, lo, hi, &klo, &khi);

  for (int j0 = klo; j0 < khi; j0 += kBlockK) {
    const int nk = std::min(kBlockK, khi - j0);
    int ra, rb;
    rows_meeting(lo, hi, nq, j0, j0 + nk, &ra, &rb);
    if (ra == rb) continue;
    load_transposed(p.k, p.dtype, hd.k + j0 * p.k_row_stride, p.k_row_stride, nk, d, t.kt,
                    t.row_buffer);
    load_transposed(p.v, p.dtype, hd.v + j0 * p.v_row_stride, p.v_row_stride, nk, d, t.vt,
                    t.row_buffer);
    load_rows(p.k, p.dtype, hd.k + j0 * p.k_row_stride, p.k_row_stride, nk, d, t.k, dpad);
    // As in the forward: with a masked key in the tile and a non-finite K, each row sums its
    // visible keys alone (0·Inf = NaN).
    const bool per_row = tile_masked(lo, hi, ra, rb, j0, j0 + nk) &&
                         !all_finite(t.k, int64_t{nk} * dpad);
    for_row_blocks(rb - ra, [&](auto rows, int r0) {
      constexpr int R = decltype(rows)::value;
      const int r = ra + r0;
      rows_times_tile<R>(t.q + r * dpad, dpad, t.kt, d, t.s + r * kBlockK);
      rows_times_tile<R>(t.dout + r * dpad, dpad, t.vt, d, t.dp + r * kBlockK);
    });
    for (int r = ra; r < rb; ++r)
      backward_row(p, hd, i0 + r, j0, nk, lo[r], hi[r], t.lse[r], t.delta[r], &t, r);
    if (!per_row) {
      for_row_blocks(rb - ra, [&](auto rows, int r0) {
        constexpr int R = decltype(rows)::value;
        const int r = ra + r0;
        accumulate_rows<R>(t.dp + r * kBlockK, kBlockK, 1, t.k, dpad, nk, t.acc0 + r * dpad, dpad,
                           dvecs);
      });
    } else {
      for (int r = ra; r < rb; ++r) {
        const int a = std::max(lo[r], j0) - j0, e = std::min(hi[r], j0 + nk) - j0;
        accumulate_rows<1>(t.dp + r * kBlockK + a, kBlockK, 1, t.k + a * dpad, dpad, e - a,
                           t.acc0 + r * dpad, dpad, dvecs);
      }
    }
  }
  store_rows(t.acc0, dpad, p.scale, nq, d, p.dq, p.dtype, hd.dq + i0 * p.dq_row_stride,
             p.dq_row_stride);
}

}  // namespace

// ---- entry points -------------------------------------------------------------------------------

Status flash_forward(const AttentionParams& p) {
  const int d = p.head_dim, dpad = round_up(d, kLanes);
  BlockTasks tasks;
  try {
    tasks = BlockTasks(p, p.heads_q, kBlockQ, true);
  } catch (const std::bad_alloc&) {
    return Status::out_of_memory("cpu flash forward: task list");
  }
  if (tasks.size() == 0) return {};
  const int threads = static_cast<int>(std::min<int64_t>(omp_get_max_threads(), tasks.size()));
  std::vector<std::vector<float>> scratch;
  if (!allocate_scratch(threads, forward_scratch_floats(d, dpad), &scratch))
    return Status::out_of_memory("cpu flash forward: per-thread tiles");
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t task = 0; task < tasks.size(); ++task) {
    const BlockTasks::Task t = tasks[task];
    forward_block(p, t.b, t.h, t.blocks - 1 - t.block,  // heavy (causal: last) blocks first
                  scratch[omp_get_thread_num()].data());
  }
  return {};
}

Status flash_backward(const AttentionParams& p) {
  const int d = p.head_dim, dpad = round_up(d, kLanes);
  BlockTasks q_tasks, k_tasks;
  try {
    q_tasks = BlockTasks(p, p.heads_q, kBlockQ, true);
    k_tasks = BlockTasks(p, p.heads_kv, kBlockK, false);
  } catch (const std::bad_alloc&) {
    return Status::out_of_memory("cpu flash backward: task lists");
  }
  if (q_tasks.size() == 0 && k_tasks.size() == 0) return {};
  const int threads = static_cast<int>(
      std::min<int64_t>(omp_get_max_threads(), std::max(q_tasks.size(), k_tasks.size())));
  std::vector<std::vector<float>> scratch;
  std::vector<float> delta;
  try {
    delta.resize(static_cast<size_t>(p.heads_q) * static_cast<size_t>(p.total_q));
  } catch (const std::bad_alloc&) {
    return Status::out_of_memory("cpu flash backward: D buffer");
  }
  if (!allocate_scratch(threads, backward_scratch_floats(d, dpad), &scratch))
    return Status::out_of_memory("cpu flash backward: per-thread tiles");

#pragma omp parallel num_threads(threads)
  {
    float* mine = scratch[omp_get_thread_num()].data();
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < q_tasks.size(); ++task) {
      const BlockTasks::Task t = q_tasks[task];
      delta_block(p, t.b, t.h, t.block, delta.data(), mine);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < k_tasks.size(); ++task) {
      const BlockTasks::Task t = k_tasks[task];  // in key order: causal's early keys are heavy
      key_block_backward(p, t.b, t.h, t.block, delta.data(), mine);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < q_tasks.size(); ++task) {
      const BlockTasks::Task t = q_tasks[task];
      query_block_backward(p, t.b, t.h, t.blocks - 1 - t.block, delta.data(), mine);
    }
  }
  return {};
}

}  // namespace flare::cpu::FLARE_SIMD_NAMESPACE
FLARE_SIMD_END
