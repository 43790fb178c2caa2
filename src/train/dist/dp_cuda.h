// dp_cuda.h — the collectives of a data-parallel step on CUDA devices (backend.h describes the
// step): what the ranks agree on, the gradient buckets' reduce-scatter overlapped with the
// backward, and the all-gather of the updated weights, over an NCCL communicator.
//
// Two streams. The compute stream (the model's) runs forward, backward and the optimizer; a
// communication stream of this object's own runs every collective, in the one order every rank
// issues them. The streams meet only through events, never a host wait:
//   - agree_valid_count(): the step's count of valid targets goes up from pinned memory on the
//     communication stream, is all-gathered, and a kernel adds the counts in rank order into the
//     step's total and dloss_scale = fp32(1 / total) (the bits the host computes for one device);
//     the compute stream waits for it at the forward's stage 0 (wait_for_forward_stage), before
//     the classifier reads the factor;
//   - reduce_ready_buckets(stage) runs from the last micro-batch's backward hook
//     (gpu_model.h): an event on the compute stream after `stage`, the communication stream waits
//     on it and reduce-scatters every bucket whose ready_stage is `stage` (dp_plan.h): the
//     transfers of reduce_scatter_transfers() in one exchange, then a kernel that adds this rank's
//     slice and the received copies in rank order into the shard gradient — the same bits on every
//     rank whatever the arrival order. The staging buffer is reused bucket after bucket, which the
//     stream order makes safe;
//   - wait_for_reduction(): the compute stream waits for the last bucket (exposed time);
//   - agree_norm_and_loss(): each rank's (Σ g² of its shard, its loss sum) all-gathered, the norm,
//     clip scale and the global loss sum computed from them in rank order on every rank;
//   - all_gather_weights(): the bf16 weights AdamW wrote for the shard go to every rank's model
//     weights, bucket by bucket in the order the next forward reads them (the embeddings first),
//     an event after each. The step ends without waiting for them: the next step's forward waits
//     stage by stage (wait_for_forward_stage, from GpuModel's forward hook) for the buckets that
//     hold the weights it is about to read, so the all-gather runs under the forward. Anything
//     else that reads the weights between steps waits for all of them first (wait_for_weights).
// Sharded gradients (ZeRO-2, create()'s shard_gradients; the plan's buckets then lie in one
// stage each): the model holds no whole gradient (GpuModelOptions::whole_gradient false) and this
// object is its GradientPlacement. The last stage (the embeddings, which a tied head writes into
// at stage 0) has a buffer of its own for the whole backward; every other stage s writes into ring
// buffer s mod kGradientRing, which the compute stream zeroes once the reduce-scatter of the stage
// that used it before has finished (a wait, counted as exposed, only if that one lags). Every
// micro-batch's backward then reduces its buckets (begin_backward() first, which also waits for
// the last micro-batch's reduction of the last stage before zeroing its buffer), the first into the
// shard gradient and the others adding to it: with accumulation, the reduce-scatter's bytes grow
// by the number of micro-batches, the price of never holding the whole gradient.
// Every collective's time is recorded on an EventTimer (kComm for each run of collectives between
// waits, kCommExposed for each wait of the compute stream); the all-gather's run is counted in the
// step whose forward waits for it. The NCCL communicator bounds every operation by its timeout, so
// a dead peer fails a step instead of hanging it (the all-gather's failure surfaces one step
// later, where its weights are read).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "flare/dist.h"
#include "flare/status.h"
#include "train/cuda/event_timer.h"
#include "train/dist/dp_plan.h"
#include "train/dist/stage_buffers.h"
#include "train/model/gpu_model.h"

