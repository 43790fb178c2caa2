// cpu_backend.cpp — the training step on the CPU in fp32: cpu::CpuModel for the forward and
// backward, core/adamw.h for the optimizer. The model reads fp32 weights directly (no bf16 copy),
// so this is plain fp32 training: the reference the CUDA backend's numbers are judged against,
// and the backend CI trains with.
//
// Data parallel over an in-process communicator (backend.h): the same step as on CUDA without the
// overlap — the backward runs to the end, then each bucket is reduce-scattered in plan order, the
// shard's gradient norm is agreed, AdamW runs on the shard and the updated fp32 weights are
// all-gathered. One rank keeps its shard (master, m, v) beside the full weights the model reads;
// with one rank the shard is the whole buffer and the model reads the master weights themselves.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/message.h"
#include "train/cpu/model.h"
#include "train/dist/cp_rows.h"
#include "train/dist/dp_host.h"
#include "train/dist/dp_plan.h"
#include "train/loop/backend.h"

namespace flare::train {
namespace {

size_t sz(int64_t n) { return static_cast<size_t>(n); }

class CpuBackend final : public Backend {
 public:
  CpuBackend(std::unique_ptr<cpu::CpuModel> model, const TrainConfig& train, dist::Communicator* comm,
             dp::DpPlan plan)
      : model_(std::move(model)), batch_(train.batch), seq_(train.seq), comm_(comm),
        plan_(std::move(plan)) {
    rank_ = comm_ ? comm_->rank() : 0;
    const ParameterLayout& layout = model_->layout();
    shard_layout_ = dp::shard_layout(layout, plan_, rank_);
    const int64_t shard = plan_.shard_size(rank_);
    master_.assign(sz(shard), 0.0f);
    m_.assign(sz(shard), 0.0f);
    v_.assign(sz(shard), 0.0f);
    grads_.assign(sz(layout.total), 0.0f);
    if (world() > 1) {
      weights_.assign(sz(layout.total), 0.0f);
      shard_grads_.assign(sz(shard), 0.0f);
      staging_.assign(sz((world() - 1) * plan_.max_slice), 0.0f);
    }
  }

  DeviceKind kind() const override { return DeviceKind::kCpu; }
  std::string device_name() const override { return "cpu"; }

  Status set_state(const float* master, const float* m, const float* v) override {
    if (!master) return invalid("set_state: master must not be null");
    take_shard(master, &master_);
    take_shard(m, &m_);
    take_shard(v, &v_);
    if (world() > 1) std::copy(master, master + weights_.size(), weights_.begin());
    return Status::ok_status();
  }

  Status get_state(float* master, float* m, float* v) override {
    FLARE_RETURN_IF_ERROR(put_shard(master_, master));
    FLARE_RETURN_IF_ERROR(put_shard(m_, m));
    return put_shard(v_, v);
  }

