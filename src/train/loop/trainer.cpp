// trainer.cpp — the training loop of trainer.h: setup, one step read top to bottom, evaluation,
// checkpoints, and the report's text and JSON forms.
#include "train/loop/trainer.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <numeric>
#include <sstream>
#include <utility>

#include "core/message.h"
#include "train/core/checkpoint.h"
#include "train/core/schedule.h"
#include "train/dist/dp_host.h"
#include "train/loop/init.h"

namespace flare::train {
namespace {

size_t sz(int64_t n) { return static_cast<size_t>(n); }

Status open_loader(const std::string& field, const std::string& pattern, const ModelConfig& model,
                   const TrainConfig& train, bool shuffle, int rank, int world, DataLoader* loader) {
  DataLoaderConfig c;
  c.rank = rank;
  c.world_size = world;
  Status s = expand_shard_pattern(pattern, &c.shards);
  if (!s.ok()) return invalid(field, ": ", s.message());
  c.batch_size = train.batch;
  c.seq_len = train.seq;
  c.vocab_size = model.vocab_size;
  c.shuffle = shuffle;
  c.seed = train.seed;
  s = DataLoader::open(c, loader);
  if (!s.ok()) return Status(s.code(), cat(field, ": ", s.message()));
  if (loader->batches_per_epoch() < 1) {
    return invalid(field, ": '", pattern, "' holds ", loader->total_windows(), " windows of seq ",
                   train.seq, " + 1 tokens, fewer than one batch of ", train.batch, " x ", world,
                   " ranks");
  }
  return Status::ok_status();
}

// A JSON number: finite values as %.9g, anything else as null (JSON has no NaN).
std::string json_number(double x) {
  if (!std::isfinite(x)) return "null";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", x);
  return buf;
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char ch : s) {
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (static_cast<unsigned char>(ch) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(ch));
      out += buf;
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

// 1234567 → "1,234,567".
std::string thousands(double x) {
  const std::string digits = std::to_string(static_cast<long long>(std::llround(x)));
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    const size_t left = digits.size() - i;  // digits from here to the end
    if (i > 0 && left % 3 == 0 && digits[i - 1] != '-') out.push_back(',');
    out.push_back(digits[i]);
  }
  return out;
}

// A raw little-endian fp32 file of exactly weights->size() values (the layout's flat buffer).
Status read_flat_weights(const std::string& path, HostArray<float>* weights) {
  std::error_code ec;
  const auto bytes = std::filesystem::file_size(path, ec);
  const auto want = static_cast<uintmax_t>(weights->size()) * sizeof(float);
  if (ec) return invalid("init_weights: cannot read '", path, "': ", ec.message());
  if (bytes != want) {
    return invalid("init_weights: '", path, "' has ", bytes, " bytes, the model's flat buffer is ",
                   weights->size(), " fp32 = ", want, " bytes");
  }
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return invalid("init_weights: cannot open '", path, "'");
  const size_t got = std::fread(weights->data(), sizeof(float), sz(weights->size()), f);
  std::fclose(f);
  if (got != sz(weights->size())) return invalid("init_weights: reading '", path, "' failed");
  for (int64_t i = 0; i < weights->size(); ++i) {
    if (!std::isfinite(weights->data()[i])) return invalid("init_weights: '", path, "' holds a non-finite weight");
  }
  return Status::ok_status();
}

}  // namespace

// ---- Peak FLOP/s and the report's forms -----------------------------------------------------------

double peak_bf16_flops(const std::string& device_name) {
  // Dense (no sparsity) bf16 tensor-core peaks from the vendors' data sheets, most specific name
  // first: "H100 PCIe" must not match the SXM line.
  struct Peak {
    const char* name_part;
    double flops;
  };
  static const Peak kPeaks[] = {
      {"GH200", 989e12},    {"H200", 989e12},     {"H100 PCIe", 756e12}, {"H100 NVL", 835e12},
      {"H100", 989e12},     {"H800", 989e12},     {"A100", 312e12},      {"A800", 312e12},
      {"L40S", 362e12},     {"L40", 181e12},      {"L4", 121e12},        {"A10G", 70e12},
      {"RTX 4090", 165e12}, {"RTX 3090", 71e12},  {"B200", 2250e12},     {"B100", 1750e12},
  };
  for (const Peak& p : kPeaks) {
    if (device_name.find(p.name_part) != std::string::npos) return p.flops;
  }
  return 0.0;
}

std::string format_step(const StepReport& r) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "step %6lld/%lld | loss %.4f | lr %.2e | norm %.3f | %.1f ms | ",
                static_cast<long long>(r.step), static_cast<long long>(r.steps), r.loss, r.lr,
                r.grad_norm, r.step_ms);
  std::string line = buf;
  line += thousands(r.tokens_per_s) + " tok/s";
  if (r.mfu > 0) {
    std::snprintf(buf, sizeof buf, " | MFU %.1f%%", 100.0 * r.mfu);
    line += buf;
  }
  std::snprintf(buf, sizeof buf, " | mem %.2f GiB", static_cast<double>(r.memory_bytes) / (1 << 30));
  line += buf;
  if (r.world > 1 && r.timing.measured) {
    std::snprintf(buf, sizeof buf, " | comm %.1f ms, %.1f exposed", r.timing.comm_ms, r.timing.comm_exposed_ms);
    line += buf;
  }
  if (r.cp > 1 && r.timing.measured) {
    std::snprintf(buf, sizeof buf, " | attention comm %.1f ms", r.timing.cp_comm_ms);
    line += buf;
  }
  if (r.has_val) {
    std::snprintf(buf, sizeof buf, " | val %.4f", r.val_loss);
    line += buf;
  }
  if (!r.checkpoint.empty()) line += " | saved " + r.checkpoint;
  return line;
}

