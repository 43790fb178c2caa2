// cp_bench.cpp — see cp_bench.h.
#include "cp_bench.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <memory>
#include <sstream>
#include <utility>
#include <vector>

#include "flare/attention.h"

namespace flare::cp_bench {
namespace {

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
    const size_t bytes = static_cast<size_t>(std::max<int64_t>(n, 1)) * dtype_size(dt);
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, bytes);
    if (err != cudaSuccess) {
      cudaGetLastError();  // an allocation failure is not sticky: later calls must not see it
      return Status::out_of_memory("cudaMalloc of " + std::to_string(bytes) + " bytes: " +
                                   cudaGetErrorString(err));
    }
    ptrs.push_back(p);
    FLARE_RETURN_IF_ERROR(fill(p, bytes));
    *out = TensorView::contiguous(p, dt, shape, DeviceType::kCUDA, device);
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

// q, o, dout, dq (b, rows, h, d); k, v, dk, dv (b, rows, h_kv, d); lse (b, h, rows).
struct Tensors {
  TensorView q, k, v, o, lse, dout, dq, dk, dv;
};
Status make_tensors(const Problem& p, int64_t rows, int device, DeviceTensors* mem, Tensors* t) {
  for (auto [view, heads] : {std::pair{&t->q, p.h}, {&t->o, p.h}, {&t->dout, p.h}, {&t->dq, p.h},
                             {&t->k, p.h_kv}, {&t->v, p.h_kv}, {&t->dk, p.h_kv}, {&t->dv, p.h_kv}})
    FLARE_RETURN_IF_ERROR(mem->make(DType::kBFloat16, {p.b, rows, heads, p.d}, device, view));
  return mem->make(DType::kFloat32, {p.b, p.h, rows}, device, &t->lse);
}

}  // namespace

Status single_gpu(const Problem& p, int device, Measure* fwd, Measure* fwdbwd) {
  CHECK_CUDA(cudaSetDevice(device));
  CHECK_CUDA(cudaDeviceSynchronize());
  pool_high_and_reset(device);
  const int64_t before = used_device_bytes();
  DeviceTensors mem;
  Tensors t;
  FLARE_RETURN_IF_ERROR(make_tensors(p, p.s, device, &mem, &t));
  const int64_t held = used_device_bytes() - before;
  AttentionOptions opt;
  opt.causal = p.causal;
  cudaStream_t stream = nullptr;
  CHECK_CUDA(cudaStreamCreate(&stream));
  auto forward = [&] { return attention_forward(t.q, t.k, t.v, t.o, t.lse, opt, {}, stream); };
  auto both = [&]() -> Status {
    FLARE_RETURN_IF_ERROR(forward());
    return attention_backward(t.dout, t.q, t.k, t.v, t.o, t.lse, t.dq, t.dk, t.dv, opt, {}, stream);
  };
  Status st = time_call(forward, stream, p.warmup, p.iters, &fwd->ms);
  if (st.ok()) st = time_call(both, stream, p.warmup, p.iters, &fwdbwd->ms);
  fwd->peak = fwdbwd->peak = held + pool_high_and_reset(device);
  cudaStreamSynchronize(stream);
  cudaStreamDestroy(stream);
  return st;
}

Status rank_run(const Problem& p, dist::Strategy strategy, dist::Communicator& comm,
                Measure* fwd, Measure* fwdbwd) {
  const int dev = comm.device_index();
  CHECK_CUDA(cudaSetDevice(dev));
  CHECK_CUDA(cudaDeviceSynchronize());
  pool_high_and_reset(dev);
  const int64_t before = used_device_bytes();
  dist::ContextParallelConfig cfg;
  cfg.strategy = strategy;
  cfg.batch = p.b;
  cfg.seqlen = p.s;
  cfg.heads_q = p.h;
  cfg.heads_kv = p.h_kv;
  cfg.head_dim = p.d;
  cfg.dtype = DType::kBFloat16;
  cfg.attention.causal = p.causal;
  std::unique_ptr<dist::ContextParallelAttention> cp;
  FLARE_RETURN_IF_ERROR(dist::ContextParallelAttention::create(&comm, cfg, &cp));
  DeviceTensors mem;
  Tensors t;
  FLARE_RETURN_IF_ERROR(make_tensors(p, cp->shard().length, dev, &mem, &t));
  const int64_t held = used_device_bytes() - before;
  cudaStream_t stream = nullptr;
  CHECK_CUDA(cudaStreamCreate(&stream));
  auto forward = [&] { return cp->forward(t.q, t.k, t.v, t.o, t.lse, stream); };
  auto both = [&]() -> Status {
    FLARE_RETURN_IF_ERROR(forward());
    return cp->backward(t.dout, t.q, t.k, t.v, t.o, t.lse, t.dq, t.dk, t.dv, stream);
  };
  // Times without the timing events, then the communication profile from separate iterations.
  Status st;
  for (auto [m, call] : {std::pair<Measure*, std::function<Status()>>{fwd, forward}, {fwdbwd, both}}) {
    if (st.ok()) st = time_call(call, stream, p.warmup, p.iters, &m->ms);
    if (st.ok()) st = cp->set_timing(true);
    for (int i = 0; i < p.iters && st.ok(); ++i) st = call();
    dist::CpTiming timing;
    if (st.ok()) st = cp->take_timing(&timing);
    if (st.ok()) st = cp->set_timing(false);
    m->comm_ms = timing.comm_ms / p.iters;
    m->compute_ms = m->compute_ms_sum = timing.compute_ms / p.iters;
    m->bytes = timing.bytes_sent / p.iters;
  }
  fwd->peak = fwdbwd->peak = held + pool_high_and_reset(dev);
  cudaStreamSynchronize(stream);
  cudaStreamDestroy(stream);
  return st;
}

