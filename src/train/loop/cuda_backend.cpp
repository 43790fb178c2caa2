// cuda_backend.cpp — the training step on one CUDA device: the GPU model (model/gpu_model.h) for
// forward and backward, cuda/adamw.h for the gradient norm, the clip and AdamW over fp32 master
// weights, m and v, which live here, beside the model's bf16 weights and fp32 gradients. The
// master is held as its two 16-bit halves (core/split_master.h): the bf16 weights themselves (the
// model's, or the shard's update under data parallelism) and the low halves kept here.
//
// A step is enqueued on one stream with no host wait: the micro-batches' tokens go up from pinned
// memory, the losses are summed on the device, the clip factor is read by the optimizer from
// device memory, and the step ends with one small copy of (loss sum, valid count, norm, clip)
// back to pinned memory and an event; step_end() waits on that event only, then reads the step's
// CUDA events for its profile (StepTiming).
//
// Data parallel (backend.h; NCCL communicator of several ranks): ZeRO-1, so the master's low
// halves, m and v hold this rank's shard only (dp_plan.h) and the collectives run on a second stream
// (train/dist/dp_cuda.h). The step, in order:
//   1. the ranks agree on the step's valid-target count (device all-gather), which the first
//      forward's classifier reads (1 / count) from device memory;
//   2. micro-batches forward and backward with no communication, gradients accumulating locally;
//   3. during the last backward, each bucket is reduce-scattered into the shard gradient as soon
//      as the backward has passed its stage (GpuModel's stage hook records the event);
//   4. the shard's Σ g² and the loss sum are agreed (rank order), the norm and clip follow, AdamW
//      updates the shard and writes its bf16 weights, which are all-gathered into every rank's
//      model weights under the next step's forward: it waits stage by stage for the buckets it is
//      about to read (GpuModel's forward hook); evaluation waits for all of them first.
// ZeRO-2 (TrainConfig::shard_gradients): the model holds no whole gradient; the data-parallel
// object places each backward stage's gradients in a ring of stage buffers, and every
// micro-batch's backward reduce-scatters its buckets into the shard gradient (steps 2 and 3 merge).
// With one rank (no communicator, or one of size 1) the step is the single-device step.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/message.h"
#include "core/numeric.h"
#include "train/core/host_array.h"
#include "train/core/split_master.h"
#include "train/cuda/adamw.h"
#include "train/cuda/event_timer.h"
#include "train/cuda/matmul.h"
#include "train/dist/cp_rows.h"
#include "train/dist/dp_cuda.h"
#include "train/dist/dp_plan.h"
#include "train/loop/backend.h"
#include "train/model/gpu_model.h"

namespace flare::train {
namespace {

using cuda::bf16;
using cuda::cuda_status;
using cuda::EventTimer;
using cuda::kCudaContext;

size_t sz(int64_t n) { return static_cast<size_t>(n); }

// What the host reads back per step (pinned): the step's loss sum and valid count (every rank's
// under data parallelism), the gradient norm and clip scale.
struct StepReadback {
  dp::DeviceTotals totals;
  float norm_and_scale[2];
};

std::string gib(int64_t bytes) { return cat(static_cast<double>(bytes) / double(1 << 30), " GiB"); }

class CudaBackend final : public Backend {
 public:
  ~CudaBackend() override {
    if (stream_) cudaStreamSynchronize(stream_);
    dp_.reset();
    cudaFree(state_);
    cudaFreeHost(host_);
    if (done_) cudaEventDestroy(done_);
    model_.reset();
    if (stream_) cudaStreamDestroy(stream_);
  }

