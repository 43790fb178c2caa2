// cpu_backend.cpp — the training step on the CPU in fp32: cpu::CpuModel for the forward and
// backward, core/adamw.h for the optimizer. The model reads the fp32 master weights directly (no
// bf16 copy), so this is plain fp32 training: the reference the CUDA backend's numbers are judged
// against, and the backend CI trains with.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/message.h"
#include "train/cpu/model.h"
#include "train/loop/backend.h"

namespace flare::train {
namespace {

size_t sz(int64_t n) { return static_cast<size_t>(n); }

class CpuBackend final : public Backend {
 public:
  CpuBackend(std::unique_ptr<cpu::CpuModel> model, const TrainConfig& train)
      : model_(std::move(model)), batch_(train.batch), seq_(train.seq) {
    const int64_t n = model_->layout().total;
    master_.assign(sz(n), 0.0f);
    m_.assign(sz(n), 0.0f);
    v_.assign(sz(n), 0.0f);
    grads_.assign(sz(n), 0.0f);
  }

  DeviceKind kind() const override { return DeviceKind::kCpu; }
  std::string device_name() const override { return "cpu"; }

  Status set_state(const float* master, const float* m, const float* v) override {
    if (!master) return invalid("set_state: master must not be null");
    std::copy(master, master + master_.size(), master_.begin());
    copy_or_zero(m, &m_);
    copy_or_zero(v, &v_);
    return Status::ok_status();
  }

  Status get_state(float* master, float* m, float* v) override {
    if (master) std::copy(master_.begin(), master_.end(), master);
    if (m) std::copy(m_.begin(), m_.end(), m);
    if (v) std::copy(v_.begin(), v_.end(), v);
    return Status::ok_status();
  }

  Status step_begin(std::span<const int32_t> inputs, std::span<const int32_t> targets,
                    int64_t micro_batches, const AdamWStep& step, double grad_clip) override {
    const int64_t tokens = batch_ * seq_;
    FLARE_RETURN_IF_ERROR(check_batch(inputs, targets, micro_batches));
    pending_ = {};

    // Each micro-batch's backward adds the gradient of its own mean loss; the step's gradient is
    // their average when every micro-batch has the same number of valid targets (the loader's
    // full windows always do). Unequal counts would need a weight per micro-batch, which an
    // in-place accumulation cannot apply, so they are rejected.
    int64_t valid_total = 0;
    std::vector<int64_t> valid(sz(micro_batches));
    for (int64_t i = 0; i < micro_batches; ++i) {
      valid[sz(i)] = std::count_if(targets.begin() + i * tokens, targets.begin() + (i + 1) * tokens,
                                   [](int32_t t) { return t != -1; });
      valid_total += valid[sz(i)];
    }
    for (int64_t i = 1; i < micro_batches; ++i) {
      if (valid[sz(i)] != valid[0]) {
        return invalid("targets: micro-batch ", i, " has ", valid[sz(i)], " valid targets, micro-batch 0 has ",
                       valid[0], "; the CPU backend accumulates equal-weight micro-batches only");
      }
    }

    std::fill(grads_.begin(), grads_.end(), 0.0f);
    double loss_sum = 0.0;
    for (int64_t i = 0; i < micro_batches; ++i) {
      cpu::ClassifierResult r;
      FLARE_RETURN_IF_ERROR(model_->forward(master_.data(), inputs.data() + i * tokens,
                                            targets.data() + i * tokens, &r));
      FLARE_RETURN_IF_ERROR(model_->backward(master_.data(), grads_.data()));
      loss_sum += r.mean_loss * static_cast<double>(r.n_valid);
    }
    if (micro_batches > 1) {
      const float w = static_cast<float>(1.0 / static_cast<double>(micro_batches));
      for (float& g : grads_) g *= w;
    }

    const ParameterLayout& layout = model_->layout();
    pending_.loss = valid_total > 0 ? loss_sum / static_cast<double>(valid_total) : 0.0;
    pending_.grad_norm = gradient_norm(layout, grads_.data());
    if (!std::isfinite(pending_.grad_norm)) return Status::ok_status();  // skip: the trainer stops

    AdamWStep s = step;
    s.grad_scale = step.grad_scale * clip_scale(pending_.grad_norm, grad_clip);
    FLARE_RETURN_IF_ERROR(adamw_step(layout, s, grads_.data(), master_.data(), m_.data(), v_.data(),
                                     nullptr));
    pending_.updated = true;
    return Status::ok_status();
  }

