// workload.cpp — see workload.h.
#include "workload.h"

#include <algorithm>
#include <iterator>
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
  return s.str();
}

const char* pass_name(Pass pass) {
  switch (pass) {
    case Pass::kForward: return "fwd";
    case Pass::kBackward: return "bwd";
    case Pass::kForwardBackward: return "fwdbwd";
  }
  return "?";
}

double attention_flops(const Shape& s, Pass pass) {
  double fwd = 4.0 * s.b * double(s.s_q) * double(s.s_k) * s.h * s.d;
  if (s.causal) fwd /= 2;
  switch (pass) {
    case Pass::kForward: return fwd;
    case Pass::kBackward: return 2.5 * fwd;
    case Pass::kForwardBackward: return 3.5 * fwd;
  }
  return fwd;
}

const char* short_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "fp32";
    case DType::kFloat16: return "fp16";
    case DType::kBFloat16: return "bf16";
    case DType::kInt32: return "int32";
    case DType::kUInt8: return "uint8";
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
  const Shape& s = shape;
  try {
    t_.q = make(s.dtype, {s.b, s.s_q, s.h, s.d}, "q");
    t_.k = make(s.dtype, {s.b, s.s_k, s.h_kv, s.d}, "k");
    t_.v = make(s.dtype, {s.b, s.s_k, s.h_kv, s.d}, "v");
    t_.o = make(s.dtype, {s.b, s.s_q, s.h, s.d}, "o");
    t_.lse = make(DType::kFloat32, {s.b, s.h, s.s_q}, "lse");
    t_.dout = make(s.dtype, {s.b, s.s_q, s.h, s.d}, "dout");
    t_.dq = make(s.dtype, {s.b, s.s_q, s.h, s.d}, "dq");
    t_.dk = make(s.dtype, {s.b, s.s_k, s.h_kv, s.d}, "dk");
    t_.dv = make(s.dtype, {s.b, s.s_k, s.h_kv, s.d}, "dv");
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
  return attention_forward(t_.q, t_.k, t_.v, t_.o, t_.lse, options_, {}, device_.stream());
}

Status Workload::backward() const {
  return attention_backward(t_.dout, t_.q, t_.k, t_.v, t_.o, t_.lse, t_.dq, t_.dk, t_.dv, options_,
                            {}, device_.stream());
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
