// ring_bench.cpp — context-parallel attention (ring, zigzag, all-to-all) over NCCL on this
// machine's GPUs, against one GPU running the whole sequence in the same process.
//
// One process, one thread per GPU (rank r on device r), as the dist GPU tests run. For each total
// sequence length: first the whole problem as one single-GPU flare call on device 0 (skipped,
// and said so, when it does not fit: the per-block sum stands in), then every strategy on N GPUs.
// What is measured and reported, and how, is apps/flare/cp_bench.h's, shared with
// `flare bench-dist` (the same benchmark, one process per GPU under mpirun or torchrun).
//
//   ring_bench [--gpus N] [--s 32768,65536,131072] [--b 1] [--h 32] [--h-kv 8] [--d 128]
//              [--causal 1] [--strategies ring,zigzag,a2a] [--warmup 3] [--iters 10]
//              [--no-single] [--json PATH] [--commit ID]
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cp_bench.h"
#include "flare/attention.h"
#include "flare/dist.h"

namespace {

using flare::Status;
namespace dist = flare::dist;
namespace cp_bench = flare::cp_bench;

struct Args {
  int gpus = 0;
  std::vector<int64_t> seqlens = {32768, 65536, 131072};
  int b = 1, h = 32, h_kv = 8, d = 128;
  bool causal = true;
  std::vector<std::string> strategies = {"ring", "zigzag"};
  int warmup = 3, iters = 10;
  bool single = true;
  std::string json, commit;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "ring_bench: %s\nusage: ring_bench [--gpus N] [--s 32768,65536] [--b 1] [--h 32] "
               "[--h-kv 8] [--d 128] [--causal 0|1] [--strategies ring,zigzag,a2a] [--warmup 3] "
               "[--iters 10] [--no-single] [--json PATH] [--commit ID]\n",
               why.c_str());
  std::exit(2);
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

int64_t parse_int(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || x < 0) usage(flag + ": '" + v + "' is not a non-negative integer");
  return x;
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(f + " needs a value");
      return argv[++i];
    };
    if (f == "--gpus") a.gpus = static_cast<int>(parse_int(f, value()));
    else if (f == "--s") {
      a.seqlens.clear();
      for (const std::string& s : split(value())) a.seqlens.push_back(parse_int(f, s));
    } else if (f == "--b") a.b = static_cast<int>(parse_int(f, value()));
    else if (f == "--h") a.h = static_cast<int>(parse_int(f, value()));
    else if (f == "--h-kv") a.h_kv = static_cast<int>(parse_int(f, value()));
    else if (f == "--d") a.d = static_cast<int>(parse_int(f, value()));
    else if (f == "--causal") a.causal = parse_int(f, value()) != 0;
    else if (f == "--strategies") a.strategies = split(value());
    else if (f == "--warmup") a.warmup = static_cast<int>(parse_int(f, value()));
    else if (f == "--iters") a.iters = static_cast<int>(parse_int(f, value()));
    else if (f == "--no-single") a.single = false;
    else if (f == "--json") a.json = value();
    else if (f == "--commit") a.commit = value();
    else usage("unknown argument " + f);
  }
  if (a.iters < 1) usage("--iters must be >= 1");
  if (a.b < 1 || a.h < 1 || a.h_kv < 1 || a.d < 1 || a.h % a.h_kv != 0)
    usage("--b, --h, --h-kv, --d must be >= 1 and --h-kv must divide --h");
  dist::Strategy strategy;
  for (const std::string& s : a.strategies)
    if (!cp_bench::parse_strategy(s, &strategy)) usage("--strategies: unknown '" + s + "'");
  if (a.seqlens.empty()) usage("--s: no sequence length");
  if (a.commit.empty() && std::getenv("FLARE_COMMIT") != nullptr) a.commit = std::getenv("FLARE_COMMIT");
  if (a.commit.empty()) a.commit = "unknown";
  return a;
}