void combine(const Measure& rank, Measure* step) {
  step->ms = std::max(step->ms, rank.ms);
  step->comm_ms = std::max(step->comm_ms, rank.comm_ms);
  step->compute_ms = std::max(step->compute_ms, rank.compute_ms);
  step->compute_ms_sum += rank.compute_ms_sum;
  step->bytes = std::max(step->bytes, rank.bytes);
  step->peak = std::max(step->peak, rank.peak);
}

double flops(const Problem& p, const std::string& pass) {
  double f = 4.0 * p.b * static_cast<double>(p.s) * static_cast<double>(p.s) * p.h * p.d;
  if (p.causal) f /= 2.0;
  return pass == "fwd" ? f : 3.5 * f;
}

Row make_row(const std::string& impl, const std::string& pass, int gpus, const Measure& m,
             const Measure* single) {
  Row r;
  r.impl = impl;
  r.pass = pass;
  r.gpus = gpus;
  r.m = m;
  if (single != nullptr && single->ms > 0) {
    r.ms_single = single->ms;
    r.single_basis = "measured";
    r.peak_single = single->peak;
  } else if (gpus > 1 && m.compute_ms_sum > 0) {
    r.ms_single = m.compute_ms_sum;
    r.single_basis = "per-block sum";
  }
  return r;
}

const char* strategy_flag(dist::Strategy strategy) {
  switch (strategy) {
    case dist::Strategy::kRing: return "ring";
    case dist::Strategy::kZigzag: return "zigzag";
    case dist::Strategy::kAllToAll: return "a2a";
  }
  return "unknown";
}

bool parse_strategy(const std::string& name, dist::Strategy* out) {
  for (dist::Strategy s : {dist::Strategy::kRing, dist::Strategy::kZigzag, dist::Strategy::kAllToAll})
    if (name == strategy_flag(s)) {
      *out = s;
      return true;
    }
  return false;
}

void print_header() {
  std::printf("%-13s %-6s %4s %8s %10s %10s %6s %9s %9s %9s %10s %7s %8s\n", "impl", "pass", "gpus",
              "s", "ms", "1gpu_ms", "eff", "comm_ms", "exposed", "overlap", "MB_sent", "GB/s",
              "peak_GiB");
}

void print_row(const Problem& p, const Row& r) {
  const double exposed = std::max(0.0, r.m.ms - r.m.compute_ms);
  const bool dist = r.gpus > 1;
  std::printf("%-13s %-6s %4d %8lld %10.3f %10.3f %6.3f %9.3f %9.3f %9.3f %10.1f %7.1f %8.2f%s%s\n",
              r.impl.c_str(), r.pass.c_str(), r.gpus, static_cast<long long>(p.s), r.m.ms,
              r.ms_single, r.ms_single > 0 && dist ? (r.ms_single / r.gpus) / r.m.ms : 0.0,
              r.m.comm_ms, dist ? exposed : 0.0, dist ? std::max(0.0, r.m.comm_ms - exposed) : 0.0,
              static_cast<double>(r.m.bytes) / 1e6,
              r.m.comm_ms > 0 ? r.m.bytes / (r.m.comm_ms * 1e6) : 0.0,
              static_cast<double>(r.m.peak) / (1 << 30),
              dist && r.single_basis == "per-block sum" ? "  (1gpu: per-block sum)" : "",
              flops(p, r.pass) / (r.m.ms * 1e9) / r.gpus > kPeakDenseBf16Tflops
                  ? "  SUSPECT: above peak" : "");
}

std::string json_row(const Problem& p, const Row& r) {
  const double exposed = std::max(0.0, r.m.ms - r.m.compute_ms);
  const double tflops_per_gpu = flops(p, r.pass) / (r.m.ms * 1e-3) / 1e12 / r.gpus;
  std::ostringstream j;
  j.precision(6);
  j << "{\"impl\": \"" << r.impl << "\", \"pass\": \"" << r.pass << "\", \"dtype\": \"bf16\""
    << ", \"gpus\": " << r.gpus << ", \"s_total\": " << p.s << ", \"b\": " << p.b
    << ", \"h\": " << p.h << ", \"h_kv\": " << p.h_kv << ", \"d\": " << p.d
    << ", \"causal\": " << (p.causal ? "true" : "false") << ", \"ms\": " << r.m.ms
    << ", \"ms_single_gpu\": ";
  if (r.ms_single > 0) j << r.ms_single; else j << "null";
  if (r.ms_single > 0 && r.gpus > 1) j << ", \"ms_single_gpu_basis\": \"" << r.single_basis << "\"";
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
  if (r.gpus > 1 && r.single_basis == "measured")
    j << ", \"peak_mem_bytes_single_gpu\": " << r.peak_single;
  j << "}";
  return j.str();
}

}  // namespace flare::cp_bench
