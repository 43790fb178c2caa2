// device_ops.cu — CpOps on a CUDA device: the strategies' element-wise passes as kernels, the
// workspace in device memory, and the communication stream ordered against the caller's by
// events (no host waits).
//
// The passes are memory-bound and small beside the block calls (a merge reads and writes
// O(s_local·h·d) per step; a block call does O(s_local·s_block·h·d) work), so they favour one
// definition over speed: dtype conversions are core/numeric.h's load_as_float/store_from_float,
// and the merge calls merge.h's merge_weights, the very function the host path runs.
//
// Streams: computation runs on the caller's stream (compute_), exchanges on comm_, a non-blocking
// stream made at creation. comm_waits_compute() records an event at the tail of compute_ and has
// comm_ wait for it; compute_waits_comm() the reverse. An event is recorded again for every wait:
// cudaStreamWaitEvent takes the most recent record at the time of the call, which is what each
// wait means ("everything issued so far on the other stream").
//
// Timing: timed events around every exchange (on comm_) and around every stretch of computation
// between waits (on compute_); take_timing() synchronises on them once, sums, and reuses them.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/message.h"
#include "core/numeric.h"
#include "cuda/device_probe.h"
#include "dist/cp_ops.h"
#include "dist/layout.h"
#include "dist/merge.h"

namespace flare::dist {
namespace {

using cuda::cuda_status;
using cuda::launch_status;

// What the CUDA errors here name as their operation (cuda_status, cuda/device_probe.h).
constexpr char kContext[] = "context parallel";

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;

// ---- kernels ----------------------------------------------------------------------------------

__global__ void fill_kernel(float* data, int64_t count, float value) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x)
    data[i] = value;
}

// One warp per query row (b, h, i), rows numbered ((b·h_q + h)·q_len + i) as the block's LSE is.
// Every lane reads the running LSE before lane 0 replaces it.
__global__ void merge_kernel(MergeArgs a) {
  const int64_t row = blockIdx.x * int64_t{kWarpsPerBlock} + threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  if (row >= a.batch * a.heads * a.q_len) return;
  const int64_t i = row % a.q_len, bh = row / a.q_len, h = bh % a.heads, b = bh / a.heads;
  float* lse = a.lse_acc + bh * a.s_local + a.q_begin + i;
  const MergeWeights w = merge_weights(*lse, a.lse_blk[row]);
  float* acc = a.o_acc + ((b * a.s_local + a.q_begin + i) * a.heads + h) * a.head_dim;
  const int64_t blk = ((b * a.q_len + i) * a.heads + h) * a.head_dim;
  for (int64_t c = lane; c < a.head_dim; c += 32)
    acc[c] = w.a * acc[c] + w.b * load_as_float(a.o_blk, blk + c, a.dtype);
  __syncwarp();
  if (lane == 0) *lse = w.lse;
}

// acc rows [row0, row0 + rows) of a dense fp32 (b, len, hd) += a dense dtype (b, rows, hd).
__global__ void accumulate_kernel(float* acc, int64_t len, int64_t row0, const void* blk,
                                  int64_t rows, int64_t batch, int64_t hd, DType dtype) {
  const int64_t per_batch = rows * hd;
  for (int64_t x = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; x < batch * per_batch;
       x += int64_t{gridDim.x} * blockDim.x) {
    const int64_t b = x / per_batch, rest = x % per_batch;
    acc[(b * len + row0) * hd + rest] += load_as_float(blk, x, dtype);
  }
}

// A dense fp32 (b, s, h, d) into a strided (b, s, h, d) view, rounded to its dtype.
__global__ void store_kernel(const float* acc, TensorView out) {
  const int64_t s = out.shape[1], h = out.shape[2], d = out.shape[3];
  const int64_t total = out.shape[0] * s * h * d;
  for (int64_t x = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; x < total;
       x += int64_t{gridDim.x} * blockDim.x) {
    const int64_t c = x % d, j = (x / d) % h, i = (x / (d * h)) % s, b = x / (d * h * s);
    store_from_float(out.data, b * out.stride[0] + i * out.stride[1] + j * out.stride[2] + c,
                     out.dtype, acc[x]);
  }
}

// Element-wise copy between two views of one shape (any strides), elements of type T.
template <typename T>
__global__ void copy_kernel(TensorView src, TensorView dst) {
  int64_t total = 1;
  for (int i = 0; i < src.ndim; ++i) total *= src.shape[i];
  for (int64_t x = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; x < total;
       x += int64_t{gridDim.x} * blockDim.x) {
    int64_t rest = x, from = 0, to = 0;
    for (int i = src.ndim - 1; i >= 0; --i) {
      const int64_t idx = rest % src.shape[i];
      rest /= src.shape[i];
      from += idx * src.stride[i];
      to += idx * dst.stride[i];
    }
    static_cast<T*>(dst.data)[to] = static_cast<const T*>(src.data)[from];
  }
}

