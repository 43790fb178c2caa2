// nccl_communicator.cpp — the Communicator over NCCL, for ranks on CUDA devices.
//
// The communicator is non-blocking (ncclConfig_t blocking = 0): NCCL calls return at once, maybe
// with ncclInProgress, and ncclCommGetAsyncError says when an enqueue or the creation has finished
// or failed. That is what makes a timeout possible: flare polls instead of sitting in NCCL, and
// calls ncclCommAbort once the timeout passes, which also releases kernels stuck waiting for a
// dead peer.
//
// Data operations are stream-ordered and return once enqueued: no host synchronisation. Each
// records a CUDA event after itself on its stream; a watchdog thread queries the pending events
// and aborts the communicator when one has not completed within the timeout of its enqueue (the
// same clock starts when an operation waits in its stream behind other work, so the timeout must
// exceed the longest step; the default is 5 minutes). After an abort every call returns the
// error that caused it, naming the operation and its peers. barrier() and host_all_gather() wait
// on the host, through the same polling.
//
// Compiled only where CUDA and NCCL are found (CMakeLists.txt, dist section); nccl_stub.cpp
// stands in elsewhere. Tested on two GPUs by tests/test_dist_gpu_nccl.cpp.
#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cuda/device_probe.h"
#include "dist/dist_internal.h"
#include "flare/dist.h"

namespace flare::dist {
namespace {

using Clock = std::chrono::steady_clock;

std::string nccl_error(ncclResult_t r, ncclComm_t comm) {
  std::string s = ncclGetErrorString(r);
  const char* last = comm != nullptr ? ncclGetLastError(comm) : nullptr;
  if (last != nullptr && *last != '\0') s += cat(" (", last, ")");
  return s;
}

// The communicator's CUDA calls as Statuses, through flare's one conversion (a failed allocation
// is out_of_memory, anything else device_error).
Status cuda_check(cudaError_t e, const char* what) {
  return cuda::cuda_status("NCCL communicator", what, e);
}

// Polls ncclCommGetAsyncError until the communicator's last call has left ncclInProgress, or the
// deadline passes (→ false; the caller aborts).
bool wait_nccl_ready(ncclComm_t comm, Clock::time_point deadline, ncclResult_t* result) {
  for (;;) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess) {
      *result = r;
      return true;
    }
    if (state != ncclInProgress) {
      *result = state;
      return true;
    }
    if (Clock::now() >= deadline) return false;
    std::this_thread::yield();
  }
}

