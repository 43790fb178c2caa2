// main.cpp — flare-train, the command line of the training loop (src/train/loop/trainer.h).
//
//   flare-train --model NAME [flags]      train (the `train` command word is optional)
//   mpirun -np N flare-train train ...    data parallel over N GPUs, one process each (also
//                                         torchrun-style: RANK, WORLD_SIZE, LOCAL_RANK,
//                                         MASTER_ADDR, MASTER_PORT in the environment)
//   flare-train sample --checkpoint PATH  generate a few tokens from a checkpoint
//   flare-train synth-data --out DIR      random-token shards (benchmarks without a corpus)
//   flare-train models                    the model presets
//
// Every flag and config rule is checked before anything is written: a bad command line exits
// with status 2 and a message naming the flag; a failed run exits with 1. Under a launch, each
// process is one rank on CUDA device LOCAL_RANK with an NCCL communicator from the launch
// environment; only rank 0 prints, logs and writes checkpoints, and any rank reports its own
// failure on stderr, prefixed with its rank.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "flags.h"
#include "flare/attention.h"
#include "flare/dist.h"
#include "train/core/atomic_file.h"
#include "train/core/checkpoint.h"
#include "train/core/model_config.h"
#include "train/core/train_config.h"
#include "train/data/shard.h"
#include "train/data/tokenizer.h"
#include "train/loop/sample.h"
#include "train/loop/trainer.h"

namespace fs = std::filesystem;
using flare::Status;
using flare::StatusCode;
using flare::train_cli::Flags;
using flare::train_cli::UsageError;
namespace ft = flare::train;

namespace {

constexpr const char* kDefaultData = "data/pydoc";

// A failed run (not the command line's fault): exit status 1.
struct RunError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// "rank 3: " under a launch of several processes (errors say which rank failed), else empty.
std::string g_rank_prefix;

// Library messages start with the config field they are about ("grad_accum: 0 must be …"); on
// the command line that field is a flag, so it is named as the flag.
std::string flag_for_field(const std::string& message) {
  static const std::pair<const char*, const char*> kFields[] = {
      {"batch", "--batch"},           {"seq", "--seq"},
      {"grad_accum", "--grad-accum"}, {"steps", "--steps"},
      {"lr", "--lr"},                 {"min_lr", "--min-lr"},
      {"warmup", "--warmup"},         {"weight_decay", "--weight-decay"},
      {"beta1", "--beta1"},           {"beta2", "--beta2"},
      {"eps", "--eps"},               {"grad_clip", "--grad-clip"},
      {"eval_every", "--eval-every"}, {"ckpt_every", "--ckpt-every"},
      {"val_data", "--val-data"},     {"train_data", "--train-data (or --data)"},
      {"checkpoint_dir", "--ckpt-dir"}, {"n_layer", "--n-layer"},
      {"d_model", "--d-model"},       {"n_head", "--n-head"},
      {"n_kv_head", "--n-kv-head"},   {"head_dim", "--head-dim"},
      {"ffn_hidden", "--ffn-hidden"}, {"max_seq", "--max-seq"},
      {"vocab_size", "--vocab"},      {"padded_vocab", "--vocab"},
      {"norm_eps", "--norm-eps"},     {"rope_theta", "--rope-theta"},
      {"resume_from", "--resume"},    {"log_path", "--log"},
      {"peak_flops", "--peak-tflops"}, {"eval_batches", "--eval-batches"},
      {"init_weights", "--init-weights"}, {"device_index", "--device-index"},
      {"bucket_bytes", "--bucket-mb"}, {"shard_gradients", "--zero"},
  };
  const size_t colon = message.find(':');
  if (colon == std::string::npos) return message;
  const std::string field = message.substr(0, colon);
  for (const auto& [name, flag] : kFields) {
    if (field == name) return std::string(flag) + message.substr(colon);
  }
  return message;
}

void check_config(const Status& s) {
  if (s.ok()) return;
  if (s.code() == StatusCode::kInvalidArgument) throw UsageError(flag_for_field(s.message()));
  throw RunError(s.to_string());
}

void check_run(const Status& s) {
  if (!s.ok()) throw RunError(s.to_string());
}

std::string preset_list() {
  std::string names;
  for (const std::string& n : ft::model_preset_names()) names += (names.empty() ? "" : ", ") + n;
  return names;
}

// ---- train ----------------------------------------------------------------------------------------

struct TrainFlags {
  std::optional<std::string> model, data, train_data, val_data, device, ckpt_dir, resume, log, prompt,
      init_weights, dump_step;
  std::optional<int64_t> batch, seq, grad_accum, steps, warmup, eval_every, eval_batches, ckpt_every,
      seed, sample, top_k, device_index, dp_timeout_ms, bucket_mb, cp, zero;
  std::optional<int64_t> n_layer, d_model, n_head, n_kv_head, head_dim, ffn_hidden, max_seq, vocab;
  std::optional<double> lr, min_lr, weight_decay, beta1, beta2, eps, grad_clip, peak_tflops,
      norm_eps, rope_theta;
  bool recompute = false, bf16_grads = false, nondeterministic = false, no_checkpoint = false;

