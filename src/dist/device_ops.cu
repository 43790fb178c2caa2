// device_ops.cu — CpOps on a CUDA device: the strategies' element-wise passes as kernels, the
// workspace in device memory, and the communication stream ordered against the caller's by
// events (no host waits).
//
// The passes are memory-bound (a merge reads and writes O(s_local·h·d) per step; a block call
// does O(s_local·s_block·h·d) work), so they must run at the memory's speed: they walk rows with
// vector loads (below). Their arithmetic has one definition: dtype conversions are
// core/numeric.h's, and the merge calls merge.h's merge_weights, the very function the host path
// runs.
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

// ---- kernels ----------------------------------------------------------------------------------
//
// Every pass walks rows: the elements of a view with every index but the last fixed. A group of
// 2^shift threads (up to a warp) takes a row, or a segment of a long one, and its lanes take
// chunks of the row: kVec elements at once (16-byte fp32, 8-byte 16-bit loads and stores) where
// every row start and length allows it, else one element. Where a row starts comes from its index
// by one division per dimension, once per row: per element, those 64-bit divisions cost more
// than the memory traffic (the passes had become a tenth of a ring step's time).

constexpr int kVec = 4;
// Chunks a lane takes from one segment of a row: longer rows are split over several groups, so
// that a few long rows (LSE rows of a sequence) still fill the device.
constexpr int kChunksPerLane = 4;

// Where the rows of a view of up to kMaxDims dimensions start, in bytes from its data.
struct RowStarts {
  int outer = 0;  // the dimensions before the last
  int64_t extent[kMaxDims - 1] = {};
  int64_t stride[kMaxDims - 1] = {};  // bytes
  __device__ int64_t operator()(int64_t row) const {
    int64_t at = 0;
    for (int i = outer - 1; i >= 0; --i) {
      at += row % extent[i] * stride[i];
      row /= extent[i];
    }
    return at;
  }
  __host__ __device__ int64_t rows() const {
    int64_t n = 1;
    for (int i = 0; i < outer; ++i) n *= extent[i];
    return n;
  }
};

// The work of a pass: `rows` rows of `chunks` chunks, in segments of a group's lanes ×
// kChunksPerLane chunks, a group of 2^shift lanes per segment.
struct Walk {
  int64_t rows = 0, chunks = 0, segments = 0;
  int shift = 0;
  __host__ __device__ Walk(int64_t rows_, int64_t chunks_) : rows(rows_), chunks(chunks_) {
    while (shift < 5 && (int64_t{1} << shift) < chunks) ++shift;
    const int64_t span = (int64_t{1} << shift) * kChunksPerLane;
    segments = (chunks + span - 1) / span;
  }
  __host__ __device__ int64_t threads() const { return rows * segments << shift; }
};

// Calls fn(row, chunk, end, lanes) for each segment this thread's group takes: the thread's
// chunks are chunk, chunk + lanes, … below end.
template <typename Fn>
__device__ void walk_rows(const Walk& w, Fn&& fn) {
  const int lanes = 1 << w.shift;
  const int lane = static_cast<int>(threadIdx.x) & (lanes - 1);
  const int64_t span = int64_t{lanes} * kChunksPerLane;
  const int64_t items = w.rows * w.segments;
  for (int64_t item = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) >> w.shift; item < items;
       item += (gridDim.x * int64_t{blockDim.x}) >> w.shift) {
    const int64_t row = item / w.segments, first = item % w.segments * span;
    fn(row, first + lane, first + span < w.chunks ? first + span : w.chunks, lanes);
  }
}

