// cp_bench.h — measuring context-parallel attention on GPUs: what `flare bench-dist` (one process
// per GPU, launched by mpirun or torchrun) and bench/ring_bench (one process, a thread per GPU)
// share, so both time, count and report a case the same way. CUDA builds only.
//
// Per case and pass (fwd, fwd+bwd):
//   ms              median over the timed iterations (CUDA events on the rank's stream around
//                   the call); across ranks the slowest, since the ring couples them
//   ms_single_gpu   the whole problem as one single-GPU flare call, or, where it does not fit one
//                   GPU, the per-block sum: every rank's compute time added up (the work of the
//                   blocks, done one after another on one card)
//   efficiency      (ms_single_gpu / N) / ms
//   comm_ms         the communication stream's time in exchanges per call (CUDA events around
//                   each, ContextParallelAttention::take_timing), slowest rank
//   comm_exposed_ms ms − compute time per call (the caller's stream between its waits): what the
//                   communication added to the step; comm_overlapped_ms = comm_ms − exposed
//   comm_bytes      bytes a rank sent per call; comm_gbps = comm_bytes / comm_ms
//   peak_mem_bytes  device memory the rank held at its peak: its tensors and the plan's workspace
//                   (cudaMemGetInfo before/after), plus the stream-ordered pool's high watermark
//                   (the backward's scratch); the largest rank's
// FLOPs as FlashAttention counts them (4·b·s²·h·d, halved when causal, backward 2.5×); a row whose
// per-GPU TFLOP/s exceeds the card's dense bf16 peak is marked suspect (a run that silently did
// less work than asked).
#pragma once

#include <cstdint>
#include <string>

#include "flare/dist.h"
#include "flare/status.h"

namespace flare::cp_bench {

constexpr double kPeakDenseBf16Tflops = 989.0;  // H100 SXM; the bound of the "suspect" check

// One case: b × s tokens of bf16 attention, h query and h_kv key/value heads of d.
struct Problem {
  int b = 1, h = 32, h_kv = 8, d = 128;
  bool causal = true;
  int64_t s = 0;
  int warmup = 3, iters = 10;
};

// The case of sequence length s under a command line's settings: `flags` is any struct with the
// fields b, h, h_kv, d, causal, warmup and iters (flare bench-dist's and ring_bench's arguments).
template <class Flags>
Problem problem_at(const Flags& flags, int64_t s) {
  Problem p;
  p.b = flags.b;
  p.h = flags.h;
  p.h_kv = flags.h_kv;
  p.d = flags.d;
  p.causal = flags.causal;
  p.s = s;
  p.warmup = flags.warmup;
  p.iters = flags.iters;
  return p;
}

// One rank's (or the slowest rank's) figures for one pass, per call. compute_ms_sum is the sum
// over ranks of compute_ms (the per-block baseline); on one rank it equals compute_ms.
struct Measure {
  double ms = 0.0, comm_ms = 0.0, compute_ms = 0.0, compute_ms_sum = 0.0;
  int64_t bytes = 0, peak = 0;
};

// The whole problem as single-GPU flare calls on CUDA device `device`: fwd and fwd+bwd.
Status single_gpu(const Problem& p, int device, Measure* fwd, Measure* fwdbwd);

// One rank of `strategy` on comm's device (collective): its fwd and fwd+bwd times, its traffic
// and memory.
Status rank_run(const Problem& p, dist::Strategy strategy, dist::Communicator& comm,
                Measure* fwd, Measure* fwdbwd);

// Folds one rank's figures into the step's: the slowest time, the most traffic and memory, and
// the sum of compute times.
void combine(const Measure& rank, Measure* step);

double flops(const Problem& p, const std::string& pass);

// One line of the report and of the result file.
struct Row {
  std::string impl, pass;  // "flare" (one GPU) or "flare-ring" | "flare-zigzag" | "flare-a2a"
  int gpus = 1;
  Measure m;
  double ms_single = -1.0;           // < 0: no baseline
  std::string single_basis;          // "measured" or "per-block sum"
  int64_t peak_single = 0;
};

// The row with the baseline filled in: the single-GPU measurement when there is one (> 0 ms),
// else the per-block sum of the distributed run.
Row make_row(const std::string& impl, const std::string& pass, int gpus, const Measure& m,
             const Measure* single);

const char* strategy_flag(dist::Strategy strategy);  // "ring", "zigzag", "a2a"
// "ring" | "zigzag" | "a2a" → the strategy; false for anything else.
bool parse_strategy(const std::string& name, dist::Strategy* out);

void print_header();
void print_row(const Problem& p, const Row& r);
// The row schema plus the exposed/overlapped split, tflops_per_gpu and suspect.
std::string json_row(const Problem& p, const Row& r);

}  // namespace flare::cp_bench