ncclDataType_t nccl_type(DType d) {
  switch (d) {
    case DType::kFloat16: return ncclFloat16;
    case DType::kBFloat16: return ncclBfloat16;
    case DType::kInt32: return ncclInt32;
    default: return ncclFloat32;
  }
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kMin: return ncclMin;
    default: return ncclSum;
  }
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, bool owns, int rank, int size, int device, int timeout_ms)
      : comm_(comm), owns_(owns), rank_(rank), size_(size), device_(device),
        timeout_ms_(timeout_ms) {
    watchdog_ = std::thread([this] { watch(); });
  }

  ~NcclCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    watchdog_.join();
    cudaSetDevice(device_);
    for (const Pending& p : pending_) cudaEventDestroy(p.event);
    if (!owns_ || aborted_) return;  // an abort has freed it already
    // Finalize flushes outstanding work; bounded like everything else.
    ncclResult_t r = ncclCommFinalize(comm_);
    if ((r == ncclSuccess || r == ncclInProgress) && wait_nccl_ready(comm_, deadline(), &r) &&
        r == ncclSuccess) {
      ncclCommDestroy(comm_);
      return;
    }
    ncclCommAbort(comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  DeviceType device() const override { return DeviceType::kCUDA; }
  int device_index() const override { return device_; }
  int timeout_ms() const override { return timeout_ms_; }
  const char* kind() const override { return "nccl"; }

  Status health() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return failure_;
  }

  Status exchange(const Transfer* transfers, int count, Stream stream) override {
    FLARE_RETURN_IF_ERROR(health());
    if (count < 0) return invalid("exchange: count = ", count, " must be >= 0");
    if (count > 0 && transfers == nullptr) return invalid("exchange: transfers is null");
    std::string peers;
    for (int i = 0; i < count; ++i) {
      const Transfer& t = transfers[i];
      if (t.kind != Transfer::Kind::kSend && t.kind != Transfer::Kind::kRecv)
        return invalid("exchange: transfers[", i, "]: unknown kind ", static_cast<int>(t.kind));
      if (t.peer < 0 || t.peer >= size_)
        return invalid("exchange: peer ", t.peer, " is not a rank of this group of ", size_);
      if (t.bytes < 0 || (t.bytes > 0 && t.data == nullptr))
        return invalid("exchange: transfers[", i, "]: ", t.bytes, " bytes at a null pointer");
      peers += cat(peers.empty() ? "" : ", ", t.kind == Transfer::Kind::kSend ? "send to " : "recv from ",
                   t.peer);
    }
    auto s = static_cast<cudaStream_t>(stream);
    return enqueue(cat("exchange (", peers, ")"), s, [&]() {
      ncclResult_t r = ncclGroupStart();
      for (int i = 0; r == ncclSuccess && i < count; ++i) {
        const Transfer& t = transfers[i];
        r = t.kind == Transfer::Kind::kSend
                ? ncclSend(t.data, static_cast<size_t>(t.bytes), ncclUint8, t.peer, comm_, s)
                : ncclRecv(t.data, static_cast<size_t>(t.bytes), ncclUint8, t.peer, comm_, s);
      }
      const ncclResult_t end = ncclGroupEnd();
      return r != ncclSuccess ? r : end;
    });
  }

  Status all_reduce(const void* send, void* recv, int64_t count, DType dtype, ReduceOp op,
                    Stream stream) override {
    FLARE_RETURN_IF_ERROR(health());
    if (count < 0) return invalid("all_reduce: count = ", count, " must be >= 0");
    if (dtype != DType::kFloat32 && dtype != DType::kFloat16 && dtype != DType::kBFloat16 &&
        dtype != DType::kInt32)
      return invalid("all_reduce: dtype ", static_cast<int>(dtype), " is not a known dtype");
    if (op != ReduceOp::kSum && op != ReduceOp::kMax && op != ReduceOp::kMin)
      return invalid("all_reduce: op ", static_cast<int>(op), " is not sum, max or min");
    if (count > 0 && (send == nullptr || recv == nullptr))
      return invalid("all_reduce: send and recv must not be null");
    auto s = static_cast<cudaStream_t>(stream);
    return enqueue("all_reduce", s, [&]() {
      return ncclAllReduce(send, recv, static_cast<size_t>(count), nccl_type(dtype), nccl_op(op),
                           comm_, s);
    });
  }

  Status all_gather(const void* send, void* recv, int64_t bytes, Stream stream) override {
    FLARE_RETURN_IF_ERROR(health());
    FLARE_RETURN_IF_ERROR(check_slots("all_gather", send, recv, bytes));
    auto s = static_cast<cudaStream_t>(stream);
    return enqueue("all_gather", s, [&]() {
      return ncclAllGather(send, recv, static_cast<size_t>(bytes), ncclUint8, comm_, s);
    });
  }

  Status all_to_all(const void* send, void* recv, int64_t bytes, Stream stream) override {
    FLARE_RETURN_IF_ERROR(health());
    FLARE_RETURN_IF_ERROR(check_slots("all_to_all", send, recv, bytes));
    auto s = static_cast<cudaStream_t>(stream);
    const auto* in = static_cast<const unsigned char*>(send);
    auto* out = static_cast<unsigned char*>(recv);
    return enqueue("all_to_all", s, [&]() {
      ncclResult_t r = ncclGroupStart();
      for (int p = 0; r == ncclSuccess && p < size_; ++p) {
        r = ncclSend(in + p * bytes, static_cast<size_t>(bytes), ncclUint8, p, comm_, s);
        if (r == ncclSuccess)
          r = ncclRecv(out + p * bytes, static_cast<size_t>(bytes), ncclUint8, p, comm_, s);
      }
      const ncclResult_t end = ncclGroupEnd();
      return r != ncclSuccess ? r : end;
    });
  }

  Status barrier() override {
    FLARE_RETURN_IF_ERROR(health());
    FLARE_RETURN_IF_ERROR(cuda_check(cudaSetDevice(device_), "barrier: cudaSetDevice"));
    int* token = nullptr;
    FLARE_RETURN_IF_ERROR(cuda_check(cudaMalloc(&token, sizeof(int)), "barrier: cudaMalloc"));
    Status s = cuda_check(cudaMemsetAsync(token, 0, sizeof(int), nullptr), "barrier: cudaMemset");
    if (s.ok()) s = all_reduce(token, token, 1, DType::kInt32, ReduceOp::kSum, nullptr);
    if (s.ok()) s = wait_all("barrier");
    cudaFree(token);
    return s;
  }

  Status host_all_gather(const void* send, void* recv, int64_t bytes) override {
    FLARE_RETURN_IF_ERROR(health());
    if (bytes < 0 || (bytes > 0 && (send == nullptr || recv == nullptr)))
      return invalid("host_all_gather: ", bytes, " bytes at a null pointer");
    FLARE_RETURN_IF_ERROR(cuda_check(cudaSetDevice(device_), "host_all_gather: cudaSetDevice"));
    unsigned char* dev = nullptr;
    const size_t total = static_cast<size_t>(bytes) * (size_ + 1);
    FLARE_RETURN_IF_ERROR(
        cuda_check(cudaMalloc(&dev, total > 0 ? total : 1), "host_all_gather: cudaMalloc"));
    unsigned char* dev_send = dev + static_cast<size_t>(bytes) * size_;
    Status s = cuda_check(cudaMemcpy(dev_send, send, static_cast<size_t>(bytes), cudaMemcpyHostToDevice),
                          "host_all_gather: copy to the device");
    if (s.ok()) s = all_gather(dev_send, dev, bytes, nullptr);
    if (s.ok()) s = wait_all("host_all_gather");
    if (s.ok())
      s = cuda_check(cudaMemcpy(recv, dev, static_cast<size_t>(bytes) * size_, cudaMemcpyDeviceToHost),
                     "host_all_gather: copy to the host");
    cudaFree(dev);
    return s;
  }

 private:
  // An operation enqueued and not yet seen complete.
  struct Pending {
    cudaEvent_t event;
    Clock::time_point deadline;
    std::string what;
  };

  Clock::time_point deadline() const {
    return Clock::now() + std::chrono::milliseconds(timeout_ms_);
  }

  Status check_slots(const char* op, const void* send, const void* recv, int64_t bytes) const {
    if (bytes < 0) return invalid(op, ": byte count ", bytes, " must be >= 0");
    if (bytes > 0 && (send == nullptr || recv == nullptr))
      return invalid(op, ": send and recv must not be null");
    return {};
  }

  // Runs `issue` (NCCL calls on `stream`), waits for the enqueue to finish, then records an event
  // for the watchdog.
  template <typename Issue>
  Status enqueue(const std::string& what, cudaStream_t stream, Issue issue) {
    FLARE_RETURN_IF_ERROR(cuda_check(cudaSetDevice(device_), cat(what, ": cudaSetDevice").c_str()));
    if (!begin_call()) return health();
    const Clock::time_point until = deadline();
    ncclResult_t r = issue();
    const bool accepted = r != ncclInProgress || wait_nccl_ready(comm_, until, &r);
    end_call();
    if (!accepted)
      return abort_with(comm_failure(what, ": rank ", rank_, ": NCCL did not accept the operation within ",
                                     timeout_ms_, " ms; communicator aborted"));
    if (r != ncclSuccess)
      return abort_with(comm_failure(what, ": rank ", rank_, ": ", nccl_error(r, comm_)));
    cudaEvent_t event = nullptr;
    FLARE_RETURN_IF_ERROR(cuda_check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
                                     "cudaEventCreate"));
    const Status s = cuda_check(cudaEventRecord(event, stream), "cudaEventRecord");
    if (!s.ok()) {
      cudaEventDestroy(event);
      return s;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      pending_.push_back({event, until, what});
    }
    wake_.notify_all();
    return {};
  }

  // Host wait until every pending operation has completed, or the watchdog has failed one.
  Status wait_all(const char* what) {
    std::unique_lock<std::mutex> lock(mutex_);
    const Clock::time_point until = deadline() + std::chrono::milliseconds(100);
    while (failure_.ok() && !pending_.empty()) {
      if (wake_.wait_until(lock, until) == std::cv_status::timeout && !pending_.empty() &&
          failure_.ok())
        return comm_failure(what, ": rank ", rank_, ": pending operations did not finish");
    }
    return failure_;
  }

  // The watchdog: retire completed operations, abort at the first one past its deadline.
  void watch() {
    cudaSetDevice(device_);
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stop_) {
      while (!pending_.empty()) {
        const cudaError_t q = cudaEventQuery(pending_.front().event);
        if (q == cudaSuccess) {
          cudaEventDestroy(pending_.front().event);
          pending_.pop_front();
          continue;
        }
        ncclResult_t async = ncclSuccess;
        ncclCommGetAsyncError(comm_, &async);
        if (q != cudaErrorNotReady || (async != ncclSuccess && async != ncclInProgress)) {
          fail_locked(comm_failure(pending_.front().what, ": rank ", rank_, ": ",
                                   q != cudaErrorNotReady ? cudaGetErrorString(q)
                                                          : nccl_error(async, comm_)));
        } else if (Clock::now() >= pending_.front().deadline) {
          fail_locked(comm_failure(pending_.front().what, ": rank ", rank_, ": not complete within ",
                                   timeout_ms_,
                                   " ms (a peer is dead, hung, or not taking part); NCCL "
                                   "communicator aborted"));
        }
        break;
      }
      wake_.notify_all();  // wait_all sleepers re-check
      wake_.wait_for(lock, std::chrono::milliseconds(pending_.empty() ? 100 : 2));
    }
  }

  // The calling thread is about to use comm_ (false: the communicator has failed). While it is,
  // the watchdog defers its abort to end_call(): comm_ must not be freed under a running call.
  bool begin_call() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!failure_.ok()) return false;
    in_call_ = true;
    return true;
  }
  void end_call() {
    std::lock_guard<std::mutex> lock(mutex_);
    in_call_ = false;
    if (!failure_.ok()) abort_locked();
  }

  // Records the first failure and aborts the communicator (which ends kernels stuck on a dead
  // peer), now or, during a call, when it returns. Holding mutex_.
  void fail_locked(Status s) {
    if (!failure_.ok()) return;
    failure_ = std::move(s);
    if (!in_call_) abort_locked();
    for (const Pending& p : pending_) cudaEventDestroy(p.event);
    pending_.clear();
  }
  void abort_locked() {
    if (aborted_) return;
    ncclCommAbort(comm_);
    aborted_ = true;
  }

  Status abort_with(Status s) {
    std::lock_guard<std::mutex> lock(mutex_);
    fail_locked(std::move(s));
    return failure_;
  }

  ncclComm_t comm_;
  bool owns_;
  int rank_, size_, device_, timeout_ms_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Pending> pending_;
  Status failure_;
  bool aborted_ = false;
  bool in_call_ = false;
  bool stop_ = false;
  std::thread watchdog_;
};

}  // namespace