  Status init(const ModelConfig& config, const TrainConfig& train, const BackendOptions& options) {
    batch_ = train.batch;
    seq_ = train.seq;
    max_micro_batches_ = train.grad_accum;
    layout_ = parameter_layout(config);
    int devices = 0;
    const cudaError_t found = cudaGetDeviceCount(&devices);
    if (found != cudaSuccess || devices == 0) {
      return Status::unsupported(cat("device: no usable CUDA device (", cudaGetErrorString(found),
                                     "); use --device cpu"));
    }
    if (options.device_index >= devices) {
      return invalid("device_index: ", options.device_index, " must be below the ", devices,
                     " CUDA devices present");
    }
    dist::Communicator* comm = options.comm;
    const int world = comm ? comm->size() : 1;
    if (comm && world > 1) {
      if (comm->device() != DeviceType::kCUDA) {
        return invalid("comm: the CUDA backend needs a communicator over CUDA memory (NCCL), got ", comm->kind());
      }
      if (comm->device_index() != options.device_index) {
        return invalid("device_index: ", options.device_index, " is not the communicator's device ",
                       comm->device_index());
      }
    }
    int cp = 1;
    FLARE_RETURN_IF_ERROR(context_parallel_ranks(options, &cp));
    if (cp > 1) {
      if (options.cp_comm == comm || options.cp_comm->device() != DeviceType::kCUDA ||
          options.cp_comm->device_index() != options.device_index) {
        return invalid("cp_comm: the CUDA backend needs an NCCL communicator of its own on device ",
                       options.device_index, " (not comm: the two run on different streams at once)");
      }
    }
    if (train.bf16_grads && (world > 1 || cp > 1)) {
      return invalid("bf16_grads: one rank only (data and context parallelism sum fp32 gradients), got ",
                     world, " data-parallel and ", cp, " context-parallel ranks");
    }
    rank_ = comm ? comm->rank() : 0;
    // ZeRO-2 where there are ranks to shard over; its buckets lie in one backward stage each.
    shard_gradients_ = train.shard_gradients && world > 1;
    FLARE_RETURN_IF_ERROR(dp::make_dp_plan(layout_, config.n_layer, world, options.bucket_bytes, &plan_,
                                           shard_gradients_));
    shard_layout_ = dp::shard_layout(layout_, plan_, rank_);
    FLARE_RETURN_IF_ERROR(
        cuda_status(kCudaContext, "cudaSetDevice", cudaSetDevice(options.device_index)));
    cudaDeviceProp prop{};
    FLARE_RETURN_IF_ERROR(cuda_status(kCudaContext, "device properties",
                                      cudaGetDeviceProperties(&prop, options.device_index)));
    name_ = prop.name;
    device_index_ = options.device_index;

    // Will it fit? The configuration's estimate (the floor any implementation needs) and this
    // implementation's own buffers, against the free memory, before allocating anything.
    size_t free_bytes = 0, total_bytes = 0;
    FLARE_RETURN_IF_ERROR(
        cuda_status(kCudaContext, "cudaMemGetInfo", cudaMemGetInfo(&free_bytes, &total_bytes)));
    const int64_t free_now = static_cast<int64_t>(free_bytes);
    // A context-parallel rank holds seq / cp rows of each sequence: memory as for that length
    // (attention's plan adds a few blocks of K/V in flight).
    TrainConfig rows = train;
    rows.seq = train.seq / cp;
    FLARE_RETURN_IF_ERROR(check_fits(estimate_training_memory(rows, config, world), free_now));
    const int64_t tokens = train.grad_accum * train.batch * rows.seq;
    const int64_t shard = plan_.shard_size(rank_);
    // The master's low halves (2 bytes), m and v (4 each), the step's tokens and targets.
    const int64_t state_bytes = 10 * shard + 2 * tokens * int64_t{sizeof(int32_t)} + 256;
    const int64_t dp_bytes = world > 1 ? dp::CudaDataParallel::buffer_bytes(plan_, rank_, shard_gradients_) : 0;
    const int64_t need = cuda::GpuModel::buffer_bytes(config, train.batch, rows.seq, train.recompute,
                                                      !shard_gradients_, train.bf16_grads) +
                         state_bytes + dp_bytes + cuda::MatmulContext::kWorkspaceBytes;
    if (need > free_now) {
      return Status::out_of_memory(cat("the run needs ", gib(need), " on ", name_, " (model buffers ",
                                       gib(need - state_bytes - dp_bytes), ", optimizer state ", gib(state_bytes),
                                       world > 1 ? cat(" of a 1/", world, " shard, data-parallel buffers ", gib(dp_bytes)) : "",
                                       "), ", gib(free_now), " are free; try --recompute, a smaller "
                                       "--batch with --grad-accum, or a shorter --seq"));
    }

    FLARE_RETURN_IF_ERROR(cuda_status(kCudaContext, "stream",
                                      cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)));
    FLARE_RETURN_IF_ERROR(cuda_status(kCudaContext, "event",
                                      cudaEventCreateWithFlags(&done_, cudaEventDisableTiming)));
    cuda::GpuModelOptions mo;
    mo.recompute = train.recompute;
    mo.bf16_grads = train.bf16_grads;
    mo.deterministic_attention = options.deterministic_attention;
    mo.device_index = options.device_index;
    mo.cp = cp > 1 ? options.cp_comm : nullptr;
    mo.whole_gradient = !shard_gradients_;
    FLARE_RETURN_IF_ERROR(cuda::GpuModel::create(config, train.batch, train.seq, mo, stream_, &model_));
    // The optimizer's chunks walk the shard (for one rank: the whole buffer, the same chunks).
    FLARE_RETURN_IF_ERROR(table_.init(shard_layout_));
    if (world > 1) {
      FLARE_RETURN_IF_ERROR(dp::CudaDataParallel::create(comm, plan_, stream_, &timer_, &dp_, shard_gradients_));
      if (shard_gradients_) model_->set_gradient_placement(dp_.get());
    }

