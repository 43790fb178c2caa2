// ring_bench.cpp — context-parallel attention (ring, zigzag, all-to-all) over NCCL on this
// machine's GPUs, against one GPU running the whole sequence in the same process.
//
// One process, one thread per GPU (rank r on device r), as the dist GPU tests run. For each total
// sequence length: first the whole problem as one single-GPU flare call on device 0 (skipped,
// and said so, when it does not fit), then every strategy on N GPUs. Per case and pass (fwd,
// fwd+bwd) it reports:
//   ms              median over the timed iterations of the slowest rank (CUDA events on its
//                   stream around the call; the ring couples the ranks, so this is the step time)
//   ms_single_gpu   the same problem on one GPU, same process, same iterations
//   efficiency      (ms_single_gpu / N) / ms
//   comm_ms         the communication stream's time in exchanges per call (CUDA events around
//                   each, ContextParallelAttention::take_timing), slowest rank
//   comm_exposed_ms ms − compute time per call (the caller's stream between its waits): what the
//                   communication added to the step; comm_overlapped_ms = comm_ms − exposed
//   comm_bytes      bytes a rank sent per call; comm_gbps = comm_bytes / comm_ms
//   peak_mem_bytes  device memory the rank held at its peak: its tensors and the plan's workspace
//                   (cudaMemGetInfo before/after), plus the stream-ordered pool's high watermark
//                   (the backward's scratch)
// FLOPs as FlashAttention counts them (4·b·s²·h·d, halved when causal, backward 2.5×); a row whose
// per-GPU TFLOP/s exceeds the card's dense bf16 peak is marked suspect (a run that silently did
// less work than asked).
//
//   ring_bench [--gpus N] [--s 32768,65536,131072] [--b 1] [--h 32] [--h-kv 8] [--d 128]
//              [--causal 1] [--strategies ring,zigzag,a2a] [--warmup 3] [--iters 10]
//              [--no-single] [--json PATH] [--commit ID]
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "flare/attention.h"
#include "flare/dist.h"

namespace {

using flare::DType;
using flare::Status;
using flare::TensorView;
namespace dist = flare::dist;

constexpr double kPeakDenseBf16Tflops = 989.0;  // H100 SXM; the bound of the "suspect" check

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
  for (const std::string& s : a.strategies)
    if (s != "ring" && s != "zigzag" && s != "a2a") usage("--strategies: unknown '" + s + "'");
  if (a.seqlens.empty()) usage("--s: no sequence length");
  if (a.commit.empty() && std::getenv("FLARE_COMMIT") != nullptr) a.commit = std::getenv("FLARE_COMMIT");
  if (a.commit.empty()) a.commit = "unknown";
  return a;
}

dist::Strategy strategy_of(const std::string& s) {
  return s == "ring" ? dist::Strategy::kRing
                     : s == "zigzag" ? dist::Strategy::kZigzag : dist::Strategy::kAllToAll;
}

#define CHECK_CUDA(call)                                                                    \
  do {                                                                                      \
    const cudaError_t e_ = (call);                                                          \
    if (e_ != cudaSuccess)                                                                  \
      return Status::device_error(std::string(#call) + ": " + cudaGetErrorString(e_));      \
  } while (0)

// bf16 device tensors filled with a tiled host pattern of uniform values in [-1, 1] (attention's
// speed does not depend on the values; NaN-free inputs are all it needs).
struct DeviceTensors {
  std::vector<void*> ptrs;
  ~DeviceTensors() {
    for (void* p : ptrs) cudaFree(p);
  }
  Status make(DType dt, std::initializer_list<int64_t> shape, int device, TensorView* out) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    const size_t bytes = static_cast<size_t>(std::max<int64_t>(n, 1)) * flare::dtype_size(dt);
    void* p = nullptr;
    CHECK_CUDA(cudaMalloc(&p, bytes));
    ptrs.push_back(p);
    FLARE_RETURN_IF_ERROR(fill(p, bytes));
    *out = TensorView::contiguous(p, dt, shape, flare::DeviceType::kCUDA, device);
    return {};
  }
  static Status fill(void* p, size_t bytes) {
    static const std::vector<uint16_t> pattern = [] {
      std::vector<uint16_t> v(size_t{1} << 22);
      uint64_t x = 0x9E3779B97F4A7C15ull;
      for (uint16_t& e : v) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        const float f = static_cast<float>((x >> 40) & 0xFFFFFF) / 8388608.0f - 1.0f;
        uint32_t bits;
        std::memcpy(&bits, &f, 4);
        e = static_cast<uint16_t>(bits >> 16);  // bf16 (also a finite fp32 half-word pair)
      }
      return v;
    }();
    const size_t chunk = pattern.size() * 2;
    for (size_t at = 0; at < bytes; at += chunk)
      CHECK_CUDA(cudaMemcpy(static_cast<char*>(p) + at, pattern.data(), std::min(chunk, bytes - at),
                            cudaMemcpyHostToDevice));
    return {};
  }
};