// kN consecutive elements from element i of base (aligned to kN elements when kN > 1), as floats.
template <int kN>
struct Floats {
  static_assert(kN == 1 || kN == kVec, "one element or a vector chunk");
  float v[kN];
};
template <int kN>
__device__ Floats<kN> load_floats(const void* base, int64_t i, DType dtype) {
  Floats<kN> f;
  if constexpr (kN == 1) {
    f.v[0] = load_as_float(base, i, dtype);
  } else if (dtype == DType::kFloat32) {
    const float4 x = *reinterpret_cast<const float4*>(static_cast<const float*>(base) + i);
    f.v[0] = x.x;
    f.v[1] = x.y;
    f.v[2] = x.z;
    f.v[3] = x.w;
  } else {
    const uint2 x = *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(base) + i);
    const uint32_t words[2] = {x.x, x.y};
    for (int k = 0; k < 4; ++k) {
      const auto h = static_cast<uint16_t>(words[k / 2] >> (16 * (k % 2)));
      f.v[k] = dtype == DType::kFloat16 ? half_to_float(h) : bf16_to_float(h);
    }
  }
  return f;
}
template <int kN>
__device__ void store_floats(void* base, int64_t i, DType dtype, const Floats<kN>& f) {
  if constexpr (kN == 1) {
    store_from_float(base, i, dtype, f.v[0]);
  } else if (dtype == DType::kFloat32) {
    *reinterpret_cast<float4*>(static_cast<float*>(base) + i) = {f.v[0], f.v[1], f.v[2], f.v[3]};
  } else {
    uint32_t words[2] = {0, 0};
    for (int k = 0; k < 4; ++k) {
      const uint16_t h =
          dtype == DType::kFloat16 ? float_to_half(f.v[k]) : float_to_bf16(f.v[k]);
      words[k / 2] |= static_cast<uint32_t>(h) << (16 * (k % 2));
    }
    *reinterpret_cast<uint2*>(static_cast<uint16_t*>(base) + i) = {words[0], words[1]};
  }
}

__global__ void fill_kernel(float* data, int64_t count, float value) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x)
    data[i] = value;
}

// One group per query row (b, h, i) of the block, rows numbered ((b·h_q + h)·q_len + i) as the
// block's LSE is. Every lane of a group reads the running LSE before the group's first lane
// replaces it: the lanes of a warp go round the loop together, for the __syncwarp between.
template <int kN>
__global__ void merge_kernel(MergeArgs a, int shift) {
  const int lanes = 1 << shift;
  const int lane = static_cast<int>(threadIdx.x) & (lanes - 1);
  const int64_t rows = a.batch * a.heads * a.q_len, chunks = a.head_dim / kN;
  const int64_t group_in_warp = (threadIdx.x & 31) >> shift;
  const int64_t groups = (gridDim.x * int64_t{blockDim.x}) >> shift;
  for (int64_t first = ((blockIdx.x * int64_t{blockDim.x} + threadIdx.x) >> shift) - group_in_warp;
       first < rows; first += groups) {
    const int64_t row = first + group_in_warp;
    float* lse = nullptr;
    float merged = 0.0f;
    if (row < rows) {
      const int64_t i = row % a.q_len, bh = row / a.q_len, h = bh % a.heads, b = bh / a.heads;
      lse = a.lse_acc + bh * a.s_local + a.q_begin + i;
      const MergeWeights w = merge_weights(*lse, a.lse_blk[row]);
      float* acc = a.o_acc + ((b * a.s_local + a.q_begin + i) * a.heads + h) * a.head_dim;
      const int64_t blk = ((b * a.q_len + i) * a.heads + h) * a.head_dim;
      for (int64_t c = lane; c < chunks; c += lanes) {
        Floats<kN> x = load_floats<kN>(acc, c * kN, DType::kFloat32);
        const Floats<kN> y = load_floats<kN>(a.o_blk, blk + c * kN, a.dtype);
        for (int k = 0; k < kN; ++k) x.v[k] = w.a * x.v[k] + w.b * y.v[k];
        store_floats<kN>(acc, c * kN, DType::kFloat32, x);
      }
      merged = w.lse;
    }
    __syncwarp();
    if (row < rows && lane == 0) *lse = merged;
  }
}