  Status step_begin(std::span<const int32_t> full_inputs, std::span<const int32_t> full_targets,
                    int64_t micro_batches, const AdamWStep& step, double grad_clip) override {
    FLARE_RETURN_IF_ERROR(check_batch(full_inputs, full_targets, micro_batches));
    const std::span<const int32_t> inputs = own_rows(full_inputs, &local_inputs_);
    const std::span<const int32_t> targets = own_rows(full_targets, &local_targets_);
    const int64_t tokens = batch_ * model_->seq_len();
    pending_ = {};

    // Each micro-batch's backward adds the gradient of its own mean loss; the step's gradient is
    // their average when every micro-batch of every rank has the same number of valid targets
    // (the loader's full windows always do). Unequal counts would need a weight per micro-batch,
    // which an in-place accumulation cannot apply, so they are rejected — on every rank alike,
    // since the ranks compare the counts of all of them.
    std::vector<int64_t> valid(sz(micro_batches));
    for (int64_t i = 0; i < micro_batches; ++i) {
      valid[sz(i)] = std::count_if(targets.begin() + i * tokens, targets.begin() + (i + 1) * tokens,
                                   [](int32_t t) { return t != -1; });
    }
    std::vector<int64_t> all_valid = valid;
    if (world() > 1) FLARE_RETURN_IF_ERROR(dp::gather_values(*comm_, valid, &all_valid));
    int64_t valid_total = 0;
    for (size_t i = 0; i < all_valid.size(); ++i) {
      valid_total += all_valid[i];
      if (all_valid[i] != all_valid[0]) {
        const int64_t mb = static_cast<int64_t>(i) % micro_batches;
        return invalid("targets: micro-batch ", mb, world() > 1 ? cat(" of rank ", static_cast<int64_t>(i) / micro_batches) : "",
                       " has ", all_valid[i], " valid targets, micro-batch 0 has ", all_valid[0],
                       "; the CPU backend accumulates equal-weight micro-batches only");
      }
    }

    // The micro-batches, with no communication between them.
    std::fill(grads_.begin(), grads_.end(), 0.0f);
    double loss_sum = 0.0;
    for (int64_t i = 0; i < micro_batches; ++i) {
      cpu::ClassifierResult r;
      FLARE_RETURN_IF_ERROR(model_->forward(model_weights(), inputs.data() + i * tokens,
                                            targets.data() + i * tokens, &r));
      FLARE_RETURN_IF_ERROR(model_->backward(model_weights(), grads_.data()));
      loss_sum += r.mean_loss * static_cast<double>(r.n_valid);
    }

    // The step's mean gradient, this rank's shard of it: Σ over ranks, then / (ranks · micro-batches).
    FLARE_RETURN_IF_ERROR(reduce_scatter_gradients(static_cast<int64_t>(all_valid.size())));
    std::vector<double> loss_sums{loss_sum};
    if (world() > 1) FLARE_RETURN_IF_ERROR(dp::gather_values(*comm_, std::vector<double>{loss_sum}, &loss_sums));
    pending_.loss = valid_total > 0 ? dp::sum_in_order(loss_sums) / static_cast<double>(valid_total) : 0.0;
    FLARE_RETURN_IF_ERROR(global_gradient_norm(&pending_.grad_norm));
    if (!std::isfinite(pending_.grad_norm)) return Status::ok_status();  // skip: the trainer stops

    AdamWStep s = step;
    s.grad_scale = step.grad_scale * clip_scale(pending_.grad_norm, grad_clip);
    FLARE_RETURN_IF_ERROR(adamw_step(shard_layout_, s, shard_grads(), master_.data(), m_.data(),
                                     v_.data(), nullptr));
    FLARE_RETURN_IF_ERROR(all_gather_weights());
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
    FLARE_RETURN_IF_ERROR(model_->forward(model_weights(), own_rows(inputs, &local_inputs_).data(),
                                          own_rows(targets, &local_targets_).data(), &r));
    *loss_sum = r.mean_loss * static_cast<double>(r.n_valid);
    *valid = r.n_valid;
    return Status::ok_status();
  }

  Status step_gradients(std::span<const int32_t> inputs, std::span<const int32_t> targets,
                        double* loss, float* grads, float* logits) override {
    FLARE_RETURN_IF_ERROR(check_batch(inputs, targets, 1));
    if (model_->seq_len() != seq_) {
      return invalid("step_gradients: one rank's whole step, which a context-parallel rank does not hold");
    }
    if (logits) {
      FLARE_RETURN_IF_ERROR(model_->forward(model_weights(), inputs.data(), nullptr, nullptr));
      std::copy(model_->logits().begin(), model_->logits().end(), logits);
    }
    cpu::ClassifierResult r;
    FLARE_RETURN_IF_ERROR(model_->forward(model_weights(), inputs.data(), targets.data(), &r));
    std::fill(grads_.begin(), grads_.end(), 0.0f);
    FLARE_RETURN_IF_ERROR(model_->backward(model_weights(), grads_.data()));
    std::copy(grads_.begin(), grads_.end(), grads);
    *loss = r.mean_loss;
    return Status::ok_status();
  }

  int64_t memory_bytes() const override {
    // The state and gradient buffers; the model's activations are of the same order for tiny
    // models and are not counted.
    const size_t floats = master_.size() + m_.size() + v_.size() + grads_.size() + weights_.size() +
                          shard_grads_.size() + staging_.size();
    return static_cast<int64_t>(floats * sizeof(float));
  }

