// bench_dist_gpu.cpp — `flare bench-dist` on GPUs: this process is one rank of a launch (mpirun or
// torchrun), on CUDA device LOCAL_RANK, with an NCCL communicator made from the launch
// environment. Per total length: rank 0 first times the whole problem on its GPU alone while the
// others wait at a barrier (the baseline; where it does not fit, the per-block sum of the
// distributed run stands in), then every rank runs each strategy (cp_bench::rank_run), and the
// ranks' figures meet at rank 0 through the communicator's host all-gather. Only rank 0 prints to
// stdout and writes the result file; any rank reports its own failure on stderr.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "args.h"
#include "bench_dist.h"
#include "cp_bench.h"
#include "flare/attention.h"
#include "report.h"

namespace flare::cli {
namespace {

// What each rank sends rank 0 after one strategy at one length.
struct RankFigures {
  int32_t ok = 0;
  int32_t code = 0;  // the StatusCode of a failure
  cp_bench::Measure fwd, fwdbwd;
};

std::string version_string(int v) {  // 12040 → "12.4"
  return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10);
}

// Where this process sits in the launch, with a message that says how to launch it otherwise.
dist::LaunchInfo launch_info() {
  dist::LaunchInfo info;
  const Status s = dist::launch_info_from_env(&info);
  if (!s.ok())
    throw RunError("bench-dist: " + s.message() +
                   "; launch one process per GPU with `mpirun -np N flare bench-dist ...` or "
                   "`torchrun --nproc-per-node N --no-python flare bench-dist ...`");
  return info;
}

void check_device(const dist::LaunchInfo& info) {
  int devices = 0;
  const cudaError_t err = cudaGetDeviceCount(&devices);
  if (err != cudaSuccess || devices < 1)
    throw RunError("bench-dist: rank " + std::to_string(info.rank) + " finds no CUDA device (" +
                   (err != cudaSuccess ? cudaGetErrorString(err) : "none present") + ")");
  if (info.local_rank >= devices)
    throw RunError("bench-dist: rank " + std::to_string(info.rank) + " has LOCAL_RANK " +
                   std::to_string(info.local_rank) + " but this node has " +
                   std::to_string(devices) + " CUDA device(s): launch at most one process per GPU");
}

std::string result_text(const BenchDistArgs& a, const dist::LaunchInfo& info,
                        const cudaDeviceProp& prop,
                        const std::vector<std::pair<cp_bench::Problem, cp_bench::Row>>& rows) {
  int runtime = 0, driver = 0;
  cudaRuntimeGetVersion(&runtime);
  cudaDriverGetVersion(&driver);
  const auto software = software_versions({{"cuda_runtime", version_string(runtime)},
                                           {"cuda_driver", version_string(driver)}});
  std::ostringstream j;
  j << "{\n  \"card\": " << json_string(prop.name) << ",\n  \"date\": "
    << json_string(iso_date_utc()) << ",\n  \"commit\": " << json_string(source_commit(a.commit))
    << ",\n  \"software\": {";
  for (size_t i = 0; i < software.size(); ++i)
    j << (i ? ", " : "") << json_string(software[i].first) << ": "
      << json_string(software[i].second);
  j << "},\n  \"benchmark\": \"flare bench-dist\",\n  \"config\": {\"gpus\": " << info.size
    << ", \"launch\": " << json_string(info.source + ", one process per GPU")
    << ", \"warmup\": " << a.warmup << ", \"iters\": " << a.iters << "},\n  \"rows\": [";
  for (size_t i = 0; i < rows.size(); ++i)
    j << (i ? "," : "") << "\n    " << cp_bench::json_row(rows[i].first, rows[i].second);
  j << "\n  ]\n}\n";
  return j.str();
}

}  // namespace