  void declare(Flags* f) {
    constexpr int64_t kBig = int64_t{1} << 40;
    f->add_string("model", &model, "model preset (required; `flare-train models` lists them)");
    f->add_string("data", &data, "directory made by scripts/prepare_data.py (default data/pydoc)");
    f->add_string("train-data", &train_data, "training shards pattern (default DATA/*_train_*.bin)");
    f->add_string("val-data", &val_data, "validation shards pattern (default DATA/*_val_*.bin)");
    f->add_string("device", &device, "cpu or cuda (default: cuda when built with CUDA)");
    f->add_int("device-index", &device_index, 0, 1023,
               "CUDA device ordinal (default 0; under a launch: LOCAL_RANK)");
    f->add_int("dp-timeout-ms", &dp_timeout_ms, 1, int64_t{1} << 30,
               "launch: a collective or the rendezvous not complete within this fails the run "
               "(default 600000; NCCL's first operation can be slow)");
    f->add_int("bucket-mb", &bucket_mb, 1, 1 << 16,
               "launch: gradient bucket target in MiB for the overlapped reduce-scatter (default 25)");
    f->add_int("zero", &zero, 1, 2,
               "launch: ZeRO stage (default 1): 1 shards the optimizer state over the data-parallel "
               "ranks, 2 the gradients too (each rank holds only the backward stages in flight; with "
               "--grad-accum every micro-batch's gradients are reduced)");
    f->add_int("cp", &cp, 1, 1 << 16,
               "launch: context-parallel ranks per sequence (default 1): consecutive ranks share each "
               "sequence (zigzag layout, ring attention between them), groups of them are data parallel"),
    f->add_int("batch", &batch, -kBig, kBig, "sequences per micro-batch (default 8)");
    f->add_int("seq", &seq, -kBig, kBig, "tokens per sequence (default min(1024, max_seq))");
    f->add_int("grad-accum", &grad_accum, -kBig, kBig, "micro-batches per optimizer step (default 1)");
    f->add_int("steps", &steps, -kBig, kBig, "optimizer steps (default 1000)");
    f->add_double("lr", &lr, -1e30, 1e30, "peak learning rate (default 6e-4)");
    f->add_double("min-lr", &min_lr, -1e30, 1e30, "final learning rate of the cosine (default lr/10)");
    f->add_int("warmup", &warmup, -kBig, kBig, "linear warm-up steps (default min(100, steps/10))");
    f->add_double("weight-decay", &weight_decay, -1e30, 1e30, "AdamW weight decay (default 0.1)");
    f->add_double("beta1", &beta1, -1e30, 1e30, "AdamW beta1 (default 0.9)");
    f->add_double("beta2", &beta2, -1e30, 1e30, "AdamW beta2 (default 0.95)");
    f->add_double("eps", &eps, -1e30, 1e30, "AdamW epsilon (default 1e-8)");
    f->add_double("grad-clip", &grad_clip, -1e30, 1e30, "global gradient-norm clip, 0 = off (default 1)");
    f->add_int("seed", &seed, 0, kBig, "initialisation and data-order seed (default 1337)");
    f->add_switch("recompute", &recompute, "recompute each layer in the backward (less memory)");
    f->add_switch("bf16-grads", &bf16_grads,
                  "CUDA, one rank, --grad-accum 1: gradients in bf16 (less memory and traffic)");
    f->add_switch("nondeterministic", &nondeterministic,
                  "CUDA: allow a faster, not bitwise-reproducible attention backward");
    f->add_int("eval-every", &eval_every, -kBig, kBig,
               "steps between validation passes, 0 = never (default 100 with validation data)");
    f->add_int("eval-batches", &eval_batches, -kBig, kBig, "batches per validation pass (default 8)");
    f->add_int("ckpt-every", &ckpt_every, -kBig, kBig, "steps between checkpoints (default 0: only at the end)");
    f->add_string("ckpt-dir", &ckpt_dir, "checkpoint directory (default checkpoints/MODEL)");
    f->add_switch("no-checkpoint", &no_checkpoint, "write no checkpoint, not even at the end (benchmarks)");
    f->add_string("resume", &resume, "continue from this checkpoint");
    f->add_string("init-weights", &init_weights,
                  "initial weights: raw fp32 flat buffer (bench/train_compare.py prepare writes one)");
    f->add_string("dump-step", &dump_step,
                  "write the first forward/backward (loss, logits, gradients) to DIR and stop; "
                  "reads DIR/tokens.bin and targets.bin when present");
    f->add_string("log", &log, "append one JSON object per step to this file");
    f->add_double("peak-tflops", &peak_tflops, -1e30, 1e30,
                  "device peak bf16 TFLOP/s for MFU (default from the device name)");
    f->add_int("sample", &sample, -kBig, kBig,
               "tokens to generate at the end (default 32 below 200M parameters, else 0)");
    f->add_string("prompt", &prompt, "text that starts the sample (default: end-of-text)");
    f->add_int("top-k", &top_k, -kBig, kBig, "sample among the k most likely tokens (default 0: greedy)");
    f->add_int("n-layer", &n_layer, -kBig, kBig, "model override: layers");
    f->add_int("d-model", &d_model, -kBig, kBig, "model override: width");
    f->add_int("n-head", &n_head, -kBig, kBig, "model override: query heads");
    f->add_int("n-kv-head", &n_kv_head, -kBig, kBig, "model override: key/value heads (LLaMA)");
    f->add_int("head-dim", &head_dim, -kBig, kBig, "model override: head dimension");
    f->add_int("ffn-hidden", &ffn_hidden, -kBig, kBig, "model override: MLP width");
    f->add_int("max-seq", &max_seq, -kBig, kBig, "model override: longest sequence");
    f->add_int("vocab", &vocab, -kBig, kBig, "vocabulary size (default: the data's tokenizer, else the preset's)");
    f->add_double("norm-eps", &norm_eps, -1e30, 1e30, "model override: norm epsilon");
    f->add_double("rope-theta", &rope_theta, -1e30, 1e30, "model override: RoPE theta (LLaMA)");
  }
};

// The preset named by --model with the dimension flags applied, and the vocabulary: --vocab, else
// the data's tokenizer (a model trained on GPT-2 tokens needs GPT-2's 50257 rows whatever the
// preset's tokenizer was), else the preset's.
ft::ModelConfig model_from_flags(const TrainFlags& f, int64_t tokenizer_vocab) {
  if (!f.model) throw UsageError("--model: required, one of " + preset_list());
  ft::ModelConfig m;
  if (!ft::model_preset(*f.model, &m).ok()) {
    throw UsageError("--model: unknown preset '" + *f.model + "', expected one of " + preset_list());
  }
  auto set = [&](const std::optional<int64_t>& flag, int64_t* field) {
    if (flag) *field = *flag;
  };
  set(f.n_layer, &m.n_layer);
  set(f.d_model, &m.d_model);
  set(f.n_head, &m.n_head);
  set(f.n_kv_head, &m.n_kv_head);
  set(f.ffn_hidden, &m.ffn_hidden);
  set(f.max_seq, &m.max_seq);
  if (f.head_dim) {
    m.head_dim = *f.head_dim;
  } else if (f.d_model || f.n_head) {
    if (m.n_head < 1 || m.d_model % m.n_head != 0) {
      throw UsageError("--n-head: " + std::to_string(m.n_head) + " heads do not divide d_model " +
                       std::to_string(m.d_model) + " (or give --head-dim)");
    }
    m.head_dim = m.d_model / m.n_head;
  }
  if (m.family == ft::Family::kGpt) {
    if (f.n_head && !f.n_kv_head) m.n_kv_head = m.n_head;
    if (f.d_model && !f.ffn_hidden) m.ffn_hidden = 4 * m.d_model;
  }
  if (f.norm_eps) m.norm_eps = *f.norm_eps;
  if (f.rope_theta) m.rope_theta = *f.rope_theta;
  const int64_t vocab = f.vocab ? *f.vocab : tokenizer_vocab > 0 ? tokenizer_vocab : m.vocab_size;
  if (vocab != m.vocab_size) {
    if (vocab < 1) throw UsageError("--vocab: " + std::to_string(vocab) + " must be >= 1");
    m.vocab_size = vocab;
    m.padded_vocab = ft::padded_vocab_size(vocab);
  }
  const bool overridden = f.n_layer || f.d_model || f.n_head || f.n_kv_head || f.head_dim ||
                          f.ffn_hidden || f.max_seq || f.norm_eps || f.rope_theta;
  if (overridden) m.name += "+custom";
  check_config(ft::validate_model_config(m));
  return m;
}

std::string gib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", bytes / (1 << 30));
  return buf;
}

