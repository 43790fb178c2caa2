// flash_simd.h — the handful of SIMD operations the CPU flash backend is written in.
//
// One vector type, Vec, as wide as the widest float registers the code targets (16 lanes with
// AVX-512, 8 with AVX, 4 otherwise), written with the GCC/Clang vector extension so that +, −,
// ·, comparisons and lane access read like scalar code. Fused multiply-add goes through the
// intrinsic where the ISA has one: in ISO C++ mode GCC does not contract a·b + c on its own
// (-ffp-contract=off), and the matrix-product loops live on FMA.
//
// Instruction-set levels. A portable x86-64 build compiles flash.cpp once per level, with
// FLARE_SIMD_LEVEL set (CMakeLists.txt), and flash_dispatch.cpp runs the best one the CPU has:
//   1  x86-64     (SSE2, 4 lanes)
//   3  x86-64-v3  (AVX2 and FMA, 8 lanes)
//   4  x86-64-v4  (AVX-512, 16 lanes, 32 registers)
//   5  x86-64-v4-bf16 (level 4 and AVX-512 BF16: bf16 pair dot products, vdpbf16ps)
// The level's code lies between FLARE_SIMD_BEGIN and FLARE_SIMD_END, which give the functions
// there the level's target, as -march would, but only those: the standard library's and flare's
// other inline functions stay baseline code, so the single copy of each that the linker keeps is
// safe for every caller (with -march, an AVX-512 copy of a std::vector member could be the one
// kept). Each configuration has its own namespace (FLARE_SIMD_NAMESPACE), so no two share a
// symbol. Without FLARE_SIMD_LEVEL (FLARE_NATIVE builds, other hosts, the tests of the vector
// math) the compiler's own target decides.
//
// exp and tanh are our own because std::exp in a loop does not vectorise. Both are accurate to
// about one ulp (tests/test_cpu_flash.cpp measures them against double precision):
//   exp:  x = n·ln2 + r with n = round(x·log2 e), r by Cody–Waite reduction with FMA; e^r by
//         its Taylor polynomial to degree 7, 2^n by building exponent bits. A natural-base exp
//         (rather than exp2 of x·log2 e) avoids rounding the product, so softmax weights are as
//         accurate as those of a plain fp32 softmax. Inputs are clamped to [−104, 88]: results
//         underflow gradually through the subnormals to exp(−inf) = 0, as std::exp does;
//         exp(NaN) = NaN (a NaN score must poison its row, as it does in the reference).
//   tanh: |x| < 0.625 by the Cephes odd polynomial (no cancellation near 0), otherwise
//         1 − 2/(e^{2|x|} + 1) with the sign restored.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

#include "core/numeric.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // declares every level's intrinsics, whatever the compiler's target
#endif

// FLARE_SIMD_LANES, FLARE_SIMD_FMA and FLARE_SIMD_TARGET (the level's target features).
#if defined(FLARE_SIMD_LEVEL)
#if FLARE_SIMD_LEVEL == 5
#define FLARE_SIMD_LANES 16
#define FLARE_SIMD_FMA 1
#define FLARE_SIMD_BF16 1
#define FLARE_SIMD_TARGET "avx512f,avx512cd,avx512bw,avx512dq,avx512vl,avx2,fma,avx512bf16"
#elif FLARE_SIMD_LEVEL == 4
#define FLARE_SIMD_LANES 16
#define FLARE_SIMD_FMA 1
#define FLARE_SIMD_TARGET "avx512f,avx512cd,avx512bw,avx512dq,avx512vl,avx2,fma"
#elif FLARE_SIMD_LEVEL == 3
#define FLARE_SIMD_LANES 8
#define FLARE_SIMD_FMA 1
#define FLARE_SIMD_TARGET "avx2,fma"
#elif FLARE_SIMD_LEVEL == 1
#define FLARE_SIMD_LANES 4
#define FLARE_SIMD_FMA 0
#else
#error "FLARE_SIMD_LEVEL must be 1, 3, 4 or 5"
#endif
#elif defined(__AVX512F__)
#define FLARE_SIMD_LANES 16
#define FLARE_SIMD_FMA 1
#if defined(__AVX512BF16__)
#define FLARE_SIMD_BF16 1
#endif
#elif defined(__AVX__)
#define FLARE_SIMD_LANES 8
#if defined(__FMA__)
#define FLARE_SIMD_FMA 1
#else
#define FLARE_SIMD_FMA 0
#endif
#else
#define FLARE_SIMD_LANES 4
#define FLARE_SIMD_FMA 0
#endif

// FLARE_SIMD_BF16: bf16 pair dot products (AVX-512 BF16: vdpbf16ps) for bf16 inputs.
#if !defined(FLARE_SIMD_BF16)
#define FLARE_SIMD_BF16 0
#endif