    // The master's low halves (16-bit), m, v (fp32), the shard each; the step's tokens and
    // targets; the loss sum and the norm pair; the norm's scratch. One allocation, 256-byte
    // aligned pieces.
    const int64_t norm_scratch = cuda::gradient_norm_scratch_bytes(table_);
    auto piece = [](int64_t bytes) { return (bytes + 255) / 256 * 256; };
    const int64_t bytes = piece(shard * 2) + 2 * piece(shard * 4) + 2 * piece(tokens * 4) + piece(8) + piece(8) +
                          piece(norm_scratch);
    char* p = nullptr;
    FLARE_RETURN_IF_ERROR(
        cuda_status(kCudaContext, "optimizer state",
                    cudaMalloc(reinterpret_cast<void**>(&p), static_cast<size_t>(bytes))));
    state_ = p;
    low_ = reinterpret_cast<uint16_t*>(p);          p += piece(shard * 2);
    m_ = reinterpret_cast<float*>(p);               p += piece(shard * 4);
    v_ = reinterpret_cast<float*>(p);               p += piece(shard * 4);
    tokens_ = reinterpret_cast<int32_t*>(p);        p += piece(tokens * 4);
    targets_ = reinterpret_cast<int32_t*>(p);       p += piece(tokens * 4);
    loss_sum_ = reinterpret_cast<double*>(p);       p += piece(8);
    norm_and_scale_ = reinterpret_cast<float*>(p);  p += piece(8);
    norm_scratch_ = p;

    // Pinned staging: the step's tokens and targets, and the readback.
    const size_t host_bytes = sizeof(StepReadback) + static_cast<size_t>(2 * tokens) * sizeof(int32_t);
    FLARE_RETURN_IF_ERROR(
        cuda_status(kCudaContext, "pinned staging", cudaMallocHost(&host_, host_bytes)));
    readback_ = static_cast<StepReadback*>(host_);
    host_tokens_ = reinterpret_cast<int32_t*>(readback_ + 1);
    host_targets_ = host_tokens_ + tokens;
    return cuda_status(kCudaContext, "setup", cudaStreamSynchronize(stream_));
  }

  DeviceKind kind() const override { return DeviceKind::kCuda; }
  std::string device_name() const override { return name_; }

  Status set_state(const float* master, const float* m, const float* v) override {
    if (!master) return invalid("set_state: master must not be null");
    FLARE_RETURN_IF_ERROR(wait_idle());
    // The master's halves: the bf16 weights (the master rounded to nearest even) and the low halves.
    const int64_t n = layout_.total;
    HostArray<uint16_t> weights(n), low(n);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const SplitMaster h = split_master(master[i]);
      weights.data()[i] = h.weight;
      low.data()[i] = h.low;
    }
    // This rank's shard of each state tensor (the whole buffer for one rank); under data
    // parallelism also the shard's bf16 weights, which AdamW reads as the master's top half.
    FLARE_RETURN_IF_ERROR(upload_shard(low.data(), low_, sizeof(uint16_t)));
    FLARE_RETURN_IF_ERROR(upload_shard(m, m_, sizeof(float)));
    FLARE_RETURN_IF_ERROR(upload_shard(v, v_, sizeof(float)));
    if (dp_) FLARE_RETURN_IF_ERROR(upload_shard(weights.data(), dp_->shard_weights(), sizeof(uint16_t)));
    // The bf16 weights the model reads, all of them on every rank.
    return cuda_status(kCudaContext, "set_state weights",
                       cudaMemcpy(model_->weights(), weights.data(),
                                  static_cast<size_t>(n) * sizeof(bf16), cudaMemcpyHostToDevice));
  }