void print_sample(const ft::ModelConfig& model, const std::vector<float>& master,
                  const ft::Tokenizer* tokenizer, const std::string& prompt_text,
                  const ft::SampleOptions& o) {
  std::vector<int32_t> prompt;
  if (tokenizer && !prompt_text.empty()) prompt = tokenizer->encode(prompt_text);
  if (prompt.empty()) prompt.push_back(tokenizer ? tokenizer->eot_token() : 0);
  if (static_cast<int64_t>(prompt.size()) + o.tokens > model.max_seq) {
    throw UsageError("--prompt/--tokens: prompt " + std::to_string(prompt.size()) + " + " +
                     std::to_string(o.tokens) + " tokens exceed max_seq " + std::to_string(model.max_seq));
  }
  std::vector<int32_t> out;
  check_run(ft::sample_tokens(model, master.data(), prompt, o, &out));
  if (tokenizer) {
    std::string text;
    check_run(tokenizer->decode(out, &text));
    std::printf("sample (%s, %lld tokens): %s%s\n", o.top_k > 1 ? "top-k" : "greedy",
                static_cast<long long>(o.tokens), prompt_text.c_str(), text.c_str());
  } else {
    std::printf("sample token ids (no tokenizer):");
    for (int32_t t : out) std::printf(" %d", t);
    std::printf("\n");
  }
}

// The steady state of the run: the median step over the last 90% of the steps (the first ones
// pay for cuBLASLt's plan search and the allocator's growth), as one line for benchmarks.
void print_throughput(const std::vector<ft::StepReport>& reports) {
  if (reports.size() < 2) return;
  const size_t skip = std::max<size_t>(1, reports.size() / 10);
  std::vector<ft::StepReport> steady(reports.begin() + static_cast<std::ptrdiff_t>(skip), reports.end());
  std::sort(steady.begin(), steady.end(),
            [](const ft::StepReport& a, const ft::StepReport& b) { return a.step_ms < b.step_ms; });
  const ft::StepReport& median = steady[steady.size() / 2];
  int64_t peak_memory = 0;
  for (const ft::StepReport& r : reports) {
    peak_memory = std::max({peak_memory, r.memory_bytes, r.peak_memory_bytes});
  }
  std::printf("throughput: median of steps %lld-%lld: %.1f ms/step, %.0f tokens/s",
              static_cast<long long>(reports[skip].step), static_cast<long long>(reports.back().step),
              median.step_ms, median.tokens_per_s);
  if (median.mfu > 0) std::printf(", MFU %.1f%%", 100.0 * median.mfu);
  std::printf(", peak device memory in use %s%s\n", gib(static_cast<double>(peak_memory)).c_str(),
              median.world > 1 ? " (rank 0's GPU)" : "");
  const ft::StepTiming& t = median.timing;
  if (t.measured) {
    std::printf("profile of that step: forward %.1f ms, backward %.1f ms, optimizer %.1f ms",
                t.fwd_ms, t.bwd_ms, t.optimizer_ms);
    if (median.world > 1) {
      std::printf(", communication %.1f ms (%.1f ms exposed), %.1f MB sent per rank", t.comm_ms,
                  t.comm_exposed_ms, static_cast<double>(t.comm_bytes) / 1e6);
    }
    std::printf("\n");
  }
}

// ---- the launch ----------------------------------------------------------------------------------

