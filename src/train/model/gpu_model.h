// gpu_model.h — the whole GPT or LLaMA model on one CUDA device: bf16 weights and activations,
// fp32 gradients, forward to the loss and backward to every parameter's gradient, built from the
// trainer's CUDA operators (src/train/cuda) and flare's attention.
//
// The same model as cpu/model.h, block for block (pre-norm, model_config.h's layout and
// conventions), with two fusions the CPU model does not need:
//   - each residual add is fused with the norm that follows it (norm.h residual_*norm_forward):
//     the attention branch's add with the MLP's norm, the MLP branch's add with the next layer's
//     attention norm (or the final norm);
//   - GPT's GELU is the fc matmul's cuBLASLt epilogue (the pre-activation kept for the backward,
//     whose DGELU epilogue folds gelu' into the proj layer's input gradient).
// The classifier overwrites the logits with their gradient in place (classifier.h), so no
// (tokens × vocab) fp32 tensor exists.
//
// Buffers are allocated once, in one cudaMalloc, for (batch, seq). With recompute, each layer
// keeps only its input (the residual stream entering it) and all layers share one set of the
// other activations: the backward recomputes layer i's forward from its input just before its
// backward (the last layer's set is still there from the forward). The recomputation calls the
// same kernels in the same order on the same bits — the fused residual norm reads back its stored
// bf16 sum, so the plain norm of the stored input gives the same output — hence recompute changes
// no bit of the gradients (tested).
//
// No call synchronises the host: everything is enqueued on the model's stream. Attention runs
// with AttentionOptions::deterministic unless turned off, so the gradients are bitwise
// reproducible run to run.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "flare/dist.h"
#include "flare/status.h"
#include "train/core/model_config.h"
#include "train/cuda/common.h"

namespace flare::train::cuda {

// Where the backward writes gradients when the model holds no whole flat gradient
// (GpuModelOptions::whole_gradient false: data parallelism with sharded gradients, dp_cuda.h):
// gradient_at(offset) is the device address of the gradient element at flat offset `offset` of
// parameter_layout(config), asked for when the backward enqueues the work that writes it, so it
// must be valid for every parameter of the stage the backward is in (backward()'s stages).
class GradientPlacement {
 public:
  virtual ~GradientPlacement() = default;
  virtual float* gradient_at(int64_t offset) const = 0;
};

struct GpuModelOptions {
  bool recompute = false;               // keep only each layer's input; recompute in backward
  // false: no flat gradient buffer (grads() is null); backward() writes through the placement
  // set with set_gradient_placement(), which must start each stage's gradients at zero.
  bool whole_gradient = true;
  // The whole gradient in bf16 instead of fp32 (needs whole_gradient; backward() then writes it,
  // never accumulates): 2 bytes per parameter less, cuBLASLt's bf16-output weight-gradient
  // products, and half the optimizer's gradient reads (TrainConfig::bf16_grads).
  bool bf16_grads = false;
  bool deterministic_attention = true;  // bitwise-reproducible attention backward
  int device_index = 0;                 // the device the stream belongs to (current at create)
  // Context parallel over this NCCL communicator (not owned; outlives the model; its device the
  // model's) when it has several ranks: as cpu/model.h describes — the model holds the zigzag
  // rows of each sequence (positions()), RoPE and the position embedding read their global
  // positions, and attention is the group's context-parallel attention. create() is then
  // collective over it, and its seq is the global length, a multiple of 2 · its ranks.
  dist::Communicator* cp = nullptr;
};

class GpuModel {
 public:
  // Validates the config and the sizes (batch ≥ 1, 1 ≤ seq ≤ max_seq), creates the matmul
  // context and allocates every buffer on the current device (a setup call: it may synchronise).
  // The weights start as zeros: the optimizer writes them (or the caller copies them in).
  static Status create(const ModelConfig& config, int64_t batch, int64_t seq,
                       const GpuModelOptions& options, cudaStream_t stream,
                       std::unique_ptr<GpuModel>* out);
  ~GpuModel();
  GpuModel(const GpuModel&) = delete;
  GpuModel& operator=(const GpuModel&) = delete;

  // Bytes create() allocates for these sizes (weights, gradients, activations, scratch), without
  // the matmul context's workspace and attention's stream-ordered scratch.
  static int64_t buffer_bytes(const ModelConfig& config, int64_t batch, int64_t seq,
                              bool recompute, bool whole_gradient = true, bool bf16_grads = false);

  // A host callback with a stage number (train/dist/dp_plan.h's backward_stage numbering), for
  // forward()'s and backward()'s hooks below. It must not synchronise; an error it returns stops
  // the pass and is returned.
  using StageHook = std::function<Status(int64_t stage)>;

