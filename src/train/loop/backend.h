// backend.h — where a training step runs: the CPU (fp32, the reference and CI's backend) or a
// CUDA device (bf16 weights and activations, fp32 master weights, gradients and AdamW state).
//
// The trainer (trainer.h) drives either through this one interface, so the loop — data, schedule,
// accumulation, clipping, evaluation, checkpoints — is the same code on both and is tested on the
// CPU. A backend owns the whole optimizer state (master weights, m, v) and the gradients; the
// trainer only sees them as fp32 host arrays when it checkpoints or samples.
//
// Data parallel (BackendOptions::comm): each rank runs its own micro-batches, and the step is that
// of one model over every rank's micro-batches together (docs/training.md, "Several GPUs"):
//   - the gradients stay local until the last micro-batch of the step (accumulation without
//     communication); then each bucket of the flat gradient (train/dist/dp_plan.h) is
//     reduce-scattered, every rank keeping the sum of its slices (on CUDA on a communication
//     stream, each bucket as soon as the backward has finished its layers);
//   - the loss is the mean over the valid targets of every rank's micro-batches. CUDA: the ranks
//     all-gather their counts on the device before the first forward, and the classifier scales
//     each logit gradient by 1 / (global count), so the reduction is a plain sum. CPU: each
//     micro-batch's gradient is that of its own mean, the reduction averages them, and the ranks
//     check that every micro-batch has the same count (the loader's windows always do);
//   - ZeRO-1: master weights, m and v exist only for this rank's shard; the gradient norm is the
//     square root of the ranks' shard sums of squares (gathered and added in rank order, so every
//     rank clips alike), AdamW runs on the shard, and the updated weights (bf16 on CUDA, fp32 on
//     the CPU) are all-gathered to every rank.
// With comm of size 1 the step is the single-device step, bit for bit.
//
// A step is split in two so that the host can prepare the next batch while the device computes:
// step_begin() enqueues the whole optimizer step (every micro-batch's forward and backward, the
// gradient norm, the clip and AdamW) and returns; step_end() waits for that step's loss and
// gradient norm, the only values the host reads per step. On the CPU, step_begin() does the work
// and step_end() only reports it.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "flare/dist.h"
#include "flare/status.h"
#include "train/core/adamw.h"
#include "train/core/model_config.h"
#include "train/core/train_config.h"

namespace flare::train {

enum class DeviceKind { kCpu, kCuda };

// "cpu" or "cuda", for flags and messages.
const char* device_kind_name(DeviceKind kind);

// Where a CUDA step's time went, from CUDA events read with the step's loss (no extra wait).
// Times are device time per stream, summed over the step: fwd_ms and bwd_ms over every
// micro-batch; comm_ms the communication stream's collectives (the valid-count and norm
// agreements, every bucket's reduce-scatter, the weights' all-gather), most of it overlapped with
// the backward; comm_exposed_ms the time the compute stream stood waiting for the communication
// stream (communication not hidden behind compute); optimizer_ms the gradient norm, clip and
// AdamW. comm_bytes: what this rank sent in the step's collectives. Context parallel: cp_comm_ms
// the attention plan's K/V and dK/dV exchanges (its own stream, overlapped with the blocks'
// attention, within fwd_ms and bwd_ms), cp_comm_bytes what this rank sent in them.
struct StepTiming {
  bool measured = false;  // false on the CPU backend
  double fwd_ms = 0.0;
  double bwd_ms = 0.0;
  double comm_ms = 0.0;
  double comm_exposed_ms = 0.0;
  double optimizer_ms = 0.0;
  int64_t comm_bytes = 0;
  double cp_comm_ms = 0.0;
  int64_t cp_comm_bytes = 0;
};

struct StepResult {
  double loss = 0.0;        // mean cross-entropy over the step's valid targets (every micro-batch)
  double grad_norm = 0.0;   // global L2 norm of the step's gradient, before clipping
  bool updated = false;     // false when the norm was not finite and the CPU skipped the update
  StepTiming timing;
};

struct BackendOptions {
  bool deterministic_attention = true;  // CUDA: bitwise-reproducible attention backward
  int device_index = 0;                 // CUDA ordinal (with comm: must be comm's device)
  // Data parallel over this communicator (not owned; outlives the backend): in-process for the
  // CPU backend, NCCL for CUDA. Null: one device, no communication.
  dist::Communicator* comm = nullptr;
  int64_t bucket_bytes = int64_t{25} << 20;  // gradient bucket target (dp_plan.h)
  // Context parallel over this communicator (not owned; may be comm itself): the ranks that share
  // each sequence, consecutive ranks of comm (group g holds comm ranks g·c … g·c + c − 1, and its
  // rank i is comm rank g·c + i). Every rank of a group is given the same micro-batches and runs
  // the zigzag share of each sequence (cpu/model.h); comm reduces the gradients over all ranks, so
  // the step is that of one model over every group's micro-batches. CPU backend only for now.
  dist::Communicator* cp_comm = nullptr;
  // CPU: flare's attention backend the model calls; kReference (float64 arithmetic, rounded once)
  // gives a run with exact attention, which tests compare others with.
  flare::Backend attention_backend = flare::Backend::kAuto;
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual DeviceKind kind() const = 0;
  // "cpu", or the CUDA device's name ("NVIDIA H100 80GB HBM3") for the peak-FLOP/s table.
  virtual std::string device_name() const = 0;