// This process's place in a launch of several processes (mpirun, or torchrun-style variables) and
// its NCCL communicator; without a launch (or a launch of one) rank 0 of 1 and no communicator.
struct Launch {
  flare::dist::LaunchInfo info;
  std::unique_ptr<flare::dist::Communicator> comm;
  std::unique_ptr<flare::dist::Communicator> cp_comm;  // --cp > 1: this rank's context-parallel group
  bool lead() const { return info.rank == 0; }
  int world() const { return comm ? info.size : 1; }
};

// Any variable of a launch set: then the launch must be whole and consistent.
bool launch_variables_present() {
  for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK",
                           "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"}) {
    if (std::getenv(name) != nullptr) return true;
  }
  return false;
}

// The context-parallel group of this rank: ranks g·cp … g·cp + cp − 1 of `all` share an NCCL id
// that the group's first rank makes (every rank's id goes round `all`; each keeps its leader's).
// A communicator of its own, since the data-parallel collectives run on `all` at the same time.
flare::Status join_cp_group(flare::dist::Communicator& all, int cp, int device,
                            const flare::dist::CommOptions& options,
                            std::unique_ptr<flare::dist::Communicator>* out) {
  const int rank = all.rank();
  flare::dist::NcclId mine;
  if (rank % cp == 0) FLARE_RETURN_IF_ERROR(flare::dist::nccl_unique_id(&mine));
  std::vector<flare::dist::NcclId> ids(static_cast<size_t>(all.size()));
  FLARE_RETURN_IF_ERROR(all.host_all_gather(&mine, ids.data(), sizeof(mine)));
  return flare::dist::make_nccl_communicator(ids[static_cast<size_t>(rank - rank % cp)], rank % cp, cp,
                                             device, options, out);
}

// Joins the launch this process belongs to: reads the environment (a partial or inconsistent one
// is an error naming the variables), shares rank 0's NCCL id through the rendezvous at
// MASTER_ADDR:MASTER_PORT and creates the communicator on CUDA device LOCAL_RANK.
Launch join_launch(const TrainFlags& f, ft::DeviceKind device) {
  Launch l;
  if (!launch_variables_present()) return l;
  const Status read = flare::dist::launch_info_from_env(&l.info);
  if (!read.ok()) {
    // The library's message starts with "environment: ".
    const std::string& why = read.message();
    throw UsageError("launch " + (why.rfind("environment: ", 0) == 0 ? why : "environment: " + why));
  }
  if (l.info.size == 1) return l;  // a launch of one process is a plain run
  const std::string where = l.info.source + " launch, rank " + std::to_string(l.info.rank) + " of " +
                            std::to_string(l.info.size) + ", LOCAL_RANK " + std::to_string(l.info.local_rank);
  g_rank_prefix = "rank " + std::to_string(l.info.rank) + ": ";
  if (device != ft::DeviceKind::kCuda) {
    throw UsageError("--device: a launch of " + std::to_string(l.info.size) + " processes trains "
                     "data parallel on CUDA devices over NCCL; --device cpu runs one process");
  }
  if (f.device_index) {
    throw UsageError("--device-index: under a launch each rank uses CUDA device LOCAL_RANK (" + where +
                     "); drop the flag (or set CUDA_VISIBLE_DEVICES)");
  }
  if (f.dump_step) throw UsageError("--dump-step: runs in one process, not under a launch (" + where + ")");
  if (!flare::dist::nccl_built()) {
    throw RunError("launch (" + where + "): this build of flare has no NCCL; data parallel across "
                   "GPUs needs NCCL at configure time (NCCL_HOME or the CUDA toolkit's)");
  }
  flare::dist::CommOptions options;
  options.timeout_ms = static_cast<int>(f.dp_timeout_ms.value_or(600000));
  const Status made = flare::dist::make_nccl_communicator_from_env(options, &l.comm);
  if (!made.ok()) {
    throw RunError("launch (" + where + ", rendezvous at " + l.info.master_addr + ":" +
                   std::to_string(l.info.master_port) + "): " + made.to_string());
  }
  const int cp = static_cast<int>(f.cp.value_or(1));
  if (cp > 1) {
    if (l.info.size % cp != 0) {
      throw UsageError("--cp: " + std::to_string(cp) + " ranks per sequence must divide the launch's " +
                       std::to_string(l.info.size) + " processes");
    }
    const Status group = join_cp_group(*l.comm, cp, l.info.local_rank, options, &l.cp_comm);
    if (!group.ok()) throw RunError("launch (" + where + "): context-parallel group: " + group.to_string());
  }
  return l;
}

// ---- the step dump (bench/train_compare.py reads it) -------------------------------------------

void write_file(const fs::path& path, const void* data, size_t bytes) {
  check_run(ft::write_file_atomically(path.string(), [&](FILE* f) {
    return bytes == 0 || std::fwrite(data, 1, bytes, f) == bytes;
  }));
}

// DIR/<stem>.bin as count int32, or false when absent.
bool read_ints(const fs::path& path, size_t count, std::vector<int32_t>* out) {
  if (!fs::exists(path)) return false;
  const auto bytes = fs::file_size(path);
  if (bytes != count * sizeof(int32_t)) {
    throw UsageError("--dump-step: " + path.string() + " has " + std::to_string(bytes / 4) +
                     " int32, expected batch x seq = " + std::to_string(count));
  }
  out->resize(count);
  FILE* f = std::fopen(path.string().c_str(), "rb");
  const size_t got = f ? std::fread(out->data(), sizeof(int32_t), count, f) : 0;
  if (f) std::fclose(f);
  if (got != count) throw RunError("--dump-step: reading " + path.string() + " failed");
  return true;
}