// Runs of rows between two views (shard / unshard): blockIdx.y picks the run, the block's threads
// stride over its elements. The runs travel as a kernel argument (no upload), kRunsPerLaunch at a
// time.
constexpr int kRunsPerLaunch = 32;
struct RunBatch {
  int64_t src_row[kRunsPerLaunch], dst_row[kRunsPerLaunch], rows[kRunsPerLaunch];
};

template <typename T>
__global__ void copy_runs_kernel(TensorView src, TensorView dst, int seq_dim, RunBatch runs) {
  const int run = static_cast<int>(blockIdx.y);
  int64_t total = 1;
  for (int i = 0; i < src.ndim; ++i) total *= i == seq_dim ? runs.rows[run] : src.shape[i];
  for (int64_t x = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; x < total;
       x += int64_t{gridDim.x} * blockDim.x) {
    int64_t rest = x, from = 0, to = 0;
    for (int i = src.ndim - 1; i >= 0; --i) {
      const int64_t extent = i == seq_dim ? runs.rows[run] : src.shape[i];
      const int64_t idx = rest % extent;
      rest /= extent;
      from += (i == seq_dim ? idx + runs.src_row[run] : idx) * src.stride[i];
      to += (i == seq_dim ? idx + runs.dst_row[run] : idx) * dst.stride[i];
    }
    static_cast<T*>(dst.data)[to] = static_cast<const T*>(src.data)[from];
  }
}

// ---- host side --------------------------------------------------------------------------------

unsigned blocks_for(int64_t items) {
  // Grid-stride loops: enough blocks to fill an H100 several times over, no more.
  return static_cast<unsigned>(std::clamp<int64_t>((items + kThreads - 1) / kThreads, 1, 8192));
}

class DeviceOps final : public CpOps {
 public:
  explicit DeviceOps(int device) : device_(device) {}

  Status init(int64_t workspace_bytes) {
    FLARE_RETURN_IF_ERROR(cuda_status(kContext, "cudaGetDevice", cudaGetDevice(&previous_)));
    FLARE_RETURN_IF_ERROR(cuda_status(kContext, "cudaSetDevice", cudaSetDevice(device_)));
    Status s = cuda_status(
        kContext, "cudaMalloc of the workspace",
        cudaMalloc(&workspace_, static_cast<size_t>(std::max<int64_t>(workspace_bytes, 1))));
    if (s.ok())
      s = cuda_status(kContext, "cudaStreamCreate (communication stream)",
                      cudaStreamCreateWithFlags(&comm_, cudaStreamNonBlocking));
    if (s.ok())
      s = cuda_status(kContext, "cudaEventCreate",
                      cudaEventCreateWithFlags(&compute_mark_, cudaEventDisableTiming));
    if (s.ok())
      s = cuda_status(kContext, "cudaEventCreate",
                      cudaEventCreateWithFlags(&comm_mark_, cudaEventDisableTiming));
    cudaSetDevice(previous_);
    return s;
  }

  ~DeviceOps() override {
    const int previous = current_device();
    cudaSetDevice(device_);
    for (cudaEvent_t e : timed_) cudaEventDestroy(e);
    if (compute_mark_ != nullptr) cudaEventDestroy(compute_mark_);
    if (comm_mark_ != nullptr) cudaEventDestroy(comm_mark_);
    if (comm_ != nullptr) cudaStreamDestroy(comm_);
    if (workspace_ != nullptr) cudaFree(workspace_);
    cudaSetDevice(previous);
  }

  Status begin(Stream compute) override {
    FLARE_RETURN_IF_ERROR(cuda_status(kContext, "cudaGetDevice", cudaGetDevice(&previous_)));
    if (previous_ != device_)
      FLARE_RETURN_IF_ERROR(cuda_status(kContext, "cudaSetDevice", cudaSetDevice(device_)));
    compute_ = static_cast<cudaStream_t>(compute);
    active_ = true;
    ++timing_.calls;
    return open_span();
  }

  void end() override {
    if (!active_) return;
    const Status s = close_span();
    if (timing_error_.ok() && !s.ok()) timing_error_ = s;
    if (previous_ != device_) cudaSetDevice(previous_);
    active_ = false;
  }

  unsigned char* workspace() override { return static_cast<unsigned char*>(workspace_); }

