// thread_index.cuh — the thread index read through a volatile PTX move.
//
// A value derived from threadIdx.x is loop-invariant, so the compiler computes it once and holds it
// in a register across every loop that uses it. In kernels that sit at the 255-register limit,
// a per-thread copy offset held that way is what spills; read through this (the compiler may not
// hoist or merge a volatile asm), the value is recomputed where it is used, for a few integer
// instructions.
#pragma once

namespace flare::cuda::ptx {

__device__ __forceinline__ int thread_index_volatile() {
  int tid;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(tid));
  return tid;
}

}  // namespace flare::cuda::ptx