std::string model_json(const ft::ModelConfig& m) {
  char buf[1024];
  std::snprintf(buf, sizeof buf,
                "{\"family\": \"%s\", \"name\": \"%s\", \"vocab_size\": %lld, \"padded_vocab\": %lld, "
                "\"n_layer\": %lld, \"d_model\": %lld, \"n_head\": %lld, \"n_kv_head\": %lld, "
                "\"head_dim\": %lld, \"ffn_hidden\": %lld, \"max_seq\": %lld, \"norm_eps\": %.17g, "
                "\"rope_theta\": %.17g, \"rope_scaling\": {\"enabled\": %s, \"factor\": %.17g, "
                "\"low_freq_factor\": %.17g, \"high_freq_factor\": %.17g, \"original_max_position\": %lld}, "
                "\"tied_embeddings\": %s}",
                ft::family_name(m.family), m.name.c_str(), static_cast<long long>(m.vocab_size),
                static_cast<long long>(m.padded_vocab), static_cast<long long>(m.n_layer),
                static_cast<long long>(m.d_model), static_cast<long long>(m.n_head),
                static_cast<long long>(m.n_kv_head), static_cast<long long>(m.head_dim),
                static_cast<long long>(m.ffn_hidden), static_cast<long long>(m.max_seq), m.norm_eps,
                m.rope_theta, m.rope_scaling.enabled ? "true" : "false", m.rope_scaling.factor,
                m.rope_scaling.low_freq_factor, m.rope_scaling.high_freq_factor,
                static_cast<long long>(m.rope_scaling.original_max_position),
                m.tied_embeddings ? "true" : "false");
  return buf;
}

// The first step's forward and backward, before clipping and the optimizer, as
// bench/train_compare.py's "step dump": step.json, weights.bin, grads.bin, tokens.bin,
// targets.bin, logits.bin (fp32; on CUDA the bf16 logits exactly).
void dump_first_step(ft::Trainer& trainer, const std::string& dir) {
  const ft::TrainerOptions& o = trainer.options();
  const int64_t B = o.train.batch, T = o.train.seq, N = B * T;
  const fs::path d(dir);
  std::vector<int32_t> tokens, targets;
  const bool given = read_ints(d / "tokens.bin", static_cast<size_t>(N), &tokens);
  if (given != read_ints(d / "targets.bin", static_cast<size_t>(N), &targets)) {
    throw UsageError("--dump-step: " + dir + " holds only one of tokens.bin and targets.bin");
  }
  if (given) {
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (tokens[i] < 0 || tokens[i] >= o.model.vocab_size || targets[i] < -1 || targets[i] >= o.model.vocab_size) {
        throw UsageError("--dump-step: token or target " + std::to_string(i) + " (" + std::to_string(tokens[i]) +
                         ", " + std::to_string(targets[i]) + ") is outside the vocabulary of " +
                         std::to_string(o.model.vocab_size));
      }
    }
  } else {
    check_run(trainer.next_batch(&tokens, &targets));
  }
  const size_t n = static_cast<size_t>(ft::parameter_layout(o.model).total);
  std::vector<float> master(n), grads(n), logits(static_cast<size_t>(N * o.model.padded_vocab));
  double loss = 0.0;
  check_run(trainer.backend().step_gradients(tokens, targets, &loss, grads.data(), logits.data()));
  check_run(trainer.backend().get_state(master.data(), nullptr, nullptr));
  std::error_code ec;
  fs::create_directories(d, ec);
  if (ec) throw RunError("--dump-step: cannot create '" + dir + "': " + ec.message());
  write_file(d / "weights.bin", master.data(), n * sizeof(float));
  write_file(d / "grads.bin", grads.data(), n * sizeof(float));
  write_file(d / "logits.bin", logits.data(), logits.size() * sizeof(float));
  if (!given) {
    write_file(d / "tokens.bin", tokens.data(), tokens.size() * sizeof(int32_t));
    write_file(d / "targets.bin", targets.data(), targets.size() * sizeof(int32_t));
  }
  const bool gpu = o.device == ft::DeviceKind::kCuda;
  char tail[256];
  std::snprintf(tail, sizeof tail, ", \"batch\": %lld, \"seq\": %lld, \"loss\": %.9g, \"precision\": \"%s\", "
                "\"logits_dtype\": \"fp32\"}\n", static_cast<long long>(B), static_cast<long long>(T), loss,
                gpu ? "bf16" : "fp32");
  const std::string json = "{\"model\": " + model_json(o.model) + tail;
  write_file(d / "step.json", json.data(), json.size());
  std::printf("step dump: loss %.6f, %s/{step.json, weights.bin, grads.bin, logits.bin, tokens.bin, targets.bin}\n",
              loss, dir.c_str());
}