std::string step_json(const StepReport& r) {
  std::ostringstream s;
  s << "{\"step\": " << r.step << ", \"steps\": " << r.steps << ", \"loss\": " << json_number(r.loss)
    << ", \"lr\": " << json_number(r.lr) << ", \"grad_norm\": " << json_number(r.grad_norm)
    << ", \"step_ms\": " << json_number(r.step_ms)
    << ", \"tokens_per_s\": " << json_number(r.tokens_per_s) << ", \"mfu\": " << json_number(r.mfu)
    << ", \"memory_bytes\": " << r.memory_bytes;
  if (r.timing.measured) {
    const StepTiming& t = r.timing;
    const double gbps = t.comm_ms > 0 ? static_cast<double>(t.comm_bytes) / (t.comm_ms * 1e6) : 0.0;
    s << ", \"dp\": " << r.world / r.cp << ", \"cp\": " << r.cp << ", \"fwd_ms\": " << json_number(t.fwd_ms)
      << ", \"bwd_ms\": " << json_number(t.bwd_ms) << ", \"comm_ms\": " << json_number(t.comm_ms)
      << ", \"comm_exposed_ms\": " << json_number(t.comm_exposed_ms)
      << ", \"optimizer_ms\": " << json_number(t.optimizer_ms) << ", \"comm_bytes\": " << t.comm_bytes
      << ", \"cp_comm_ms\": " << json_number(t.cp_comm_ms) << ", \"cp_comm_bytes\": " << t.cp_comm_bytes
      << ", \"comm_gbps\": " << json_number(gbps) << ", \"peak_memory_bytes\": " << r.peak_memory_bytes;
  }
  if (r.has_val) s << ", \"val_loss\": " << json_number(r.val_loss);
  if (!r.checkpoint.empty()) s << ", \"checkpoint\": " << json_string(r.checkpoint);
  s << "}";
  return s.str();
}

// ---- Setup ----------------------------------------------------------------------------------------

Trainer::~Trainer() {
  if (log_) std::fclose(log_);
}