bool nccl_built() { return true; }

Status nccl_unique_id(NcclId* id) {
  if (id == nullptr) return invalid("nccl_unique_id: id is null");
  static_assert(sizeof(ncclUniqueId) == sizeof(NcclId::bytes), "NcclId must hold ncclUniqueId");
  ncclUniqueId u;
  const ncclResult_t r = ncclGetUniqueId(&u);
  if (r != ncclSuccess) return Status::device_error(cat("ncclGetUniqueId: ", nccl_error(r, nullptr)));
  std::memcpy(id->bytes, &u, sizeof u);
  return {};
}

Status make_nccl_communicator(const NcclId& id, int rank, int size, int device,
                              const CommOptions& options, std::unique_ptr<Communicator>* comm) {
  if (comm == nullptr) return invalid("make_nccl_communicator: comm is null");
  if (size < 1) return invalid("size: ", size, " must be >= 1");
  if (rank < 0 || rank >= size) return invalid("rank: ", rank, " must be in [0, ", size, ")");
  if (options.timeout_ms <= 0)
    return invalid("CommOptions.timeout_ms: must be > 0, got ", options.timeout_ms);
  int devices = 0;
  FLARE_RETURN_IF_ERROR(cuda_check(cudaGetDeviceCount(&devices), "cudaGetDeviceCount"));
  if (device < 0 || device >= devices)
    return invalid("device: ", device, " is not one of this process's ", devices, " CUDA devices");
  FLARE_RETURN_IF_ERROR(cuda_check(cudaSetDevice(device), "cudaSetDevice"));
  ncclUniqueId u;
  std::memcpy(&u, id.bytes, sizeof u);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t c = nullptr;
  ncclResult_t r = ncclCommInitRankConfig(&c, size, u, rank, &config);
  const Clock::time_point until = Clock::now() + std::chrono::milliseconds(options.timeout_ms);
  if (c != nullptr && (r == ncclSuccess || r == ncclInProgress) && !wait_nccl_ready(c, until, &r)) {
    ncclCommAbort(c);
    return comm_failure("make_nccl_communicator: rank ", rank, " of ", size,
                        ": the other ranks did not join within ", options.timeout_ms, " ms");
  }
  if (r != ncclSuccess) {
    const std::string why = nccl_error(r, c);
    if (c != nullptr) ncclCommAbort(c);
    return comm_failure("make_nccl_communicator: rank ", rank, " of ", size, ": ", why);
  }
  *comm = std::make_unique<NcclCommunicator>(c, true, rank, size, device, options.timeout_ms);
  return {};
}

