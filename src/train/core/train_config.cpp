// train_config.cpp — the rules of a training run and its memory estimate.
#include "train/core/train_config.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "core/message.h"

namespace flare::train {
namespace {

constexpr int64_t kMaxBatch = int64_t{1} << 20;
constexpr int64_t kMaxSteps = int64_t{1} << 40;

bool finite_at_least(double x, double lo) { return std::isfinite(x) && x >= lo; }

// Elements of one layer's saved activations per token: bf16 elements and fp32 elements.
struct PerToken {
  int64_t bf16 = 0;
  int64_t fp32 = 0;
  int64_t bytes() const { return 2 * bf16 + 4 * fp32; }
};

PerToken layer_activations(const ModelConfig& m) {
  const int64_t d = m.d_model;
  const int64_t q_width = m.n_head * m.head_dim;
  const int64_t qkv_rows = (m.n_head + 2 * m.n_kv_head) * m.head_dim;
  PerToken t;
  // layer input, attention-norm output, qkv, attention output, residual after attention,
  // mlp-norm output; then the MLP's inner tensors.
  t.bf16 = 4 * d + qkv_rows + q_width;
  if (m.family == Family::kGpt) {
    t.bf16 += 2 * m.ffn_hidden;           // fc output and GELU output
    t.fp32 = m.n_head + 4;                // LSE; mean and rstd of two LayerNorms
  } else {
    t.bf16 += 3 * m.ffn_hidden;           // gate_up output and SwiGLU output
    t.fp32 = m.n_head + 2;                // LSE; rstd of two RMSNorms
  }
  return t;
}

}  // namespace

Status validate_train_config(const TrainConfig& t, const ModelConfig& m) {
  FLARE_RETURN_IF_ERROR(validate_model_config(m));
  if (t.batch < 1 || t.batch > kMaxBatch)
    return invalid("batch: ", t.batch, " must be in [1, ", kMaxBatch, "]");
  if (t.seq < 1 || t.seq > m.max_seq)
    return invalid("seq: ", t.seq, " must be in [1, max_seq = ", m.max_seq, "] of model '", m.name, "'");
  if (t.grad_accum < 1 || t.grad_accum > kMaxBatch)
    return invalid("grad_accum: ", t.grad_accum, " must be in [1, ", kMaxBatch, "]");
  if (t.bf16_grads && t.grad_accum != 1)
    return invalid("bf16_grads: needs grad_accum = 1 (a bf16 gradient is written once, never summed), got ",
                   t.grad_accum);
  if (t.bf16_grads && t.shard_gradients)
    return invalid("bf16_grads: not with shard_gradients (ZeRO-2 reduces fp32 gradient buckets)");
  if (t.steps < 1 || t.steps > kMaxSteps)
    return invalid("steps: ", t.steps, " must be in [1, ", kMaxSteps, "]");
  if (!std::isfinite(t.lr) || t.lr <= 0) return invalid("lr: ", t.lr, " must be finite and > 0");
  if (!finite_at_least(t.min_lr, 0) || t.min_lr > t.lr)
    return invalid("min_lr: ", t.min_lr, " must be in [0, lr = ", t.lr, "]");
  if (t.warmup < 0 || t.warmup > t.steps)
    return invalid("warmup: ", t.warmup, " must be in [0, steps = ", t.steps, "]");
  if (!finite_at_least(t.weight_decay, 0))
    return invalid("weight_decay: ", t.weight_decay, " must be finite and >= 0");
  if (!finite_at_least(t.beta1, 0) || t.beta1 >= 1)
    return invalid("beta1: ", t.beta1, " must be in [0, 1)");
  if (!finite_at_least(t.beta2, 0) || t.beta2 >= 1)
    return invalid("beta2: ", t.beta2, " must be in [0, 1)");
  if (!std::isfinite(t.eps) || t.eps <= 0) return invalid("eps: ", t.eps, " must be finite and > 0");
  if (!finite_at_least(t.grad_clip, 0))
    return invalid("grad_clip: ", t.grad_clip, " must be finite and >= 0 (0 turns clipping off)");
  if (t.eval_every < 0) return invalid("eval_every: ", t.eval_every, " must be >= 0 (0: never)");
  if (t.ckpt_every < 0) return invalid("ckpt_every: ", t.ckpt_every, " must be >= 0 (0: never)");
  if (t.eval_every > 0 && t.val_data.empty())
    return invalid("val_data: must be set when eval_every = ", t.eval_every, " > 0");
  if (t.ckpt_every > 0 && t.checkpoint_dir.empty())
    return invalid("checkpoint_dir: must be set when ckpt_every = ", t.ckpt_every, " > 0");
  return Status::ok_status();
}

MemoryEstimate estimate_training_memory(const TrainConfig& t, const ModelConfig& m, int dp_world) {
  const ParameterLayout layout = parameter_layout(m);
  const int64_t n = layout.total;
  const int64_t world = std::max(dp_world, 1);
  const int64_t shard = (n + world - 1) / world;
  const int64_t tokens = t.batch * t.seq;
  const int64_t layer_bytes = tokens * layer_activations(m).bytes();
  const int64_t layer_input_bytes = tokens * m.d_model * 2;

  MemoryEstimate e;
  e.weights = 2 * n;
  e.master = 2 * shard;  // the low halves: the bf16 weights are the top ones (split_master.h)
  e.adam = 8 * shard;
  e.grads = (t.bf16_grads ? 2 : 4) * n;
  std::vector<int64_t> stage_begin, stage_end;
  if (t.shard_gradients && world > 1 && backward_stage_ranges(layout, m.n_layer, &stage_begin, &stage_end).ok()) {
    int64_t largest = 0;
    const size_t last = stage_begin.size() - 1;
    for (size_t s = 0; s < last; ++s) largest = std::max(largest, stage_end[s] - stage_begin[s]);
    e.grads = 4 * (kGradientStagesHeld * largest + stage_end[last] - stage_begin[last]);
  }
  if (world > 1) {
    // A bucket holds at least one whole tensor: the largest sets the staging when it exceeds the
    // 25 MiB bucket target (train/dist/dp_plan.h).
    int64_t bucket = int64_t{25} << 20 >> 2;
    for (const ParamSpec& p : layout.params) bucket = std::max(bucket, p.numel);
    e.dp_buffers = 6 * shard + 4 * (world - 1) * ((bucket + world - 1) / world);
  }
  // Every layer keeps its full set, or only its input while one layer at a time is recomputed.
  e.activations = t.recompute ? m.n_layer * layer_input_bytes + layer_bytes : m.n_layer * layer_bytes;
  // The final norm's input and output, then the logits.
  e.activations += 2 * layer_input_bytes;
  e.logits = tokens * m.padded_vocab * 2;
  e.workspace = layer_bytes;
  e.total = e.weights + e.master + e.adam + e.grads + e.dp_buffers + e.activations + e.logits +
            e.workspace;
  return e;
}

Status check_fits(const MemoryEstimate& e, int64_t device_bytes) {
  if (e.total <= device_bytes) return Status::ok_status();
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  auto gib = [&](int64_t b) { return static_cast<double>(b) / kGiB; };
  return Status::out_of_memory(cat(
      "training needs about ", gib(e.total), " GiB but the device has ", gib(device_bytes),
      " GiB (weights ", gib(e.weights), ", master ", gib(e.master), ", adam ", gib(e.adam),
      ", grads ", gib(e.grads), e.dp_buffers > 0 ? cat(", data-parallel buffers ", gib(e.dp_buffers)) : std::string(),
      ", activations ", gib(e.activations), ", logits ", gib(e.logits),
      ", workspace ", gib(e.workspace), "); lower batch or seq, or turn on recompute"));
}

}  // namespace flare::train
