// bench_dist.cpp — `flare bench-dist`: the command line, its help, and the checks made before
// anything runs (sizes, strategies, a writable --json path, a build that can run it). The run
// itself is bench_dist_gpu.cpp's (CUDA builds); what it measures is cp_bench.h's, shared with
// bench/ring_bench.
#include <cstdio>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "args.h"
#include "bench_dist.h"
#include "commands.h"
#include "report.h"

namespace flare::cli {
namespace {

constexpr int64_t kMaxSeqlen = int64_t{1} << 30;

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) out.push_back(item);
  return out;
}

std::vector<int64_t> parse_seqlens(const ArgParser& p, const std::string& text) {
  std::vector<int64_t> out;
  for (const std::string& item : split_list(text)) {
    char* end = nullptr;
    const long long x = std::strtoll(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || x < 1 || x > kMaxSeqlen)
      throw p.error("--s: expected comma-separated integers in [1, " + std::to_string(kMaxSeqlen) +
                    "], got '" + text + "'");
    out.push_back(x);
  }
  if (out.empty()) throw p.error("--s: no sequence length in '" + text + "'");
  return out;
}

std::vector<dist::Strategy> parse_strategies(const ArgParser& p, const std::string& text) {
  std::vector<dist::Strategy> out;
  for (const std::string& item : split_list(text)) {
    dist::Strategy s;
    if (item == "ring") s = dist::Strategy::kRing;
    else if (item == "zigzag") s = dist::Strategy::kZigzag;
    else if (item == "a2a") s = dist::Strategy::kAllToAll;
    else throw p.error("--strategies: expected a comma-separated list of ring, zigzag, a2a; got '" +
                       text + "'");
    out.push_back(s);
  }
  if (out.empty()) throw p.error("--strategies: no strategy in '" + text + "'");
  return out;
}

BenchDistArgs parse(int argc, char** argv, bool* help) {
  BenchDistArgs a;
  ArgParser p("bench-dist");
  std::optional<std::string> seqlens, strategies;
  std::optional<int64_t> b, h, h_kv, d, warmup, iters, timeout_s;
  bool causal = false, non_causal = false, no_single = false;
  p.add_string("--s", &seqlens);
  p.add_int("--b", &b, 1, 2147483647);
  p.add_int("--h", &h, 1, 65535);
  p.add_int("--h-kv", &h_kv, 1, 65535);
  p.add_int("--d", &d, 1, 256);
  p.add_switch("--causal", &causal);
  p.add_switch("--no-causal", &non_causal);
  p.add_string("--strategies", &strategies);
  p.add_int("--warmup", &warmup, 0, 1000000);
  p.add_int("--iters", &iters, 1, 1000000);
  p.add_switch("--no-single", &no_single);
  p.add_int("--timeout-s", &timeout_s, 1, 2147483);  // as milliseconds it must fit an int
  p.add_string("--json", &a.json);
  p.add_string("--commit", &a.commit);
  *help = !p.parse(argc, argv, 2);
  if (*help) return a;
  if (causal && non_causal) throw p.error("--causal and --no-causal exclude each other");
  if (seqlens) a.seqlens = parse_seqlens(p, *seqlens);
  if (strategies) a.strategies = parse_strategies(p, *strategies);
  a.b = b ? int(*b) : a.b;
  a.h = h ? int(*h) : a.h;
  a.h_kv = h_kv ? int(*h_kv) : (h ? a.h : a.h_kv);
  a.d = d ? int(*d) : a.d;
  if (a.h % a.h_kv != 0)
    throw p.error("--h-kv: " + std::to_string(a.h_kv) + " must divide --h " + std::to_string(a.h));
  a.causal = !non_causal;
  a.warmup = warmup ? int(*warmup) : a.warmup;
  a.iters = iters ? int(*iters) : a.iters;
  a.single = !no_single;
  a.timeout_s = timeout_s ? int(*timeout_s) : a.timeout_s;
  // Checked now, before any rank starts: found at the end, it would cost the whole run's results.
  if (a.json) {
    const std::string problem = result_file_problem(*a.json);
    if (!problem.empty()) throw p.error("--json: cannot write '" + *a.json + "': " + problem);
  }
  return a;
}

}  // namespace

const char* bench_dist_help() {
  return R"(usage: flare bench-dist [options]

Times context-parallel attention (one sequence split across GPUs) forward and
forward+backward, one process per GPU, against one GPU running the whole problem.
Launch one process per GPU; each uses GPU LOCAL_RANK and they meet through NCCL:

  mpirun -np 4 flare bench-dist --s 32768,131072
  torchrun --nproc-per-node 4 --no-python flare bench-dist --s 32768,131072

It reads torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT) or else mpirun's (OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK; MASTER_ADDR
and MASTER_PORT default to 127.0.0.1:29500, so across nodes set MASTER_ADDR to rank
0's host). Rank 0 prints one line per (strategy, pass) and writes the result file:
  ms         median step time (slowest rank; CUDA events around each call)
  1gpu_ms    the whole problem on rank 0's GPU alone, measured first while the other
             ranks wait; where it does not fit, the per-block sum (every rank's
             compute time added up), marked as such
  eff        (1gpu_ms / N) / ms
  comm_ms    time of the communication stream's exchanges per call (slowest rank);
  exposed    ms minus compute time, what communication added; overlap = the rest
  MB_sent    bytes a rank sends per call; GB/s = MB_sent / comm_ms
  peak_GiB   device memory a rank held at its peak (the largest rank's)
bf16, FLOPs as FlashAttention counts them; a row above the card's peak is SUSPECT.

options:
  --s N[,N...]           total sequence lengths (default 32768,65536,131072)
  --b N  --h N  --h-kv N --d N
                         batch, query heads, key/value heads, head_dim
                         (default 1, 32, 8, 128; --h alone sets --h-kv to it)
  --causal | --no-causal causal mask or none (default causal)
  --strategies LIST      ring, zigzag, a2a, comma-separated (default ring,zigzag)
  --warmup N  --iters N  untimed and timed calls per pass (default 3 and 10)
  --no-single            skip rank 0's single-GPU run (efficiency from the per-block sum)
  --timeout-s N          how long any rank waits for the others (default 1800), rank 0's
                         single-GPU run included: a rank that dies fails the others then
  --json FILE            write the results (bench/results schema: card, date, commit,
                         software, rows with impl flare-ring | flare-zigzag | flare-a2a);
                         checked before anything runs, written whole by rank 0 at the end
  --commit ID            commit to record (default $FLARE_COMMIT, else git rev-parse)

Needs a build with CUDA and NCCL; elsewhere it exits 1 saying so.
exit status: 0 every case ran, 1 a case failed or it could not run, 2 bad arguments
)";
}

int run_bench_dist(int argc, char** argv) {
  bool help = false;
  const BenchDistArgs args = parse(argc, argv, &help);
  if (help) {
    std::fputs(bench_dist_help(), stdout);
    return 0;
  }
#ifdef FLARE_WITH_CUDA
  return run_bench_dist_on_gpus(args);
#else
  throw RunError("bench-dist: this build of flare has no CUDA kernels; context parallelism across "
                 "GPUs needs a build with CUDA and NCCL (configure with -DFLARE_CUDA=ON where nvcc "
                 "and NCCL are found)");
#endif
}

}  // namespace flare::cli
