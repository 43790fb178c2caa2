// online_softmax.cuh — the running row max of the online softmax, shared by the sm80 and sm90
// forwards and decoding.
//
// Every kernel keeps, per accumulator row, a base-2 running max m and sum l beside its output O;
// a step with scores S (log2 units) moves m to m' = max(m, rowmax S), exponentiates
// P = 2^(S − m') and scales l and O by 2^(m − m') before adding the step's share. The row
// fragments of mma.sync (sm80, decode) and wgmma (sm90) lay a row over the four lanes of a quad,
// each lane holding some of its columns, so a row's max is the lane's max reduced over its quad.
// The exponentials and the sums stay in each kernel: their operand order (a fused scale, a
// pre-scaled score) and their interleaving with the MMAs are each kernel's measured choice.
// The finishing step (O / l and the LSE, with the non-finite rules) is FinishedRow in
// nonfinite_fixup.cuh.
#pragma once

#include <cmath>

#include "core/numeric.h"
#include "cuda/ptx/fast_math.cuh"

namespace flare::cuda {

// The max of x over the quad of lanes that holds one row fragment (lanes 4q … 4q + 3).
__device__ __forceinline__ float quad_row_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

// The same for N fragments at once, x[i] in place: each shuffle round goes over every fragment
// before the next, so the shuffles' latencies overlap.
template <int N>
__device__ __forceinline__ void quad_row_max(float (&x)[N]) {
#pragma unroll
  for (int lanes = 1; lanes <= 2; lanes *= 2)
#pragma unroll
    for (int i = 0; i < N; ++i) x[i] = fmaxf(x[i], __shfl_xor_sync(0xffffffffu, x[i], lanes));
}

// A row's running max after a step whose scores peak at `seen` (log2 units), updated in place:
// the base the step's exponentials subtract, the factor for O and the row sum, and whether the
// max moved. Lazily (the sm80 forward's choice, fwd_notes.md), the max moves only when `seen`
// exceeds it by more than kLazyRescaleLog2: below that the step's probabilities are
// exp2(x − max) ≤ 2^8 and O and the row sum keep their scale, so O's rescale (and its vote) is
// skipped. Softmax does not depend on the reference it subtracts as long as O, the sum and the
// LSE share it, so only rounding changes: fp32 sums and fp16/bf16 P round relative to their
// magnitude, and 2^8 is far from overflow. A row that has seen only −inf keeps base 0, so no
// −inf − −inf arises.
inline constexpr float kLazyRescaleLog2 = 8.0f;
struct MaxStep {
  float base, correction;
  bool moved;
};
template <bool kLazy>
__device__ __forceinline__ MaxStep advance_row_max(float& max, float seen) {
  const float m_old = max;
  const float m_new = kLazy ? (seen > m_old + kLazyRescaleLog2 ? seen : m_old) : fmaxf(m_old, seen);
  const float base = softmax_base(m_new);
  max = m_new;
  return {base, ptx::exp2_approx(m_old - base), m_new != m_old};
}

}  // namespace flare::cuda