// The run's description, printed by rank 0 before the first step.
void print_run(const ft::TrainerOptions& o, const std::string& device, ft::Trainer& trainer,
               const ft::MemoryEstimate& mem, const Launch& launch, const std::string& train_pattern,
               size_t shards, bool have_val, const std::string& val_pattern) {
  const ft::TrainConfig& t = o.train;
  const int64_t params = ft::parameter_count(o.model);
  const int world = launch.world();
  std::printf("model %s (%s): %lld layers, d_model %lld, %lld heads (%lld kv) x %lld, ffn %lld, "
              "vocab %lld, %.1fM parameters\n",
              o.model.name.c_str(), ft::family_name(o.model.family),
              static_cast<long long>(o.model.n_layer), static_cast<long long>(o.model.d_model),
              static_cast<long long>(o.model.n_head), static_cast<long long>(o.model.n_kv_head),
              static_cast<long long>(o.model.head_dim), static_cast<long long>(o.model.ffn_hidden),
              static_cast<long long>(o.model.vocab_size), static_cast<double>(params) / 1e6);
  std::printf("run: device %s (%s), batch %lld x seq %lld x accum %lld%s = %lld tokens/step, %lld "
              "steps from step %lld, lr %.2e, recompute %s, gradients %s, estimated memory %s%s\n",
              device.c_str(), trainer.backend().device_name().c_str(),
              static_cast<long long>(t.batch), static_cast<long long>(t.seq),
              static_cast<long long>(t.grad_accum),
              world > 1 ? (" x " + std::to_string(world) + " GPUs").c_str() : "",
              static_cast<long long>(t.batch * t.seq * t.grad_accum * world), static_cast<long long>(t.steps),
              static_cast<long long>(trainer.step()), t.lr, t.recompute ? "on" : "off",
              t.bf16_grads ? "bf16" : "fp32", gib(static_cast<double>(mem.total)).c_str(),
              world > 1 ? " per GPU" : "");
  if (world > 1) {
    std::printf("data parallel: %d ranks (%s launch), %s, "
                "gradient buckets of %lld MiB reduce-scattered during the backward, collectives "
                "time out after %d ms\n",
                world, launch.info.source.c_str(),
                t.shard_gradients ? "ZeRO-2 (master weights, AdamW state and gradients sharded)"
                                  : "ZeRO-1 (master weights and AdamW state sharded)",
                static_cast<long long>(o.backend.bucket_bytes >> 20), launch.comm->timeout_ms());
    if (launch.cp_comm) {
      std::printf("context parallel: %d ranks per sequence (zigzag rows, ring attention between them), "
                  "%d data-parallel groups\n", launch.cp_comm->size(), world / launch.cp_comm->size());
    }
  }
  std::printf("data: %s (%zu shards)%s%s\n", train_pattern.c_str(), shards,
              have_val ? ", validation " : "", have_val ? val_pattern.c_str() : "");
  if (trainer.peak_flops() <= 0 && o.device == ft::DeviceKind::kCuda) {
    std::printf("MFU: peak of '%s' unknown; pass --peak-tflops\n", trainer.backend().device_name().c_str());
  }
}

