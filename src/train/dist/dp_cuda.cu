// dp_cuda.cu — the data-parallel collectives of dp_cuda.h: kernels (the rank-ordered sums), then
// the host side (buffers, the step's protocol over the communicator).
#include "train/dist/dp_cuda.h"

#include <algorithm>
#include <array>
#include <vector>

#include "core/message.h"
#include "train/cuda/adamw.h"
#include "train/cuda/common.h"
#include "train/dist/dp_host.h"

namespace flare::train::dp {
namespace {

using cuda::cuda_status;
using cuda::kCudaContext;
using cuda::launch_status;

constexpr int kThreads = 256;
constexpr int64_t kAlignment = 256;

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
size_t sz(int64_t n) { return static_cast<size_t>(n); }

// ---- Kernels ------------------------------------------------------------------------------------

__global__ void __launch_bounds__(kThreads)
    sum_slices_kernel(const float* __restrict__ own, const float* __restrict__ staging,
                      int64_t stride, int world, int rank, int64_t n, bool accumulate,
                      float* __restrict__ out) {
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * kThreads) {
    float acc = 0.0f;
    for (int q = 0; q < world; ++q) {
      acc += q == rank ? own[i] : staging[staging_slot(q, rank) * stride + i];
    }
    out[i] = accumulate ? out[i] + acc : acc;
  }
}

// The step's count of valid targets: every rank's, added in rank order; the loss gradient's
// factor as the host computes it for one device (fp32 of the double quotient).
__global__ void agree_count_kernel(const int64_t* counts, int world, float* dloss_scale,
                                   DeviceTotals* totals) {
  int64_t total = 0;
  for (int q = 0; q < world; ++q) total += counts[q];
  totals->valid = total;
  *dloss_scale = total > 0 ? static_cast<float>(1.0 / static_cast<double>(total)) : 0.0f;
}

// The ranks' loss sums (sums[2q + 1]) in rank order.
__global__ void agree_loss_kernel(const double* sums, int world, DeviceTotals* totals) {
  double loss = 0.0;
  for (int q = 0; q < world; ++q) loss += sums[2 * q + 1];
  totals->loss_sum = loss;
}

// Where create() carves each buffer from one allocation.
struct Layout {
  int64_t shard_grads, shard_weights, staging, counts_send, counts_recv, sums_send, sums_recv,
      dloss_scale, totals, ring[kGradientRing], last_stage, total;
};

Layout buffer_layout(const DpPlan& plan, int rank, bool shard_gradients) {
  const int64_t shard = plan.shard_size(rank), world = plan.world;
  Layout l{};
  int64_t at = 0;
  auto take = [&](int64_t bytes) {
    const int64_t here = at;
    at += round_up(bytes > 0 ? bytes : 1, kAlignment);
    return here;
  };
  l.shard_grads = take(shard * 4);
  l.shard_weights = take(shard * 2);
  l.staging = take((world - 1) * plan.max_slice * 4);
  l.counts_send = take(8);
  l.counts_recv = take(8 * world);
  l.sums_send = take(16);
  l.sums_recv = take(16 * world);
  l.dloss_scale = take(4);
  l.totals = take(static_cast<int64_t>(sizeof(DeviceTotals)));
  const int64_t ring = shard_gradients ? longest_ring_stage(plan) : 0;
  for (int64_t& slot : l.ring) slot = take(ring * 4);
  l.last_stage = take(shard_gradients ? plan.stage_size(static_cast<int64_t>(plan.stage_begin.size()) - 1) * 4 : 0);
  l.total = at;
  return l;
}

}  // namespace

Status sum_slices_in_rank_order(const float* own, const float* staging, int64_t stride, int world,
                                int rank, int64_t n, float* out, cudaStream_t stream, bool accumulate) {
  const char* op = "sum_slices_in_rank_order";
  if (world < 1 || rank < 0 || rank >= world)
    return invalid(op, ": rank ", rank, " must be in [0, world = ", world, ")");
  if (n < 0 || stride < n) return invalid(op, ": n = ", n, " must be in [0, stride = ", stride, "]");
  if (n == 0) return Status::ok_status();
  if (own == nullptr || out == nullptr || (world > 1 && staging == nullptr))
    return invalid(op, ": own, staging and out must not be null");
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, 4096);
  sum_slices_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(own, staging, stride, world,
                                                                              rank, n, accumulate, out);
  return launch_status(kCudaContext, op);
}

// ---- Setup --------------------------------------------------------------------------------------

int64_t CudaDataParallel::buffer_bytes(const DpPlan& plan, int rank, bool shard_gradients) {
  return buffer_layout(plan, rank, shard_gradients).total;
}