namespace flare::train::dp {

// What the ranks agree on per step, in device memory.
struct DeviceTotals {
  double loss_sum = 0.0;  // Σ every rank's per-token losses (ranks added in rank order)
  int64_t valid = 0;      // Σ every rank's valid targets
};

class CudaDataParallel final : public cuda::GradientPlacement {
 public:
  // comm: `plan.world` ranks (> 1), its device the current one; compute: the model's stream;
  // timer: where the collectives' spans go (outlives this object). Allocates the shard's reduced
  // gradient and bf16 weights, the staging of one bucket and the agreement buffers, and with
  // shard_gradients (which needs plan.stage_buckets) the stage buffers.
  static Status create(dist::Communicator* comm, const DpPlan& plan, cudaStream_t compute,
                       cuda::EventTimer* timer, std::unique_ptr<CudaDataParallel>* out,
                       bool shard_gradients = false);
  ~CudaDataParallel() override;
  CudaDataParallel(const CudaDataParallel&) = delete;
  CudaDataParallel& operator=(const CudaDataParallel&) = delete;

  // Device bytes create() allocates for this plan and rank.
  static int64_t buffer_bytes(const DpPlan& plan, int rank, bool shard_gradients = false);

  // Sharded gradients: before each micro-batch's backward (the first of a step with accumulate
  // false). Zeroes the last stage's buffer and stage 0's.
  Status begin_backward(bool accumulate);
  // cuda::GradientPlacement: the address of flat gradient element `offset` in its stage's buffer
  // (null, and an error at wait_for_reduction(), for a stage that is not being written).
  float* gradient_at(int64_t offset) const override;

  int rank() const { return rank_; }
  float* shard_grads() const { return shard_grads_; }          // (shard) fp32, the reduced gradient
  __nv_bfloat16* shard_weights() const { return shard_weights_; }  // (shard) bf16, AdamW's output
  const float* dloss_scale() const { return dloss_scale_; }    // (1) fp32: 1 / the step's count
  // This rank's two numbers for agree_norm_and_loss(): [0] Σ g² of the shard gradient, [1] the
  // loss sum of its micro-batches (the model adds into it; zero it at the step's start).
  double* rank_sums() const { return sums_send_; }
  const DeviceTotals* totals() const { return totals_; }
  // Bytes this rank sends in one step's collectives (of micro_batches micro-batches).
  int64_t bytes_per_step(int64_t micro_batches) const {
    return other_bytes_ + reduce_bytes_ * (shard_gradients_ ? micro_batches : 1);
  }

  // The step's protocol, in this order (each enqueues and returns).
  Status agree_valid_count(int64_t local_valid);
  // grads: the model's whole gradient (null with sharded gradients: the stage buffers).
  Status reduce_ready_buckets(int64_t stage, const float* grads);
  Status wait_for_reduction();
  Status agree_norm_and_loss(double max_norm, float* norm_and_scale);
  Status all_gather_weights(__nv_bfloat16* weights);
  // The compute stream waits for the weights of backward stage `stage` and every later one
  // (dp_plan.h's numbering; the forward reads them in decreasing order) that the last
  // all_gather_weights() is still bringing, and at stage 0 also for agree_valid_count().
  Status wait_for_forward_stage(int64_t stage);
  // The compute stream waits for every weight of the last all_gather_weights().
  Status wait_for_weights() { return wait_for_gathered(0); }

  // Rank 0 receives every rank's shard of one state tensor (elements of elem_bytes) into `full`
  // (host, plan.total elements); the others send. Host-blocking, collective (checkpoints).
  Status gather_to_rank0(const void* shard, int64_t elem_bytes, void* full);
  // Waits for the communication stream (setup and checkpoints only).
  Status synchronize();
  // OK, or the communicator's failure (a collective that timed out or failed after it was
  // enqueued surfaces here once the step's end has been waited for).
  Status health() { return comm_->health(); }

