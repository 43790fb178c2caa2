// fast_math.cuh — the special-function unit's base-2 exponential.
//
// The softmax is computed in base 2 with scale·log2(e) folded into the scores, so each
// probability costs one FFMA and one MUFU.EX2. ex2.approx has a maximum relative error of 2^-22,
// far below the fp16/bf16 rounding P goes through next; .ftz flushes subnormal results, which are
// below anything P·V can resolve. ex2(−inf) = +0, which the masking relies on.
#pragma once

namespace flare::cuda::ptx {

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace flare::cuda::ptx
