// chunk_copy.cuh — the unit of every global → shared tile copy in the sm80 kernels: one 16-byte
// chunk (8 fp16/bf16 elements) of one row.
//
// Rows that are 16-byte aligned with d_valid % 8 == 0 (`vec`) go through cp.async with hardware
// zero-fill for chunks outside the tile. Any other layout (odd head_dim, odd strides) reads the
// chunk element by element and stores it synchronously; the caller's barriers order both kinds.
// Out-of-tile rows and columns read as zeros, so padded head dims and ragged tails contribute
// nothing to the products.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/ptx/cp_async.cuh"
#include "cuda/ptx/ldmatrix.cuh"  // smem_addr

namespace flare::cuda::sm80 {

// dst: the chunk in shared memory; src: the chunk in global memory (may be out of bounds when
// !row_in); base: any valid global address, read instead of src where nothing may be read.
template <typename Element>
__device__ __forceinline__ void copy_chunk16(Element* dst, const Element* src, const Element* base,
                                             bool row_in, int col, int d_valid, bool vec) {
  if (vec) {
    const bool in = row_in && col < d_valid;
    ptx::cp_async_16_zfill(ptx::smem_addr(dst), in ? src : base, in);
    return;
  }
  const uint16_t* e16 = reinterpret_cast<const uint16_t*>(row_in ? src : base);
  uint32_t w[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const uint32_t lo = row_in && col + 2 * e < d_valid ? e16[2 * e] : 0u;
    const uint32_t hi = row_in && col + 2 * e + 1 < d_valid ? e16[2 * e + 1] : 0u;
    w[e] = lo | (hi << 16);
  }
  *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
}

}  // namespace flare::cuda::sm80