int train_command(int argc, char** argv, int first) {
  Flags flags;
  TrainFlags f;
  f.declare(&flags);
  if (!flags.parse(argc, argv, first)) {
    std::printf(
        "usage: flare-train [train] --model NAME [flags]\n\n"
        "Trains a GPT or LLaMA model on token shards (scripts/prepare_data.py) and prints one line\n"
        "per step. With only --model it trains on the Python documentation corpus in data/pydoc.\n"
        "Several GPUs, one process each: `mpirun -np N flare-train train ...`, or RANK, WORLD_SIZE,\n"
        "LOCAL_RANK, MASTER_ADDR and MASTER_PORT set per process (torchrun style); see\n"
        "docs/training.md, \"Several GPUs\".\n"
        "Other commands: flare-train sample --help | synth-data --help | models\n\nflags:\n%s",
        flags.help().c_str());
    return 0;
  }

  // The model's name first: its absence is the most likely mistake.
  if (!f.model) throw UsageError("--model: required, one of " + preset_list());
  ft::ModelConfig preset;
  if (!ft::model_preset(*f.model, &preset).ok()) {
    throw UsageError("--model: unknown preset '" + *f.model + "', expected one of " + preset_list());
  }

  // Data: shards and the tokenizer beside them.
  const std::string data_dir = f.data.value_or(kDefaultData);
  const std::string train_pattern = f.train_data.value_or((fs::path(data_dir) / "*_train_*.bin").string());
  std::vector<std::string> shards;
  if (!ft::expand_shard_pattern(train_pattern, &shards).ok()) {
    if (!f.train_data && !f.data) {
      throw UsageError(std::string("--data: no training shards in ") + kDefaultData +
                       " (the default corpus); prepare them with\n  python3 scripts/prepare_data.py --out " +
                       kDefaultData + "\n(needs the python3-doc package; --tiny makes a small test set), "
                       "or pass --data DIR");
    }
    throw UsageError((f.train_data ? "--train-data: " : "--data: ") + std::string("no shard matches '") +
                     train_pattern + "'");
  }
  const std::string val_pattern = f.val_data.value_or((fs::path(data_dir) / "*_val_*.bin").string());
  std::vector<std::string> val_shards;
  const bool have_val = ft::expand_shard_pattern(val_pattern, &val_shards).ok();
  if (f.val_data && !have_val) throw UsageError("--val-data: no shard matches '" + val_pattern + "'");
  std::unique_ptr<ft::Tokenizer> tokenizer;
  const fs::path tokenizer_path = fs::path(data_dir) / "tokenizer.tiktoken";
  if (fs::exists(tokenizer_path)) {
    tokenizer = std::make_unique<ft::Tokenizer>();
    const Status s = ft::Tokenizer::load(tokenizer_path.string(), tokenizer.get());
    if (!s.ok()) throw UsageError("--data: " + s.message());
  }

  ft::TrainerOptions o;
  o.model = model_from_flags(f, tokenizer ? tokenizer->vocab_size() : 0);
  ft::TrainConfig& t = o.train;
  t.batch = f.batch.value_or(8);
  t.seq = f.seq.value_or(std::min<int64_t>(1024, o.model.max_seq));
  t.grad_accum = f.grad_accum.value_or(1);
  t.steps = f.steps.value_or(1000);
  t.lr = f.lr.value_or(6e-4);
  t.min_lr = f.min_lr.value_or(t.lr / 10);
  t.warmup = f.warmup.value_or(std::min<int64_t>(100, t.steps / 10));
  t.weight_decay = f.weight_decay.value_or(0.1);
  t.beta1 = f.beta1.value_or(0.9);
  t.beta2 = f.beta2.value_or(0.95);
  t.eps = f.eps.value_or(1e-8);
  t.grad_clip = f.grad_clip.value_or(1.0);
  t.seed = static_cast<uint64_t>(f.seed.value_or(1337));
  t.recompute = f.recompute;
  t.bf16_grads = f.bf16_grads;
  t.shard_gradients = f.zero.value_or(1) == 2;
  t.eval_every = f.eval_every.value_or(have_val ? 100 : 0);
  t.ckpt_every = f.ckpt_every.value_or(0);
  t.train_data = train_pattern;
  t.val_data = have_val ? val_pattern : "";
  t.checkpoint_dir = f.ckpt_dir.value_or((fs::path("checkpoints") / o.model.name).string());
  if (f.no_checkpoint) {
    if (f.ckpt_every || f.ckpt_dir) throw UsageError("--no-checkpoint: conflicts with --ckpt-every/--ckpt-dir");
    t.checkpoint_dir.clear();
  }
  check_config(ft::validate_train_config(t, o.model));

  const std::string device = f.device.value_or(flare::cuda_built() ? "cuda" : "cpu");
  if (device == "cpu") {
    o.device = ft::DeviceKind::kCpu;
  } else if (device == "cuda") {
    o.device = ft::DeviceKind::kCuda;
  } else {
    throw UsageError("--device: '" + device + "' must be cpu or cuda");
  }
  o.backend.deterministic_attention = !f.nondeterministic;
  o.backend.device_index = static_cast<int>(f.device_index.value_or(0));
  if (f.bucket_mb) o.backend.bucket_bytes = *f.bucket_mb << 20;
  o.resume_from = f.resume.value_or("");
  o.init_weights = f.init_weights.value_or("");
  o.log_path = f.log.value_or("");
  o.eval_batches = f.eval_batches.value_or(8);
  o.peak_flops = f.peak_tflops.value_or(0.0) * 1e12;
  const int64_t params = ft::parameter_count(o.model);
  const int64_t sample = f.sample.value_or(params < 200'000'000 ? 32 : 0);
  if (sample < 0) throw UsageError("--sample: " + std::to_string(sample) + " must be >= 0");
  const int64_t top_k = f.top_k.value_or(0);
  if (top_k < 0) throw UsageError("--top-k: " + std::to_string(top_k) + " must be >= 0");
  if (sample > 0 && sample + 1 > o.model.max_seq) {
    throw UsageError("--sample: " + std::to_string(sample) + " tokens exceed max_seq " +
                     std::to_string(o.model.max_seq));
  }
  if (!o.resume_from.empty() && !fs::exists(o.resume_from)) {
    throw UsageError("--resume: no file '" + o.resume_from + "'");
  }

  // Several processes: one rank each, on device LOCAL_RANK, the loader dealing each its share.
  const Launch launch = join_launch(f, o.device);
  const bool lead = launch.lead();
  const int world = launch.world();
  if (launch.comm) {
    o.backend.comm = launch.comm.get();
    o.backend.cp_comm = launch.cp_comm.get();
    o.backend.device_index = launch.info.local_rank;
  } else if (f.cp.value_or(1) > 1) {
    throw UsageError("--cp: context parallelism spans the processes of a launch (mpirun or a "
                     "torchrun-style environment); this is one process");
  }

  std::unique_ptr<ft::Trainer> trainer;
  check_config(ft::Trainer::create(o, &trainer));

  ft::TrainConfig rows = t;  // a context-parallel rank's activations: its rows of each sequence
  if (launch.cp_comm) rows.seq = t.seq / launch.cp_comm->size();
  const ft::MemoryEstimate mem = ft::estimate_training_memory(rows, o.model, world);
  if (lead) print_run(o, device, *trainer, mem, launch, train_pattern, shards.size(), have_val, val_pattern);
  std::fflush(stdout);
  if (f.dump_step) {
    dump_first_step(*trainer, *f.dump_step);
    return 0;
  }

  std::vector<ft::StepReport> reports;
  check_run(trainer->run(t.steps, [&](const ft::StepReport& r) {
    if (!lead) return;
    std::printf("%s\n", ft::format_step(r).c_str());
    std::fflush(stdout);
    reports.push_back(r);
  }));
  if (lead) print_throughput(reports);

  if (sample > 0) {
    // Collective under a launch: every rank sends its shard, rank 0 samples.
    std::vector<float> master(lead ? static_cast<size_t>(ft::parameter_layout(o.model).total) : 0);
    check_run(trainer->backend().get_state(lead ? master.data() : nullptr, nullptr, nullptr));
    ft::SampleOptions so;
    so.tokens = sample;
    so.top_k = top_k;
    so.seed = t.seed;
    if (lead) print_sample(o.model, master, tokenizer.get(), f.prompt.value_or(""), so);
  }
  return 0;
}

// ---- sample ---------------------------------------------------------------------------------------

