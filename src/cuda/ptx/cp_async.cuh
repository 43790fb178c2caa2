// cp_async.cuh — asynchronous global → shared copies (cp.async, sm_80+).
//
// A copy is issued without waiting; copies are grouped by commit_group and waited for with
// wait_group<N> ("at most N groups still in flight"). A thread's wait covers only its own copies:
// a __syncthreads() must follow before other threads read the data. The 16-byte form with a
// source size of 0 writes zeros without reading global memory, which is how tiles hanging over a
// ragged sequence end or past head_dim are zero-filled (zeros keep 0·V finite and QKᵀ exact).
#pragma once

#include <cstdint>

namespace flare::cuda::ptx {

// Copies 16 bytes when `valid`, else writes 16 zero bytes. Both addresses 16-byte aligned;
// .cg caches in L2 only, since each tile is read once per CTA.
__device__ __forceinline__ void cp_async_16_zfill(uint32_t smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem),
               "r"(src_bytes)
               : "memory");
}

// Copies 16 bytes only when `issue` (a predicated instruction, not a branch: code that must stay
// one basic block for the scheduler can carry it).
__device__ __forceinline__ void cp_async_16_if(bool issue, uint32_t smem, const void* gmem) {
  asm volatile(
      "{\n"
      "  .reg .pred p;\n"
      "  setp.ne.b32 p, %2, 0;\n"
      "  @p cp.async.cg.shared.global [%0], [%1], 16;\n"
      "}\n" ::"r"(smem),
      "l"(gmem), "r"(static_cast<int>(issue))
      : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <int kInFlight>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kInFlight) : "memory");
}

}  // namespace flare::cuda::ptx