// One namespace per (lanes, FMA, bf16 pairs): the code differs exactly when these do.
#if FLARE_SIMD_LANES == 16 && FLARE_SIMD_BF16
#define FLARE_SIMD_NAMESPACE avx512bf16
#elif FLARE_SIMD_LANES == 16
#define FLARE_SIMD_NAMESPACE avx512
#elif FLARE_SIMD_LANES == 8 && FLARE_SIMD_FMA
#define FLARE_SIMD_NAMESPACE avx_fma
#elif FLARE_SIMD_LANES == 8
#define FLARE_SIMD_NAMESPACE avx
#else
#define FLARE_SIMD_NAMESPACE generic
#endif

// The target region. GCC does not expand macros inside its pragmas, so the target string is
// expanded before it is quoted.
#define FLARE_SIMD_PRAGMA_QUOTED(x) _Pragma(#x)
#define FLARE_SIMD_PRAGMA(x) FLARE_SIMD_PRAGMA_QUOTED(x)
#if !defined(FLARE_SIMD_TARGET)
#define FLARE_SIMD_BEGIN
#define FLARE_SIMD_END
#elif defined(__clang__)
#define FLARE_SIMD_BEGIN                                                              \
  FLARE_SIMD_PRAGMA(clang attribute push(__attribute__((target(FLARE_SIMD_TARGET))), \
                                         apply_to = function))
#define FLARE_SIMD_END _Pragma("clang attribute pop")
#else
#define FLARE_SIMD_BEGIN \
  _Pragma("GCC push_options") FLARE_SIMD_PRAGMA(GCC target(FLARE_SIMD_TARGET))
#define FLARE_SIMD_END _Pragma("GCC pop_options")
#endif

FLARE_SIMD_BEGIN
namespace flare::cpu::FLARE_SIMD_NAMESPACE::simd {

inline constexpr int kLanes = FLARE_SIMD_LANES;
inline constexpr int kRegisters = kLanes == 16 ? 32 : 16;

typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t IVec __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }

// A broadcast (Vec{} + x would cost an add, since 0 + x is not x for x = −0).
inline Vec splat(float x) {
#if FLARE_SIMD_LANES == 16
  return _mm512_set1_ps(x);
#elif FLARE_SIMD_LANES == 8
  return _mm256_set1_ps(x);
#else
  return Vec{x, x, x, x};
#endif
}

inline IVec splat_int(int32_t x) { return IVec{} + x; }

// Lane indices 0, 1, …, kLanes − 1.
inline IVec lane_index() {
  IVec v{};
  for (int i = 0; i < kLanes; ++i) v[i] = i;
  return v;
}

// a·b + c, rounded once where the ISA allows.
inline Vec fma(Vec a, Vec b, Vec c) {
#if FLARE_SIMD_LANES == 16
  return _mm512_fmadd_ps(a, b, c);
#elif FLARE_SIMD_LANES == 8 && FLARE_SIMD_FMA
  return _mm256_fmadd_ps(a, b, c);
#else
  return a * b + c;
#endif
}

