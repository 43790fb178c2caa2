// bench.cpp — `flare bench`: time flare's forward and backward over the standard grid
// (docs/architecture.md, "Performance method") or the sizes given, print one standard line per
// (case, pass), optionally write a result file.
//
// The standard grid keeps 16k tokens per batch — (b, s) ∈ {(32,512), (16,1k), (8,2k), (4,4k),
// (2,8k), (1,16k)} — and a hidden size of 2048 (heads = 2048 / head_dim) for head_dim 64, 128 and
// 256, causal and not, in bf16: the grid FlashAttention's papers report, so numbers compare. Its
// largest case is about 8 TFLOP per forward+backward, minutes per call on a CPU, and the whole
// grid about 8e14 FLOP with the CPU's repetitions (hours), so the CPU runs a small grid of the
// same shape instead (2k tokens, hidden 512, head_dim 64 and 128, fp32): 81 s on 2 cores (AMD
// EPYC, shared with other work; 113 s of CPU time).
// Any size given on the command line pins that axis; the others keep following the grid's rules
// (b = tokens / s, h = hidden / d). --varlen packs each case's b sequences, their lengths spread
// around s (varlen_lengths), into one batch for the variable-length API.
//
// Each pass is run `warmup` times, then timed `iters` times one call at a time; the line reports
// the median. bwd times the backward alone (o and lse come from one forward before the timing);
// fwdbwd times a forward followed by a backward. Benchmarks are not tests: nothing here asserts a
// speed.
#include <algorithm>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "args.h"
#include "commands.h"
#include "device.h"
#include "report.h"
#include "workload.h"

