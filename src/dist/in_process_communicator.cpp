// in_process_communicator.cpp — a Communicator whose ranks are threads of one process.
//
// It exists so that everything above the communicator (the ring, the zigzag layout, the merge,
// the backward's dK/dV return trip, the timeouts) runs and is tested on the CPU, in CI, with any
// number of ranks. The ranks share a hub of mailboxes, one FIFO per (sender, receiver) pair.
// A send copies its bytes into the receiver's mailbox and completes at once; a receive waits for
// the next message of its pair until the operation's deadline. Collectives are built from those
// messages and reduce in rank order, so every rank gets bitwise the same result.
//
// Each message carries the name of the operation that sent it: a receiver that finds another
// operation's message, or a size other than it expects, reports that the ranks disagree instead
// of reading garbage. Any failure (timeout, mismatch) leaves the mailboxes out of step, so it
// makes the communicator unusable, as an abort does to an NCCL communicator.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/numeric.h"
#include "dist/dist_internal.h"
#include "flare/dist.h"

namespace flare::dist {
namespace {

using Clock = std::chrono::steady_clock;

struct Message {
  std::string op;
  std::vector<unsigned char> bytes;
};

class Hub {
 public:
  explicit Hub(int size) : size_(size), boxes_(static_cast<size_t>(size) * size) {}

  void post(int from, int to, Message message) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      box(from, to).push_back(std::move(message));
    }
    ready_.notify_all();
  }

  // The next message from `from` to `to`, waiting until `deadline`; false when none came.
  bool take(int from, int to, Clock::time_point deadline, Message* out) {
    std::unique_lock<std::mutex> lock(mutex_);
    std::deque<Message>& b = box(from, to);
    if (!ready_.wait_until(lock, deadline, [&] { return !b.empty(); })) return false;
    *out = std::move(b.front());
    b.pop_front();
    return true;
  }

  bool pending(int from, int to) {
    std::lock_guard<std::mutex> lock(mutex_);
    return !box(from, to).empty();
  }

 private:
  std::deque<Message>& box(int from, int to) {
    return boxes_[static_cast<size_t>(from) * size_ + to];
  }

  int size_;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::vector<std::deque<Message>> boxes_;
};