  Status step_end(StepResult* result) override {
    *result = pending_;
    return Status::ok_status();
  }

  Status evaluate(std::span<const int32_t> inputs, std::span<const int32_t> targets,
                  double* loss_sum, int64_t* valid) override {
    FLARE_RETURN_IF_ERROR(check_batch(inputs, targets, 1));
    cpu::ClassifierResult r;
    FLARE_RETURN_IF_ERROR(model_->forward(master_.data(), inputs.data(), targets.data(), &r));
    *loss_sum = r.mean_loss * static_cast<double>(r.n_valid);
    *valid = r.n_valid;
    return Status::ok_status();
  }

  Status step_gradients(std::span<const int32_t> inputs, std::span<const int32_t> targets,
                        double* loss, float* grads, float* logits) override {
    FLARE_RETURN_IF_ERROR(check_batch(inputs, targets, 1));
    if (logits) {
      FLARE_RETURN_IF_ERROR(model_->forward(master_.data(), inputs.data(), nullptr, nullptr));
      std::copy(model_->logits().begin(), model_->logits().end(), logits);
    }
    cpu::ClassifierResult r;
    FLARE_RETURN_IF_ERROR(model_->forward(master_.data(), inputs.data(), targets.data(), &r));
    std::fill(grads_.begin(), grads_.end(), 0.0f);
    FLARE_RETURN_IF_ERROR(model_->backward(master_.data(), grads_.data()));
    std::copy(grads_.begin(), grads_.end(), grads);
    *loss = r.mean_loss;
    return Status::ok_status();
  }

  int64_t memory_bytes() const override {
    // The four state buffers; the model's activations are of the same order for tiny models and
    // are not counted.
    return static_cast<int64_t>(4 * master_.size() * sizeof(float));
  }

 private:
  static void copy_or_zero(const float* src, std::vector<float>* dst) {
    if (src) {
      std::copy(src, src + dst->size(), dst->begin());
    } else {
      std::fill(dst->begin(), dst->end(), 0.0f);
    }
  }

  Status check_batch(std::span<const int32_t> inputs, std::span<const int32_t> targets,
                     int64_t micro_batches) const {
    const int64_t want = micro_batches * batch_ * seq_;
    if (micro_batches < 1) return invalid("micro_batches: ", micro_batches, " must be >= 1");
    if (static_cast<int64_t>(inputs.size()) != want || static_cast<int64_t>(targets.size()) != want) {
      return invalid("inputs/targets: ", inputs.size(), "/", targets.size(), " tokens, expected ",
                     micro_batches, " x batch ", batch_, " x seq ", seq_, " = ", want);
    }
    return Status::ok_status();
  }

  std::unique_ptr<cpu::CpuModel> model_;
  int64_t batch_, seq_;
  std::vector<float> master_, m_, v_, grads_;
  StepResult pending_;
};

}  // namespace

const char* device_kind_name(DeviceKind kind) { return kind == DeviceKind::kCpu ? "cpu" : "cuda"; }

Status make_cpu_backend(const ModelConfig& model, const TrainConfig& train,
                        std::unique_ptr<Backend>* out) {
  std::unique_ptr<cpu::CpuModel> m;
  FLARE_RETURN_IF_ERROR(cpu::CpuModel::create(model, train.batch, train.seq, &m));
  *out = std::make_unique<CpuBackend>(std::move(m), train);
  return Status::ok_status();
}

}  // namespace flare::train
