// test_dist_gpu_util.h — what the multi-GPU tests share: how many devices a test may use, the skip
// that says why a test did not run, a device buffer for raw bytes, a rank's local tensors of a
// context-parallel case on its device, an NCCL group that serves many cases, and the stacks of
// every thread on SIGUSR1 (a hung run's diagnosis).
#pragma once

#include <cuda_runtime.h>
#include <dirent.h>
#include <execinfo.h>
#include <gtest/gtest.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "flare/dist.h"
#include "gpu_util.h"
#include "test_dist_util.h"

namespace flare::test {

// A hung run's diagnosis: SIGUSR1 to the process (scripts/gpu-check.sh sends it to a run past its
// timeout) prints the stack of every thread to stderr, each thread its own on SIGUSR2. The ranks
// are threads of one process, so a hang is a wait between them, and the stacks name it (one such
// was a lock held through a CUDA call that waited on a peer's collective). The tests link with
// -rdynamic, so the frames carry function names. Not async-signal-safe everywhere (opendir), which
// a process about to be killed can afford.
namespace hang_diagnosis {
inline void print_own_stack(int) {
  void* frames[64];
  const int n = backtrace(frames, 64);
  char line[64];
  const int len = std::snprintf(line, sizeof line, "--- thread %ld\n",
                                static_cast<long>(syscall(SYS_gettid)));
  if (len > 0) (void)!write(STDERR_FILENO, line, static_cast<size_t>(len));
  backtrace_symbols_fd(frames, n, STDERR_FILENO);
}
inline void print_every_stack(int) {
  const long self = syscall(SYS_gettid);
  if (DIR* dir = opendir("/proc/self/task")) {
    while (const dirent* entry = readdir(dir)) {
      const long tid = std::strtol(entry->d_name, nullptr, 10);
      if (tid > 0 && tid != self) {
        syscall(SYS_tgkill, static_cast<long>(getpid()), tid, SIGUSR2);
        usleep(200 * 1000);  // one thread's lines at a time
      }
    }
    closedir(dir);
  }
  print_own_stack(0);
}
inline const bool kInstalled = [] {
  void* warm[1];
  backtrace(warm, 1);  // loads the unwinder now, not inside a handler
  std::signal(SIGUSR2, print_own_stack);
  std::signal(SIGUSR1, print_every_stack);
  return true;
}();
}  // namespace hang_diagnosis

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
// seconds per group of 4 GPUs, more than a case's own work. Each rank has one worker thread for
// the group's whole life, which makes its communicator, runs every case's work on it and destroys
// it: NCCL's collective init and finalize need a thread per rank (one thread alone would wait on
// the others), and a rank's calls then always come from the thread that made its communicator,
// as they do in a process per rank.
class NcclGroup {
 public:
  static Status create(int size, int timeout_ms, std::unique_ptr<NcclGroup>* out) {
    dist::NcclId id;
    FLARE_RETURN_IF_ERROR(dist::nccl_unique_id(&id));
    std::unique_ptr<NcclGroup> group(new NcclGroup(size));
    const std::vector<Status> st = group->on_every_rank([&](int r) {
      return dist::make_nccl_communicator(id, r, size, r, {timeout_ms}, &group->comms_[r]);
    });
    for (int r = 0; r < size; ++r)
      if (!st[r].ok())
        return Status(st[r].code(), "rank " + std::to_string(r) + ": " + st[r].message());
    *out = std::move(group);
    return {};
  }
  ~NcclGroup() {
    on_every_rank([this](int r) {
      comms_[r].reset();
      return Status{};
    });
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (std::thread& t : workers_) t.join();
  }
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;

  int size() const { return static_cast<int>(comms_.size()); }

  // Runs fn(comm) for every rank at once, each on its rank's worker with the rank's device
  // current; returns each rank's status.
  std::vector<Status> run(const std::function<Status(dist::Communicator&)>& fn) {
    return on_every_rank([&](int r) {
      dist::Communicator& comm = *comms_[r];
      const Status s = cuda_ok(cudaSetDevice(comm.device_index()), "cudaSetDevice");
      return s.ok() ? fn(comm) : s;
    });
  }

 private:
  explicit NcclGroup(int size) : comms_(static_cast<size_t>(size)), tasks_(static_cast<size_t>(size)) {
    for (int r = 0; r < size; ++r) workers_.emplace_back([this, r] { serve(r); });
  }

  // Hands fn(r) to every rank's worker and waits for all of them; each rank's status.
  std::vector<Status> on_every_rank(const std::function<Status(int rank)>& fn) {
    std::vector<Status> st(comms_.size());
    std::unique_lock<std::mutex> lock(mutex_);
    for (size_t r = 0; r < tasks_.size(); ++r)
      tasks_[r] = [&st, &fn, r] { st[r] = fn(static_cast<int>(r)); };
    busy_ = tasks_.size();
    wake_.notify_all();
    done_.wait(lock, [this] { return busy_ == 0; });
    return st;
  }

  void serve(int r) {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return stop_ || tasks_[r] != nullptr; });
      if (stop_) return;
      std::function<void()> task = std::move(tasks_[r]);
      tasks_[r] = nullptr;
      lock.unlock();
      task();
      lock.lock();
      if (--busy_ == 0) done_.notify_all();
    }
  }

  std::vector<std::unique_ptr<dist::Communicator>> comms_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::vector<std::function<void()>> tasks_;  // per rank: the work handed to its worker, or null
  size_t busy_ = 0;                           // workers still running the current work
  bool stop_ = false;
  std::vector<std::thread> workers_;          // last: started once the rest exists
};

}  // namespace flare::test