  Status get_state(float* master, float* m, float* v) override {
    FLARE_RETURN_IF_ERROR(wait_idle());
    const int64_t n = layout_.total;
    // The master's halves, joined on the host (rank 0 gathers them whether or not it is asked for
    // the master: the gather is collective).
    HostArray<uint16_t> weights((dp_ ? rank_ == 0 : master != nullptr) ? n : 0), low(weights.size());
    if (dp_) {
      // Collective: every rank takes part for each tensor; rank 0 gathers into a scratch buffer
      // for a null one.
      std::vector<float> unused;
      for (auto [shard, full] : {std::pair{m_, m}, {v_, v}}) {
        if (!full && rank_ == 0) {
          unused.resize(sz(plan_.total));
          full = unused.data();
        }
        FLARE_RETURN_IF_ERROR(dp_->gather_to_rank0(shard, sizeof(float), full));
      }
      FLARE_RETURN_IF_ERROR(dp_->gather_to_rank0(dp_->shard_weights(), sizeof(uint16_t), weights.data()));
      FLARE_RETURN_IF_ERROR(dp_->gather_to_rank0(low_, sizeof(uint16_t), low.data()));
      if (rank_ == 0 && master) join_halves(weights.data(), low.data(), master, n);
      return Status::ok_status();
    }
    const size_t bytes = static_cast<size_t>(n) * sizeof(float);
    if (master) {
      const size_t half_bytes = static_cast<size_t>(n) * sizeof(uint16_t);
      FLARE_RETURN_IF_ERROR(cuda_status(kCudaContext, "get_state",
                                        cudaMemcpy(weights.data(), model_->weights(), half_bytes,
                                                   cudaMemcpyDeviceToHost)));
      FLARE_RETURN_IF_ERROR(cuda_status(
          kCudaContext, "get_state", cudaMemcpy(low.data(), low_, half_bytes, cudaMemcpyDeviceToHost)));
      join_halves(weights.data(), low.data(), master, n);
    }
    if (m)
      FLARE_RETURN_IF_ERROR(
          cuda_status(kCudaContext, "get_state", cudaMemcpy(m, m_, bytes, cudaMemcpyDeviceToHost)));
    if (v)
      FLARE_RETURN_IF_ERROR(
          cuda_status(kCudaContext, "get_state", cudaMemcpy(v, v_, bytes, cudaMemcpyDeviceToHost)));
    return Status::ok_status();
  }