namespace flare::cli {
namespace {

struct Grid {
  int tokens;  // b · s per case
  int hidden;  // h · d per case
  std::vector<int> seqlens;
  std::vector<int> head_dims;
  DType dtype;
  int warmup, iters;
};

// The standard grid; warm-up and repetitions as in FlashAttention's benchmark script.
const Grid kGpuGrid = {
    16384, 2048, {512, 1024, 2048, 4096, 8192, 16384}, {64, 128, 256}, DType::kBFloat16, 5, 30};
// The same shape scaled down 8× in tokens and 4× in width (its run time: top of this file).
const Grid kCpuGrid = {2048, 512, {512, 1024, 2048}, {64, 128}, DType::kFloat32, 1, 5};

// Seed of the inputs; values do not affect the time, a fixed seed keeps runs identical.
constexpr uint64_t kSeed = 1;

struct BenchArgs {
  std::optional<std::string> device, dtype, pass, json, commit;
  std::optional<int64_t> b, h, h_kv, s, s_k, d, warmup, iters;
  std::optional<double> softcap, dropout;
  bool causal = false, non_causal = false, varlen = false, alibi = false, deterministic = false;
};

BenchArgs parse(int argc, char** argv, bool* help) {
  BenchArgs a;
  ArgParser p("bench");
  constexpr int64_t kIntMax = 2147483647;
  p.add_choice("--device", &a.device, {"auto", "cpu", "cuda"});
  p.add_choice("--dtype", &a.dtype, {"fp32", "fp16", "bf16"});
  p.add_choice("--pass", &a.pass, {"fwd", "bwd", "fwdbwd", "all"});
  p.add_int("--b", &a.b, 1, kIntMax);
  p.add_int("--h", &a.h, 1, 65535);  // the library's limit on query heads
  p.add_int("--h-kv", &a.h_kv, 1, 65535);
  p.add_int("--s", &a.s, 1, int64_t{1} << 30);  // the library's limit on sequence length
  p.add_int("--s-k", &a.s_k, 1, int64_t{1} << 30);
  p.add_int("--d", &a.d, 1, 256);  // the library's head_dim range
  p.add_switch("--causal", &a.causal);
  p.add_switch("--no-causal", &a.non_causal);
  p.add_switch("--varlen", &a.varlen);
  p.add_number("--softcap", &a.softcap, 0.0, 1e6);
  p.add_switch("--alibi", &a.alibi);
  p.add_number("--dropout", &a.dropout, 0.0, 0.999);
  p.add_switch("--deterministic", &a.deterministic);
  p.add_int("--warmup", &a.warmup, 0, 1000000);
  p.add_int("--iters", &a.iters, 1, 1000000);
  p.add_string("--json", &a.json);
  p.add_string("--commit", &a.commit);
  *help = !p.parse(argc, argv, 2);
  if (*help) return a;
  if (a.causal && a.non_causal) throw p.error("--causal and --no-causal exclude each other");
  if (a.h_kv && a.h && *a.h % *a.h_kv != 0)
    throw p.error("--h-kv: " + std::to_string(*a.h_kv) + " must divide --h " +
                  std::to_string(*a.h));
  // Checked now, before any case runs: found at the end, it would cost the whole run's results.
  if (a.json) {
    const std::string problem = result_file_problem(*a.json);
    if (!problem.empty()) throw p.error("--json: cannot write '" + *a.json + "': " + problem);
  }
  return a;
}

std::vector<Shape> make_cases(const BenchArgs& a, const Grid& grid) {
  std::vector<bool> causals = {false, true};
  if (a.causal) causals = {true};
  if (a.non_causal) causals = {false};
  const std::vector<int> head_dims = a.d ? std::vector<int>{int(*a.d)} : grid.head_dims;
  const std::vector<int> seqlens = a.s ? std::vector<int>{int(*a.s)} : grid.seqlens;
  std::vector<Shape> cases;
  for (bool causal : causals) {
    for (int d : head_dims) {
      for (int s : seqlens) {
        Shape c;
        c.causal = causal;
        c.varlen = a.varlen;
        c.softcap = static_cast<float>(a.softcap.value_or(0.0));
        c.alibi = a.alibi;
        c.dropout_p = static_cast<float>(a.dropout.value_or(0.0));
        c.deterministic = a.deterministic;
        c.d = d;
        c.s_q = s;
        c.s_k = a.s_k ? int(*a.s_k) : s;
        c.b = a.b ? int(*a.b) : std::max(1, grid.tokens / s);
        c.h = a.h ? int(*a.h) : std::max(1, grid.hidden / d);
        c.h_kv = a.h_kv ? int(*a.h_kv) : c.h;
        c.dtype = a.dtype ? parse_dtype(*a.dtype) : grid.dtype;
        if (c.h % c.h_kv != 0)
          throw UsageError("flare bench: --h-kv: " + std::to_string(c.h_kv) +
                           " must divide the number of query heads " + std::to_string(c.h) +
                           " (hidden / d for d=" + std::to_string(d) + "); give --h too");
        cases.push_back(c);
      }
    }
  }
  return cases;
}

// "512", or "512/1024" when the two differ (s_q/s_k, h/h_kv).
std::string one_or_two(int a, int b) {
  std::string s = std::to_string(a);
  if (b != a) s.append("/").append(std::to_string(b));
  return s;
}

// One standard line: pass, dtype, sizes, median time, throughput, peak memory.
void print_row(const ResultRow& r, bool gpu) {
  const Shape& s = r.shape;
  const std::string seq = one_or_two(s.s_q, s.s_k);
  const std::string heads = one_or_two(s.h, s.h_kv);
  // Packed and modified cases say so after the mask, in a column as wide as "non-causal" and
  // the words the run adds.
  std::string mask = s.causal ? "causal" : "non-causal";
  int width = 10;
  for (const auto& [on, word] :
       {std::pair{s.varlen, " varlen"}, std::pair{s.softcap > 0.0f, " softcap"},
        std::pair{s.alibi, " alibi"}, std::pair{s.dropout_p > 0.0f, " dropout"},
        std::pair{s.deterministic, " deterministic"}})
    if (on) {
      mask += word;
      width += static_cast<int>(std::string(word).size());
    }
  std::printf("%-6s %s b=%-3d s=%-11s h=%-9s d=%-3d %-*s %10.3f ms %10.2f %s  peak %9.1f MiB\n",
              pass_name(r.pass), short_dtype_name(s.dtype), s.b, seq.c_str(), heads.c_str(), s.d,
              width, mask.c_str(), r.ms, gpu ? r.tflops : r.tflops * 1e3,
              gpu ? "TFLOP/s" : "GFLOP/s", double(r.peak_mem_bytes) / (1 << 20));
}

}  // namespace

const char* bench_help() {
  return R"(usage: flare bench [options]

Times flare's forward and backward passes and prints one line per (case, pass):
pass, dtype, b, s (s_q/s_k), h (h/h_kv), d, causal (and varlen), median ms, throughput,
peak memory. FLOPs are counted as FlashAttention does: forward 4*b*s_q*s_k*h*d (halved when
causal; with --varlen the sum over the sequences of 4*len_q*len_k*h*d), backward 2.5x
forward, fwdbwd 3.5x.

Without sizes it runs a grid:
  cuda  the standard grid: 16k tokens per batch, (b, s) in (32,512) (16,1k) (8,2k) (4,4k)
        (2,8k) (1,16k), hidden 2048 (h = 2048/d), d 64 128 256, causal and not, bf16
  cpu   a small grid of the same shape: 2k tokens, (b, s) in (4,512) (2,1k) (1,2k),
        hidden 512 (h = 512/d), d 64 128, causal and not, fp32; about 1.5 minutes
        on 2 cores
Each size given pins that axis; the rest follow the grid (b = tokens/s, h = hidden/d).

options:
  --device auto|cpu|cuda   where to run (default auto: the GPU if usable, else the CPU)
  --dtype fp32|fp16|bf16   element type (default: bf16 on cuda, fp32 on cpu)
  --pass fwd|bwd|fwdbwd|all  which passes to time (default all)
  --b N  --s N  --s-k N    batch, query length, key length (default s-k = s)
  --h N  --h-kv N  --d N   query heads, key/value heads (GQA/MQA; default h), head_dim (1..256)
  --causal | --no-causal   only causal / only non-causal cases (default both)
  --varlen                 pack each case's b sequences into one (total, h, d) batch and
                           call the variable-length API (cu_seqlens); sequence i of b gets
                           round(s*(0.25 + 1.5*i/(b-1))) queries (s/4 to 7s/4, about b*s
                           in all; s for b=1), keys likewise from s-k
  --softcap X              cap the scores at +-X (X * tanh(s / X)); 0, the default, is off
  --alibi                  ALiBi with the usual slopes 2^(-8(i+1)/h) for query head i
  --dropout P              dropout with drop probability P in [0, 0.999) (fixed seed); 0 is off
  --deterministic          the backward's deterministic mode (two runs give the same bits)
  --warmup N  --iters N    untimed and timed calls per pass (default 5 and 30 on cuda,
                           1 and 5 on cpu); the median of the timed calls is reported
  --json FILE              also write the results (bench/results schema: card, date,
                           commit, software, rows); checked before the first case runs,
                           and written whole at the end (never a truncated file)
  --commit ID              commit to record (default $FLARE_COMMIT, else git rev-parse)

A pass the library reports as unsupported on the device is listed as skipped.

exit status: 0 every case ran or was skipped as unsupported, 1 a case failed or nothing
ran, 2 bad arguments
example: flare bench --device cpu --s 1024 --d 64 --causal --json cpu.json
)";
}

