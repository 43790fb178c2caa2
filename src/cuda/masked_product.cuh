// masked_product.cuh — what the CUDA kernels share to keep masked pairs out of non-finite results:
// a probe for ±Inf/NaN in a tile, and an exact product over only the visible pairs of a tile.
//
// Why. A tensor-core product multiplies every pair of its tile. A masked pair enters it as an exact
// zero (P = 0, dS = 0), and 0·x = 0 for every finite x — but 0·Inf and 0·NaN are NaN. So where the
// operand that meets a masked zero holds a non-finite value (V in O += P·V; dO, Q and K in the
// backward's dV += Pᵀ·dO, dK += dSᵀ·Q, dQ += dS·K), the MMA lets a key a row cannot see turn that
// row into NaN, while the reference (src/cpu/reference.cpp) never visits a masked pair. The
// selects that form P and dS cannot help: no value x has x·Inf = 0.
//
// Masked pairs exist only on partially masked tiles — the causal diagonal, window edges, the ragged
// end of a sequence — and every kernel already knows which tiles those are (it masks only there).
// On those tiles alone the kernels ask whether an operand holds a non-finite value — a cheap probe
// of the tile (NonfiniteProbe: one packed FMA per two elements, then a vote), or of the product's
// own fp32 result where that already contains the operand (a non-finite Q row makes its whole
// column of S non-finite) — and only when one does they replace the tile's MMA by masked_product:
// a plain loop over the pairs that skips the masked ones, fp32 accumulation of the same rounded
// operands the MMA would read. Slow, simple, and run only for inputs that hold ±Inf or NaN; the
// finite common case pays the probe on boundary tiles and nothing else.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace flare::cuda {

// Whether any of the 16-bit elements fed to add() is ±Inf or NaN. x·0 + acc is NaN exactly when x
// is non-finite (0 for finite x, and NaN stays NaN), so one packed FMA per 32-bit word accumulates
// the answer; found() tests the two halves for NaN once at the end.
template <typename Element>
struct NonfiniteProbe {
  uint32_t acc = 0;

  __device__ __forceinline__ void add(uint32_t w) {
    if constexpr (std::is_same_v<Element, __half>)
      asm("fma.rn.f16x2 %0, %1, %2, %0;\n" : "+r"(acc) : "r"(w), "r"(0u));
    else
      asm("fma.rn.bf16x2 %0, %1, %2, %0;\n" : "+r"(acc) : "r"(w), "r"(0u));
  }
  __device__ __forceinline__ void add(const uint4& v) {
    add(v.x);
    add(v.y);
    add(v.z);
    add(v.w);
  }
  __device__ __forceinline__ bool found() const {
    constexpr uint32_t kInf = std::is_same_v<Element, __half> ? 0x7c00u : 0x7f80u;  // exponent all ones
    return (acc & 0x7fffu) > kInf || ((acc >> 16) & 0x7fffu) > kInf;
  }
};

// Whether an fp32 value is ±Inf or NaN (one unordered compare).
__device__ __forceinline__ bool nonfinite(float x) { return !(fabsf(x) < INFINITY); }

// Whether any element of a thread's fp32 fragment array is ±Inf or NaN.
template <int kA, int kB, int kC>
__device__ __forceinline__ bool any_nonfinite(const float (&x)[kA][kB][kC]) {
  bool found = false;
#pragma unroll
  for (int a = 0; a < kA; ++a)
#pragma unroll
    for (int b = 0; b < kB; ++b)
#pragma unroll
      for (int c = 0; c < kC; ++c) found |= nonfinite(x[a][b][c]);
  return found;
}

// Element `hi` (0: low half, 1: high half) of a packed pair, as fp32.
template <typename Element>
__device__ __forceinline__ float unpack_half(uint32_t pair, int hi) {
  const uint16_t bits = static_cast<uint16_t>(hi ? pair >> 16 : pair);
  if constexpr (std::is_same_v<Element, __half>)
    return __half2float(__ushort_as_half(bits));
  else
    return __bfloat162float(__ushort_as_bfloat16(bits));
}

// The 16-bit element at shared-window address `addr`, as fp32.
template <typename Element>
__device__ __forceinline__ float load_shared_element(uint32_t addr) {
  uint16_t bits;
  asm volatile("ld.shared.u16 %0, [%1];\n" : "=h"(bits) : "r"(addr));
  return unpack_half<Element>(bits, 0);
}

