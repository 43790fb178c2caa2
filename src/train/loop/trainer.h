// trainer.h — the training loop: config → data loaders → backend (CPU or CUDA) → steps, with the
// schedule, gradient accumulation, clipping and AdamW, a report per step, validation every
// eval_every steps, a JSON log, checkpoints every ckpt_every steps and at the end, and bitwise
// resume from a checkpoint.
//
// One step, in order:
//   1. the step's grad_accum micro-batches come from the training loader (prefetched while the
//      previous step ran on the device);
//   2. the backend enqueues forward + backward of each, the gradient norm, the clip and AdamW with
//      the step's learning rate (schedule.h) and t = step + 1;
//   3. the next step's batches are read from disk while the device works;
//   4. the step's loss and gradient norm are read back (the one wait of the step), and the
//      report is made: tokens/s over the wall time since the previous report, MFU from
//      model_flops_per_token() over the device's peak bf16 FLOP/s.
// A non-finite loss or gradient norm stops the run with an error naming the step; the weights
// of that step are not checkpointed.
//
// Resuming is exact: a checkpoint holds the master weights, AdamW's m and v, the step and the
// training loader's position after that step, and everything else the step computes is a
// function of (config, step), so N steps + checkpoint + resume + N steps gives the same bits as
// 2N steps straight (tested on the CPU backend).
//
// Data parallel (options.backend.comm, backend.h): every rank runs its own Trainer with the same
// options; the training loader gives each rank its share of every batch (loader.h), so a step's
// global batch is world · grad_accum · batch sequences, the same windows as one rank with
// batch · world. Every rank gets the same reports (loss and norm are global). Only rank 0
// evaluates, writes the log and writes checkpoints: saving is collective (rank 0 gathers the
// shards, writes the usual single-file format, and the ranks then agree on the outcome, bounded
// by the communicator's timeout, so a dead peer is an error and the last checkpoint stays
// whole). Any world size resumes any checkpoint: each rank takes its shard of the saved state
// and the loader's position is converted to the new batch · world (it must fall on a batch
// boundary, which it does when the global batch is unchanged).
//
// The trainer never prints: reports go to the caller's callback, formatted by format_step() and
// step_json() when the caller wants the standard line and log object.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "flare/status.h"
#include "train/core/host_array.h"
#include "train/core/model_config.h"
#include "train/core/train_config.h"
#include "train/data/loader.h"
#include "train/loop/backend.h"