int run_bench(int argc, char** argv) {
  bool help = false;
  const BenchArgs args = parse(argc, argv, &help);
  if (help) {
    std::fputs(bench_help(), stdout);
    return 0;
  }
  std::string fallback;
  std::unique_ptr<Device> device = choose_device(args.device.value_or("auto"), &fallback);
  const bool gpu = device->type() == DeviceType::kCUDA;
  const Grid& grid = gpu ? kGpuGrid : kCpuGrid;
  const std::vector<Shape> cases = make_cases(args, grid);
  const int warmup = args.warmup ? int(*args.warmup) : grid.warmup;
  const int iters = args.iters ? int(*args.iters) : grid.iters;
  std::vector<Pass> passes = {Pass::kForward, Pass::kBackward, Pass::kForwardBackward};
  if (args.pass == "fwd") passes = {Pass::kForward};
  if (args.pass == "bwd") passes = {Pass::kBackward};
  if (args.pass == "fwdbwd") passes = {Pass::kForwardBackward};

  ResultFile result;
  result.card = device->card();
  result.date = iso_date_utc();
  result.commit = source_commit(args.commit);
  result.software = software_versions(device->software());
  std::printf(
      "flare %s bench on %s, commit %s: %zu case(s), median of %d after %d warm-up, "
      "peak = %s\n",
      version(), result.card.c_str(), result.commit.c_str(), cases.size(), iters, warmup,
      device->memory_kind());
  if (!fallback.empty()) std::printf("(on the CPU: %s)\n", fallback.c_str());
  if (!gpu && !args.s && !args.d)
    std::printf(
        "(the standard grid is too slow for a CPU: running the small CPU grid; see "
        "flare help bench)\n");

  int failures = 0, skipped = 0;
  for (const Shape& shape : cases) {
    try {
      Workload w(*device, shape, kSeed);
      for (Pass pass : passes) {
        try {
          device->reset_peak_memory();
          std::function<Status()> fn = [&w] { return w.forward(); };
          if (pass == Pass::kBackward) {
            throw_if_error(w.forward());
            fn = [&w] { return w.backward(); };
          } else if (pass == Pass::kForwardBackward) {
            fn = [&w] {
              const Status s = w.forward();
              return s.ok() ? w.backward() : s;
            };
          }
          ResultRow row;
          row.pass = pass;
          row.shape = shape;
          row.ms = median(device->time_ms(warmup, iters, fn));
          row.tflops = attention_flops(shape, pass) / (row.ms * 1e-3) / 1e12;
          row.peak_mem_bytes = device->peak_memory_bytes();
          print_row(row, gpu);
          result.rows.push_back(row);
        } catch (const UnsupportedError& e) {
          std::printf("%-6s %s: skipped, %s\n", pass_name(pass), shape.describe().c_str(),
                      e.what());
          ++skipped;
        }
      }
    } catch (const RunError& e) {
      std::fprintf(stderr, "flare bench: %s: %s\n", shape.describe().c_str(), e.what());
      ++failures;
    }
  }
  if (args.json) {
    write_result_file(*args.json, result);
    std::printf("wrote %s (%zu rows)\n", args.json->c_str(), result.rows.size());
  }
  if (skipped > 0)
    std::printf("%d pass(es) skipped: not supported by this build or device\n", skipped);
  if (failures > 0) {
    std::fprintf(stderr, "flare bench: %d of %zu case(s) failed\n", failures, cases.size());
    return 1;
  }
  if (result.rows.empty()) {
    std::fprintf(stderr, "flare bench: nothing could be measured\n");
    return 1;
  }
  return 0;
}

}  // namespace flare::cli