  // Forward over tokens (batch · seq int32, device) to the logits. With targets (batch · seq
  // int32, device; −1 ignored) also the loss: the per-token losses are summed (fp64, fixed order)
  // and added to *loss_sum (device), and with write_dlogits the logits are overwritten by the
  // gradient of the loss times dloss_scale (1 / valid targets of the whole optimizer step) for
  // backward(). Tokens must lie in [0, vocab_size) (the data loader checks them; an invalid one
  // gives NaN rows, see embedding.h). dloss_scale_device (1 fp32, device, or null) multiplies
  // dloss_scale: data parallelism agrees on the step's count of valid targets on the device
  // (classifier.h).
  // before_stage (may be empty) is called on the host before the forward
  // enqueues the first work that reads a stage's weights, with the stage's backward number:
  // n_layer + 1 (the embeddings) and n_layer (layer 0's first norm) first, then for each layer i
  // its own number and that of the weights its last kernel also reads (layer i + 1's first norm,
  // or the final norm: 0), so the numbers never increase; stage 0 comes before the final norm,
  // the head and the loss, so it is also the last point to wait for dloss_scale_device. Data
  // parallelism makes the stream wait there for the weights the all-gather is still bringing.
  Status forward(const int32_t* tokens, const int32_t* targets, float dloss_scale,
                 bool write_dlogits, double* loss_sum, const float* dloss_scale_device = nullptr,
                 const StageHook& before_stage = {});

  // Backward of the last forward with write_dlogits, for the same tokens: adds (+=) every
  // parameter's gradient into grads() (without a whole gradient: where the placement says), or
  // with accumulate false writes it (=), so a step's first micro-batch needs no zero_grads()
  // before it: the dW products then skip reading the old gradient and the bias gradients come
  // from the products' epilogue (matmul.h). after_stage (may be empty) is called on the host right
  // after the backward has enqueued each stage, in order: 0 after the output head and the final
  // norm, 1 + (n_layer − 1 − i) after layer i, n_layer + 1 after the embeddings. Once the stream
  // reaches that point, the stage's gradients are final for this backward, so the hook may record
  // an event there for another stream to wait on (data parallelism reduces each gradient bucket
  // while the backward goes on).
  Status backward(const int32_t* tokens, bool accumulate = true, const StageHook& after_stage = {});

  // grads() = 0 (enqueued); invalid without a whole gradient.
  Status zero_grads();

  // Without a whole gradient: where backward() writes (not owned; outlives the backward calls).
  void set_gradient_placement(const GradientPlacement* placement) { placement_ = placement; }

  // Context parallel: the attention plan's exchanges since the last call (dist.h CpTiming; zeros
  // without context parallelism). Waits for their events, so call it once the step is done.
  Status take_cp_timing(dist::CpTiming* out);

  const ModelConfig& config() const { return config_; }
  const ParameterLayout& layout() const;
  int64_t batch() const { return batch_; }
  int64_t seq() const { return seq_; }  // rows per sequence this model holds
  // The global position of each of those rows (0 … seq() − 1 without context parallelism).
  const std::vector<int64_t>& positions() const;
  cudaStream_t stream() const { return stream_; }
  bf16* weights() const { return weights_; }        // (layout().total) bf16, the forward reads
  float* grads() const { return grads_; }           // (layout().total) fp32, backward adds into;
                                                    // null without a whole fp32 gradient
  GradientOut gradient() const {                    // the whole gradient, fp32 or bf16, or null
    return grads16_ ? GradientOut(grads16_) : GradientOut(grads_);
  }
  const bf16* logits() const { return logits_; }    // (batch · seq, padded_vocab): logits, or
                                                    // dlogits after a forward with write_dlogits

  struct Impl;  // offsets, activations, scratch: private to gpu_model.cpp

 private:
  GpuModel();

  ModelConfig config_;
  int64_t batch_ = 0, seq_ = 0;
  cudaStream_t stream_ = nullptr;
  bf16* weights_ = nullptr;
  float* grads_ = nullptr;
  bf16* grads16_ = nullptr;  // the whole gradient with GpuModelOptions::bf16_grads
  const GradientPlacement* placement_ = nullptr;
  bf16* logits_ = nullptr;
  std::unique_ptr<Impl> impl_;
};

// *sum += Σ losses[i] over n fp32 values, in double, in one fixed order (one block): the loss of
// a micro-batch, accumulated over the micro-batches of a step without a host read.
Status loss_sum(const float* losses, int64_t n, double* sum, cudaStream_t stream);

}  // namespace flare::train::cuda
