// workload.cpp — see workload.h.
#include "workload.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <numeric>
#include <sstream>
#include <string>

#include "args.h"

namespace flare::cli {

std::string Shape::describe() const {
  std::ostringstream s;
  s << "b=" << b << " s=" << s_q;
  if (s_k != s_q) s << "/" << s_k;
  s << " h=" << h;
  if (h_kv != h) s << "/" << h_kv;
  s << " d=" << d << (causal ? " causal " : " non-causal ") << short_dtype_name(dtype);
  if (varlen) s << " varlen";
  if (softcap > 0.0f) s << " softcap=" << softcap;
  if (alibi) s << " alibi";
  if (dropout_p > 0.0f) s << " dropout=" << dropout_p;
  if (deterministic) s << " deterministic";
  return s.str();
}

std::vector<int> varlen_lengths(int b, int s) {
  if (b == 1) return {s};
  std::vector<int> lengths(static_cast<std::size_t>(b));
  for (int i = 0; i < b; ++i) {
    const long n = std::lround(double(s) * (0.25 + 1.5 * double(i) / double(b - 1)));
    lengths[static_cast<std::size_t>(i)] = static_cast<int>(std::max(1L, n));
  }
  return lengths;
}

std::vector<int> Shape::lengths_q() const {
  return varlen ? varlen_lengths(b, s_q) : std::vector<int>(static_cast<std::size_t>(b), s_q);
}

std::vector<int> Shape::lengths_k() const {
  return varlen ? varlen_lengths(b, s_k) : std::vector<int>(static_cast<std::size_t>(b), s_k);
}

int64_t Shape::total_q() const {
  if (!varlen) return int64_t{b} * s_q;
  const std::vector<int> n = lengths_q();
  return std::accumulate(n.begin(), n.end(), int64_t{0});
}

int64_t Shape::total_k() const {
  if (!varlen) return int64_t{b} * s_k;
  const std::vector<int> n = lengths_k();
  return std::accumulate(n.begin(), n.end(), int64_t{0});
}

const char* pass_name(Pass pass) {
  switch (pass) {
    case Pass::kForward:
      return "fwd";
    case Pass::kBackward:
      return "bwd";
    case Pass::kForwardBackward:
      return "fwdbwd";
  }
  return "?";
}

namespace {

// The forward's FLOPs for `count` sequences of s_q queries and s_k keys: the one formula both
// layouts use.
double forward_flops(const Shape& s, double count, int s_q, int s_k) {
  const double fwd = 4.0 * count * double(s_q) * double(s_k) * s.h * s.d;
  return s.causal ? fwd / 2 : fwd;
}

}  // namespace

double attention_flops(const Shape& s, Pass pass) {
  double fwd = 0;
  if (s.varlen) {
    const std::vector<int> lq = s.lengths_q(), lk = s.lengths_k();
    for (std::size_t i = 0; i < lq.size(); ++i) fwd += forward_flops(s, 1, lq[i], lk[i]);
  } else {
    fwd = forward_flops(s, s.b, s.s_q, s.s_k);
  }
  switch (pass) {
    case Pass::kForward:
      return fwd;
    case Pass::kBackward:
      return 2.5 * fwd;
    case Pass::kForwardBackward:
      return 3.5 * fwd;
  }
  return fwd;
}

const char* short_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "fp32";
    case DType::kFloat16:
      return "fp16";
    case DType::kBFloat16:
      return "bf16";
    case DType::kInt32:
      return "int32";
    case DType::kUInt8:
      return "uint8";
    case DType::kFloat8E4M3:
      return "fp8e4m3";
  }
  return "?";
}