int run_bench_dist_on_gpus(const BenchDistArgs& a) {
  if (!dist::nccl_built())
    throw RunError("bench-dist: this build of flare has CUDA but no NCCL; context parallelism "
                   "across GPUs needs NCCL at configure time (NCCL_HOME or the CUDA toolkit's)");
  const dist::LaunchInfo info = launch_info();
  check_device(info);
  const bool lead = info.rank == 0;
  const std::string who = "bench-dist: rank " + std::to_string(info.rank) + ": ";
  dist::CommOptions options;
  options.timeout_ms = a.timeout_s * 1000;
  std::unique_ptr<dist::Communicator> comm;
  Status st = dist::make_nccl_communicator_from_env(options, &comm);
  if (!st.ok()) throw RunError(who + st.to_string());
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, info.local_rank);

  if (lead) {
    std::printf("flare %s bench-dist: %d x %s (%s launch), b %d h %d h_kv %d d %d %s bf16, "
                "%d+%d iters\n",
                version(), info.size, prop.name, info.source.c_str(), a.b, a.h, a.h_kv, a.d,
                a.causal ? "causal" : "full", a.warmup, a.iters);
    cp_bench::print_header();
  }
  std::vector<std::pair<cp_bench::Problem, cp_bench::Row>> rows;
  int failures = 0;
  for (int64_t s : a.seqlens) {
    const cp_bench::Problem p = cp_bench::problem_at(a, s);
    const size_t first = rows.size();
    cp_bench::Measure single_f, single_fb;
    bool have_single = false;
    if (lead && a.single) {
      st = cp_bench::single_gpu(p, info.local_rank, &single_f, &single_fb);
      have_single = st.ok();
      if (have_single) {
        for (auto [pass, m] : {std::pair{"fwd", &single_f}, {"fwdbwd", &single_fb}})
          rows.push_back({p, cp_bench::make_row("flare", pass, 1, *m, m)});
      } else {
        std::printf("single GPU at s %lld: not measured (%s); efficiency from the per-block sum\n",
                    static_cast<long long>(s), st.to_string().c_str());
      }
    }
    // The others wait here while rank 0 measures alone (within the timeout).
    st = comm->barrier();
    if (!st.ok()) throw RunError(who + st.to_string());
    for (dist::Strategy strategy : a.strategies) {
      RankFigures mine;
      st = cp_bench::rank_run(p, strategy, *comm, &mine.fwd, &mine.fwdbwd);
      mine.ok = st.ok() ? 1 : 0;
      mine.code = static_cast<int32_t>(st.code());
      if (!st.ok())
        std::fprintf(stderr, "flare %s%s at s %lld: %s\n", who.c_str(),
                     cp_bench::strategy_flag(strategy), static_cast<long long>(s),
                     st.to_string().c_str());
      // A failure that broke the communicator (a dead peer, a timeout) ends the run here.
      std::vector<RankFigures> all(static_cast<size_t>(info.size));
      const Status gathered = comm->host_all_gather(&mine, all.data(), sizeof mine);
      if (!gathered.ok()) throw RunError(who + gathered.to_string());
      cp_bench::Measure f, fb;
      std::string failed;
      for (int r = 0; r < info.size; ++r) {
        if (!all[r].ok) failed += (failed.empty() ? "" : ", ") + std::to_string(r);
        cp_bench::combine(all[r].fwd, &f);
        cp_bench::combine(all[r].fwdbwd, &fb);
      }
      if (!failed.empty()) {
        ++failures;
        if (lead)
          std::printf("%s at s %lld: failed on rank(s) %s (their messages are on stderr)\n",
                      cp_bench::strategy_flag(strategy), static_cast<long long>(s), failed.c_str());
        continue;
      }
      const std::string impl = std::string("flare-") + cp_bench::strategy_flag(strategy);
      rows.push_back({p, cp_bench::make_row(impl, "fwd", info.size, f,
                                            have_single ? &single_f : nullptr)});
      rows.push_back({p, cp_bench::make_row(impl, "fwdbwd", info.size, fb,
                                            have_single ? &single_fb : nullptr)});
    }
    if (lead)
      for (size_t i = first; i < rows.size(); ++i) cp_bench::print_row(rows[i].first, rows[i].second);
  }
  if (lead && a.json) {
    write_file_whole(*a.json, result_text(a, info, prop, rows));
    std::printf("wrote %s (%zu rows)\n", a.json->c_str(), rows.size());
  }
  if (failures > 0) {
    if (lead) std::fprintf(stderr, "flare bench-dist: %d case(s) failed\n", failures);
    return 1;
  }
  return 0;
}

}  // namespace flare::cli
