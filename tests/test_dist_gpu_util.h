// test_dist_gpu_util.h — what the multi-GPU tests share: how many devices a test may use, the skip
// that says why a test did not run, a device buffer for raw bytes, and a rank's local tensors of a
// context-parallel case on its device.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "flare/dist.h"
#include "gpu_util.h"
#include "test_dist_util.h"

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

// One rank's local tensors on its device (the current one when constructed).
struct DeviceLocal {
  GpuTensor q, k, v, o, lse, dout, dq, dk, dv;
  int device;

  DeviceLocal(const Local& l, int dev) : device(dev) {
    for (auto [d, h] : {std::pair{&q, &l.q}, {&k, &l.k}, {&v, &l.v}, {&o, &l.o}, {&lse, &l.lse},
                        {&dout, &l.dout}, {&dq, &l.dq}, {&dk, &l.dk}, {&dv, &l.dv}})
      d->upload(*h);
  }
  // GpuTensor's views name device 0; this rank's are on `device`.
  TensorView at(const GpuTensor& t) const {
    TensorView view = t.view();
    view.device_index = device;
    return view;
  }
  void poison_outputs() const {
    for (const GpuTensor* t : {&o, &lse, &dq, &dk, &dv}) t->poison();
  }
  void download_outputs(Local* l) const {
    o.download(&l->o);
    lse.download(&l->lse);
    dq.download(&l->dq);
    dk.download(&l->dk);
    dv.download(&l->dv);
  }
};

inline Status cuda_ok(cudaError_t e, const char* what) {
  return e == cudaSuccess ? Status{}
                         : Status::device_error(std::string(what) + ": " + cudaGetErrorString(e));
}

}  // namespace flare::test