// The scalar twin of fma(Vec, Vec, Vec): fused exactly when the vector one is, so a scalar
// dot product can reproduce a lane of a vector one bit for bit.
inline float fma(float a, float b, float c) {
#if FLARE_SIMD_FMA
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

// Lanes of a where mask is set (all ones), else lanes of b.
inline Vec select(IVec mask, Vec a, Vec b) {
  return reinterpret_cast<Vec>((mask & reinterpret_cast<IVec>(a)) |
                               (~mask & reinterpret_cast<IVec>(b)));
}

// The forms vmaxps / vminps implement (GCC 12 warns spuriously inside _mm512_max_ps).
inline Vec max(Vec a, Vec b) { return a > b ? a : b; }

inline Vec min(Vec a, Vec b) { return a < b ? a : b; }

inline Vec abs(Vec a) { return reinterpret_cast<Vec>(reinterpret_cast<IVec>(a) & 0x7fffffff); }

inline float reduce_max(Vec v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

inline float reduce_sum(Vec v) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

inline Vec exp(Vec x) {
  // Bounds first, NaN second (max/min return their second operand when either is NaN): a NaN
  // argument must give a NaN weight, as std::exp does, not the weight of the bound.
  x = min(splat(88.0f), max(splat(-104.0f), x));
  // n = round(x·log2 e) by adding 1.5·2^23, whose ulp is 1: the sum is n + 1.5·2^23 exactly,
  // its low mantissa bits hold n, and NaN stays NaN without a float-to-int conversion.
  const Vec magic = splat(12582912.0f);
  const Vec shifted = fma(x, splat(kLog2e), magic);
  const Vec nf = shifted - magic;
  // r = x − n·ln 2 in two FMA steps (Cody–Waite): |r| ≤ ln2/2 plus rounding, almost exact.
  Vec r = fma(nf, splat(-0.693145751953125f), x);
  r = fma(nf, splat(-1.428606820309417e-6f), r);
  Vec p = splat(1.0f / 5040.0f);  // Taylor to degree 7: truncation < 0.1 ulp for |r| ≤ ln2/2
  p = fma(p, r, splat(1.0f / 720.0f));
  p = fma(p, r, splat(1.0f / 120.0f));
  p = fma(p, r, splat(1.0f / 24.0f));
  p = fma(p, r, splat(1.0f / 6.0f));
  p = fma(p, r, splat(0.5f));
  p = fma(p, r, splat(1.0f));
  p = fma(p, r, splat(1.0f));
#if FLARE_SIMD_LANES == 16
  // p · 2^n in one instruction (AVX-512's scalef), rounded once: the same bits as the two-step
  // product below, in one instruction instead of eight (the zero-masked form with every lane
  // set: the unmasked intrinsic trips GCC 12's -Wmaybe-uninitialized inside its own header).
  return reinterpret_cast<Vec>(
      _mm512_maskz_scalef_ps(__mmask16(0xffff), reinterpret_cast<__m512>(p), reinterpret_cast<__m512>(nf)));
#else
  // 2^n as 2^n1 · 2^n2, both normal for n ≥ −150, so results underflow gradually into the
  // subnormals as std::exp does, down to exp(−inf) = +0. A NaN lane's n is meaningless, but
  // its p is NaN, and so is the product.
  const IVec n = reinterpret_cast<IVec>(shifted) - reinterpret_cast<IVec>(magic);
  const IVec n1 = n >> 1;
  const Vec two_n1 = reinterpret_cast<Vec>((n1 + 127) << 23);
  const Vec two_n2 = reinterpret_cast<Vec>((n - n1 + 127) << 23);
  return p * two_n1 * two_n2;
#endif
}

// ---- transpose of a kLanes × kLanes block held in kLanes vectors ------------------------------
//
// By block swaps: at level h (kLanes/2, …, 2, 1), in each pair of rows r and r + h with bit h of r
// clear, the lanes of row r with bit h set trade places with the lanes h lower of row r + h —
// the off-diagonal h × h blocks swap — and after the last level every block is transposed.
// Each trade is one two-source shuffle per row.
namespace transpose_detail {
// Lane j of the new row r (upper = false) or r + h (upper = true), as an index into the
// concatenation (row r, row r + h) that __builtin_shufflevector reads.
constexpr int source(int j, int h, bool upper) {
  if (!upper) return (j & h) ? kLanes + j - h : j;
  return (j & h) ? kLanes + j : j + h;
}
template <int h, bool upper, size_t... J>
inline Vec trade(Vec lo, Vec hi, std::index_sequence<J...>) {
  return __builtin_shufflevector(lo, hi, source(static_cast<int>(J), h, upper)...);
}
template <int h>
inline void level(Vec (&v)[kLanes]) {
  for (int r = 0; r < kLanes; ++r) {
    if (r & h) continue;
    const Vec lo = v[r], hi = v[r + h];
    v[r] = trade<h, false>(lo, hi, std::make_index_sequence<kLanes>{});
    v[r + h] = trade<h, true>(lo, hi, std::make_index_sequence<kLanes>{});
  }
  if constexpr (h > 1) level<h / 2>(v);
}
}  // namespace transpose_detail

// v[r][j] becomes v[j][r].
inline void transpose(Vec (&v)[kLanes]) { transpose_detail::level<kLanes / 2>(v); }

inline Vec tanh(Vec x) {
  const Vec ax = abs(x);
  const Vec z = x * x;
  Vec poly = splat(-5.70498872745e-3f);
  poly = fma(poly, z, splat(2.06390887954e-2f));
  poly = fma(poly, z, splat(-5.37397155531e-2f));
  poly = fma(poly, z, splat(1.33314422036e-1f));
  poly = fma(poly, z, splat(-3.33332819422e-1f));
  const Vec small = fma(poly * z, x, x);
  const Vec e = exp(ax + ax);
  const Vec large_abs = 1.0f - 2.0f / (e + 1.0f);
  const IVec sign = reinterpret_cast<IVec>(x) & static_cast<int32_t>(0x80000000u);
  const Vec large = reinterpret_cast<Vec>(reinterpret_cast<IVec>(large_abs) | sign);
  return select(ax < 0.625f, small, large);
}

}  // namespace flare::cpu::FLARE_SIMD_NAMESPACE::simd
FLARE_SIMD_END

// The configuration this translation unit compiles, by its plain name (the vector-math tests).
namespace flare::cpu {
namespace simd = FLARE_SIMD_NAMESPACE::simd;
}  // namespace flare::cpu