Status Trainer::create(const TrainerOptions& options, std::unique_ptr<Trainer>* out) {
  const ModelConfig& model = options.model;
  const TrainConfig& train = options.train;
  FLARE_RETURN_IF_ERROR(validate_model_config(model));
  FLARE_RETURN_IF_ERROR(validate_train_config(train, model));
  if (train.train_data.empty()) return invalid("train_data: must name the training shards");
  if (options.eval_batches < 1) {
    return invalid("eval_batches: ", options.eval_batches, " must be >= 1");
  }
  if (!std::isfinite(options.peak_flops) || options.peak_flops < 0) {
    return invalid("peak_flops: ", options.peak_flops, " must be finite and >= 0 (0: from the device)");
  }

  std::unique_ptr<Trainer> t(new Trainer());
  t->options_ = options;
  t->layout_ = parameter_layout(model);
  if (dist::Communicator* comm = options.backend.comm) {
    t->rank_ = comm->rank();
    t->world_ = comm->size();
  }
  FLARE_RETURN_IF_ERROR(context_parallel_ranks(options.backend, &t->cp_));
  // Each context-parallel group reads one data-parallel rank's share of the batches.
  FLARE_RETURN_IF_ERROR(open_loader("train_data", train.train_data, model, train, true, t->rank_ / t->cp_,
                                    t->world_ / t->cp_, &t->train_loader_));
  // Validation runs on rank 0's context-parallel group alone (rank 0 alone without one), over the
  // same batches whatever the world size.
  if (train.eval_every > 0 && t->rank_ < t->cp_) {
    FLARE_RETURN_IF_ERROR(open_loader("val_data", train.val_data, model, train, false, 0, 1,
                                      &t->val_loader_));
    t->have_val_ = true;
    t->val_batches_ = std::min(options.eval_batches, t->val_loader_.batches_per_epoch());
  }

  // The state: a checkpoint's (checked against this model before anything is read into the
  // buffers) or a fresh initialisation.
  const int64_t n = t->layout_.total;
  HostArray<float> master(n), m, v;
  if (!options.resume_from.empty() && !options.init_weights.empty()) {
    return invalid("init_weights: conflicts with resume_from (a resumed run takes its weights from the checkpoint)");
  }
  if (!options.resume_from.empty()) {
    m = HostArray<float>(n);
    v = HostArray<float>(n);
    CheckpointMeta meta;
    FLARE_RETURN_IF_ERROR(load_checkpoint(options.resume_from, model, &meta, master.data(),
                                          m.data(), v.data(), n));
    if (meta.step > train.steps) {
      return invalid("steps: ", train.steps, " is fewer than the ", meta.step,
                     " steps the checkpoint '", options.resume_from, "' has done");
    }
    Status s = t->train_loader_.restore_position(meta.loader_state);
    if (!s.ok()) return invalid("resume_from: '", options.resume_from, "': ", s.message());
    t->step_ = meta.step;
  } else if (!options.init_weights.empty()) {
    FLARE_RETURN_IF_ERROR(read_flat_weights(options.init_weights, &master));
  } else {
    init_parameters(t->layout_, train.seed, master.data());
  }
  t->loader_position_ = t->train_loader_.save_position();

  if (options.device == DeviceKind::kCpu) {
    FLARE_RETURN_IF_ERROR(make_cpu_backend(model, train, options.backend, &t->backend_));
  } else {
    FLARE_RETURN_IF_ERROR(make_cuda_backend(model, train, options.backend, &t->backend_));
  }
  FLARE_RETURN_IF_ERROR(t->backend_->set_state(master.data(), m.empty() ? nullptr : m.data(),
                                               v.empty() ? nullptr : v.data()));

  t->flops_per_token_ = model_flops_per_token(model, train.seq);
  t->peak_flops_ = options.peak_flops > 0 ? options.peak_flops
                                          : peak_bf16_flops(t->backend_->device_name());
  if (!options.log_path.empty() && t->rank_ == 0) {
    t->log_ = std::fopen(options.log_path.c_str(), "a");
    if (!t->log_) return invalid("log_path: cannot open '", options.log_path, "' for appending");
  }
  *out = std::move(t);
  return Status::ok_status();
}

// ---- The loop -------------------------------------------------------------------------------------

// The grad_accum micro-batches of one step, and the loader's position after them.
Status Trainer::load_step_batches(std::vector<int32_t>* inputs, std::vector<int32_t>* targets,
                                  std::vector<uint8_t>* position_after) {
  const TrainConfig& c = options_.train;
  const int64_t tokens = c.batch * c.seq;
  inputs->resize(sz(c.grad_accum * tokens));
  targets->resize(sz(c.grad_accum * tokens));
  for (int64_t i = 0; i < c.grad_accum; ++i) {
    FLARE_RETURN_IF_ERROR(train_loader_.next_batch(
        std::span<int32_t>(inputs->data() + i * tokens, sz(tokens)),
        std::span<int32_t>(targets->data() + i * tokens, sz(tokens))));
  }
  *position_after = train_loader_.save_position();
  return Status::ok_status();
}