 private:
  int world() const { return plan_.world; }

  // One rank: the model reads the master weights (the shard is the whole buffer).
  const float* model_weights() const { return world() > 1 ? weights_.data() : master_.data(); }
  const float* shard_grads() const { return world() > 1 ? shard_grads_.data() : grads_.data(); }

  // This rank's shard of a full state tensor (zeros for null).
  void take_shard(const float* full, std::vector<float>* shard) const {
    if (full) {
      dp::full_to_shard(plan_, rank_, full, shard->data(), sizeof(float));
    } else {
      std::fill(shard->begin(), shard->end(), 0.0f);
    }
  }

  // A shard back into a full tensor: itself with one rank, a gather to rank 0 with several.
  Status put_shard(const std::vector<float>& shard, float* full) {
    if (world() == 1) {
      if (full) std::copy(shard.begin(), shard.end(), full);
      return Status::ok_status();
    }
    // Every rank takes part whatever it passed; rank 0 gathers into a scratch buffer for null.
    std::vector<float> unused;
    if (!full && rank_ == 0) {
      unused.resize(sz(plan_.total));
      full = unused.data();
    }
    const dp::CopyToHost copy = [](void* dst, const void* src, int64_t bytes) {
      std::copy_n(static_cast<const unsigned char*>(src), bytes, static_cast<unsigned char*>(dst));
      return Status::ok_status();
    };
    return dp::gather_shards_to_rank0(*comm_, plan_, shard.data(), staging_.data(), sizeof(float),
                                      full, copy);
  }

  // Sums every rank's gradient over this rank's slices, bucket by bucket in plan order, in rank
  // order, and divides by the number of equal-weight micro-batches of the step (all ranks').
  Status reduce_scatter_gradients(int64_t step_micro_batches) {
    const float mean = static_cast<float>(1.0 / static_cast<double>(step_micro_batches));
    if (world() == 1) {
      if (step_micro_batches > 1) {
        for (float& g : grads_) g *= mean;
      }
      return Status::ok_status();
    }
    for (const dp::Bucket& b : plan_.buckets) {
      const std::vector<dist::Transfer> t =
          dp::reduce_scatter_transfers(plan_, b, rank_, grads_.data(), staging_.data(), sizeof(float));
      if (!t.empty()) FLARE_RETURN_IF_ERROR(comm_->exchange(t.data(), static_cast<int>(t.size())));
      const int64_t n = b.slice_size(rank_);
      const float* own = grads_.data() + b.slice_begin[sz(rank_)];
      float* out = shard_grads_.data() + b.shard_offset[sz(rank_)];
      for (int64_t i = 0; i < n; ++i) {
        float acc = 0.0f;
        for (int q = 0; q < world(); ++q) {
          acc += q == rank_ ? own[i] : staging_[sz(dp::staging_slot(q, rank_) * plan_.max_slice + i)];
        }
        out[i] = acc * mean;
      }
    }
    return Status::ok_status();
  }

  // ‖gradient‖₂ over every rank's shard: squares summed in double over this shard's pieces (for
  // one rank, core's gradient_norm order exactly), the ranks' sums added in rank order.
  Status global_gradient_norm(double* norm) {
    const float* g = shard_grads();
    double sum = 0.0;
    for (const ParamSpec& p : shard_layout_.params) {
      for (int64_t i = p.offset; i < p.offset + p.numel; ++i) sum += static_cast<double>(g[i]) * g[i];
    }
    std::vector<double> sums{sum};
    if (world() > 1) FLARE_RETURN_IF_ERROR(dp::gather_values(*comm_, std::vector<double>{sum}, &sums));
    *norm = std::sqrt(dp::sum_in_order(sums));
    return Status::ok_status();
  }