Status CudaDataParallel::create(dist::Communicator* comm, const DpPlan& plan, cudaStream_t compute,
                                cuda::EventTimer* timer, std::unique_ptr<CudaDataParallel>* out,
                                bool shard_gradients) {
  if (comm == nullptr || timer == nullptr) return invalid("CudaDataParallel: comm and timer must not be null");
  if (comm->device() != DeviceType::kCUDA) {
    return invalid("comm: the CUDA backend needs a communicator over CUDA memory (NCCL), got ", comm->kind());
  }
  if (comm->size() != plan.world || plan.world < 2) {
    return invalid("comm: ", comm->size(), " ranks, the data-parallel plan has ", plan.world,
                   " (and needs at least 2)");
  }
  if (shard_gradients && !plan.stage_buckets) {
    return invalid("plan: sharded gradients need buckets that lie in one stage each (make_dp_plan's stage_buckets)");
  }
  std::unique_ptr<CudaDataParallel> d(new CudaDataParallel());
  d->shard_gradients_ = shard_gradients;
  d->comm_ = comm;
  d->plan_ = &plan;
  d->rank_ = comm->rank();
  d->compute_ = compute;
  d->timer_ = timer;
  FLARE_RETURN_IF_ERROR(cuda_status(kCudaContext, "data-parallel stream",
                                    cudaStreamCreateWithFlags(&d->stream_, cudaStreamNonBlocking)));
  const Layout l = buffer_layout(plan, d->rank_, shard_gradients);
  FLARE_RETURN_IF_ERROR(
      cuda_status(kCudaContext, "data-parallel buffers", cudaMalloc(&d->buffers_, sz(l.total))));
  char* base = static_cast<char*>(d->buffers_);
  d->shard_grads_ = reinterpret_cast<float*>(base + l.shard_grads);
  d->shard_weights_ = reinterpret_cast<__nv_bfloat16*>(base + l.shard_weights);
  d->staging_ = reinterpret_cast<float*>(base + l.staging);
  d->counts_send_ = reinterpret_cast<int64_t*>(base + l.counts_send);
  d->counts_recv_ = reinterpret_cast<int64_t*>(base + l.counts_recv);
  d->sums_send_ = reinterpret_cast<double*>(base + l.sums_send);
  d->sums_recv_ = reinterpret_cast<double*>(base + l.sums_recv);
  d->dloss_scale_ = reinterpret_cast<float*>(base + l.dloss_scale);
  d->totals_ = reinterpret_cast<DeviceTotals*>(base + l.totals);
  if (shard_gradients) {
    std::array<float*, kGradientRing> ring{};
    for (int k = 0; k < kGradientRing; ++k) ring[sz(k)] = reinterpret_cast<float*>(base + l.ring[k]);
    d->stages_.init(plan, ring, reinterpret_cast<float*>(base + l.last_stage));
  }
  // Zero everything once: the shard buffers' alignment gaps are never written by a kernel.
  FLARE_RETURN_IF_ERROR(cuda_status(kCudaContext, "data-parallel buffers",
                                    cudaMemsetAsync(d->buffers_, 0, sz(l.total), d->stream_)));
  FLARE_RETURN_IF_ERROR(
      cuda_status(kCudaContext, "data-parallel pinned count",
                  cudaMallocHost(reinterpret_cast<void**>(&d->host_count_), sizeof(int64_t))));
  FLARE_RETURN_IF_ERROR(d->create_events());

  // What this rank sends per step: its share of the agreement all-gathers, every other rank's
  // slice of each bucket (fp32), and its own slice of each bucket to every other rank (bf16).
  const int64_t peers = plan.world - 1;
  d->other_bytes_ = peers * (8 + 16);
  for (const Bucket& b : plan.buckets) {
    d->reduce_bytes_ += (b.end - b.begin - b.slice_size(d->rank_)) * 4;
    d->other_bytes_ += peers * b.slice_size(d->rank_) * 2;
  }
  FLARE_RETURN_IF_ERROR(d->synchronize());
  *out = std::move(d);
  return Status::ok_status();
}

Status CudaDataParallel::create_events() {
  auto make = [](cudaEvent_t* e, unsigned flags) {
    return cuda_status(kCudaContext, "data-parallel event", cudaEventCreateWithFlags(e, flags));
  };
  gathered_.assign(plan_->buckets.size(), nullptr);
  for (cudaEvent_t& e : gathered_) FLARE_RETURN_IF_ERROR(make(&e, cudaEventDisableTiming));
  for (int i = 0; i < 2; ++i) {
    FLARE_RETURN_IF_ERROR(make(&gather_begin_[i], cudaEventDefault));
    FLARE_RETURN_IF_ERROR(make(&gather_end_[i], cudaEventDefault));
  }
  if (shard_gradients_) {
    for (BufferRead& r : read_) FLARE_RETURN_IF_ERROR(make(&r.event, cudaEventDisableTiming));
  }
  return make(&count_ready_, cudaEventDisableTiming);
}