int64_t used_device_bytes() {
  size_t free_b = 0, total_b = 0;
  cudaMemGetInfo(&free_b, &total_b);
  return static_cast<int64_t>(total_b - free_b);
}

// The stream-ordered pool's high watermark since the last reset (the backward's scratch).
int64_t pool_high_and_reset(int device) {
  cudaMemPool_t pool = nullptr;
  if (cudaDeviceGetDefaultMemPool(&pool, device) != cudaSuccess) return 0;
  uint64_t high = 0;
  cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &high);
  uint64_t zero = 0;
  cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &zero);
  return static_cast<int64_t>(high);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Median milliseconds of `call` on `stream` over iters, after warmup (CUDA events).
Status time_call(const std::function<Status()>& call, cudaStream_t stream, int warmup, int iters,
                 double* ms) {
  for (int i = 0; i < warmup; ++i) FLARE_RETURN_IF_ERROR(call());
  std::vector<cudaEvent_t> ev(static_cast<size_t>(2 * iters));
  for (cudaEvent_t& e : ev) CHECK_CUDA(cudaEventCreate(&e));
  Status s;
  for (int i = 0; i < iters && s.ok(); ++i) {
    cudaEventRecord(ev[2 * i], stream);
    s = call();
    cudaEventRecord(ev[2 * i + 1], stream);
  }
  if (s.ok()) s = cudaStreamSynchronize(stream) == cudaSuccess ? Status{} : Status::device_error("sync");
  std::vector<double> t;
  for (int i = 0; i < iters && s.ok(); ++i) {
    float x = 0.0f;
    cudaEventElapsedTime(&x, ev[2 * i], ev[2 * i + 1]);
    t.push_back(x);
  }
  for (cudaEvent_t e : ev) cudaEventDestroy(e);
  *ms = median(t);
  return s;
}

struct Measure {
  double ms = 0.0, comm_ms = 0.0, compute_ms = 0.0;
  int64_t bytes = 0, peak = 0;
};

struct Row {
  std::string impl, pass;
  int gpus = 1;
  int64_t s = 0;
  Measure m;
  double ms_single = -1.0;  // < 0: not measured
  int64_t peak_single = 0;
};

// The single-GPU flare call over the whole sequence on device 0: fwd and fwd+bwd.
Status single_gpu(const Args& a, int64_t s, Measure* fwd, Measure* fwdbwd) {
  CHECK_CUDA(cudaSetDevice(0));
  CHECK_CUDA(cudaDeviceSynchronize());
  pool_high_and_reset(0);
  const int64_t before = used_device_bytes();
  DeviceTensors mem;
  TensorView q, k, v, o, lse, dout, dq, dk, dv;
  for (auto [t, heads] : {std::pair{&q, a.h}, {&o, a.h}, {&dout, a.h}, {&dq, a.h}, {&k, a.h_kv},
                          {&v, a.h_kv}, {&dk, a.h_kv}, {&dv, a.h_kv}})
    FLARE_RETURN_IF_ERROR(mem.make(DType::kBFloat16, {a.b, s, heads, a.d}, 0, t));
  FLARE_RETURN_IF_ERROR(mem.make(DType::kFloat32, {a.b, a.h, s}, 0, &lse));
  const int64_t held = used_device_bytes() - before;
  flare::AttentionOptions opt;
  opt.causal = a.causal;
  cudaStream_t stream = nullptr;
  CHECK_CUDA(cudaStreamCreate(&stream));
  auto forward = [&] { return flare::attention_forward(q, k, v, o, lse, opt, {}, stream); };
  auto both = [&]() -> Status {
    FLARE_RETURN_IF_ERROR(forward());
    return flare::attention_backward(dout, q, k, v, o, lse, dq, dk, dv, opt, {}, stream);
  };
  Status st = time_call(forward, stream, a.warmup, a.iters, &fwd->ms);
  if (st.ok()) st = time_call(both, stream, a.warmup, a.iters, &fwdbwd->ms);
  fwd->peak = fwdbwd->peak = held + pool_high_and_reset(0);
  cudaStreamDestroy(stream);
  return st;
}