// A packed pair of 16-bit elements as two fp32 values (low half first).
template <typename Element>
__device__ __forceinline__ float2 unpack2(uint32_t pair) {
  return make_float2(unpack_half<Element>(pair, 0), unpack_half<Element>(pair, 1));
}

// The pair of 16-bit elements at 4-byte aligned shared-window address `addr`, as fp32 (a 32-bit
// address: a generic pointer would hold two registers).
template <typename Element>
__device__ __forceinline__ float2 load_shared_pair(uint32_t addr) {
  uint32_t pair;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(pair) : "r"(addr));
  return unpack2<Element>(pair);
}

// f(c) for a run-time c in [0, kN), evaluating f at compile-time indices only: registers cannot be
// indexed at run time (an array indexed so would move to local memory).
template <int kN, typename F>
__device__ __forceinline__ auto select_static(int c, F&& f) {
  auto v = f(0);
#pragma unroll
  for (int i = 1; i < kN; ++i) v = c == i ? f(i) : v;
  return v;
}

// Element (row slot, k) of an operand held as a warp's m16n8 accumulator fragments (mma.sync's C
// layout, which wgmma's accumulator shares), rounded to the dtype as the next product's A operand:
// the n8 fragment k / 8 holds column k on quad lane (k % 8) / 2, as half k % 2 of the packed pair
// `word(slot, nf)` returns there (compile-time arguments after unrolling). The packed word is
// chosen and fetched from the lane that holds it and only then unpacked, so nothing per fragment
// is hoisted out of the caller's loop beside the registers the fragments already occupy. Every
// lane of the warp must call this with the same k.
template <typename Element, int kNFrags, typename Word>
__device__ __forceinline__ float quad_fragment_at(Word&& word, int slot, int k, int lane) {
  const uint32_t mine = select_static<kNFrags>(k >> 3, [&](int f) { return word(slot, f); });
  return unpack_half<Element>(__shfl_sync(0xffffffffu, mine, (lane & ~3) | ((k & 7) >> 1)), k & 1);
}

// acc(r, c) += Σ_k a(r, k)·b(k, c) over k ∈ [0, k_count) with visible(r, k), for this thread's kRows
// row slots and 2·kColPairs column slots of an accumulator fragment: the product a tile's MMA
// computes, except that masked pairs are skipped instead of multiplied by zero. b_pair(k, cp)
// returns b(k, 2cp) and b(k, 2cp + 1) (adjacent columns in every fragment layout, one 4-byte
// load). One column pair at a time, so the loop holds a handful of registers beside the caller's
// accumulators whatever the tile's width (a wide body made ptxas spill in kernels at their register
// limit); a(r, k) is evaluated again per pair, and may shuffle (every lane runs every k). Slots are
// compile-time after unrolling; the accumulation order over k is the reference's.
template <int kRows, int kColPairs, typename A, typename BPair, typename Visible, typename Acc>
__device__ __forceinline__ void masked_product(int k_count, A&& a, BPair&& b_pair,
                                               Visible&& visible, Acc&& acc) {
#pragma unroll
  for (int cp = 0; cp < kColPairs; ++cp) {
#pragma unroll 1
    for (int k = 0; k < k_count; ++k) {
      const float2 b = b_pair(k, cp);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float a_rk = a(r, k);
        if (visible(r, k)) {
          acc(r, 2 * cp) += a_rk * b.x;
          acc(r, 2 * cp + 1) += a_rk * b.y;
        }
      }
    }
  }
}

// Sets p to the OR of `pred` over the `threads` threads arriving at named barrier `id` (bar.red:
// a named barrier that also reduces).
__device__ __forceinline__ bool named_barrier_or(int id, int threads, bool pred) {
  uint32_t out;
  asm volatile(
      "{\n"
      ".reg .pred p_in, p_out;\n"
      "setp.ne.u32 p_in, %1, 0;\n"
      "bar.red.or.pred p_out, %2, %3, p_in;\n"
      "selp.u32 %0, 1, 0, p_out;\n"
      "}\n"
      : "=r"(out)
      : "r"(static_cast<uint32_t>(pred)), "r"(id), "r"(threads)
      : "memory");
  return out != 0;
}

}  // namespace flare::cuda