  Status step_begin(std::span<const int32_t> inputs, std::span<const int32_t> targets,
                    int64_t micro_batches, const AdamWStep& step, double grad_clip) override {
    if (pending_) return invalid("step_begin: the previous step was not ended (step_end first)");
    FLARE_RETURN_IF_ERROR(stage(inputs, targets, micro_batches, &valid_));
    micro_batches_ = micro_batches;
    const int64_t tokens = batch_ * model_->seq();
    timer_.reset();

    // The gradient of the mean over the whole step's valid targets: this rank's count alone, or
    // every rank's, agreed on the device (the classifier then reads the factor from there).
    float dloss_scale = valid_ > 0 ? static_cast<float>(1.0 / static_cast<double>(valid_)) : 0.0f;
    const float* dloss_scale_device = nullptr;
    double* loss_sum = loss_sum_;
    if (dp_) {
      FLARE_RETURN_IF_ERROR(dp_->agree_valid_count(valid_));
      dloss_scale = 1.0f;
      dloss_scale_device = dp_->dloss_scale();
      loss_sum = dp_->rank_sums() + 1;
    }

    FLARE_RETURN_IF_ERROR(
        cuda_status(kCudaContext, "loss", cudaMemsetAsync(loss_sum, 0, sizeof(double), stream_)));
    // The first forward waits for the weights the last step's all-gather brings, stage by stage.
    cuda::GpuModel::StageHook gathered;
    if (dp_) gathered = [this](int64_t stage) { return dp_->wait_for_forward_stage(stage); };
    for (int64_t i = 0; i < micro_batches; ++i) {
      // The last backward hands each finished stage's buckets to the communication stream (every
      // backward, with sharded gradients: no rank keeps them past their reduction).
      cuda::GpuModel::StageHook reduce;
      if (dp_ && (shard_gradients_ || i + 1 == micro_batches)) {
        reduce = [this](int64_t stage) { return dp_->reduce_ready_buckets(stage, model_->grads()); };
      }
      cudaEvent_t fwd_begin = nullptr, bwd_begin = nullptr, bwd_end = nullptr;
      FLARE_RETURN_IF_ERROR(timer_.record(stream_, &fwd_begin));
      FLARE_RETURN_IF_ERROR(model_->forward(tokens_ + i * tokens, targets_ + i * tokens, dloss_scale, true,
                                            loss_sum, dloss_scale_device, gathered));
      FLARE_RETURN_IF_ERROR(timer_.record(stream_, &bwd_begin));
      if (shard_gradients_) FLARE_RETURN_IF_ERROR(dp_->begin_backward(i > 0));
      // The first micro-batch writes the whole gradient, later ones add to it; sharded gradients
      // are added into the stage buffers the data-parallel plan zeroes.
      const bool accumulate = shard_gradients_ || i > 0;
      FLARE_RETURN_IF_ERROR(model_->backward(tokens_ + i * tokens, accumulate, reduce));
      FLARE_RETURN_IF_ERROR(timer_.record(stream_, &bwd_end));
      timer_.span(EventTimer::kForward, fwd_begin, bwd_begin);
      timer_.span(EventTimer::kBackward, bwd_begin, bwd_end);
    }
    FLARE_RETURN_IF_ERROR(dp_ ? sharded_update(step, grad_clip) : update(step, grad_clip));
    FLARE_RETURN_IF_ERROR(
        cuda_status(kCudaContext, "norm readback",
                    cudaMemcpyAsync(readback_->norm_and_scale, norm_and_scale_, 2 * sizeof(float),
                                    cudaMemcpyDeviceToHost, stream_)));
    FLARE_RETURN_IF_ERROR(cuda_status(kCudaContext, "step event", cudaEventRecord(done_, stream_)));
    pending_ = true;
    return Status::ok_status();
  }

  Status step_end(StepResult* result) override {
    if (!pending_) return invalid("step_end: no step was begun");
    pending_ = false;
    FLARE_RETURN_IF_ERROR(cuda_status(kCudaContext, "training step", cudaEventSynchronize(done_)));
    if (dp_) FLARE_RETURN_IF_ERROR(dp_->health());
    const dp::DeviceTotals& totals = readback_->totals;
    result->loss = totals.valid > 0 ? totals.loss_sum / static_cast<double>(totals.valid) : 0.0;
    result->grad_norm = readback_->norm_and_scale[0];
    result->updated = true;  // a non-finite norm reaches the weights on the GPU; the trainer stops
    EventTimer::Totals ms;
    FLARE_RETURN_IF_ERROR(timer_.read(&ms));
    StepTiming& t = result->timing;
    t.measured = true;
    t.fwd_ms = ms[EventTimer::kForward];
    t.bwd_ms = ms[EventTimer::kBackward];
    t.comm_ms = ms[EventTimer::kComm];
    t.comm_exposed_ms = ms[EventTimer::kCommExposed];
    t.optimizer_ms = ms[EventTimer::kOptimizer];
    t.comm_bytes = dp_ ? dp_->bytes_per_step(micro_batches_) : 0;
    dist::CpTiming cp;
    FLARE_RETURN_IF_ERROR(model_->take_cp_timing(&cp));  // the step is done: no wait
    t.cp_comm_ms = cp.comm_ms;
    t.cp_comm_bytes = cp.bytes_sent;
    sample_peak_memory();
    return Status::ok_status();
  }

  Status evaluate(std::span<const int32_t> inputs, std::span<const int32_t> targets,
                  double* loss_sum, int64_t* valid) override {
    if (pending_) return invalid("evaluate: a step is in flight (step_end first)");
    int64_t staged_valid = 0;
    FLARE_RETURN_IF_ERROR(stage(inputs, targets, 1, &staged_valid));
    if (dp_) FLARE_RETURN_IF_ERROR(dp_->wait_for_weights());
    FLARE_RETURN_IF_ERROR(
        cuda_status(kCudaContext, "loss", cudaMemsetAsync(loss_sum_, 0, sizeof(double), stream_)));
    FLARE_RETURN_IF_ERROR(model_->forward(tokens_, targets_, 0.0f, false, loss_sum_));
    FLARE_RETURN_IF_ERROR(
        cuda_status(kCudaContext, "loss readback",
                    cudaMemcpyAsync(&readback_->totals.loss_sum, loss_sum_, sizeof(double),
                                    cudaMemcpyDeviceToHost, stream_)));
    FLARE_RETURN_IF_ERROR(cuda_status(kCudaContext, "evaluation", cudaStreamSynchronize(stream_)));
    dist::CpTiming not_a_step;  // evaluation's exchanges are not the next step's
    FLARE_RETURN_IF_ERROR(model_->take_cp_timing(&not_a_step));
    *loss_sum = readback_->totals.loss_sum;
    *valid = staged_valid;
    return Status::ok_status();
  }

