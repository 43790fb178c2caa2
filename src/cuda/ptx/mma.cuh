// mma.cuh — warp-level tensor-core matrix multiply-accumulate (mma.sync, sm_80+).
//
// One instruction shape is all the FlashAttention-2 kernels need: m16n8k16 with fp16 or bf16
// operands and fp32 accumulators. Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16"),
// with g = lane / 4 and t = lane % 4:
//   A (16×16, row-major)  a0: (g, 2t..2t+1)   a1: (g+8, 2t..2t+1)   a2: (g, 2t+8..)   a3: (g+8, 2t+8..)
//   B (16×8,  col-major)  b0: (k 2t..2t+1, n g)                      b1: (k 2t+8..2t+9, n g)
//   C (16×8,  fp32)       c0, c1: (g, 2t..2t+1)                      c2, c3: (g+8, 2t..2t+1)
// Each 32-bit A/B register packs two consecutive-k elements, the lower k in the low half.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace flare::cuda::ptx {

// D += A·B for one 16×8×16 tile; Element is __half or __nv_bfloat16.
template <typename Element>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
  if constexpr (std::is_same_v<Element, __half>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    static_assert(std::is_same_v<Element, __nv_bfloat16>, "mma: fp16 or bf16 operands");
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two fp32 values rounded (to nearest even) into one packed register, `lo` in the low half: the
// A-operand layout, so an fp32 accumulator tile becomes the next product's A operand in place.
template <typename Element>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<Element, __half>) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}

}  // namespace flare::cuda::ptx
