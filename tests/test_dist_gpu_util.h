// test_dist_gpu_util.h — what the multi-GPU tests share: how many devices a test may use, the skip
// that says why a test did not run, and a device buffer for raw bytes.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "flare/dist.h"

namespace flare::test {

// Every visible CUDA device, up to 8 (one rank each).
inline int usable_devices() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return std::min(n, 8);
}

#define FLARE_SKIP_WITHOUT_TWO_GPUS()                                                       \
  do {                                                                                      \
    if (!::flare::dist::nccl_built()) GTEST_SKIP() << "this build of flare has no NCCL";    \
    if (::flare::test::usable_devices() < 2)                                                \
      GTEST_SKIP() << "needs 2 CUDA devices, found " << ::flare::test::usable_devices();    \
  } while (0)

// Device memory for `n` elements of T on the current device.
template <typename T>
struct DeviceBuffer {
  T* ptr = nullptr;
  explicit DeviceBuffer(size_t n) { cudaMalloc(&ptr, std::max<size_t>(n, 1) * sizeof(T)); }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void upload(const std::vector<T>& h) {
    cudaMemcpy(ptr, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  std::vector<T> download(size_t n) const {
    std::vector<T> h(n);
    cudaMemcpy(h.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost);
    return h;
  }
};

}  // namespace flare::test