CudaDataParallel::~CudaDataParallel() {
  if (stream_) cudaStreamSynchronize(stream_);
  for (cudaEvent_t e : gathered_)
    if (e) cudaEventDestroy(e);
  for (cudaEvent_t e : {gather_begin_[0], gather_begin_[1], gather_end_[0], gather_end_[1], count_ready_})
    if (e) cudaEventDestroy(e);
  for (const BufferRead& r : read_)
    if (r.event) cudaEventDestroy(r.event);
  cudaFree(buffers_);
  cudaFreeHost(host_count_);
  if (stream_) cudaStreamDestroy(stream_);
}

Status CudaDataParallel::synchronize() {
  return cuda_status(kCudaContext, "data-parallel stream", cudaStreamSynchronize(stream_));
}

// ---- Stream hand-offs ---------------------------------------------------------------------------

Status CudaDataParallel::comm_after_compute() {
  cudaEvent_t ready = nullptr;
  FLARE_RETURN_IF_ERROR(timer_->record(compute_, &ready));
  FLARE_RETURN_IF_ERROR(
      cuda_status(kCudaContext, "data-parallel wait", cudaStreamWaitEvent(stream_, ready, 0)));
  return timer_->record(stream_, &run_begin_);
}

Status CudaDataParallel::end_comm_run() {
  FLARE_RETURN_IF_ERROR(timer_->record(stream_, &run_end_));
  timer_->span(cuda::EventTimer::kComm, run_begin_, run_end_);
  return Status::ok_status();
}

Status CudaDataParallel::compute_after_comm() {
  FLARE_RETURN_IF_ERROR(end_comm_run());
  return compute_waits(run_end_);
}

Status CudaDataParallel::compute_waits(cudaEvent_t event) {
  cudaEvent_t before = nullptr, after = nullptr;
  FLARE_RETURN_IF_ERROR(timer_->record(compute_, &before));
  FLARE_RETURN_IF_ERROR(
      cuda_status(kCudaContext, "data-parallel wait", cudaStreamWaitEvent(compute_, event, 0)));
  FLARE_RETURN_IF_ERROR(timer_->record(compute_, &after));
  timer_->span(cuda::EventTimer::kCommExposed, before, after);
  return Status::ok_status();
}

Status CudaDataParallel::wait_for_gathered(size_t first_bucket) {
  if (first_bucket >= gathered_waited_) return Status::ok_status();
  FLARE_RETURN_IF_ERROR(compute_waits(gathered_[first_bucket]));
  gathered_waited_ = first_bucket;
  return Status::ok_status();
}

Status CudaDataParallel::wait_for_forward_stage(int64_t stage) {
  // The buckets holding weights of `stage` or a later stage are those whose ready_stage (their
  // highest stage) is at least `stage`: a suffix of the list, whose first bucket is gathered last.
  const std::vector<Bucket>& buckets = plan_->buckets;
  const auto first = std::partition_point(buckets.begin(), buckets.end(),
                                          [stage](const Bucket& b) { return b.ready_stage < stage; });
  FLARE_RETURN_IF_ERROR(wait_for_gathered(static_cast<size_t>(first - buckets.begin())));
  if (stage > 0 || count_waited_) return Status::ok_status();
  count_waited_ = true;
  return compute_waits(count_ready_);
}

// ---- The step -----------------------------------------------------------------------------------

Status CudaDataParallel::agree_valid_count(int64_t local_valid) {
  next_bucket_ = 0;
  *host_count_ = local_valid;  // the previous step's copy has completed: its end was waited for
  if (gather_unreported_) {    // the last step's all-gather, which this step's forward waits for
    timer_->span(cuda::EventTimer::kComm, gather_begin_[gather_parity_], gather_end_[gather_parity_]);
    gather_unreported_ = false;
  }
  FLARE_RETURN_IF_ERROR(comm_after_compute());
  FLARE_RETURN_IF_ERROR(cuda_status(kCudaContext, "valid count",
                                    cudaMemcpyAsync(counts_send_, host_count_, sizeof(int64_t),
                                                    cudaMemcpyHostToDevice, stream_)));
  // valid-target count: one int64 per rank
  FLARE_RETURN_IF_ERROR(comm_->all_gather(counts_send_, counts_recv_, sizeof(int64_t), stream_));
  agree_count_kernel<<<1, 1, 0, stream_>>>(counts_recv_, plan_->world, dloss_scale_, totals_);
  FLARE_RETURN_IF_ERROR(launch_status(kCudaContext, "agree_count_kernel"));
  FLARE_RETURN_IF_ERROR(end_comm_run());
  FLARE_RETURN_IF_ERROR(
      cuda_status(kCudaContext, "data-parallel event", cudaEventRecord(count_ready_, stream_)));
  count_waited_ = false;
  return Status::ok_status();
}