  Status step_gradients(std::span<const int32_t> inputs, std::span<const int32_t> targets,
                        double* loss, float* grads, float* logits) override {
    if (pending_) return invalid("step_gradients: a step is in flight (step_end first)");
    if (model_->seq() != seq_) {
      return invalid("step_gradients: one rank's whole step, which a context-parallel rank does not hold");
    }
    int64_t valid = 0;
    FLARE_RETURN_IF_ERROR(stage(inputs, targets, 1, &valid));
    const ModelConfig& c = model_->config();
    if (dp_) FLARE_RETURN_IF_ERROR(dp_->wait_for_weights());
    if (logits) {
      FLARE_RETURN_IF_ERROR(model_->forward(tokens_, nullptr, 0.0f, false, nullptr));
      std::vector<uint16_t> bits(static_cast<size_t>(batch_ * seq_ * c.padded_vocab));
      FLARE_RETURN_IF_ERROR(
          cuda_status(kCudaContext, "logits",
                      cudaMemcpyAsync(bits.data(), model_->logits(), bits.size() * sizeof(bf16),
                                      cudaMemcpyDeviceToHost, stream_)));
      FLARE_RETURN_IF_ERROR(cuda_status(kCudaContext, "logits", cudaStreamSynchronize(stream_)));
      for (size_t i = 0; i < bits.size(); ++i) logits[i] = bf16_to_float(bits[i]);
    }
    const float dloss_scale = valid > 0 ? static_cast<float>(1.0 / static_cast<double>(valid)) : 0.0f;
    FLARE_RETURN_IF_ERROR(
        cuda_status(kCudaContext, "loss", cudaMemsetAsync(loss_sum_, 0, sizeof(double), stream_)));
    FLARE_RETURN_IF_ERROR(model_->forward(tokens_, targets_, dloss_scale, true, loss_sum_));
    FLARE_RETURN_IF_ERROR(model_->backward(tokens_, /*accumulate=*/false));
    FLARE_RETURN_IF_ERROR(
        cuda_status(kCudaContext, "loss readback",
                    cudaMemcpyAsync(&readback_->totals.loss_sum, loss_sum_, sizeof(double),
                                    cudaMemcpyDeviceToHost, stream_)));
    const cuda::GradientOut g = model_->gradient();
    const int64_t n = layout_.total;
    HostArray<uint16_t> bits(g.is_bf16() ? n : 0);  // bf16 gradients come up as bits, widened here
    FLARE_RETURN_IF_ERROR(cuda_status(
        kCudaContext, "gradients",
        cudaMemcpyAsync(g.is_bf16() ? static_cast<void*>(bits.data()) : grads, g.data(),
                        static_cast<size_t>(n * g.element_bytes()), cudaMemcpyDeviceToHost, stream_)));
    FLARE_RETURN_IF_ERROR(
        cuda_status(kCudaContext, "step_gradients", cudaStreamSynchronize(stream_)));
    for (int64_t i = 0; i < bits.size(); ++i) grads[i] = bf16_to_float(bits.data()[i]);
    *loss = valid > 0 ? readback_->totals.loss_sum / static_cast<double>(valid) : 0.0;
    return Status::ok_status();
  }