Status adopt_nccl_communicator(void* nccl_comm, bool take_ownership, const CommOptions& options,
                               std::unique_ptr<Communicator>* comm) {
  if (comm == nullptr) return invalid("adopt_nccl_communicator: comm is null");
  if (nccl_comm == nullptr) return invalid("nccl_comm: is null");
  if (options.timeout_ms <= 0)
    return invalid("CommOptions.timeout_ms: must be > 0, got ", options.timeout_ms);
  auto c = static_cast<ncclComm_t>(nccl_comm);
  int rank = 0, size = 0, device = 0;
  ncclResult_t r = ncclCommUserRank(c, &rank);
  if (r == ncclSuccess) r = ncclCommCount(c, &size);
  if (r == ncclSuccess) r = ncclCommCuDevice(c, &device);
  if (r != ncclSuccess)
    return invalid("nccl_comm: not a usable NCCL communicator: ", nccl_error(r, c));
  *comm = std::make_unique<NcclCommunicator>(c, take_ownership, rank, size, device,
                                             options.timeout_ms);
  return {};
}

Status make_nccl_communicator_from_env(const CommOptions& options,
                                       std::unique_ptr<Communicator>* comm, LaunchInfo* info) {
  LaunchInfo launch;
  FLARE_RETURN_IF_ERROR(launch_info_from_env(&launch));
  NcclId id;
  if (launch.rank == 0) FLARE_RETURN_IF_ERROR(nccl_unique_id(&id));
  FLARE_RETURN_IF_ERROR(rendezvous_broadcast(launch, id.bytes, sizeof id.bytes, options.timeout_ms));
  FLARE_RETURN_IF_ERROR(
      make_nccl_communicator(id, launch.rank, launch.size, launch.local_rank, options, comm));
  if (info != nullptr) *info = launch;
  return {};
}

}  // namespace flare::dist
