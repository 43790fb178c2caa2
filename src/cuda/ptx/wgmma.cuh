// wgmma.cuh — warpgroup-level tensor-core products (wgmma.mma_async, sm_90a).
//
// A warpgroup (4 consecutive warps, 128 threads) issues m64nNk16 products whose B operand, and
// optionally A, is read from shared memory through a 64-bit matrix descriptor. The products run
// asynchronously: wgmma_fence() orders earlier register writes before the next products read
// their accumulators or A fragments, wgmma_commit() closes a group of issued products, and
// wgmma_wait<N>() returns once at most N groups are still in flight. Accumulator registers must not
// be touched between issue and wait; fence_operands() pins them on both sides so the compiler does
// not move their reads or writes across.
//
// Layouts, with g = lane / 4 and t = lane % 4 of warp w (0–3) of the warpgroup:
//   accumulator of m64nN (N/2 fp32 per thread): for n8 block j, d[4j], d[4j+1] are row 16w + g,
//     columns 8j + 2t, +1; d[4j+2], d[4j+3] are row 16w + g + 8, the same columns — mma.sync's C
//     layout repeated N/8 times.
//   A in registers (m64k16, four packed pairs): mma.sync's A fragment for rows 16w..16w+15, so an
//     accumulator rounded pairwise is the next product's A operand in place.
// Shared-memory operands here are always in the 128-byte swizzle: a tile is stored as panels of
// 64 columns (128 bytes of fp16/bf16) by R rows, row r at r·128 bytes, its 16-byte chunk c at
// position c ^ (r % 8); every panel starts on a 1024-byte boundary. This is what TMA writes with
// CU_TENSOR_MAP_SWIZZLE_128B and a 64-column box. Descriptors (PTX ISA, "Matrix Descriptor
// Format"; offsets in 16-byte units):
//   K-major (the reduction dimension runs along the row: Q and K in S = Q·Kᵀ): SBO = 1024 bytes
//     between 8-row groups, LBO unused; the k16 slice kk of a panel starts 32·kk bytes in.
//   MN-major (rows are the reduction dimension: V in O = P·V): LBO = the byte distance between
//     64-column panels, SBO = 1024 bytes between 8-row groups; k slice kk starts 16 rows (2048
//     bytes) further.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace flare::cuda::ptx {

// Descriptor of a 128-byte-swizzled operand at shared-memory byte address `addr`.
__device__ __forceinline__ uint64_t wgmma_desc(uint32_t addr, uint32_t lbo_bytes) {
  uint64_t d = 0;
  d |= static_cast<uint64_t>((addr & 0x3FFFFu) >> 4);
  d |= static_cast<uint64_t>((lbo_bytes >> 4) & 0x3FFFu) << 16;
  d |= static_cast<uint64_t>(1024u >> 4) << 32;  // SBO: 8 rows of 128 bytes
  d |= static_cast<uint64_t>(1) << 62;           // layout: 128-byte swizzle
  return d;
}
__device__ __forceinline__ uint64_t wgmma_desc_k_major(uint32_t addr) { return wgmma_desc(addr, 16); }
__device__ __forceinline__ uint64_t wgmma_desc_mn_major(uint32_t addr, uint32_t panel_bytes) {
  return wgmma_desc(addr, panel_bytes);
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int kInFlight>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kInFlight) : "memory");
}

// Pins registers at this point of the program (no instruction).
template <int kCount>
__device__ __forceinline__ void fence_operands(float (&r)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// D (+)= A·B, m64nNk16, fp32 accumulators; scale_d = 0 overwrites D. wgmma_ss: A and B K-major in
// shared memory; wgmma_ss_mn: both MN-major; wgmma_ss_bmn: A K-major, B MN-major. wgmma_rs: A in
// registers, B MN-major in shared memory.
template <int kN, typename Element>
__device__ void wgmma_ss(float (&d)[kN / 2], uint64_t desc_a, uint64_t desc_b, int scale_d);
template <int kN, typename Element>
__device__ void wgmma_ss_mn(float (&d)[kN / 2], uint64_t desc_a, uint64_t desc_b, int scale_d);
template <int kN, typename Element>
__device__ void wgmma_ss_bmn(float (&d)[kN / 2], uint64_t desc_a, uint64_t desc_b, int scale_d);
template <int kN, typename Element>
__device__ void wgmma_rs(float (&d)[kN / 2], const uint32_t (&a)[4], uint64_t desc_b, int scale_d);

#include "cuda/ptx/wgmma_ops.inc"

}  // namespace flare::cuda::ptx