  int64_t memory_bytes() const override {
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) return 0;
    return static_cast<int64_t>(total_bytes - free_bytes);
  }

  int64_t peak_memory_bytes() override {
    sample_peak_memory();
    return peak_memory_;
  }

 private:
  // One device: the norm of the whole gradient, the clip, AdamW writing the model's bf16 weights;
  // the loss sum and this rank's count go to the readback.
  Status update(const AdamWStep& step, double grad_clip) {
    cudaEvent_t begin = nullptr, end = nullptr;
    FLARE_RETURN_IF_ERROR(timer_.record(stream_, &begin));
    FLARE_RETURN_IF_ERROR(cuda::gradient_norm(table_, model_->gradient(), grad_clip, norm_and_scale_,
                                              norm_scratch_, stream_));
    FLARE_RETURN_IF_ERROR(cuda::adamw_update(table_, step, norm_and_scale_ + 1, model_->gradient(),
                                             model_->weights(), low_, m_, v_, stream_));
    FLARE_RETURN_IF_ERROR(timer_.record(stream_, &end));
    timer_.span(EventTimer::kOptimizer, begin, end);
    readback_->totals.valid = valid_;
    return cuda_status(kCudaContext, "loss readback",
                       cudaMemcpyAsync(&readback_->totals.loss_sum, loss_sum_, sizeof(double),
                                       cudaMemcpyDeviceToHost, stream_));
  }

  // Data parallel (ZeRO-1 or 2): wait for the buckets' reduction, agree on the norm and the loss, AdamW
  // on the shard, all-gather the updated weights; the agreed totals go to the readback.
  Status sharded_update(const AdamWStep& step, double grad_clip) {
    FLARE_RETURN_IF_ERROR(dp_->wait_for_reduction());
    cudaEvent_t norm_begin = nullptr, norm_end = nullptr, adam_begin = nullptr, adam_end = nullptr;
    FLARE_RETURN_IF_ERROR(timer_.record(stream_, &norm_begin));
    FLARE_RETURN_IF_ERROR(cuda::gradient_sum_of_squares(table_, dp_->shard_grads(), dp_->rank_sums(),
                                                        norm_scratch_, stream_));
    FLARE_RETURN_IF_ERROR(timer_.record(stream_, &norm_end));
    timer_.span(EventTimer::kOptimizer, norm_begin, norm_end);
    FLARE_RETURN_IF_ERROR(dp_->agree_norm_and_loss(grad_clip, norm_and_scale_));
    FLARE_RETURN_IF_ERROR(timer_.record(stream_, &adam_begin));
    FLARE_RETURN_IF_ERROR(cuda::adamw_update(table_, step, norm_and_scale_ + 1, dp_->shard_grads(),
                                             dp_->shard_weights(), low_, m_, v_, stream_));
    FLARE_RETURN_IF_ERROR(timer_.record(stream_, &adam_end));
    timer_.span(EventTimer::kOptimizer, adam_begin, adam_end);
    FLARE_RETURN_IF_ERROR(dp_->all_gather_weights(model_->weights()));
    return cuda_status(kCudaContext, "totals readback",
                       cudaMemcpyAsync(&readback_->totals, dp_->totals(), sizeof(dp::DeviceTotals),
                                       cudaMemcpyDeviceToHost, stream_));
  }

  // The batch into pinned memory and up to the device (enqueued): this rank's rows of it under
  // context parallelism (cp_rows.h), and *valid, their count of valid targets.
  Status stage(std::span<const int32_t> inputs, std::span<const int32_t> targets,
               int64_t micro_batches, int64_t* valid) {
    const int64_t want = micro_batches * batch_ * seq_;
    if (micro_batches < 1 || micro_batches > max_micro_batches_) {
      return invalid("micro_batches: ", micro_batches, " must be in [1, grad_accum = ", max_micro_batches_, "]");
    }
    if (static_cast<int64_t>(inputs.size()) != want || static_cast<int64_t>(targets.size()) != want) {
      return invalid("inputs/targets: ", inputs.size(), "/", targets.size(), " tokens, expected ",
                     micro_batches, " x batch ", batch_, " x seq ", seq_, " = ", want);
    }
    const std::span<const int32_t> rows = dp::gather_rows(inputs, seq_, model_->positions(), &local_rows_);
    const size_t bytes = rows.size() * sizeof(int32_t);
    std::copy(rows.begin(), rows.end(), host_tokens_);
    const std::span<const int32_t> row_targets = dp::gather_rows(targets, seq_, model_->positions(), &local_rows_);
    std::copy(row_targets.begin(), row_targets.end(), host_targets_);
    *valid = std::count_if(row_targets.begin(), row_targets.end(), [](int32_t t) { return t != -1; });
    FLARE_RETURN_IF_ERROR(cuda_status(
        kCudaContext, "tokens",
        cudaMemcpyAsync(tokens_, host_tokens_, bytes, cudaMemcpyHostToDevice, stream_)));
    return cuda_status(
        kCudaContext, "targets",
        cudaMemcpyAsync(targets_, host_targets_, bytes, cudaMemcpyHostToDevice, stream_));
  }

  // A full host tensor's shard (or zeros for null) into device memory.
  Status upload_shard(const void* full, void* shard, int64_t elem_bytes) {
    const int64_t n = plan_.shard_size(rank_);
    const size_t bytes = sz(n * elem_bytes);
    if (!full) return cuda_status(kCudaContext, "set_state", cudaMemset(shard, 0, bytes));
    if (plan_.world == 1)
      return cuda_status(kCudaContext, "set_state",
                         cudaMemcpy(shard, full, bytes, cudaMemcpyHostToDevice));
    HostArray<unsigned char> host(n * elem_bytes);  // full_to_shard writes every element
    dp::full_to_shard(plan_, rank_, full, host.data(), elem_bytes);
    return cuda_status(kCudaContext, "set_state",
                       cudaMemcpy(shard, host.data(), bytes, cudaMemcpyHostToDevice));
  }

  // The fp32 master from its halves (split_master.h), on the host.
  static void join_halves(const uint16_t* weights, const uint16_t* low, float* master, int64_t n) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) master[i] = join_master(weights[i], low[i]);
  }

  Status wait_idle() {
    if (pending_) return invalid("a step is in flight (step_end first)");
    if (dp_) FLARE_RETURN_IF_ERROR(dp_->synchronize());
    return cuda_status(kCudaContext, "device", cudaStreamSynchronize(stream_));
  }

  // memory_bytes() now plus the stream-ordered allocations' high-water mark (freed memory of the
  // default pool goes back to the device at synchronisation, so memory_bytes() misses it).
  void sample_peak_memory() {
    uint64_t pool_high = 0;
    cudaMemPool_t pool = nullptr;
    if (cudaDeviceGetDefaultMemPool(&pool, device_index_) == cudaSuccess) {
      uint64_t reserved = 0;
      if (cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &pool_high) != cudaSuccess ||
          cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved) != cudaSuccess) {
        pool_high = 0;
      } else {
        pool_high = pool_high > reserved ? pool_high - reserved : 0;  // what memory_bytes() cannot see
      }
    }
    peak_memory_ = std::max(peak_memory_, memory_bytes() + static_cast<int64_t>(pool_high));
  }

  int64_t batch_ = 0, seq_ = 0, max_micro_batches_ = 1, micro_batches_ = 1;
  bool shard_gradients_ = false;  // ZeRO-2 (TrainConfig::shard_gradients with several ranks)
  ParameterLayout layout_;
  dp::DpPlan plan_;              // one rank: a single shard, the whole buffer
  ParameterLayout shard_layout_;
  int rank_ = 0;
  std::string name_;
  int device_index_ = 0;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t done_ = nullptr;
  EventTimer timer_;
  std::unique_ptr<cuda::GpuModel> model_;
  std::unique_ptr<dp::CudaDataParallel> dp_;  // several ranks only
  cuda::DeviceChunkTable table_;  // over the shard
  void* state_ = nullptr;
  uint16_t* low_ = nullptr;  // the master's low halves (split_master.h), the shard
  float *m_ = nullptr, *v_ = nullptr, *norm_and_scale_ = nullptr;
  int32_t *tokens_ = nullptr, *targets_ = nullptr;
  double* loss_sum_ = nullptr;
  void* norm_scratch_ = nullptr;
  void* host_ = nullptr;
  int32_t *host_tokens_ = nullptr, *host_targets_ = nullptr;
  StepReadback* readback_ = nullptr;
  bool pending_ = false;
  int64_t valid_ = 0;
  std::vector<int32_t> local_rows_;  // context parallel: this rank's rows of a batch (staging)
  int64_t peak_memory_ = 0;
};

}  // namespace

Status make_cuda_backend(const ModelConfig& model, const TrainConfig& train,
                         const BackendOptions& options, std::unique_ptr<Backend>* out) {
  FLARE_RETURN_IF_ERROR(validate_model_config(model));
  FLARE_RETURN_IF_ERROR(validate_train_config(train, model));
  auto backend = std::make_unique<CudaBackend>();
  FLARE_RETURN_IF_ERROR(backend->init(model, train, options));
  *out = std::move(backend);
  return Status::ok_status();
}

}  // namespace flare::train