// One strategy on every GPU: each rank's fwd and fwd+bwd times, communication and memory.
Status rank_run(const Args& a, int64_t s, dist::Strategy strategy, dist::Communicator& comm,
                Measure* fwd, Measure* fwdbwd) {
  const int dev = comm.device_index();
  CHECK_CUDA(cudaSetDevice(dev));
  CHECK_CUDA(cudaDeviceSynchronize());
  pool_high_and_reset(dev);
  const int64_t before = used_device_bytes();
  dist::ContextParallelConfig cfg;
  cfg.strategy = strategy;
  cfg.batch = a.b;
  cfg.seqlen = s;
  cfg.heads_q = a.h;
  cfg.heads_kv = a.h_kv;
  cfg.head_dim = a.d;
  cfg.dtype = DType::kBFloat16;
  cfg.attention.causal = a.causal;
  std::unique_ptr<dist::ContextParallelAttention> cp;
  FLARE_RETURN_IF_ERROR(dist::ContextParallelAttention::create(&comm, cfg, &cp));
  const int64_t rows = cp->shard().length;
  DeviceTensors mem;
  TensorView q, k, v, o, lse, dout, dq, dk, dv;
  for (auto [t, heads] : {std::pair{&q, a.h}, {&o, a.h}, {&dout, a.h}, {&dq, a.h}, {&k, a.h_kv},
                          {&v, a.h_kv}, {&dk, a.h_kv}, {&dv, a.h_kv}})
    FLARE_RETURN_IF_ERROR(mem.make(DType::kBFloat16, {a.b, rows, heads, a.d}, dev, t));
  FLARE_RETURN_IF_ERROR(mem.make(DType::kFloat32, {a.b, a.h, rows}, dev, &lse));
  const int64_t held = used_device_bytes() - before;
  cudaStream_t stream = nullptr;
  CHECK_CUDA(cudaStreamCreate(&stream));
  auto forward = [&] { return cp->forward(q, k, v, o, lse, stream); };
  auto both = [&]() -> Status {
    FLARE_RETURN_IF_ERROR(forward());
    return cp->backward(dout, q, k, v, o, lse, dq, dk, dv, stream);
  };
  // Times without the timing events, then the communication profile from separate iterations.
  Status st;
  for (auto [m, call] : {std::pair<Measure*, std::function<Status()>>{fwd, forward}, {fwdbwd, both}}) {
    if (st.ok()) st = time_call(call, stream, a.warmup, a.iters, &m->ms);
    if (st.ok()) st = cp->set_timing(true);
    for (int i = 0; i < a.iters && st.ok(); ++i) st = call();
    dist::CpTiming t;
    if (st.ok()) st = cp->take_timing(&t);
    if (st.ok()) st = cp->set_timing(false);
    m->comm_ms = t.comm_ms / a.iters;
    m->compute_ms = t.compute_ms / a.iters;
    m->bytes = t.bytes_sent / a.iters;
  }
  fwd->peak = fwdbwd->peak = held + pool_high_and_reset(dev);
  cudaStreamSynchronize(stream);
  cudaStreamDestroy(stream);
  return st;
}

// Every rank of one strategy at one length, one thread per GPU.
Status distributed(const Args& a, int64_t s, dist::Strategy strategy, Measure* fwd, Measure* fwdbwd) {
  dist::NcclId id;
  FLARE_RETURN_IF_ERROR(dist::nccl_unique_id(&id));
  const int n = a.gpus;
  std::vector<Status> st(static_cast<size_t>(n));
  std::vector<Measure> f(static_cast<size_t>(n)), fb(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      std::unique_ptr<dist::Communicator> comm;
      st[r] = dist::make_nccl_communicator(id, r, n, r, {600000}, &comm);
      if (st[r].ok()) st[r] = rank_run(a, s, strategy, *comm, &f[r], &fb[r]);
    });
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < n; ++r)
    if (!st[r].ok()) return Status(st[r].code(), "rank " + std::to_string(r) + ": " + st[r].message());
  // The slowest rank sets the step; memory and traffic are the largest of any rank.
  for (auto [out, per] : {std::pair{fwd, &f}, {fwdbwd, &fb}})
    for (const Measure& m : *per) {
      out->ms = std::max(out->ms, m.ms);
      out->comm_ms = std::max(out->comm_ms, m.comm_ms);
      out->compute_ms = std::max(out->compute_ms, m.compute_ms);
      out->bytes = std::max(out->bytes, m.bytes);
      out->peak = std::max(out->peak, m.peak);
    }
  return {};
}

double flops(const Args& a, int64_t s, const std::string& pass) {
  double f = 4.0 * a.b * static_cast<double>(s) * static_cast<double>(s) * a.h * a.d;
  if (a.causal) f /= 2.0;
  return pass == "fwd" ? f : 3.5 * f;
}