  // The optimizer state from host arrays of layout.total floats each; m and v may be null for a
  // fresh run (zeros). The weights the model reads are derived from master. Data parallel: every
  // rank passes the whole state and keeps its shard (so any world size resumes any checkpoint).
  virtual Status set_state(const float* master, const float* m, const float* v) = 0;
  // The state into host arrays (any may be null). Waits for the device. Data parallel: a
  // collective that gathers all three tensors to rank 0, whose non-null arrays receive them; the
  // other ranks' arrays are not written (they may be null).
  virtual Status get_state(float* master, float* m, float* v) = 0;

  // Enqueues one optimizer step over `micro_batches` micro-batches of (batch, seq) tokens each:
  // inputs and targets hold micro_batches · batch · seq int32, micro-batch after micro-batch.
  // The gradient is that of the mean loss over all valid targets (not −1) of the step; it is
  // clipped to grad_clip (0: no clipping) and AdamW `step` applied (its grad_scale is multiplied
  // by the clip factor). The previous step must have been ended.
  virtual Status step_begin(std::span<const int32_t> inputs, std::span<const int32_t> targets,
                            int64_t micro_batches, const AdamWStep& step, double grad_clip) = 0;
  // Waits for the step enqueued last and reports it.
  virtual Status step_end(StepResult* result) = 0;

  // The summed loss and the count of valid targets of one (batch, seq) micro-batch, without
  // gradients (validation). Waits for the device.
  virtual Status evaluate(std::span<const int32_t> inputs, std::span<const int32_t> targets,
                          double* loss_sum, int64_t* valid) = 0;

  // One micro-batch's forward and backward from the current weights, without the optimizer (a
  // step dump for comparison with a reference; this rank's batch alone, no communication): the
  // mean loss over the valid targets, the fp32
  // gradient of that loss (layout.total floats; gaps 0) and, when logits is not null, the logits
  // before the classifier replaced them ((batch · seq, padded_vocab) floats; on CUDA the bf16
  // values, exactly). Waits for the device.
  virtual Status step_gradients(std::span<const int32_t> inputs, std::span<const int32_t> targets,
                                double* loss, float* grads, float* logits) = 0;

  // Device memory in use (CUDA: total − free as the driver reports it) or the bytes of the
  // backend's own buffers (CPU).
  virtual int64_t memory_bytes() const = 0;
  // The most memory in use so far on this rank's device: CUDA, memory_bytes() at the step reads
  // plus the high-water mark of stream-ordered allocations (attention's scratch, freed within a
  // step); CPU, memory_bytes().
  virtual int64_t peak_memory_bytes() { return memory_bytes(); }
};

// The number of context-parallel ranks options describes (1 without cp_comm or with one of a
// single rank), after checking that cp_comm's groups are consecutive ranks of comm, which it
// needs (BackendOptions::cp_comm); the rule's error names cp_comm.
Status context_parallel_ranks(const BackendOptions& options, int* cp);

// The fp32 CPU backend over cpu::CpuModel for (batch, seq) micro-batches; data parallel over
// options.comm (a CPU communicator) when it is set.
Status make_cpu_backend(const ModelConfig& model, const TrainConfig& train,
                        std::unique_ptr<Backend>* out);
Status make_cpu_backend(const ModelConfig& model, const TrainConfig& train,
                        const BackendOptions& options, std::unique_ptr<Backend>* out);

// The CUDA backend over the GPU model (model/gpu_model.h). It first compares
// estimate_training_memory() with the device's free memory and returns out_of_memory, with the
// breakdown, before allocating anything when the run cannot fit. Returns unsupported in a build
// without CUDA.
Status make_cuda_backend(const ModelConfig& model, const TrainConfig& train,
                         const BackendOptions& options, std::unique_ptr<Backend>* out);

}  // namespace flare::train
