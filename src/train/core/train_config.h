// train_config.h — what one training run is: batch shape, optimizer and schedule settings, how
// often to evaluate and checkpoint, and where data and checkpoints live; the rules a run must
// satisfy against its model; and the memory it needs on one device, so the trainer can say
// "does not fit" before it allocates anything.
#pragma once

#include <cstdint>
#include <string>

#include "flare/status.h"
#include "train/core/model_config.h"

namespace flare::train {

struct TrainConfig {
  int64_t batch = 8;         // sequences per micro-batch (per device)
  int64_t seq = 1024;        // tokens per sequence; at most the model's max_seq
  int64_t grad_accum = 1;    // micro-batches summed into one optimizer step
  int64_t steps = 1000;      // optimizer steps of the run
  double lr = 6e-4;          // peak learning rate, reached at the end of warm-up
  double min_lr = 6e-5;      // where the cosine ends, at the last step
  int64_t warmup = 100;      // steps of linear warm-up (schedule.h)
  double weight_decay = 0.1; // decoupled, on the tensors the layout marks (matrices)
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double grad_clip = 1.0;    // clip the global gradient norm to this; 0 turns clipping off
  uint64_t seed = 1337;      // initialisation and data order
  bool recompute = false;    // keep only each layer's input; recompute the layer in backward
  // With several data-parallel ranks, ZeRO-2: no rank holds the whole gradient, only the
  // backward stages being written or reduced (kGradientStagesHeld) and its shard of the sum.
  bool shard_gradients = false;
  // The gradient in bf16 (CUDA, one micro-batch, one rank): the weight-gradient products write
  // bf16 (cuBLASLt's bf16-output kernels, as torch's autocast products do), the optimizer reads
  // 2 bytes per parameter instead of 4, and the gradient takes half the memory. Each gradient
  // element is rounded once to bf16 before the norm and AdamW read it; there is nothing to
  // accumulate, so grad_accum must be 1.
  bool bf16_grads = false;
  int64_t eval_every = 0;    // steps between validation passes; 0: never
  int64_t ckpt_every = 0;    // steps between checkpoints; 0: never
  std::string train_data;    // training shards (a file or pattern the data part understands)
  std::string val_data;      // validation shards; needed when eval_every > 0
  std::string checkpoint_dir;  // needed when ckpt_every > 0
};

// Sharded gradients: the stage buffers a rank holds besides the last stage's (the embeddings,
// live for the whole backward): the stage being written and two whose reduce-scatter may still be
// in flight.
inline constexpr int kGradientStagesHeld = 3;

// Every rule a run must satisfy for `model`, each failure naming the field: positive sizes,
// seq ≤ max_seq, 0 ≤ min_lr ≤ lr, warmup ≤ steps, betas in [0, 1), eps > 0, paths present where
// a feature needs them.
Status validate_train_config(const TrainConfig& train, const ModelConfig& model);

// Bytes one device holds for a run, alone or as one of dp_world data-parallel ranks (ZeRO-1:
// master weights, m and v sharded, so 10 of the 16 bytes of state per parameter shrink to
// 10 / dp_world; weights and gradients stay whole on every rank). The state is exact up to the
// shards' 64-element rounding; activations count the tensors the backward reads, per layer, in
// their stored precision (bf16 activations, fp32 softmax LSE and norm statistics), which is the
// floor of what any implementation keeps.
//   weights      bf16 copy of the flat buffer the forward reads
//   master       the fp32 master weights' low 16-bit halves (of the shard: ⌈n / dp_world⌉); the
//                bf16 weights are their top halves (core/split_master.h)
//   adam         fp32 m and v (of the shard)
//   grads        fp32 gradients (accumulated over micro-batches in fp32), or bf16 (bf16_grads); sharded: the stage
//                buffers (kGradientStagesHeld of the largest stage but the last, and the last)
//   dp_buffers   data parallel only: the shard's reduced fp32 gradient and its bf16 update, and
//                the staging of one bucket's incoming slices ((dp_world − 1) slices of the
//                largest of a 25 MiB bucket and the largest tensor)
//   activations  saved per layer for one micro-batch (only the layer inputs with recompute,
//                plus one layer's full set, live while that layer runs backward)
//   logits       bf16 (tokens, padded_vocab) of one micro-batch, reused for their gradient
//   workspace    one layer's activations again: the activation gradients flowing backward
struct MemoryEstimate {
  int64_t weights = 0;
  int64_t master = 0;
  int64_t adam = 0;
  int64_t grads = 0;
  int64_t dp_buffers = 0;
  int64_t activations = 0;
  int64_t logits = 0;
  int64_t workspace = 0;
  int64_t total = 0;
};

// The estimate for a valid (train, model) pair on one of dp_world ranks (>= 1).
MemoryEstimate estimate_training_memory(const TrainConfig& train, const ModelConfig& model,
                                        int dp_world = 1);

// OK when the estimate fits in `device_bytes`; otherwise out_of_memory with the breakdown.
Status check_fits(const MemoryEstimate& estimate, int64_t device_bytes);

}  // namespace flare::train