std::string json_row(const Args& a, const Row& r) {
  const double exposed = std::max(0.0, r.m.ms - r.m.compute_ms);
  const double tflops_per_gpu = flops(a, r.s, r.pass) / (r.m.ms * 1e-3) / 1e12 / r.gpus;
  std::ostringstream j;
  j.precision(6);
  j << "{\"impl\": \"" << r.impl << "\", \"pass\": \"" << r.pass << "\", \"dtype\": \"bf16\""
    << ", \"gpus\": " << r.gpus << ", \"s_total\": " << r.s << ", \"b\": " << a.b
    << ", \"h\": " << a.h << ", \"h_kv\": " << a.h_kv << ", \"d\": " << a.d
    << ", \"causal\": " << (a.causal ? "true" : "false") << ", \"ms\": " << r.m.ms
    << ", \"ms_single_gpu\": ";
  if (r.ms_single > 0) j << r.ms_single; else j << "null";
  j << ", \"efficiency\": ";
  if (r.ms_single > 0 && r.gpus > 1) j << (r.ms_single / r.gpus) / r.m.ms; else j << "null";
  j << ", \"tflops_per_gpu\": " << tflops_per_gpu
    << ", \"suspect\": " << (tflops_per_gpu > kPeakDenseBf16Tflops ? "true" : "false");
  if (r.gpus > 1) {
    j << ", \"comm_ms\": " << r.m.comm_ms << ", \"comm_exposed_ms\": " << exposed
      << ", \"comm_overlapped_ms\": " << std::max(0.0, r.m.comm_ms - exposed)
      << ", \"compute_ms\": " << r.m.compute_ms << ", \"comm_bytes\": " << r.m.bytes
      << ", \"comm_gbps\": " << (r.m.comm_ms > 0 ? r.m.bytes / (r.m.comm_ms * 1e6) : 0.0);
  }
  j << ", \"peak_mem_bytes\": " << r.m.peak;
  if (r.gpus > 1 && r.ms_single > 0) j << ", \"peak_mem_bytes_single_gpu\": " << r.peak_single;
  j << "}";
  return j.str();
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
  std::printf("%-13s %-6s %4s %8s %10s %10s %6s %9s %9s %9s %7s %8s\n", "impl", "pass", "gpus",
              "s", "ms", "1gpu_ms", "eff", "comm_ms", "exposed", "overlap", "GB/s", "peak_GiB");

  std::vector<Row> rows;
  for (int64_t s : a.seqlens) {
    Measure single_f, single_fb;
    bool have_single = false;
    if (a.single) {
      const Status st = single_gpu(a, s, &single_f, &single_fb);
      have_single = st.ok();
      if (!st.ok())
        std::printf("single GPU at s %lld: not measured (%s)\n", static_cast<long long>(s),
                    st.to_string().c_str());
      cudaSetDevice(0);
      cudaDeviceSynchronize();
      if (have_single)
        for (auto [pass, m] : {std::pair{"fwd", &single_f}, {"fwdbwd", &single_fb}})
          rows.push_back({"flare", pass, 1, s, *m, m->ms, m->peak});
    }
    for (const std::string& name : a.strategies) {
      Measure f, fb;
      const Status st = distributed(a, s, strategy_of(name), &f, &fb);
      if (!st.ok()) {
        std::printf("%s at s %lld: failed (%s)\n", name.c_str(), static_cast<long long>(s),
                    st.to_string().c_str());
        continue;
      }
      const std::string impl = "flare-" + name;
      rows.push_back({impl, "fwd", a.gpus, s, f, have_single ? single_f.ms : -1.0, single_f.peak});
      rows.push_back({impl, "fwdbwd", a.gpus, s, fb, have_single ? single_fb.ms : -1.0, single_fb.peak});
    }
    for (const Row& r : rows) {
      if (r.s != s) continue;
      const double exposed = std::max(0.0, r.m.ms - r.m.compute_ms);
      std::printf("%-13s %-6s %4d %8lld %10.3f %10.3f %6.3f %9.3f %9.3f %9.3f %7.1f %8.2f%s\n",
                  r.impl.c_str(), r.pass.c_str(), r.gpus, static_cast<long long>(r.s), r.m.ms,
                  r.ms_single, r.ms_single > 0 && r.gpus > 1 ? (r.ms_single / r.gpus) / r.m.ms : 0.0,
                  r.m.comm_ms, r.gpus > 1 ? exposed : 0.0,
                  r.gpus > 1 ? std::max(0.0, r.m.comm_ms - exposed) : 0.0,
                  r.m.comm_ms > 0 ? r.m.bytes / (r.m.comm_ms * 1e6) : 0.0,
                  static_cast<double>(r.m.peak) / (1 << 30),
                  flops(a, r.s, r.pass) / (r.m.ms * 1e9) / r.gpus > kPeakDenseBf16Tflops
                      ? "  SUSPECT: above peak" : "");
    }
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
      out << "    " << json_row(a, rows[i]) << (i + 1 < rows.size() ? ",\n" : "\n");
    out << "  ]\n}\n";
    if (!out) {
      std::fprintf(stderr, "ring_bench: could not write %s\n", a.json.c_str());
      return 1;
    }
    std::printf("wrote %s\n", a.json.c_str());
  }
  return 0;
}