int sample_command(int argc, char** argv, int first) {
  Flags flags;
  std::optional<std::string> checkpoint, tokenizer_file, data, prompt;
  std::optional<int64_t> tokens, top_k, seed;
  std::optional<double> temperature;
  flags.add_string("checkpoint", &checkpoint, "checkpoint file (required)");
  flags.add_string("data", &data, "data directory whose tokenizer.tiktoken decodes (default data/pydoc)");
  flags.add_string("tokenizer", &tokenizer_file, "tiktoken rank file (overrides --data)");
  flags.add_string("prompt", &prompt, "text to continue (default: end-of-text)");
  flags.add_int("tokens", &tokens, 1, 1 << 20, "tokens to generate (default 32)");
  flags.add_int("top-k", &top_k, 0, 1 << 30, "sample among the k most likely (default 0: greedy)");
  flags.add_double("temperature", &temperature, 1e-6, 1e6, "softmax temperature (default 1)");
  flags.add_int("seed", &seed, 0, int64_t{1} << 40, "sampling seed (default 0)");
  if (!flags.parse(argc, argv, first)) {
    std::printf("usage: flare-train sample --checkpoint PATH [flags]\n\nflags:\n%s", flags.help().c_str());
    return 0;
  }
  if (!checkpoint) throw UsageError("--checkpoint: required");
  if (!fs::exists(*checkpoint)) throw UsageError("--checkpoint: no file '" + *checkpoint + "'");
  ft::CheckpointMeta meta;
  const Status read = ft::read_checkpoint_meta(*checkpoint, &meta);
  if (!read.ok()) throw UsageError("--checkpoint: " + read.message());
  const int64_t n = ft::parameter_layout(meta.model).total;
  std::vector<float> master(static_cast<size_t>(n)), m(static_cast<size_t>(n)), v(static_cast<size_t>(n));
  check_run(ft::load_checkpoint(*checkpoint, meta.model, &meta, master.data(), m.data(), v.data(), n));

  const std::string path = tokenizer_file.value_or((fs::path(data.value_or(kDefaultData)) / "tokenizer.tiktoken").string());
  std::unique_ptr<ft::Tokenizer> tokenizer;
  if (fs::exists(path)) {
    tokenizer = std::make_unique<ft::Tokenizer>();
    const Status s = ft::Tokenizer::load(path, tokenizer.get());
    if (!s.ok()) throw UsageError((tokenizer_file ? "--tokenizer: " : "--data: ") + s.message());
    if (tokenizer->vocab_size() > meta.model.vocab_size) {
      throw UsageError("--tokenizer: its " + std::to_string(tokenizer->vocab_size()) +
                       " tokens exceed the model's vocab_size " + std::to_string(meta.model.vocab_size));
    }
  } else if (tokenizer_file) {
    throw UsageError("--tokenizer: no file '" + path + "'");
  }
  std::printf("checkpoint %s: model %s, step %lld\n", checkpoint->c_str(), meta.model.name.c_str(),
              static_cast<long long>(meta.step));
  ft::SampleOptions o;
  o.tokens = tokens.value_or(32);
  o.top_k = top_k.value_or(0);
  o.temperature = temperature.value_or(1.0);
  o.seed = static_cast<uint64_t>(seed.value_or(0));
  print_sample(meta.model, master, tokenizer.get(), prompt.value_or(""), o);
  return 0;
}

// ---- synth-data -----------------------------------------------------------------------------------

int synth_data_command(int argc, char** argv, int first) {
  Flags flags;
  std::optional<std::string> out;
  std::optional<int64_t> tokens, vocab, seed;
  flags.add_string("out", &out, "directory for synth_train_000000.bin and synth_val_000000.bin (required)");
  flags.add_int("tokens", &tokens, 2, int64_t{1} << 32, "training tokens (default 4,194,304)");
  flags.add_int("vocab", &vocab, 1, int64_t{1} << 31, "token ids drawn uniformly below this (default 50257)");
  flags.add_int("seed", &seed, 0, int64_t{1} << 40, "seed (default 0)");
  if (!flags.parse(argc, argv, first)) {
    std::printf("usage: flare-train synth-data --out DIR [flags]\n\n"
                "Uniformly random tokens: for throughput runs where no corpus is prepared (the loss\n"
                "cannot fall below log(vocab)).\n\nflags:\n%s", flags.help().c_str());
    return 0;
  }
  if (!out) throw UsageError("--out: required");
  const int64_t n = tokens.value_or(int64_t{1} << 22), v = vocab.value_or(50257);
  std::error_code ec;
  fs::create_directories(*out, ec);
  if (ec) throw RunError("--out: cannot create '" + *out + "': " + ec.message());
  std::mt19937_64 rng(static_cast<uint64_t>(seed.value_or(0)));
  std::uniform_int_distribution<int32_t> draw(0, static_cast<int32_t>(v - 1));
  for (const auto& [split, count] : {std::pair<const char*, int64_t>{"train", n}, {"val", std::max<int64_t>(n / 16, 2)}}) {
    std::vector<int32_t> ids(static_cast<size_t>(count));
    for (int32_t& id : ids) id = draw(rng);
    const std::string path = (fs::path(*out) / (std::string("synth_") + split + "_000000.bin")).string();
    check_run(ft::write_shard(path, ids, v));
    std::printf("wrote %s (%lld tokens)\n", path.c_str(), static_cast<long long>(count));
  }
  return 0;
}

int models_command() {
  for (const std::string& name : ft::model_preset_names()) {
    ft::ModelConfig m;
    ft::model_preset(name, &m);
    std::printf("%-12s %-5s %3lld layers  d_model %5lld  heads %3lld/%-3lld x %3lld  vocab %6lld  %8.1fM\n",
                name.c_str(), ft::family_name(m.family), static_cast<long long>(m.n_layer),
                static_cast<long long>(m.d_model), static_cast<long long>(m.n_head),
                static_cast<long long>(m.n_kv_head), static_cast<long long>(m.head_dim),
                static_cast<long long>(m.vocab_size), static_cast<double>(ft::parameter_count(m)) / 1e6);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string command = argc > 1 ? argv[1] : "";
    if (command == "sample") return sample_command(argc, argv, 2);
    if (command == "synth-data") return synth_data_command(argc, argv, 2);
    if (command == "models") return models_command();
    if (command == "train") return train_command(argc, argv, 2);
    return train_command(argc, argv, 1);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "flare-train: %s%s\n", g_rank_prefix.c_str(), e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "flare-train: %s%s\n", g_rank_prefix.c_str(), e.what());
    return 1;
  }
}