// Every rank of one strategy at one length, one thread per GPU.
Status distributed(const Args& a, const cp_bench::Problem& p, dist::Strategy strategy,
                   cp_bench::Measure* fwd, cp_bench::Measure* fwdbwd) {
  dist::NcclId id;
  FLARE_RETURN_IF_ERROR(dist::nccl_unique_id(&id));
  const int n = a.gpus;
  std::vector<Status> st(static_cast<size_t>(n));
  std::vector<cp_bench::Measure> f(static_cast<size_t>(n)), fb(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      std::unique_ptr<dist::Communicator> comm;
      st[r] = dist::make_nccl_communicator(id, r, n, r, {600000}, &comm);
      if (st[r].ok()) st[r] = cp_bench::rank_run(p, strategy, *comm, &f[r], &fb[r]);
    });
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < n; ++r)
    if (!st[r].ok()) return Status(st[r].code(), "rank " + std::to_string(r) + ": " + st[r].message());
  for (int r = 0; r < n; ++r) {
    cp_bench::combine(f[r], fwd);
    cp_bench::combine(fb[r], fwdbwd);
  }
  return {};
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  Args a = parse(argc, argv);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 1) {
    std::fprintf(stderr, "ring_bench: no CUDA device\n");
    return 1;
  }
  if (a.gpus == 0) a.gpus = devices;
  if (a.gpus < 2 || a.gpus > devices) usage("--gpus: needs 2 to " + std::to_string(devices));
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  int peer = 0;
  cudaDeviceCanAccessPeer(&peer, 0, 1);
  int runtime = 0, driver = 0, nccl = 0;
  cudaRuntimeGetVersion(&runtime);
  cudaDriverGetVersion(&driver);
  ncclGetVersion(&nccl);
  std::printf("ring_bench: %d x %s (peer access %s), b %d h %d h_kv %d d %d %s bf16, %d+%d iters\n",
              a.gpus, prop.name, peer ? "yes" : "no", a.b, a.h, a.h_kv, a.d,
              a.causal ? "causal" : "full", a.warmup, a.iters);
  cp_bench::print_header();

  // Each row with the case it measured (rows of several lengths go to one file).
  std::vector<std::pair<cp_bench::Problem, cp_bench::Row>> rows;
  for (int64_t s : a.seqlens) {
    const cp_bench::Problem p = cp_bench::problem_at(a, s);
    cp_bench::Measure single_f, single_fb;
    bool have_single = false;
    if (a.single) {
      const Status st = cp_bench::single_gpu(p, 0, &single_f, &single_fb);
      have_single = st.ok();
      if (!st.ok())
        std::printf("single GPU at s %lld: not measured (%s); efficiency from the per-block sum\n",
                    static_cast<long long>(s), st.to_string().c_str());
      cudaSetDevice(0);
      cudaDeviceSynchronize();
      if (have_single)
        for (auto [pass, m] : {std::pair{"fwd", &single_f}, {"fwdbwd", &single_fb}})
          rows.push_back({p, cp_bench::make_row("flare", pass, 1, *m, m)});
    }
    const size_t first = rows.size();
    for (const std::string& name : a.strategies) {
      dist::Strategy strategy = dist::Strategy::kZigzag;
      cp_bench::parse_strategy(name, &strategy);  // checked by parse()
      cp_bench::Measure f, fb;
      const Status st = distributed(a, p, strategy, &f, &fb);
      if (!st.ok()) {
        std::printf("%s at s %lld: failed (%s)\n", name.c_str(), static_cast<long long>(s),
                    st.to_string().c_str());
        continue;
      }
      const std::string impl = "flare-" + name;
      rows.push_back({p, cp_bench::make_row(impl, "fwd", a.gpus, f, have_single ? &single_f : nullptr)});
      rows.push_back({p, cp_bench::make_row(impl, "fwdbwd", a.gpus, fb, have_single ? &single_fb : nullptr)});
    }
    for (size_t i = have_single ? first - 2 : first; i < rows.size(); ++i)
      cp_bench::print_row(rows[i].first, rows[i].second);
    std::fflush(stdout);
  }

  if (!a.json.empty()) {
    std::ofstream out(a.json);
    out << "{\n  \"card\": \"" << prop.name << "\",\n  \"date\": \"" << utc_now()
        << "\",\n  \"commit\": \"" << a.commit << "\",\n  \"software\": {\"flare\": \""
        << flare::version() << "\", \"cuda_runtime\": " << runtime << ", \"driver\": " << driver
        << ", \"nccl\": " << nccl << "},\n  \"benchmark\": \"bench/ring_bench\",\n"
        << "  \"config\": {\"gpus\": " << a.gpus << ", \"peer_access\": " << (peer ? "true" : "false")
        << ", \"launch\": \"one process, one thread per GPU\", \"warmup\": " << a.warmup
        << ", \"iters\": " << a.iters << "},\n  \"rows\": [\n";
    for (size_t i = 0; i < rows.size(); ++i)
      out << "    " << cp_bench::json_row(rows[i].first, rows[i].second)
          << (i + 1 < rows.size() ? ",\n" : "\n");
    out << "  ]\n}\n";
    if (!out) {
      std::fprintf(stderr, "ring_bench: could not write %s\n", a.json.c_str());
      return 1;
    }
    std::printf("wrote %s\n", a.json.c_str());
  }
  return 0;
}