DType parse_dtype(const std::string& name) {
  if (name == "fp16") return DType::kFloat16;
  if (name == "bf16") return DType::kBFloat16;
  if (name == "fp32") return DType::kFloat32;
  throw UsageError("unknown dtype '" + name + "' (expected fp32, fp16 or bf16)");
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  if (n == 0) return 0;
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

Workload::Workload(Device& device, const Shape& shape, uint64_t seed)
    : device_(device), shape_(shape) {
  options_.causal = shape.causal;
  options_.softcap = shape.softcap;
  options_.dropout_p = shape.dropout_p;
  options_.deterministic = shape.deterministic;
  const Shape& s = shape;
  const int64_t total_q = s.total_q(), total_k = s.total_k();
  if (s.varlen && std::max(total_q, total_k) > INT32_MAX)
    throw RunError(std::to_string(std::max(total_q, total_k)) +
                   " packed tokens do not fit cu_seqlens' int32 offsets");
  // (b, s, heads, d), or (total, heads, d) packed.
  const auto q_like = [&](const char* what) {
    return s.varlen ? make(s.dtype, {total_q, s.h, s.d}, what)
                    : make(s.dtype, {s.b, s.s_q, s.h, s.d}, what);
  };
  const auto k_like = [&](const char* what) {
    return s.varlen ? make(s.dtype, {total_k, s.h_kv, s.d}, what)
                    : make(s.dtype, {s.b, s.s_k, s.h_kv, s.d}, what);
  };
  // b + 1 running totals from 0, copied to the device; int32 holds them (checked above).
  const auto cu_seqlens = [&](const std::vector<int>& lengths, const char* what) {
    std::vector<int32_t> cu(lengths.size() + 1, 0);
    std::partial_sum(lengths.begin(), lengths.end(), cu.begin() + 1);
    const TensorView t = make(DType::kInt32, {int64_t(cu.size())}, what);
    device_.upload(t.data, cu.data(), cu.size() * sizeof(int32_t));
    return t;
  };
  try {
    t_.q = q_like("q");
    t_.k = k_like("k");
    t_.v = k_like("v");
    t_.o = q_like("o");
    t_.lse = s.varlen ? make(DType::kFloat32, {s.h, total_q}, "lse")
                      : make(DType::kFloat32, {s.b, s.h, s.s_q}, "lse");
    t_.dout = q_like("dout");
    t_.dq = q_like("dq");
    t_.dk = k_like("dk");
    t_.dv = k_like("dv");
    if (s.alibi) {
      std::vector<float> slopes(static_cast<std::size_t>(s.h));
      for (int i = 0; i < s.h; ++i)
        slopes[static_cast<std::size_t>(i)] = std::exp2(-8.0f * float(i + 1) / float(s.h));
      options_.alibi_slopes = make(DType::kFloat32, {s.h}, "alibi_slopes");
      device_.upload(options_.alibi_slopes.data, slopes.data(), slopes.size() * sizeof(float));
    }
    if (s.varlen) {
      const std::vector<int> lengths_q = s.lengths_q(), lengths_k = s.lengths_k();
      varlen_.cu_seqlens_q = cu_seqlens(lengths_q, "cu_seqlens_q");
      varlen_.cu_seqlens_k = cu_seqlens(lengths_k, "cu_seqlens_k");
      varlen_.max_seqlen_q = *std::max_element(lengths_q.begin(), lengths_q.end());
      varlen_.max_seqlen_k = *std::max_element(lengths_k.begin(), lengths_k.end());
    }
  } catch (...) {
    for (void* p : buffers_) device_.release(p);
    throw;
  }
  // Distinct streams of the generator per tensor: seed·4 + tensor number.
  device_.fill_random(t_.q.data, s.dtype, s.q_numel(), seed * 4 + 0);
  device_.fill_random(t_.k.data, s.dtype, s.k_numel(), seed * 4 + 1);
  device_.fill_random(t_.v.data, s.dtype, s.k_numel(), seed * 4 + 2);
  device_.fill_random(t_.dout.data, s.dtype, s.q_numel(), seed * 4 + 3);
  poison_outputs();
}

Workload::~Workload() {
  for (void* p : buffers_) device_.release(p);
}

TensorView Workload::make(DType dtype, std::initializer_list<int64_t> shape, const char* what) {
  // Each size fits an int, but their product may not fit anything: refuse before it wraps.
  double n_exact = 1;
  for (int64_t x : shape) n_exact *= double(x);
  if (n_exact * double(dtype_size(dtype)) > double(int64_t{1} << 62))
    throw RunError(std::string(what) + ": " + shape_.describe() + " is too large to allocate");
  int64_t n = 1;
  for (int64_t x : shape) n *= x;
  void* data = device_.allocate(static_cast<std::size_t>(n) * dtype_size(dtype), what);
  buffers_.push_back(data);
  return TensorView::contiguous(data, dtype, shape, device_.type(), device_.index());
}

void Workload::poison_outputs() {
  for (const TensorView* t : {&t_.o, &t_.lse, &t_.dq, &t_.dk, &t_.dv})
    device_.poison(t->data, static_cast<std::size_t>(t->numel()) * dtype_size(t->dtype));
}

Status Workload::forward() const {
  return attention_forward(t_.q, t_.k, t_.v, t_.o, t_.lse, options_, varlen_, device_.stream());
}

Status Workload::backward() const {
  return attention_backward(t_.dout, t_.q, t_.k, t_.v, t_.o, t_.lse, t_.dq, t_.dk, t_.dv, options_,
                            varlen_, device_.stream());
}

HostTensors Workload::to_host() const {
  HostTensors h;
  h.views = t_;
  TensorView* views[] = {&h.views.q,    &h.views.k,  &h.views.v,  &h.views.o, &h.views.lse,
                         &h.views.dout, &h.views.dq, &h.views.dk, &h.views.dv};
  h.storage.resize(std::size(views));
  for (std::size_t i = 0; i < std::size(views); ++i) {
    TensorView& v = *views[i];
    const std::size_t bytes = static_cast<std::size_t>(v.numel()) * dtype_size(v.dtype);
    h.storage[i].resize(bytes);
    device_.download(h.storage[i].data(), v.data, bytes);
    v.data = h.storage[i].data();
    v.device = DeviceType::kCPU;
    v.device_index = 0;
  }
  return h;
}

}  // namespace flare::cli