  Status upload(int64_t offset, const void* host, int64_t bytes) override {
    if (bytes <= 0) return {};
    const int previous = current_device();
    cudaSetDevice(device_);
    Status s =
        cuda_status(kContext, "cudaMemcpyAsync (plan tables)",
                    cudaMemcpyAsync(static_cast<unsigned char*>(workspace_) + offset, host,
                                    static_cast<size_t>(bytes), cudaMemcpyHostToDevice, comm_));
    if (s.ok())
      s = cuda_status(kContext, "cudaStreamSynchronize (plan tables)",
                      cudaStreamSynchronize(comm_));
    cudaSetDevice(previous);
    return s;
  }

  Status fill(float* data, int64_t count, float value) override {
    if (count <= 0) return {};
    fill_kernel<<<blocks_for(count), kThreads, 0, compute_>>>(data, count, value);
    return launch_status(kContext, "fill kernel");
  }

  Status merge_block(const MergeArgs& a) override {
    const int64_t rows = a.batch * a.heads * a.q_len;
    if (rows <= 0) return {};
    const auto blocks = static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
    merge_kernel<<<blocks, kThreads, 0, compute_>>>(a);
    return launch_status(kContext, "merge kernel");
  }

  Status accumulate_rows(float* acc, int64_t len, int64_t row0, const void* blk, int64_t rows,
                         int64_t batch, int64_t hd, DType dtype) override {
    const int64_t items = batch * rows * hd;
    if (items <= 0) return {};
    accumulate_kernel<<<blocks_for(items), kThreads, 0, compute_>>>(acc, len, row0, blk, rows,
                                                                    batch, hd, dtype);
    return launch_status(kContext, "accumulate kernel");
  }

  Status store_rows(const float* acc, const TensorView& out) override {
    const int64_t items = out.numel();
    if (items <= 0) return {};
    store_kernel<<<blocks_for(items), kThreads, 0, compute_>>>(acc, out);
    return launch_status(kContext, "store kernel");
  }

  Status copy_rows(const TensorView& src, int64_t src_row, const TensorView& dst, int64_t dst_row,
                   int64_t count, int seq_dim) override {
    if (count <= 0) return {};
    TensorView from = src, to = dst;
    const auto el = static_cast<int64_t>(dtype_size(src.dtype));
    from.data = static_cast<unsigned char*>(src.data) + src_row * src.stride[seq_dim] * el;
    to.data = static_cast<unsigned char*>(dst.data) + dst_row * dst.stride[seq_dim] * el;
    from.shape[seq_dim] = to.shape[seq_dim] = count;
    const int64_t items = from.numel();
    if (items <= 0) return {};
    if (el == 2)
      copy_kernel<uint16_t><<<blocks_for(items), kThreads, 0, compute_>>>(from, to);
    else
      copy_kernel<uint32_t><<<blocks_for(items), kThreads, 0, compute_>>>(from, to);
    return launch_status(kContext, "copy kernel");
  }

  Stream compute_stream() override { return compute_; }
  Stream comm_stream() override { return comm_; }

  Status comm_waits_compute() override {
    FLARE_RETURN_IF_ERROR(
        cuda_status(kContext, "cudaEventRecord", cudaEventRecord(compute_mark_, compute_)));
    return cuda_status(kContext, "cudaStreamWaitEvent",
                       cudaStreamWaitEvent(comm_, compute_mark_, 0));
  }

  Status compute_waits_comm() override {
    FLARE_RETURN_IF_ERROR(close_span());
    FLARE_RETURN_IF_ERROR(
        cuda_status(kContext, "cudaEventRecord", cudaEventRecord(comm_mark_, comm_)));
    FLARE_RETURN_IF_ERROR(
        cuda_status(kContext, "cudaStreamWaitEvent", cudaStreamWaitEvent(compute_, comm_mark_, 0)));
    return open_span();
  }

  Status comm_started(int64_t bytes_sent) override {
    timing_.bytes_sent += bytes_sent;
    ++timing_.exchanges;
    if (!timing_on_) return {};
    return record(comm_, &comm_open_);
  }

  Status comm_finished() override {
    if (!timing_on_ || comm_open_ < 0) return {};
    int end = -1;
    FLARE_RETURN_IF_ERROR(record(comm_, &end));
    comm_spans_.emplace_back(comm_open_, end);
    comm_open_ = -1;
    return {};
  }

  Status set_timing(bool on) override {
    timing_on_ = on;
    return {};
  }