// acc rows [row0, row0 + rows) of a dense fp32 (b, len, hd) += a dense dtype (b, rows, hd): rows
// (b, i) of hd elements.
template <int kN>
__global__ void accumulate_kernel(float* acc, int64_t len, int64_t row0, const void* blk,
                                  int64_t rows, DType dtype, Walk w) {
  const int64_t hd = w.chunks * kN;
  walk_rows(w, [&](int64_t r, int64_t c, int64_t end, int lanes) {
    float* to = acc + (r / rows * len + row0 + r % rows) * hd;
    for (; c < end; c += lanes) {
      Floats<kN> x = load_floats<kN>(to, c * kN, DType::kFloat32);
      const Floats<kN> y = load_floats<kN>(blk, r * hd + c * kN, dtype);
      for (int k = 0; k < kN; ++k) x.v[k] += y.v[k];
      store_floats<kN>(to, c * kN, DType::kFloat32, x);
    }
  });
}

// A dense fp32 (b, s, h, d) into a (b, s, h, d) view of any strides, rounded to its dtype: rows
// (b, s, h) of d elements; `step` is the view's last stride in bytes.
template <int kN>
__global__ void store_kernel(const float* acc, TensorView out, RowStarts starts, int64_t step,
                             Walk w) {
  const int64_t d = w.chunks * kN;
  walk_rows(w, [&](int64_t r, int64_t c, int64_t end, int lanes) {
    unsigned char* to = static_cast<unsigned char*>(out.data) + starts(r);
    for (; c < end; c += lanes) {
      const Floats<kN> x = load_floats<kN>(acc, r * d + c * kN, DType::kFloat32);
      if constexpr (kN == 1)
        store_floats<1>(to + c * step, 0, out.dtype, x);
      else
        store_floats<kN>(to, c * kN, out.dtype, x);
    }
  });
}

// Runs of rows along seq_dim between two views of one dtype (copy_rows is one run): blockIdx.y
// picks the run, which sets the seq_dim extent of the rows walked (or their length, when seq_dim
// is the last). The runs travel as a kernel argument (no upload), kRunsPerLaunch at a time.
constexpr int kRunsPerLaunch = 32;
struct RunBatch {
  int64_t src_row[kRunsPerLaunch], dst_row[kRunsPerLaunch], rows[kRunsPerLaunch];
};
struct CopyArgs {
  const unsigned char* src;
  unsigned char* dst;
  RowStarts from, to;
  int seq_dim;
  int64_t src_seq, dst_seq;    // bytes between consecutive rows along seq_dim
  int64_t inner;               // elements of a row when seq_dim is not the last dimension
  int64_t src_step, dst_step;  // bytes between consecutive chunks of a row
  int chunk_elems;
};

template <typename Chunk>
__global__ void copy_runs_kernel(CopyArgs a, RunBatch runs) {
  const int run = static_cast<int>(blockIdx.y);
  RowStarts from = a.from, to = a.to;
  int64_t inner = a.inner;
  if (a.seq_dim == from.outer)
    inner = runs.rows[run];
  else
    from.extent[a.seq_dim] = to.extent[a.seq_dim] = runs.rows[run];
  const unsigned char* src = a.src + runs.src_row[run] * a.src_seq;
  unsigned char* dst = a.dst + runs.dst_row[run] * a.dst_seq;
  walk_rows(Walk(from.rows(), inner / a.chunk_elems),
            [&](int64_t r, int64_t c, int64_t end, int lanes) {
              const unsigned char* s = src + from(r);
              unsigned char* d = dst + to(r);
              for (; c < end; c += lanes)
                *reinterpret_cast<Chunk*>(d + c * a.dst_step) =
                    *reinterpret_cast<const Chunk*>(s + c * a.src_step);
            });
}

// ---- host side --------------------------------------------------------------------------------

