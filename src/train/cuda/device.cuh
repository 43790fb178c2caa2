// device.cuh — the device-side vocabulary of the trainer's kernels: 16-byte packs of bf16,
// warp and block sums in a fixed order, and a grid-size helper.
//
// Every reduction here has a fixed shape (the butterfly of a warp, then warp 0 over the per-warp
// partials in index order), so a kernel that uses them returns the same bits on every run with
// the same launch configuration: the trainer's determinism rests on that, and on never adding
// floats with atomics.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace flare::train::cuda {

// Eight bf16 values moved as one 16-byte load or store.
struct alignas(16) Bf16x8 {
  __nv_bfloat162 h[4];
};

__device__ __forceinline__ Bf16x8 load_bf16x8(const __nv_bfloat16* p) {
  return *reinterpret_cast<const Bf16x8*>(p);
}
__device__ __forceinline__ void store_bf16x8(__nv_bfloat16* p, const Bf16x8& v) {
  *reinterpret_cast<Bf16x8*>(p) = v;
}
__device__ __forceinline__ void unpack(const Bf16x8& v, float (&f)[8]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __bfloat1622float2(v.h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}
// Round to nearest even, as every bf16 store of the trainer does.
__device__ __forceinline__ Bf16x8 pack(const float (&f)[8]) {
  Bf16x8 v;
#pragma unroll
  for (int i = 0; i < 4; ++i) v.h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  return v;
}

// Loads `kVec` (8 or 1) consecutive bf16 values as floats: one 16-byte load or one scalar load.
template <int kVec>
__device__ __forceinline__ void load_floats(const __nv_bfloat16* p, float (&f)[kVec]) {
  if constexpr (kVec == 8) {
    unpack(load_bf16x8(p), f);
  } else {
    static_assert(kVec == 1, "kVec is 8 (16-byte packs) or 1 (scalars)");
    f[0] = __bfloat162float(*p);
  }
}
template <int kVec>
__device__ __forceinline__ void store_floats(__nv_bfloat16* p, const float (&f)[kVec]) {
  if constexpr (kVec == 8) {
    store_bf16x8(p, pack(f));
  } else {
    *p = __float2bfloat16_rn(f[0]);
  }
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `shared` holds 32 floats; the call ends with the block synchronised, so it may be reused.
__device__ __forceinline__ float block_sum(float x, float* shared) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int warps = blockDim.x / 32;
  x = warp_sum(x);
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  float total = lane < warps ? shared[lane] : 0.0f;
  total = warp_sum(total);
  __syncthreads();
  return total;
}

inline unsigned int ceil_div(int64_t a, int64_t b) { return static_cast<unsigned int>((a + b - 1) / b); }

// True when p is aligned for 16-byte packs.
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace flare::train::cuda
