// test_dist_gpu_util.h — what the multi-GPU tests share: how many devices a test may use, the skip
// that says why a test did not run, a device buffer for raw bytes, a rank's local tensors of a
// context-parallel case on its device, and an NCCL group that serves many cases.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <thread>
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

// NCCL communicators of one group, rank r on device r, made to serve many cases: NCCL's init costs
// seconds per group of 4 GPUs, more than a case's own work. Made and destroyed from one thread per
// rank, as NCCL's collective init and finalize need (one thread alone would wait on the others).
class NcclGroup {
 public:
  static Status create(int size, int timeout_ms, std::unique_ptr<NcclGroup>* out) {
    dist::NcclId id;
    FLARE_RETURN_IF_ERROR(dist::nccl_unique_id(&id));
    std::unique_ptr<NcclGroup> group(new NcclGroup(size));
    std::vector<Status> st(static_cast<size_t>(size));
    std::vector<std::thread> threads;
    for (int r = 0; r < size; ++r)
      threads.emplace_back([&, r] {
        st[r] = dist::make_nccl_communicator(id, r, size, r, {timeout_ms}, &group->comms_[r]);
      });
    for (std::thread& t : threads) t.join();
    for (int r = 0; r < size; ++r)
      if (!st[r].ok())
        return Status(st[r].code(), "rank " + std::to_string(r) + ": " + st[r].message());
    *out = std::move(group);
    return {};
  }
  ~NcclGroup() {
    std::vector<std::thread> threads;
    for (std::unique_ptr<dist::Communicator>& comm : comms_)
      threads.emplace_back([&comm] { comm.reset(); });
    for (std::thread& t : threads) t.join();
  }
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;

  int size() const { return static_cast<int>(comms_.size()); }

  // Runs fn(comm) for every rank at once, each on its own thread with the rank's device current;
  // returns each rank's status.
  std::vector<Status> run(const std::function<Status(dist::Communicator&)>& fn) {
    std::vector<Status> st(comms_.size());
    std::vector<std::thread> threads;
    for (size_t r = 0; r < comms_.size(); ++r)
      threads.emplace_back([&, r] {
        dist::Communicator& comm = *comms_[r];
        st[r] = cuda_ok(cudaSetDevice(comm.device_index()), "cudaSetDevice");
        if (st[r].ok()) st[r] = fn(comm);
      });
    for (std::thread& t : threads) t.join();
    return st;
  }

 private:
  explicit NcclGroup(int size) : comms_(static_cast<size_t>(size)) {}
  std::vector<std::unique_ptr<dist::Communicator>> comms_;
};

}  // namespace flare::test
