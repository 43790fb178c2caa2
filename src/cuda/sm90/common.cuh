// common.cuh — pieces the sm90 kernels share: the element type, the register budget setmaxnreg
// must fit, the swizzled tile offset, the warp's copy of swizzled rows to global memory, and the
// launch with its error reporting.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "core/params.h"
#include "cuda/device_probe.h"
#include "cuda/element_type.cuh"
#include "flare/status.h"

namespace flare::cuda::sm90 {

// Registers per thread a CTA of `threads` starts with at one CTA per SM (64 Ki / threads, rounded
// down to 8). setmaxnreg.inc waits until the producer's release covers the consumers' growth, so a
// split that exceeds this hangs the kernel.
constexpr int launch_regs(int threads) { return (65536 / threads) / 8 * 8; }

// Shared memory one CTA may opt into on sm_90 (227 KiB): what a kernel's buffers must fit.
inline constexpr uint32_t kSmemOptinBytes = 227 * 1024;

// Bytes of 16 rows of a 64-column panel (128 bytes a row): from one k16 slice of an MN-major wgmma
// operand to the next.
inline constexpr uint32_t kSlice16Bytes = 16 * 128;

// Byte offset of 16-byte chunk `chunk` (of the whole row) of row `row` in a tile stored as 64-column
// panels of `panel_bytes` in the 128-byte swizzle (ptx/wgmma.cuh).
__device__ __forceinline__ uint32_t swizzled(int row, int chunk, uint32_t panel_bytes) {
  return (chunk / 8) * panel_bytes + row * 128 + (((chunk % 8) ^ (row % 8)) * 16);
}

// One warp copies 16 rows (row0..row0 + 15) of `chunks` 16-byte chunks, starting at chunk
// `chunk0`, from a swizzled tile at `tile` to global rows `dst` (`stride` elements apart), skipping
// rows from `rows` on and chunks from column `cols` on.
template <int kChunks, typename Element>
__device__ __forceinline__ void store_rows(Element* dst, int64_t stride, const unsigned char* tile,
                                           uint32_t panel_bytes, int row0, int chunk0, int rows,
                                           int cols, int lane) {
#pragma unroll
  for (int idx = lane; idx < 16 * kChunks; idx += 32) {
    const int r = row0 + idx / kChunks, cc = chunk0 + idx % kChunks;
    if (r < rows && cc * 8 < cols)
      *reinterpret_cast<uint4*>(dst + r * stride + cc * 8) =
          *reinterpret_cast<const uint4*>(tile + swizzled(r, cc, panel_bytes));
  }
}

// Sets the kernel's dynamic shared memory, launches it and checks the launch; never synchronises.
template <typename... Params, typename... Args>
Status launch(void (*kernel)(Params...), const char* what, int bucket, dim3 grid, int threads,
              int smem, cudaStream_t stream, const Args&... args) {
  // The kernel's name for a message, built only on failure (this runs once per call).
  const auto name = [&] { return "sm90 kernel (head_dim bucket " + std::to_string(bucket) + ")"; };
  if (const Status s = allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem); !s.ok())
    return Status::device_error(std::string(what) + ": " + name() + ": " + s.message());
  kernel<<<grid, threads, smem, stream>>>(args...);
  return launch_status(what, name);
}

}  // namespace flare::cuda::sm90