// ---- Sharded gradients ---------------------------------------------------------------------------

Status CudaDataParallel::begin_backward(bool accumulate) {
  if (!shard_gradients_) return invalid("begin_backward: this data-parallel step holds whole gradients");
  accumulate_ = accumulate;
  next_bucket_ = 0;
  // The last micro-batch's reduce-scatter of the last stage may still be reading its buffer.
  FLARE_RETURN_IF_ERROR(wait_until_read(kLastStageBuffer));
  float* last = stages_.begin();
  FLARE_RETURN_IF_ERROR(cuda_status(
      kCudaContext, "gradient stage buffer",
      cudaMemsetAsync(last, 0, sz(plan_->stage_size(stages_.last_stage())) * sizeof(float),
                      compute_)));
  return acquire_stage(0);
}

Status CudaDataParallel::acquire_stage(int64_t stage) {
  FLARE_RETURN_IF_ERROR(wait_until_read(StageBuffers::slot_of(stage)));
  float* buffer = stages_.activate(stage);
  return cuda_status(
      kCudaContext, "gradient stage buffer",
      cudaMemsetAsync(buffer, 0, sz(plan_->stage_size(stage)) * sizeof(float), compute_));
}

float* CudaDataParallel::gradient_at(int64_t offset) const {
  float* at = stages_.at(offset);
  if (at == nullptr) misplaced_ = true;
  return at;
}

// ---- The step's reductions ----------------------------------------------------------------------

Status CudaDataParallel::reduce_ready_buckets(int64_t stage, const float* grads) {
  const std::vector<Bucket>& buckets = plan_->buckets;
  if (shard_gradients_) {
    if (grads != nullptr) return invalid("reduce_ready_buckets: grads must be null with sharded gradients");
    if (stages_.buffer(stage) == nullptr) return Status::internal(cat("data parallel: stage ", stage, " has no gradient buffer"));
  }
  // With sharded gradients `grads` is this stage's buffer, which starts at the stage's first element.
  const float* source = shard_gradients_ ? stages_.buffer(stage) : grads;
  const int64_t source_first = shard_gradients_ ? plan_->stage_begin[sz(stage)] : 0;
  const bool any = next_bucket_ < buckets.size() && buckets[next_bucket_].ready_stage == stage;
  if (any) {
    FLARE_RETURN_IF_ERROR(comm_after_compute());
    for (; next_bucket_ < buckets.size() && buckets[next_bucket_].ready_stage == stage; ++next_bucket_) {
      const Bucket& b = buckets[next_bucket_];
      // bucket reduce-scatter: every other rank's slice out, this rank's slice in from each
      const std::vector<dist::Transfer> t =
          reduce_scatter_transfers(*plan_, b, rank_, source, staging_, 4, source_first);
      if (!t.empty()) FLARE_RETURN_IF_ERROR(comm_->exchange(t.data(), static_cast<int>(t.size()), stream_));
      FLARE_RETURN_IF_ERROR(sum_slices_in_rank_order(source + (b.slice_begin[sz(rank_)] - source_first), staging_,
                                                     plan_->max_slice, plan_->world, rank_, b.slice_size(rank_),
                                                     shard_grads_ + b.shard_offset[sz(rank_)], stream_,
                                                     shard_gradients_ && accumulate_));
    }
    FLARE_RETURN_IF_ERROR(end_comm_run());
  }
  if (!shard_gradients_) return Status::ok_status();
  // The stage's buffer is free once its reductions are done (or now, if the stage had none); the
  // next micro-batch zeroes the last stage's, the next stage takes the following ring slot.
  const bool last = stage == stages_.last_stage();
  FLARE_RETURN_IF_ERROR(mark_read(last ? kLastStageBuffer : StageBuffers::slot_of(stage), any ? stream_ : compute_));
  return !last && stage + 1 < stages_.last_stage() ? acquire_stage(stage + 1) : Status::ok_status();
}

