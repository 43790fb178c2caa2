// ldmatrix.cuh — warp-cooperative loads of 8×8 16-bit matrices from shared memory (sm_75+).
//
// ldmatrix.x4 loads four 8×8 matrices: lanes 8i..8i+7 each give the shared-memory address of one
// 16-byte row of matrix i, and register i of every lane receives matrix i in the mma fragment
// layout (lane holds row lane/4, columns 2·(lane%4) and +1). The .trans form hands out the
// transpose, which turns a row-major V tile into the column-major B operand of P·V without any
// shuffling. Addresses are 32-bit shared-window addresses (see smem_addr).
#pragma once

#include <cstdint>

namespace flare::cuda::ptx {

// The 32-bit shared-state-space address of a generic pointer into shared memory.
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// volatile: the result depends on shared memory that barriers, not operands, make valid.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

}  // namespace flare::cuda::ptx