 private:
  CudaDataParallel() = default;
  Status create_events();
  // The communication stream waits for the compute stream's work so far; a run of collectives
  // begins.
  Status comm_after_compute();
  // The run of collectives ends; the compute stream waits for it (counted as exposed).
  Status compute_after_comm();
  // The run of collectives ends without the compute stream waiting (yet).
  Status end_comm_run();
  // The compute stream waits on `event` of the communication stream (counted as exposed).
  Status compute_waits(cudaEvent_t event);
  // The compute stream waits for the all-gather of buckets[first_bucket] and every bucket after it
  // in the list (the ones the forward reads before it), unless it already has.
  Status wait_for_gathered(size_t first_bucket);
  // Sharded gradients: stage `stage` (not the last) gets its ring buffer, zeroed on the compute
  // stream once the stage that used it before has been reduced.
  Status acquire_stage(int64_t stage);
  // The buffer's last reader is done on the communication stream (or, on `stream`, now).
  Status mark_read(int buffer, cudaStream_t stream);
  // The compute stream waits for the buffer's last reader, if it has not yet.
  Status wait_until_read(int buffer);

  dist::Communicator* comm_ = nullptr;
  const DpPlan* plan_ = nullptr;
  int rank_ = 0;
  cudaStream_t compute_ = nullptr;
  cudaStream_t stream_ = nullptr;  // communication
  cuda::EventTimer* timer_ = nullptr;
  cudaEvent_t run_begin_ = nullptr, run_end_ = nullptr;  // the current run of collectives
  size_t next_bucket_ = 0;  // reduce_ready_buckets: the first bucket not yet reduced this step
  // The weights' all-gather: an event after each bucket's (indexed as plan.buckets); the compute
  // stream has waited for buckets [gathered_waited_, size), so 0 when none is in flight.
  std::vector<cudaEvent_t> gathered_;
  size_t gathered_waited_ = 0;
  // Its run's begin and end, two pairs used in turn: a run is counted in the next step, whose
  // events the EventTimer pool reuses; gather_unreported_: a run not counted yet.
  cudaEvent_t gather_begin_[2] = {}, gather_end_[2] = {};
  int gather_parity_ = 0;
  bool gather_unreported_ = false;
  cudaEvent_t count_ready_ = nullptr;  // agree_valid_count()'s end
  bool count_waited_ = true;

  void* buffers_ = nullptr;
  float* shard_grads_ = nullptr;
  __nv_bfloat16* shard_weights_ = nullptr;
  float* staging_ = nullptr;        // (world − 1) · max_slice fp32
  int64_t* counts_send_ = nullptr;  // (1)
  int64_t* counts_recv_ = nullptr;  // (world)
  double* sums_send_ = nullptr;     // (2)
  double* sums_recv_ = nullptr;     // (2 · world)
  float* dloss_scale_ = nullptr;
  DeviceTotals* totals_ = nullptr;
  int64_t* host_count_ = nullptr;   // pinned
  int64_t reduce_bytes_ = 0, other_bytes_ = 0;  // per step: the reduce-scatter's, the rest

  // Sharded gradients.
  bool shard_gradients_ = false;
  bool accumulate_ = false;           // this micro-batch adds to the shard gradient
  StageBuffers stages_;                         // which buffer holds which stage
  // Per buffer (the ring's slots, then the last stage's): an event after the reduce-scatter that
  // reads it, and whether the compute stream has yet to wait for it before zeroing the buffer.
  struct BufferRead {
    cudaEvent_t event = nullptr;
    bool pending = false;
  };
  static constexpr int kLastStageBuffer = kGradientRing;
  BufferRead read_[kGradientRing + 1];
  mutable bool misplaced_ = false;    // gradient_at() was asked for a stage not being written
};

// out[i] = Σ over ranks q in rank order of (q == rank ? own[i] : staging[slot(q) · stride + i]),
// for i < n (dp_plan.h's staging slots). Exposed for tests.
// With accumulate, out[i] += that sum instead.
Status sum_slices_in_rank_order(const float* own, const float* staging, int64_t stride, int world,
                                int rank, int64_t n, float* out, cudaStream_t stream,
                                bool accumulate = false);

}  // namespace flare::train::dp