namespace flare::train {

struct TrainerOptions {
  ModelConfig model;
  TrainConfig train;
  DeviceKind device = DeviceKind::kCpu;
  BackendOptions backend;
  std::string resume_from;   // a checkpoint to continue from; empty: a fresh run from train.seed
  std::string init_weights;  // a fresh run's initial master weights: a raw little-endian fp32 file
                             // of parameter_layout(model).total values; empty: init.h from seed
  std::string log_path;      // JSON lines, one object per step (appended; rank 0); empty: no log
  int64_t eval_batches = 8;  // validation micro-batches per evaluation (at most one epoch)
  double peak_flops = 0.0;   // the device's dense bf16 peak in FLOP/s; 0: peak_bf16_flops(name)
};

struct StepReport {
  int64_t step = 0;           // optimizer steps completed, counting this one (1-based)
  int64_t steps = 0;          // steps of the whole run (train.steps)
  double loss = 0.0;          // mean training loss of the step
  double lr = 0.0;            // the learning rate the step used
  double grad_norm = 0.0;     // before clipping
  double step_ms = 0.0;       // wall time since the previous report
  double tokens_per_s = 0.0;  // tokens of the step (world · grad_accum · batch · seq) / step time
  double mfu = 0.0;           // model FLOP/s over the peak of all ranks; 0 when it is unknown
  int world = 1;              // ranks: data-parallel groups x context-parallel ranks
  int cp = 1;                 // context-parallel ranks per group
  int64_t memory_bytes = 0;   // Backend::memory_bytes()
  int64_t peak_memory_bytes = 0;  // Backend::peak_memory_bytes(): this rank's device, so far
  StepTiming timing;          // CUDA: where the step's device time went (backend.h)
  bool has_val = false;
  double val_loss = 0.0;      // when has_val: mean loss over the validation batches
  std::string checkpoint;     // the checkpoint written after this step, or empty
};

// Dense bf16 tensor-core peak FLOP/s of a device by its name (CUDA's device name): H100 SXM
// 989e12, H100 PCIe 756e12, H100 NVL 835e12, H200/GH200 989e12, A100 312e12, L40S 362e12, …;
// 0 for a name the table does not know (and for "cpu").
double peak_bf16_flops(const std::string& device_name);

// "step   12/1000 | loss 7.1234 | lr 6.00e-04 | norm 1.234 | 123.4 ms | 132,000 tok/s |
//  MFU 41.2% | mem 12.3 GiB" (+ "| comm 12.3 ms, 1.2 exposed" with several ranks, "| val 7.0012",
//  "| saved PATH").
std::string format_step(const StepReport& report);
// The report as one JSON object on one line (no newline); with a measured timing also "dp",
// "fwd_ms", "bwd_ms", "comm_ms", "comm_exposed_ms", "optimizer_ms", "comm_bytes", "comm_gbps"
// (bytes sent over comm_ms) and "peak_memory_bytes".
std::string step_json(const StepReport& report);

class Trainer {
 public:
  // Validates both configs, opens the loaders (the validation loader when eval_every > 0),
  // creates the backend and initialises it from train.seed (init.h) or from resume_from, and
  // opens the log. Nothing is written to disk when any of it fails.
  static Status create(const TrainerOptions& options, std::unique_ptr<Trainer>* out);
  ~Trainer();

  // Runs steps until `until_step` steps are complete (at most train.steps); on_step gets each
  // report (may be empty).
  Status run(int64_t until_step, const std::function<void(const StepReport&)>& on_step);

  // Mean loss over the validation batches (from the first validation batch each time).
  Status evaluate(double* val_loss);

  // Writes a checkpoint of the current state (after step()) to `path`. Data parallel: collective
  // (rank 0 writes; every rank returns its outcome).
  Status save_checkpoint(const std::string& path);
  // <checkpoint_dir>/step_NNNNNN.ckpt
  std::string checkpoint_path(int64_t step) const;

  // The training loader's next batch (batch · seq int32 each), moving the loader on: for a step
  // dump (Backend::step_gradients) before any step runs, not for use between steps.
  Status next_batch(std::vector<int32_t>* inputs, std::vector<int32_t>* targets);

  int64_t step() const { return step_; }
  int rank() const { return rank_; }
  int world() const { return world_; }
  double peak_flops() const { return peak_flops_; }
  double flops_per_token() const { return flops_per_token_; }
  Backend& backend() { return *backend_; }
  const TrainerOptions& options() const { return options_; }

 private:
  Trainer() = default;
  Status write_checkpoint(const std::string& path, const HostArray<float>& master,
                          const HostArray<float>& m, const HostArray<float>& v) const;
  Status load_step_batches(std::vector<int32_t>* inputs, std::vector<int32_t>* targets,
                           std::vector<uint8_t>* position_after);
  Status append_log(const StepReport& report);

  TrainerOptions options_;
  ParameterLayout layout_;
  std::unique_ptr<Backend> backend_;
  DataLoader train_loader_;
  DataLoader val_loader_;
  bool have_val_ = false;
  int64_t val_batches_ = 0;
  int64_t step_ = 0;
  int rank_ = 0, world_ = 1, cp_ = 1;  // cp_: context-parallel ranks per group (backend.h)
  std::vector<uint8_t> loader_position_;  // the training loader's position after step_ steps
  double peak_flops_ = 0.0;
  double flops_per_token_ = 0.0;
  FILE* log_ = nullptr;
};

}  // namespace flare::train