  // Every rank's updated slices into every rank's full weights.
  Status all_gather_weights() {
    if (world() == 1) return Status::ok_status();
    for (const dp::Bucket& b : plan_.buckets) {
      std::copy_n(master_.data() + b.shard_offset[sz(rank_)], b.slice_size(rank_),
                  weights_.data() + b.slice_begin[sz(rank_)]);
      const std::vector<dist::Transfer> t =
          dp::all_gather_transfers(plan_, b, rank_, master_.data(), weights_.data(), sizeof(float));
      if (!t.empty()) FLARE_RETURN_IF_ERROR(comm_->exchange(t.data(), static_cast<int>(t.size())));
    }
    return Status::ok_status();
  }

  // This rank's rows of (micro-batches · batch) sequences of seq_ tokens (cp_rows.h).
  std::span<const int32_t> own_rows(std::span<const int32_t> full, std::vector<int32_t>* local) const {
    return dp::gather_rows(full, seq_, model_->positions(), local);
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
  dist::Communicator* comm_;  // null: one rank
  dp::DpPlan plan_;
  int rank_ = 0;
  ParameterLayout shard_layout_;
  std::vector<float> master_, m_, v_;  // this rank's shard
  std::vector<float> grads_;           // the full gradient this rank's micro-batches add into
  std::vector<float> weights_;         // several ranks: the full weights the model reads
  std::vector<float> shard_grads_;     // several ranks: the reduced gradient of the shard
  std::vector<float> staging_;         // several ranks: the other ranks' slices of one bucket
  std::vector<int32_t> local_inputs_, local_targets_;  // context parallel: this rank's rows
  StepResult pending_;
};

}  // namespace

const char* device_kind_name(DeviceKind kind) { return kind == DeviceKind::kCpu ? "cpu" : "cuda"; }

Status context_parallel_ranks(const BackendOptions& options, int* cp) {
  *cp = 1;
  const dist::Communicator* group = options.cp_comm;
  if (!group || group->size() == 1) return Status::ok_status();
  const dist::Communicator* all = options.comm;
  if (!all) {
    return invalid("cp_comm: context parallelism needs comm too, the communicator of every rank "
                   "(the gradients are reduced over all of them)");
  }
  if (all->size() % group->size() != 0 || group->rank() != all->rank() % group->size()) {
    return invalid("cp_comm: its rank ", group->rank(), " of ", group->size(), " does not sit at comm rank ",
                   all->rank(), " of ", all->size(), ": context-parallel groups are consecutive ranks "
                   "of comm, group g holding ranks g x ", group->size(), " onwards");
  }
  *cp = group->size();
  return Status::ok_status();
}

Status make_cpu_backend(const ModelConfig& model, const TrainConfig& train,
                        std::unique_ptr<Backend>* out) {
  return make_cpu_backend(model, train, BackendOptions{}, out);
}

Status make_cpu_backend(const ModelConfig& model, const TrainConfig& train,
                        const BackendOptions& options, std::unique_ptr<Backend>* out) {
  dist::Communicator* comm = options.comm;
  if (comm && comm->device() != DeviceType::kCPU) {
    return invalid("comm: the CPU backend needs a communicator over host memory (in-process), got ",
                   comm->kind());
  }
  if (train.bf16_grads) {
    return invalid("bf16_grads: bf16 gradients are a CUDA backend option (the CPU backend's are fp32)");
  }
  if (train.shard_gradients && comm && comm->size() > 1) {
    return invalid("shard_gradients: sharded gradients (ZeRO-2) are built for the CUDA backend; the CPU "
                   "backend's data parallelism keeps whole gradients (ZeRO-1)");
  }
  int cp_ranks = 1;
  FLARE_RETURN_IF_ERROR(context_parallel_ranks(options, &cp_ranks));
  std::unique_ptr<cpu::CpuModel> m;
  FLARE_RETURN_IF_ERROR(cpu::CpuModel::create(model, train.batch, train.seq, &m,
                                              cp_ranks > 1 ? options.cp_comm : nullptr,
                                              options.attention_backend));
  dp::DpPlan plan;
  FLARE_RETURN_IF_ERROR(dp::make_dp_plan(m->layout(), model.n_layer, comm ? comm->size() : 1,
                                         options.bucket_bytes, &plan));
  *out = std::make_unique<CpuBackend>(std::move(m), train, comm, std::move(plan));
  return Status::ok_status();
}

}  // namespace flare::train
