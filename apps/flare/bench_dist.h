// bench_dist.h — `flare bench-dist`: context-parallel attention timed across GPUs, one process per
// GPU (mpirun or torchrun). bench_dist.cpp parses and checks the command line in every build;
// bench_dist_gpu.cpp, built with CUDA, runs it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "flare/dist.h"

namespace flare::cli {

struct BenchDistArgs {
  std::vector<int64_t> seqlens = {32768, 65536, 131072};
  int b = 1, h = 32, h_kv = 8, d = 128;
  bool causal = true;
  std::vector<dist::Strategy> strategies = {dist::Strategy::kRing, dist::Strategy::kZigzag};
  int warmup = 3, iters = 10;
  bool single = true;     // rank 0 times the whole problem on its GPU first
  int timeout_s = 1800;   // every communicator operation, rank 0's single-GPU run included
  std::optional<std::string> json, commit;
};

// Runs the benchmark on this process's GPU (LOCAL_RANK) as one rank of the launch; rank 0 prints
// and writes the result file. Returns the exit status; throws RunError when it cannot run.
int run_bench_dist_on_gpus(const BenchDistArgs& args);

}  // namespace flare::cli