unsigned blocks_for(int64_t items) {
  // Grid-stride loops: enough blocks to fill an H100 several times over, no more.
  return static_cast<unsigned>(std::clamp<int64_t>((items + kThreads - 1) / kThreads, 1, 8192));
}

bool aligned(const void* p, int64_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// The rows of a view: every dimension but the last.
RowStarts row_starts(const TensorView& v) {
  RowStarts s;
  s.outer = v.ndim - 1;
  const auto el = static_cast<int64_t>(dtype_size(v.dtype));
  for (int i = 0; i < s.outer; ++i) {
    s.extent[i] = v.shape[i];
    s.stride[i] = v.stride[i] * el;
  }
  return s;
}

// Whether every row of v starts on a multiple of `bytes` and its last dimension is dense: the
// strides of dimensions of one index do not count.
bool rows_aligned(const TensorView& v, int64_t bytes) {
  const auto el = static_cast<int64_t>(dtype_size(v.dtype));
  if (v.ndim == 0 || (v.shape[v.ndim - 1] > 1 && v.stride[v.ndim - 1] != 1)) return false;
  for (int i = 0; i + 1 < v.ndim; ++i)
    if (v.shape[i] > 1 && v.stride[i] * el % bytes != 0) return false;
  return aligned(v.data, bytes);
}

// Copies runs of rows along seq_dim from src to dst (one dtype, any strides, one shape but
// seq_dim) on `stream`, in the widest chunk that every row start and length allows.
Status launch_copy_runs(const TensorView& src, const TensorView& dst, int seq_dim,
                        const RowRun* runs, size_t count, cudaStream_t stream) {
  const auto el = static_cast<int64_t>(dtype_size(src.dtype));
  if (el != 2 && el != 4)
    return Status::unsupported(cat("context-parallel copy: elements of ", el, " bytes"));
  const int last = src.ndim - 1;
  const int64_t inner = src.shape[last];
  int64_t chunk = el;
  for (int64_t bytes : {16, 8, 4}) {
    if (bytes <= el) break;
    bool fits = rows_aligned(src, bytes) && rows_aligned(dst, bytes) &&
                src.stride[seq_dim] * el % bytes == 0 && dst.stride[seq_dim] * el % bytes == 0;
    for (size_t i = 0; i < count && fits; ++i)
      fits = seq_dim != last || (runs[i].src_row * el % bytes == 0 &&
                                 runs[i].dst_row * el % bytes == 0 && runs[i].rows * el % bytes == 0);
    if (fits && (seq_dim == last || inner * el % bytes == 0)) {
      chunk = bytes;
      break;
    }
  }
  CopyArgs a;
  a.src = static_cast<const unsigned char*>(src.data);
  a.dst = static_cast<unsigned char*>(dst.data);
  a.from = row_starts(src);
  a.to = row_starts(dst);
  a.seq_dim = seq_dim;
  a.src_seq = src.stride[seq_dim] * el;
  a.dst_seq = dst.stride[seq_dim] * el;
  a.inner = inner;
  a.chunk_elems = static_cast<int>(chunk / el);
  a.src_step = chunk == el ? src.stride[last] * el : chunk;
  a.dst_step = chunk == el ? dst.stride[last] * el : chunk;
  for (size_t first = 0; first < count; first += kRunsPerLaunch) {
    RunBatch batch{};
    unsigned n = 0;
    int64_t most = 0;  // threads of the largest run
    for (size_t i = first; i < count && n < kRunsPerLaunch; ++i, ++n) {
      batch.src_row[n] = runs[i].src_row;
      batch.dst_row[n] = runs[i].dst_row;
      batch.rows[n] = runs[i].rows;
      RowStarts f = a.from;
      int64_t len = inner;
      if (seq_dim == last)
        len = runs[i].rows;
      else
        f.extent[seq_dim] = runs[i].rows;
      most = std::max(most, Walk(f.rows(), len / a.chunk_elems).threads());
    }
    if (most == 0) continue;
    const dim3 grid(blocks_for(most), n);
    switch (chunk) {
      case 16: copy_runs_kernel<uint4><<<grid, kThreads, 0, stream>>>(a, batch); break;
      case 8: copy_runs_kernel<uint2><<<grid, kThreads, 0, stream>>>(a, batch); break;
      case 4: copy_runs_kernel<uint32_t><<<grid, kThreads, 0, stream>>>(a, batch); break;
      default: copy_runs_kernel<uint16_t><<<grid, kThreads, 0, stream>>>(a, batch); break;
    }
    FLARE_RETURN_IF_ERROR(launch_status(kContext, "copy kernel"));
  }
  return {};
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
    if (rows <= 0 || a.head_dim <= 0) return {};
    const bool vec = a.head_dim % kVec == 0 && aligned(a.o_acc, 16) &&
                     aligned(a.o_blk, kVec * static_cast<int64_t>(dtype_size(a.dtype)));
    const int shift = Walk(rows, vec ? a.head_dim / kVec : a.head_dim).shift;  // a group a row
    if (vec)
      merge_kernel<kVec><<<blocks_for(rows << shift), kThreads, 0, compute_>>>(a, shift);
    else
      merge_kernel<1><<<blocks_for(rows << shift), kThreads, 0, compute_>>>(a, shift);
    return launch_status(kContext, "merge kernel");
  }

  Status accumulate_rows(float* acc, int64_t len, int64_t row0, const void* blk, int64_t rows,
                         int64_t batch, int64_t hd, DType dtype) override {
    if (batch * rows * hd <= 0) return {};
    const bool vec = hd % kVec == 0 && aligned(acc, 16) &&
                     aligned(blk, kVec * static_cast<int64_t>(dtype_size(dtype)));
    const Walk w(batch * rows, vec ? hd / kVec : hd);
    if (vec)
      accumulate_kernel<kVec><<<blocks_for(w.threads()), kThreads, 0, compute_>>>(
          acc, len, row0, blk, rows, dtype, w);
    else
      accumulate_kernel<1><<<blocks_for(w.threads()), kThreads, 0, compute_>>>(acc, len, row0, blk,
                                                                               rows, dtype, w);
    return launch_status(kContext, "accumulate kernel");
  }

  Status store_rows(const float* acc, const TensorView& out) override {
    const int64_t d = out.shape[3];
    if (out.numel() <= 0) return {};
    const auto el = static_cast<int64_t>(dtype_size(out.dtype));
    const bool vec = d % kVec == 0 && aligned(acc, 16) && rows_aligned(out, kVec * el);
    const Walk w(out.numel() / d, vec ? d / kVec : d);
    const RowStarts starts = row_starts(out);
    if (vec)
      store_kernel<kVec><<<blocks_for(w.threads()), kThreads, 0, compute_>>>(acc, out, starts, 0, w);
    else
      store_kernel<1><<<blocks_for(w.threads()), kThreads, 0, compute_>>>(
          acc, out, starts, out.stride[3] * el, w);
    return launch_status(kContext, "store kernel");
  }

  Status copy_rows(const TensorView& src, int64_t src_row, const TensorView& dst, int64_t dst_row,
                   int64_t count, int seq_dim) override {
    if (count <= 0) return {};
    const RowRun run{src_row, dst_row, count};
    return launch_copy_runs(src, dst, seq_dim, &run, 1, compute_);
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
  int previous = 0;
  FLARE_RETURN_IF_ERROR(cuda_status(kContext, "cudaGetDevice", cudaGetDevice(&previous)));
  if (previous != src.device_index)
    FLARE_RETURN_IF_ERROR(cuda_status(kContext, "cudaSetDevice", cudaSetDevice(src.device_index)));
  const Status s = launch_copy_runs(src, dst, seq_dim, runs.data(), runs.size(),
                                    static_cast<cudaStream_t>(stream));
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