Status Trainer::run(int64_t until_step, const std::function<void(const StepReport&)>& on_step) {
  const TrainConfig& c = options_.train;
  if (until_step < step_ || until_step > c.steps) {
    return invalid("until_step: ", until_step, " must be in [", step_, " (steps done), steps = ",
                   c.steps, "]");
  }
  if (step_ == until_step) return Status::ok_status();
  using Clock = std::chrono::steady_clock;
  const double step_tokens = static_cast<double>(world_ / cp_ * c.grad_accum * c.batch * c.seq);

  std::vector<int32_t> inputs, targets, next_inputs, next_targets;
  std::vector<uint8_t> position, next_position;
  auto last_report = Clock::now();
  FLARE_RETURN_IF_ERROR(load_step_batches(&inputs, &targets, &position));

  while (step_ < until_step) {
    const int64_t s = step_;  // 0-based index of this step
    AdamWStep adam;
    adam.t = s + 1;
    adam.lr = learning_rate(c, s);
    adam.beta1 = c.beta1;
    adam.beta2 = c.beta2;
    adam.eps = c.eps;
    adam.weight_decay = c.weight_decay;
    FLARE_RETURN_IF_ERROR(backend_->step_begin(inputs, targets, c.grad_accum, adam, c.grad_clip));
    // The next step's data is read while the device runs this one.
    const bool more = s + 1 < until_step;
    if (more) FLARE_RETURN_IF_ERROR(load_step_batches(&next_inputs, &next_targets, &next_position));
    StepResult result;
    FLARE_RETURN_IF_ERROR(backend_->step_end(&result));
    const auto now = Clock::now();
    if (!std::isfinite(result.loss) || !std::isfinite(result.grad_norm)) {
      return Status::internal(cat("step ", s + 1, ": loss ", result.loss, ", gradient norm ",
                                  result.grad_norm, " is not finite; stopping (try a lower lr, or "
                                  "resume from the last checkpoint)"));
    }
    step_ = s + 1;
    loader_position_ = position;

    StepReport r;
    r.step = step_;
    r.steps = c.steps;
    r.loss = result.loss;
    r.lr = adam.lr;
    r.grad_norm = result.grad_norm;
    r.step_ms = std::chrono::duration<double, std::milli>(now - last_report).count();
    r.tokens_per_s = r.step_ms > 0 ? step_tokens / (r.step_ms * 1e-3) : 0.0;
    r.mfu = peak_flops_ > 0 ? flops_per_token_ * r.tokens_per_s / (peak_flops_ * world_) : 0.0;
    r.memory_bytes = backend_->memory_bytes();
    r.peak_memory_bytes = backend_->peak_memory_bytes();
    r.timing = result.timing;
    r.world = world_;
    r.cp = cp_;
    const bool last = step_ == c.steps;
    if (have_val_ && (step_ % c.eval_every == 0 || last)) {
      FLARE_RETURN_IF_ERROR(evaluate(&r.val_loss));
      r.has_val = true;
    }
    const bool checkpoint_due = c.ckpt_every > 0 && step_ % c.ckpt_every == 0;
    if (!c.checkpoint_dir.empty() && (checkpoint_due || last)) {
      r.checkpoint = checkpoint_path(step_);
      FLARE_RETURN_IF_ERROR(save_checkpoint(r.checkpoint));
    }
    FLARE_RETURN_IF_ERROR(append_log(r));
    if (on_step) on_step(r);
    // Evaluation, checkpoints and the caller's printing are not the step's time.
    last_report = Clock::now();

    std::swap(inputs, next_inputs);
    std::swap(targets, next_targets);
    std::swap(position, next_position);
  }
  return Status::ok_status();
}

Status Trainer::next_batch(std::vector<int32_t>* inputs, std::vector<int32_t>* targets) {
  const int64_t tokens = options_.train.batch * options_.train.seq;
  inputs->resize(sz(tokens));
  targets->resize(sz(tokens));
  return train_loader_.next_batch(*inputs, *targets);
}