  Status take_timing(CpTiming* out) override {
    CpTiming t = timing_;
    Status s = timing_error_;
    const int previous = current_device();
    cudaSetDevice(device_);
    auto sum = [&](const std::vector<std::pair<int, int>>& spans, double* ms) {
      for (const auto& [from, to] : spans) {
        if (!s.ok()) return;
        s = cuda_status(kContext, "cudaEventSynchronize (timing)",
                        cudaEventSynchronize(timed_[to]));
        float span = 0.0f;
        if (s.ok())
          s = cuda_status(kContext, "cudaEventElapsedTime",
                          cudaEventElapsedTime(&span, timed_[from], timed_[to]));
        *ms += span;
      }
    };
    sum(comm_spans_, &t.comm_ms);
    sum(compute_spans_, &t.compute_ms);
    cudaSetDevice(previous);
    comm_spans_.clear();
    compute_spans_.clear();
    used_ = 0;
    timing_ = {};
    timing_error_ = {};
    if (!s.ok()) return s;
    *out = t;
    return {};
  }

 private:
  static int current_device() {
    int d = 0;
    cudaGetDevice(&d);
    return d;
  }

  // A timed event recorded on `stream`; its index in timed_ goes to *index.
  Status record(cudaStream_t stream, int* index) {
    if (used_ == timed_.size()) {
      cudaEvent_t e = nullptr;
      FLARE_RETURN_IF_ERROR(cuda_status(kContext, "cudaEventCreate (timing)", cudaEventCreate(&e)));
      timed_.push_back(e);
    }
    *index = static_cast<int>(used_++);
    return cuda_status(kContext, "cudaEventRecord (timing)",
                       cudaEventRecord(timed_[*index], stream));
  }

  Status open_span() {
    if (!timing_on_ || !active_) return {};
    return record(compute_, &compute_open_);
  }
  Status close_span() {
    if (!timing_on_ || compute_open_ < 0) return {};
    int end = -1;
    FLARE_RETURN_IF_ERROR(record(compute_, &end));
    compute_spans_.emplace_back(compute_open_, end);
    compute_open_ = -1;
    return {};
  }

  int device_;
  int previous_ = 0;
  bool active_ = false;
  void* workspace_ = nullptr;
  cudaStream_t compute_ = nullptr;
  cudaStream_t comm_ = nullptr;
  cudaEvent_t compute_mark_ = nullptr;
  cudaEvent_t comm_mark_ = nullptr;
  // Timing.
  bool timing_on_ = false;
  std::vector<cudaEvent_t> timed_;
  size_t used_ = 0;
  int comm_open_ = -1, compute_open_ = -1;
  std::vector<std::pair<int, int>> comm_spans_, compute_spans_;
  CpTiming timing_;
  Status timing_error_;
};

}  // namespace

Status device_copy_runs(const TensorView& src, const TensorView& dst, int seq_dim,
                        const std::vector<RowRun>& runs, Stream stream) {
  const size_t el = dtype_size(src.dtype);
  if (el != 2 && el != 4)
    return Status::unsupported(cat("device_copy_runs: elements of ", el, " bytes"));
  int previous = 0;
  FLARE_RETURN_IF_ERROR(cuda_status(kContext, "cudaGetDevice", cudaGetDevice(&previous)));
  if (previous != src.device_index)
    FLARE_RETURN_IF_ERROR(cuda_status(kContext, "cudaSetDevice", cudaSetDevice(src.device_index)));
  int64_t per_row = 1;
  for (int i = 0; i < src.ndim; ++i)
    if (i != seq_dim) per_row *= src.shape[i];
  Status s;
  for (size_t first = 0; first < runs.size() && s.ok(); first += kRunsPerLaunch) {
    RunBatch batch{};
    unsigned count = 0;
    int64_t longest = 0;
    for (size_t i = first; i < runs.size() && count < kRunsPerLaunch; ++i, ++count) {
      batch.src_row[count] = runs[i].src_row;
      batch.dst_row[count] = runs[i].dst_row;
      batch.rows[count] = runs[i].rows;
      longest = std::max(longest, runs[i].rows);
    }
    if (longest * per_row == 0) continue;
    const dim3 grid(blocks_for(longest * per_row), count);
    auto* st = static_cast<cudaStream_t>(stream);
    if (el == 2)
      copy_runs_kernel<uint16_t><<<grid, kThreads, 0, st>>>(src, dst, seq_dim, batch);
    else
      copy_runs_kernel<uint32_t><<<grid, kThreads, 0, st>>>(src, dst, seq_dim, batch);
    s = launch_status(kContext, "copy_runs kernel");
  }
  if (previous != src.device_index) cudaSetDevice(previous);
  return s;
}

Status make_device_ops(int device_index, int64_t workspace_bytes, std::unique_ptr<CpOps>* out) {
  auto ops = std::make_unique<DeviceOps>(device_index);
  FLARE_RETURN_IF_ERROR(ops->init(workspace_bytes));
  *out = std::move(ops);
  return {};
}

}  // namespace flare::dist