class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(std::shared_ptr<Hub> hub, int rank, int size, int timeout_ms)
      : hub_(std::move(hub)), rank_(rank), size_(size), timeout_ms_(timeout_ms) {}

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  DeviceType device() const override { return DeviceType::kCPU; }
  int device_index() const override { return 0; }
  int timeout_ms() const override { return timeout_ms_; }
  const char* kind() const override { return "in-process"; }
  Status health() override { return failure_; }

  Status exchange(const Transfer* transfers, int count, Stream) override {
    FLARE_RETURN_IF_ERROR(failure_);
    if (count < 0) return invalid("exchange: count = ", count, " must be >= 0");
    if (count > 0 && transfers == nullptr) return invalid("exchange: transfers is null");
    for (int i = 0; i < count; ++i) {
      const Transfer& t = transfers[i];
      if (t.kind != Transfer::Kind::kSend && t.kind != Transfer::Kind::kRecv)
        return invalid("exchange: transfers[", i, "]: unknown kind ", static_cast<int>(t.kind));
      FLARE_RETURN_IF_ERROR(check_peer("exchange", t.peer));
      FLARE_RETURN_IF_ERROR(check_buffer("exchange", "transfers[].data", t.data, t.bytes));
    }
    const Clock::time_point deadline = start();
    for (int i = 0; i < count; ++i)
      if (transfers[i].kind == Transfer::Kind::kSend)
        post(transfers[i].peer, "exchange", transfers[i].data, transfers[i].bytes);
    for (int i = 0; i < count; ++i)
      if (transfers[i].kind == Transfer::Kind::kRecv)
        FLARE_RETURN_IF_ERROR(take(transfers[i].peer, "exchange", deadline, transfers[i].data,
                                   transfers[i].bytes));
    return {};
  }

  Status all_reduce(const void* send, void* recv, int64_t count, DType dtype, ReduceOp op,
                    Stream) override {
    FLARE_RETURN_IF_ERROR(failure_);
    if (count < 0) return invalid("all_reduce: count = ", count, " must be >= 0");
    if (dtype != DType::kFloat32 && dtype != DType::kFloat16 && dtype != DType::kBFloat16 &&
        dtype != DType::kInt32)
      return invalid("all_reduce: dtype ", static_cast<int>(dtype), " is not a known dtype");
    if (op != ReduceOp::kSum && op != ReduceOp::kMax && op != ReduceOp::kMin)
      return invalid("all_reduce: op ", static_cast<int>(op), " is not sum, max or min");
    const int64_t bytes = count * static_cast<int64_t>(dtype_size(dtype));
    FLARE_RETURN_IF_ERROR(check_buffer("all_reduce", "send", send, bytes));
    FLARE_RETURN_IF_ERROR(check_buffer("all_reduce", "recv", recv, bytes));
    std::vector<unsigned char> all(static_cast<size_t>(bytes) * size_);
    FLARE_RETURN_IF_ERROR(gather("all_reduce", send, all.data(), bytes));
    reduce_in_rank_order(all.data(), recv, count, dtype, op);
    return {};
  }

  Status all_gather(const void* send, void* recv, int64_t bytes, Stream) override {
    FLARE_RETURN_IF_ERROR(failure_);
    FLARE_RETURN_IF_ERROR(check_gather_args("all_gather", send, recv, bytes));
    return gather("all_gather", send, recv, bytes);
  }

  Status host_all_gather(const void* send, void* recv, int64_t bytes) override {
    FLARE_RETURN_IF_ERROR(failure_);
    FLARE_RETURN_IF_ERROR(check_gather_args("host_all_gather", send, recv, bytes));
    return gather("host_all_gather", send, recv, bytes);
  }

  Status all_to_all(const void* send, void* recv, int64_t bytes, Stream) override {
    FLARE_RETURN_IF_ERROR(failure_);
    FLARE_RETURN_IF_ERROR(check_gather_args("all_to_all", send, recv, bytes));
    const auto* in = static_cast<const unsigned char*>(send);
    auto* out = static_cast<unsigned char*>(recv);
    const Clock::time_point deadline = start();
    for (int p = 0; p < size_; ++p)
      if (p != rank_) post(p, "all_to_all", in + p * bytes, bytes);
    if (bytes > 0) std::memmove(out + rank_ * bytes, in + rank_ * bytes, static_cast<size_t>(bytes));
    return take_from_all("all_to_all", deadline, out, bytes);
  }

  Status barrier() override {
    FLARE_RETURN_IF_ERROR(failure_);
    const Clock::time_point deadline = start();
    for (int p = 0; p < size_; ++p)
      if (p != rank_) post(p, "barrier", nullptr, 0);
    return take_from_all("barrier", deadline, nullptr, 0);
  }

 private:
  Clock::time_point start() const { return Clock::now() + std::chrono::milliseconds(timeout_ms_); }

  Status check_peer(const char* op, int peer) const {
    if (peer < 0 || peer >= size_)
      return invalid(op, ": peer ", peer, " is not a rank of this group of ", size_);
    return {};
  }

  static Status check_buffer(const char* op, const char* name, const void* data, int64_t bytes) {
    if (bytes < 0) return invalid(op, ": ", name, ": byte count ", bytes, " must be >= 0");
    if (bytes > 0 && data == nullptr) return invalid(op, ": ", name, " is null");
    return {};
  }

  Status check_gather_args(const char* op, const void* send, const void* recv,
                           int64_t bytes) const {
    FLARE_RETURN_IF_ERROR(check_buffer(op, "send", send, bytes));
    return check_buffer(op, "recv", recv, bytes);
  }

  void post(int to, const char* op, const void* data, int64_t bytes) {
    Message m;
    m.op = op;
    const auto* p = static_cast<const unsigned char*>(data);
    if (bytes > 0) m.bytes.assign(p, p + bytes);
    hub_->post(rank_, to, std::move(m));
  }

  // Receives the next message from `from` into `out`, which must be `op`'s and `bytes` long.
  // On a timeout in a collective (`collective`), the error names every rank from `from` on that
  // has not sent either.
  Status take(int from, const char* op, Clock::time_point deadline, void* out, int64_t bytes,
              bool collective = false) {
    Message m;
    if (!hub_->take(from, rank_, deadline, &m)) {
      const std::string silent = collective ? silent_peers(from) : cat(from);
      const bool several = silent.find(',') != std::string::npos;
      return fail(comm_failure(op, ": rank ", rank_, " got nothing from rank",
                               several ? "s " : " ", silent,
                               " within ", timeout_ms_,
                               " ms (dead, hung, or not taking part)"));
    }
    if (m.op != op)
      return fail(comm_failure(op, ": rank ", rank_, " received rank ", from, "'s ", m.op,
                               "; every rank must issue the same operations in the same order"));
    if (static_cast<int64_t>(m.bytes.size()) != bytes)
      return fail(comm_failure(op, ": rank ", rank_, " expects ", bytes, " bytes from rank ", from,
                               ", which sent ", m.bytes.size(),
                               " (do the ranks' shapes or counts agree?)"));
    if (bytes > 0) std::memcpy(out, m.bytes.data(), static_cast<size_t>(bytes));
    return {};
  }

  // Ranks from `first` on (other than this one) with no message waiting, as "2, 5".
  std::string silent_peers(int first) {
    std::string list;
    for (int q = first; q < size_; ++q)
      if (q != rank_ && (q == first || !hub_->pending(q, rank_)))
        list += cat(list.empty() ? "" : ", ", q);
    return list;
  }

  // Receives slot p of `out` from every other rank p.
  Status take_from_all(const char* op, Clock::time_point deadline, unsigned char* out,
                       int64_t bytes) {
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      void* slot = out == nullptr ? nullptr : out + p * bytes;
      FLARE_RETURN_IF_ERROR(take(p, op, deadline, slot, bytes, /*collective=*/true));
    }
    return {};
  }

  Status gather(const char* op, const void* send, void* recv, int64_t bytes) {
    auto* out = static_cast<unsigned char*>(recv);
    const Clock::time_point deadline = start();
    for (int p = 0; p < size_; ++p)
      if (p != rank_) post(p, op, send, bytes);
    if (bytes > 0) std::memmove(out + rank_ * bytes, send, static_cast<size_t>(bytes));
    return take_from_all(op, deadline, out, bytes);
  }

  // recv[i] = op over ranks 0, 1, … of all[rank][i], accumulated in float (int64 for int32) and
  // rounded once to the dtype.
  void reduce_in_rank_order(const unsigned char* all, void* recv, int64_t count, DType dtype,
                            ReduceOp op) const {
    const int64_t bytes = count * static_cast<int64_t>(dtype_size(dtype));
    auto combine = [op](auto a, auto b) {
      if (op == ReduceOp::kMax) return std::max(a, b);
      if (op == ReduceOp::kMin) return std::min(a, b);
      return a + b;
    };
    for (int64_t i = 0; i < count; ++i) {
      if (dtype == DType::kInt32) {
        int64_t acc = reinterpret_cast<const int32_t*>(all)[i];
        for (int r = 1; r < size_; ++r)
          acc = combine(acc, int64_t{reinterpret_cast<const int32_t*>(all + r * bytes)[i]});
        static_cast<int32_t*>(recv)[i] = static_cast<int32_t>(acc);
      } else {
        float acc = load_as_float(all, i, dtype);
        for (int r = 1; r < size_; ++r) acc = combine(acc, load_as_float(all + r * bytes, i, dtype));
        store_from_float(recv, i, dtype, acc);
      }
    }
  }

  Status fail(Status s) {
    failure_ = s;
    return s;
  }

  std::shared_ptr<Hub> hub_;
  int rank_;
  int size_;
  int timeout_ms_;
  Status failure_;
};

}  // namespace

Status Communicator::send(int peer, const void* data, int64_t bytes, Stream stream) {
  const Transfer t = Transfer::send(peer, data, bytes);
  return exchange(&t, 1, stream);
}

Status Communicator::recv(int peer, void* data, int64_t bytes, Stream stream) {
  const Transfer t = Transfer::recv(peer, data, bytes);
  return exchange(&t, 1, stream);
}

Status make_in_process_group(int size, const CommOptions& options,
                             std::vector<std::unique_ptr<Communicator>>* comms) {
  if (comms == nullptr) return invalid("make_in_process_group: comms is null");
  if (size < 1) return invalid("make_in_process_group: size = ", size, " must be >= 1");
  if (options.timeout_ms <= 0)
    return invalid("CommOptions.timeout_ms: must be > 0, got ", options.timeout_ms);
  auto hub = std::make_shared<Hub>(size);
  comms->clear();
  for (int r = 0; r < size; ++r)
    comms->push_back(std::make_unique<InProcessCommunicator>(hub, r, size, options.timeout_ms));
  return {};
}

}  // namespace flare::dist