Status Trainer::evaluate(double* val_loss) {
  if (!have_val_) return invalid("evaluate: no validation data (val_data with eval_every > 0)");
  const TrainConfig& c = options_.train;
  const int64_t tokens = c.batch * c.seq;
  std::vector<int32_t> inputs(sz(tokens)), targets(sz(tokens));
  val_loader_.reset();
  double loss_sum = 0.0;
  int64_t valid = 0;
  for (int64_t i = 0; i < val_batches_; ++i) {
    FLARE_RETURN_IF_ERROR(val_loader_.next_batch(inputs, targets));
    double batch_sum = 0.0;
    int64_t batch_valid = 0;
    FLARE_RETURN_IF_ERROR(backend_->evaluate(inputs, targets, &batch_sum, &batch_valid));
    loss_sum += batch_sum;
    valid += batch_valid;
  }
  if (cp_ > 1) {  // each rank of the group holds its rows of every sequence: their sums, in rank order
    dist::Communicator& group = *options_.backend.cp_comm;
    std::vector<double> sums;
    std::vector<int64_t> counts;
    FLARE_RETURN_IF_ERROR(dp::gather_values(group, std::vector<double>{loss_sum}, &sums));
    FLARE_RETURN_IF_ERROR(dp::gather_values(group, std::vector<int64_t>{valid}, &counts));
    loss_sum = dp::sum_in_order(sums);
    valid = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  }
  *val_loss = valid > 0 ? loss_sum / static_cast<double>(valid) : 0.0;
  return Status::ok_status();
}

// ---- Checkpoints and the log ----------------------------------------------------------------------

std::string Trainer::checkpoint_path(int64_t step) const {
  char name[32];
  std::snprintf(name, sizeof name, "step_%06lld.ckpt", static_cast<long long>(step));
  return (std::filesystem::path(options_.train.checkpoint_dir) / name).string();
}

Status Trainer::save_checkpoint(const std::string& path) {
  const int64_t n = layout_.total;
  // Rank 0 gathers the whole state; the others only send their shards.
  const int64_t held = rank_ == 0 ? n : 0;
  HostArray<float> master(held), m(held), v(held);
  FLARE_RETURN_IF_ERROR(backend_->get_state(master.data(), m.data(), v.data()));
  Status written = rank_ == 0 ? write_checkpoint(path, master, m, v) : Status::ok_status();
  if (world_ == 1) return written;
  // The ranks wait for rank 0's write and learn its outcome (a dead peer fails the wait at the
  // communicator's timeout; an unwritten checkpoint leaves the previous one whole).
  std::vector<int64_t> outcome;
  FLARE_RETURN_IF_ERROR(dp::gather_values(*options_.backend.comm,
                                          std::vector<int64_t>{written.ok() ? 1 : 0}, &outcome));
  if (!written.ok()) return written;
  if (outcome[0] != 1) return Status::internal(cat("checkpoint '", path, "': rank 0 failed to write it"));
  return Status::ok_status();
}

Status Trainer::write_checkpoint(const std::string& path, const HostArray<float>& master,
                                 const HostArray<float>& m, const HostArray<float>& v) const {
  const int64_t n = layout_.total;
  CheckpointMeta meta;
  meta.model = options_.model;
  meta.train = options_.train;
  meta.step = step_;
  meta.rng_seed = options_.train.seed;
  meta.rng_offset = 0;  // training draws nothing after the initialisation (init.h)
  meta.loader_state = loader_position_;
  const std::filesystem::path dir = std::filesystem::path(path).parent_path();
  if (!dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) return invalid("checkpoint_dir: cannot create '", dir.string(), "': ", ec.message());
  }
  return flare::train::save_checkpoint(path, meta, master.data(), m.data(), v.data(), n);
}

Status Trainer::append_log(const StepReport& report) {
  if (!log_) return Status::ok_status();
  const std::string line = step_json(report) + "\n";
  if (std::fputs(line.c_str(), log_) < 0 || std::fflush(log_) != 0) {
    return invalid("log_path: writing '", options_.log_path, "' failed");
  }
  return Status::ok_status();
}

}  // namespace flare::train
