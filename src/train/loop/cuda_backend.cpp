// cuda_backend.cpp — the training step on one CUDA device: the GPU model (model/gpu_model.h) for
// forward and backward, cuda/adamw.h for the gradient norm, the clip and AdamW over fp32 master
// weights, m and v, which live here, beside the model's bf16 weights and fp32 gradients.
//
// A step is enqueued on one stream with no host wait: the micro-batches' tokens go up from pinned
// memory, the losses are summed on the device, the clip factor is read by the optimizer from
// device memory, and the step ends with one 16-byte copy of (loss sum, norm, clip) back to pinned
// memory and an event; step_end() waits on that event only.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/message.h"
#include "core/numeric.h"
#include "train/cuda/adamw.h"
#include "train/cuda/matmul.h"
#include "train/loop/backend.h"
#include "train/model/gpu_model.h"

namespace flare::train {
namespace {

using cuda::bf16;
using cuda::cuda_status;

// What the host reads back per step (pinned).
struct StepReadback {
  double loss_sum;
  float norm_and_scale[2];
};

std::string gib(int64_t bytes) { return cat(static_cast<double>(bytes) / double(1 << 30), " GiB"); }

class CudaBackend final : public Backend {
 public:
  ~CudaBackend() override {
    if (stream_) cudaStreamSynchronize(stream_);
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
    FLARE_RETURN_IF_ERROR(cuda_status(cudaSetDevice(options.device_index), "cudaSetDevice"));
    cudaDeviceProp prop{};
    FLARE_RETURN_IF_ERROR(cuda_status(cudaGetDeviceProperties(&prop, options.device_index), "device properties"));
    name_ = prop.name;

    // Will it fit? The configuration's estimate (the floor any implementation needs) and this
    // implementation's own buffers, against the free memory, before allocating anything.
    size_t free_bytes = 0, total_bytes = 0;
    FLARE_RETURN_IF_ERROR(cuda_status(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo"));
    const int64_t free_now = static_cast<int64_t>(free_bytes);
    FLARE_RETURN_IF_ERROR(check_fits(estimate_training_memory(train, config), free_now));
    const int64_t tokens = train.grad_accum * train.batch * train.seq;
    const int64_t state_bytes = 3 * layout_.total * int64_t{sizeof(float)} + 2 * tokens * int64_t{sizeof(int32_t)} + 256;
    const int64_t need = cuda::GpuModel::buffer_bytes(config, train.batch, train.seq, train.recompute) +
                         state_bytes + cuda::MatmulContext::kWorkspaceBytes;
    if (need > free_now) {
      return Status::out_of_memory(cat("the run needs ", gib(need), " on ", name_, " (model buffers ",
                                       gib(need - state_bytes), ", optimizer state ", gib(state_bytes),
                                       "), ", gib(free_now), " are free; try --recompute, a smaller "
                                       "--batch with --grad-accum, or a shorter --seq"));
    }

    FLARE_RETURN_IF_ERROR(cuda_status(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream"));
    FLARE_RETURN_IF_ERROR(cuda_status(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), "event"));
    cuda::GpuModelOptions mo;
    mo.recompute = train.recompute;
    mo.deterministic_attention = options.deterministic_attention;
    mo.device_index = options.device_index;
    FLARE_RETURN_IF_ERROR(cuda::GpuModel::create(config, train.batch, train.seq, mo, stream_, &model_));
    FLARE_RETURN_IF_ERROR(table_.init(layout_));

    // master, m, v (fp32, n each); the step's tokens and targets; the loss sum and the norm pair;
    // the norm's scratch. One allocation, 256-byte aligned pieces.
    const int64_t n = layout_.total;
    const int64_t norm_scratch = cuda::gradient_norm_scratch_bytes(table_);
    auto piece = [](int64_t bytes) { return (bytes + 255) / 256 * 256; };
    const int64_t bytes = 3 * piece(n * 4) + 2 * piece(tokens * 4) + piece(8) + piece(8) + piece(norm_scratch);
    char* p = nullptr;
    FLARE_RETURN_IF_ERROR(cuda_status(cudaMalloc(reinterpret_cast<void**>(&p), static_cast<size_t>(bytes)), "optimizer state"));
    state_ = p;
    master_ = reinterpret_cast<float*>(p);          p += piece(n * 4);
    m_ = reinterpret_cast<float*>(p);               p += piece(n * 4);
    v_ = reinterpret_cast<float*>(p);               p += piece(n * 4);
    tokens_ = reinterpret_cast<int32_t*>(p);        p += piece(tokens * 4);
    targets_ = reinterpret_cast<int32_t*>(p);       p += piece(tokens * 4);
    loss_sum_ = reinterpret_cast<double*>(p);       p += piece(8);
    norm_and_scale_ = reinterpret_cast<float*>(p);  p += piece(8);
    norm_scratch_ = p;

    // Pinned staging: the step's tokens and targets, and the readback.
    const size_t host_bytes = static_cast<size_t>(2 * tokens) * sizeof(int32_t) + sizeof(StepReadback);
    FLARE_RETURN_IF_ERROR(cuda_status(cudaMallocHost(&host_, host_bytes), "pinned staging"));
    host_tokens_ = static_cast<int32_t*>(host_);
    host_targets_ = host_tokens_ + tokens;
    readback_ = reinterpret_cast<StepReadback*>(host_targets_ + tokens);
    return cuda_status(cudaStreamSynchronize(stream_), "setup");
  }

  DeviceKind kind() const override { return DeviceKind::kCuda; }
  std::string device_name() const override { return name_; }

  Status set_state(const float* master, const float* m, const float* v) override {
    if (!master) return invalid("set_state: master must not be null");
    FLARE_RETURN_IF_ERROR(wait_idle());
    const int64_t n = layout_.total;
    const size_t bytes = static_cast<size_t>(n) * sizeof(float);
    FLARE_RETURN_IF_ERROR(cuda_status(cudaMemcpy(master_, master, bytes, cudaMemcpyHostToDevice), "set_state"));
    FLARE_RETURN_IF_ERROR(copy_or_zero(m, m_, bytes));
    FLARE_RETURN_IF_ERROR(copy_or_zero(v, v_, bytes));
    // The bf16 weights the model reads: master rounded to nearest even (as AdamW writes them).
    std::vector<uint16_t> weights(static_cast<size_t>(n));
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) weights[static_cast<size_t>(i)] = float_to_bf16(master[i]);
    return cuda_status(cudaMemcpy(model_->weights(), weights.data(), static_cast<size_t>(n) * sizeof(bf16),
                                  cudaMemcpyHostToDevice), "set_state weights");
  }

  Status get_state(float* master, float* m, float* v) override {
    FLARE_RETURN_IF_ERROR(wait_idle());
    const size_t bytes = static_cast<size_t>(layout_.total) * sizeof(float);
    if (master) FLARE_RETURN_IF_ERROR(cuda_status(cudaMemcpy(master, master_, bytes, cudaMemcpyDeviceToHost), "get_state"));
    if (m) FLARE_RETURN_IF_ERROR(cuda_status(cudaMemcpy(m, m_, bytes, cudaMemcpyDeviceToHost), "get_state"));
    if (v) FLARE_RETURN_IF_ERROR(cuda_status(cudaMemcpy(v, v_, bytes, cudaMemcpyDeviceToHost), "get_state"));
    return Status::ok_status();
  }

  Status step_begin(std::span<const int32_t> inputs, std::span<const int32_t> targets,
                    int64_t micro_batches, const AdamWStep& step, double grad_clip) override {
    if (pending_) return invalid("step_begin: the previous step was not ended (step_end)");
    FLARE_RETURN_IF_ERROR(stage(inputs, targets, micro_batches));
    const int64_t tokens = batch_ * seq_;
    valid_ = std::count_if(targets.begin(), targets.end(), [](int32_t t) { return t != -1; });
    // The gradient of the mean over the whole step's valid targets.
    const float dloss_scale = valid_ > 0 ? static_cast<float>(1.0 / static_cast<double>(valid_)) : 0.0f;

    FLARE_RETURN_IF_ERROR(cuda_status(cudaMemsetAsync(loss_sum_, 0, sizeof(double), stream_), "loss"));
    FLARE_RETURN_IF_ERROR(model_->zero_grads());
    for (int64_t i = 0; i < micro_batches; ++i) {
      FLARE_RETURN_IF_ERROR(model_->forward(tokens_ + i * tokens, targets_ + i * tokens, dloss_scale, true, loss_sum_));
      FLARE_RETURN_IF_ERROR(model_->backward(tokens_ + i * tokens));
    }
    FLARE_RETURN_IF_ERROR(cuda::gradient_norm(table_, model_->grads(), grad_clip, norm_and_scale_,
                                              norm_scratch_, stream_));
    FLARE_RETURN_IF_ERROR(cuda::adamw_update(table_, step, norm_and_scale_ + 1, model_->grads(), master_,
                                             m_, v_, model_->weights(), stream_));
    FLARE_RETURN_IF_ERROR(cuda_status(cudaMemcpyAsync(&readback_->loss_sum, loss_sum_, sizeof(double),
                                                      cudaMemcpyDeviceToHost, stream_), "loss readback"));
    FLARE_RETURN_IF_ERROR(cuda_status(cudaMemcpyAsync(readback_->norm_and_scale, norm_and_scale_, 2 * sizeof(float),
                                                      cudaMemcpyDeviceToHost, stream_), "norm readback"));
    FLARE_RETURN_IF_ERROR(cuda_status(cudaEventRecord(done_, stream_), "step event"));
    pending_ = true;
    return Status::ok_status();
  }

  Status step_end(StepResult* result) override {
    if (!pending_) return invalid("step_end: no step was begun");
    pending_ = false;
    FLARE_RETURN_IF_ERROR(cuda_status(cudaEventSynchronize(done_), "training step"));
    result->loss = valid_ > 0 ? readback_->loss_sum / static_cast<double>(valid_) : 0.0;
    result->grad_norm = readback_->norm_and_scale[0];
    result->updated = true;  // a non-finite norm reaches the weights on the GPU; the trainer stops
    return Status::ok_status();
  }

  Status evaluate(std::span<const int32_t> inputs, std::span<const int32_t> targets,
                  double* loss_sum, int64_t* valid) override {
    if (pending_) return invalid("evaluate: a step is in flight (step_end first)");
    FLARE_RETURN_IF_ERROR(stage(inputs, targets, 1));
    FLARE_RETURN_IF_ERROR(cuda_status(cudaMemsetAsync(loss_sum_, 0, sizeof(double), stream_), "loss"));
    FLARE_RETURN_IF_ERROR(model_->forward(tokens_, targets_, 0.0f, false, loss_sum_));
    FLARE_RETURN_IF_ERROR(cuda_status(cudaMemcpyAsync(&readback_->loss_sum, loss_sum_, sizeof(double),
                                                      cudaMemcpyDeviceToHost, stream_), "loss readback"));
    FLARE_RETURN_IF_ERROR(cuda_status(cudaStreamSynchronize(stream_), "evaluation"));
    *loss_sum = readback_->loss_sum;
    *valid = std::count_if(targets.begin(), targets.end(), [](int32_t t) { return t != -1; });
    return Status::ok_status();
  }

  Status step_gradients(std::span<const int32_t> inputs, std::span<const int32_t> targets,
                        double* loss, float* grads, float* logits) override {
    if (pending_) return invalid("step_gradients: a step is in flight (step_end first)");
    FLARE_RETURN_IF_ERROR(stage(inputs, targets, 1));
    const int64_t valid = std::count_if(targets.begin(), targets.end(), [](int32_t t) { return t != -1; });
    const ModelConfig& c = model_->config();
    if (logits) {
      FLARE_RETURN_IF_ERROR(model_->forward(tokens_, nullptr, 0.0f, false, nullptr));
      std::vector<uint16_t> bits(static_cast<size_t>(batch_ * seq_ * c.padded_vocab));
      FLARE_RETURN_IF_ERROR(cuda_status(cudaMemcpyAsync(bits.data(), model_->logits(), bits.size() * sizeof(bf16),
                                                        cudaMemcpyDeviceToHost, stream_), "logits"));
      FLARE_RETURN_IF_ERROR(cuda_status(cudaStreamSynchronize(stream_), "logits"));
      for (size_t i = 0; i < bits.size(); ++i) logits[i] = bf16_to_float(bits[i]);
    }
    const float dloss_scale = valid > 0 ? static_cast<float>(1.0 / static_cast<double>(valid)) : 0.0f;
    FLARE_RETURN_IF_ERROR(cuda_status(cudaMemsetAsync(loss_sum_, 0, sizeof(double), stream_), "loss"));
    FLARE_RETURN_IF_ERROR(model_->zero_grads());
    FLARE_RETURN_IF_ERROR(model_->forward(tokens_, targets_, dloss_scale, true, loss_sum_));
    FLARE_RETURN_IF_ERROR(model_->backward(tokens_));
    FLARE_RETURN_IF_ERROR(cuda_status(cudaMemcpyAsync(&readback_->loss_sum, loss_sum_, sizeof(double),
                                                      cudaMemcpyDeviceToHost, stream_), "loss readback"));
    FLARE_RETURN_IF_ERROR(cuda_status(cudaMemcpyAsync(grads, model_->grads(), static_cast<size_t>(layout_.total) * sizeof(float),
                                                      cudaMemcpyDeviceToHost, stream_), "gradients"));
    FLARE_RETURN_IF_ERROR(cuda_status(cudaStreamSynchronize(stream_), "step_gradients"));
    *loss = valid > 0 ? readback_->loss_sum / static_cast<double>(valid) : 0.0;
    return Status::ok_status();
  }

  int64_t memory_bytes() const override {
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) return 0;
    return static_cast<int64_t>(total_bytes - free_bytes);
  }

 private:
  // The batch into pinned memory and up to the device (enqueued).
  Status stage(std::span<const int32_t> inputs, std::span<const int32_t> targets, int64_t micro_batches) {
    const int64_t want = micro_batches * batch_ * seq_;
    if (micro_batches < 1 || micro_batches > max_micro_batches_) {
      return invalid("micro_batches: ", micro_batches, " must be in [1, grad_accum = ", max_micro_batches_, "]");
    }
    if (static_cast<int64_t>(inputs.size()) != want || static_cast<int64_t>(targets.size()) != want) {
      return invalid("inputs/targets: ", inputs.size(), "/", targets.size(), " tokens, expected ",
                     micro_batches, " x batch ", batch_, " x seq ", seq_, " = ", want);
    }
    std::copy(inputs.begin(), inputs.end(), host_tokens_);
    std::copy(targets.begin(), targets.end(), host_targets_);
    const size_t bytes = static_cast<size_t>(want) * sizeof(int32_t);
    FLARE_RETURN_IF_ERROR(cuda_status(cudaMemcpyAsync(tokens_, host_tokens_, bytes, cudaMemcpyHostToDevice, stream_), "tokens"));
    return cuda_status(cudaMemcpyAsync(targets_, host_targets_, bytes, cudaMemcpyHostToDevice, stream_), "targets");
  }

  Status copy_or_zero(const float* src, float* dst, size_t bytes) {
    if (src) return cuda_status(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "set_state");
    return cuda_status(cudaMemset(dst, 0, bytes), "set_state");
  }

  Status wait_idle() {
    if (pending_) return invalid("a step is in flight (step_end first)");
    return cuda_status(cudaStreamSynchronize(stream_), "device");
  }

  int64_t batch_ = 0, seq_ = 0, max_micro_batches_ = 1;
  ParameterLayout layout_;
  std::string name_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t done_ = nullptr;
  std::unique_ptr<cuda::GpuModel> model_;
  cuda::DeviceChunkTable table_;
  void* state_ = nullptr;
  float *master_ = nullptr, *m_ = nullptr, *v_ = nullptr, *norm_and_scale_ = nullptr;
  int32_t *tokens_ = nullptr, *targets_ = nullptr;
  double* loss_sum_ = nullptr;
  void* norm_scratch_ = nullptr;
  void* host_ = nullptr;
  int32_t *host_tokens_ = nullptr, *host_targets_ = nullptr;
  StepReadback* readback_ = nullptr;
  bool pending_ = false;
  int64_t valid_ = 0;
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