Status CudaDataParallel::mark_read(int buffer, cudaStream_t stream) {
  read_[buffer].pending = true;
  return cuda_status(kCudaContext, "data-parallel event",
                     cudaEventRecord(read_[buffer].event, stream));
}

Status CudaDataParallel::wait_until_read(int buffer) {
  if (!read_[buffer].pending) return Status::ok_status();
  read_[buffer].pending = false;
  return compute_waits(read_[buffer].event);
}

Status CudaDataParallel::wait_for_reduction() {
  if (misplaced_) {
    return Status::internal("data parallel: the backward asked for the gradient of a stage that was not being written");
  }
  if (next_bucket_ != plan_->buckets.size()) {
    return Status::internal(cat("data parallel: ", plan_->buckets.size() - next_bucket_,
                                " gradient buckets were not reduced by the backward's stages"));
  }
  return compute_waits(run_end_);
}

Status CudaDataParallel::agree_norm_and_loss(double max_norm, float* norm_and_scale) {
  FLARE_RETURN_IF_ERROR(comm_after_compute());
  // (Σ g² of the shard, loss sum): two doubles per rank
  FLARE_RETURN_IF_ERROR(comm_->all_gather(sums_send_, sums_recv_, 2 * sizeof(double), stream_));
  FLARE_RETURN_IF_ERROR(cuda::norm_from_sums(sums_recv_, plan_->world, 2, max_norm, norm_and_scale, stream_));
  agree_loss_kernel<<<1, 1, 0, stream_>>>(sums_recv_, plan_->world, totals_);
  FLARE_RETURN_IF_ERROR(launch_status(kCudaContext, "agree_loss_kernel"));
  return compute_after_comm();
}

Status CudaDataParallel::all_gather_weights(__nv_bfloat16* weights) {
  // The forward of this step has waited for the last all-gather at its stage 0, so its events are
  // free; this one's begins once AdamW has written the shard.
  cudaEvent_t updated = nullptr;
  FLARE_RETURN_IF_ERROR(timer_->record(compute_, &updated));
  FLARE_RETURN_IF_ERROR(
      cuda_status(kCudaContext, "data-parallel wait", cudaStreamWaitEvent(stream_, updated, 0)));
  gather_parity_ ^= 1;
  FLARE_RETURN_IF_ERROR(cuda_status(kCudaContext, "data-parallel event",
                                    cudaEventRecord(gather_begin_[gather_parity_], stream_)));
  // Last bucket first: the lowest range of the flat buffer, the weights the forward reads first.
  for (size_t k = plan_->buckets.size(); k-- > 0;) {
    const Bucket& b = plan_->buckets[k];
    const int64_t mine = b.slice_size(rank_);
    if (mine > 0) {
      FLARE_RETURN_IF_ERROR(cuda_status(
          kCudaContext, "own weights",
          cudaMemcpyAsync(weights + b.slice_begin[sz(rank_)],
                          shard_weights_ + b.shard_offset[sz(rank_)],
                          sz(mine) * sizeof(__nv_bfloat16), cudaMemcpyDeviceToDevice, stream_)));
    }
    // bucket all-gather: this rank's updated slice to every other rank, theirs into place
    const std::vector<dist::Transfer> t = all_gather_transfers(*plan_, b, rank_, shard_weights_, weights, 2);
    if (!t.empty()) FLARE_RETURN_IF_ERROR(comm_->exchange(t.data(), static_cast<int>(t.size()), stream_));
    FLARE_RETURN_IF_ERROR(
        cuda_status(kCudaContext, "data-parallel event", cudaEventRecord(gathered_[k], stream_)));
  }
  FLARE_RETURN_IF_ERROR(cuda_status(kCudaContext, "data-parallel event",
                                    cudaEventRecord(gather_end_[gather_parity_], stream_)));
  gather_unreported_ = true;
  gathered_waited_ = plan_->buckets.size();
  return Status::ok_status();
}

Status CudaDataParallel::gather_to_rank0(const void* shard, int64_t elem_bytes, void* full) {
  FLARE_RETURN_IF_ERROR(cuda_status(kCudaContext, "device", cudaStreamSynchronize(compute_)));
  const CopyToHost copy = [this](void* dst, const void* src, int64_t bytes) {
    FLARE_RETURN_IF_ERROR(
        cuda_status(kCudaContext, "state to host",
                    cudaMemcpyAsync(dst, src, sz(bytes), cudaMemcpyDeviceToHost, stream_)));
    return cuda_status(kCudaContext, "state to host", cudaStreamSynchronize(stream_));
  };
  return gather_shards_to_rank0(*comm_, *plan_, shard, staging_, elem_bytes, full, copy, stream_);
}

}  // namespace flare::train::dp
