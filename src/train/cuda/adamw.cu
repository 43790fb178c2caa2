// adamw.cu — gradient norm and AdamW over the chunk table (adamw.h).
#include "train/cuda/adamw.h"

#include <algorithm>
#include <cmath>

#include "core/message.h"
#include "train/core/split_master.h"
#include "train/cuda/device.cuh"

namespace flare::train::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kFinishThreads = 1024;

struct AdamWParams {
  const TensorChunk* chunks;
  const void* grads;               // fp32 or bf16 (G of the kernel)
  uint16_t* weights;               // the master: bf16 weights and low halves (split_master.h)
  uint16_t* low;
  float* m;
  float* v;
  const float* grad_scale_device;  // or null
  float grad_scale;                // multiplies *grad_scale_device
  float lr, beta1, beta2, eps;
  float bc1, bc2;                  // 1 − beta^t, in double on the host, rounded to fp32
  float decay;                     // fp32(1 − lr·weight_decay), for decaying tensors
};

__device__ __forceinline__ double block_sum_double(double x, double* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  double total = lane < warps ? shared[lane] : 0.0;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) total += __shfl_xor_sync(0xffffffffu, total, offset);
  return total;
}

// A gradient element (float or bf16) as a float; four consecutive ones (16- or 8-byte aligned).
__device__ __forceinline__ float grad_value(float g) { return g; }
__device__ __forceinline__ float grad_value(bf16 g) { return __bfloat162float(g); }
__device__ __forceinline__ void load_grad4(const float* g, float out[4]) {
  const float4 v = *reinterpret_cast<const float4*>(g);
  out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
}
__device__ __forceinline__ void load_grad4(const bf16* g, float out[4]) {
  const uint2 w = *reinterpret_cast<const uint2*>(g);
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.y));
  out[0] = a.x, out[1] = a.y, out[2] = b.x, out[3] = b.y;
}

template <typename G>
__global__ void __launch_bounds__(kThreads)
    norm_partials_kernel(const TensorChunk* chunks, const G* grads, double* partials) {
  __shared__ double shared[32];
  const TensorChunk chunk = chunks[blockIdx.x];
  double acc = 0.0;
  for (int64_t i = chunk.begin + threadIdx.x; i < chunk.end; i += kThreads) {
    const double g = grad_value(grads[i]);
    acc += g * g;
  }
  acc = block_sum_double(acc, shared);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

// The norm and clip scale from the total sum of squares (core's clip_scale).
__device__ __forceinline__ void write_norm_and_scale(double sum_of_squares, double max_norm, float* out) {
  const double norm = sqrt(sum_of_squares);
  const double scale = max_norm == 0.0 ? 1.0 : fmin(1.0, max_norm / (norm + 1e-6));
  out[0] = static_cast<float>(norm);
  out[1] = static_cast<float>(scale);
}

// Σ partials[0, count) in the block's fixed order: to the norm and scale (out_norm_and_scale), or
// as the plain sum (out_sum); one of the two is null.
__global__ void __launch_bounds__(kFinishThreads)
    norm_finish_kernel(const double* partials, int64_t count, double max_norm,
                       float* out_norm_and_scale, double* out_sum) {
  __shared__ double shared[32];
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < count; i += kFinishThreads) acc += partials[i];
  acc = block_sum_double(acc, shared);
  if (threadIdx.x != 0) return;
  if (out_sum) {
    *out_sum = acc;
  } else {
    write_norm_and_scale(acc, max_norm, out_norm_and_scale);
  }
}

// Σ sums[i · stride] for i in [0, count), one thread, in index order (ranks' sums: every rank
// adds them alike).
__global__ void norm_from_sums_kernel(const double* sums, int64_t count, int64_t stride,
                                      double max_norm, float* out) {
  double acc = 0.0;
  for (int64_t i = 0; i < count; ++i) acc += sums[i * stride];
  write_norm_and_scale(acc, max_norm, out);
}

// One element's update: m and v in place, the new master weight returned. Every path of the
// kernel below goes through it, so vector and scalar elements round alike.
__device__ __forceinline__ float adamw_element(const AdamWParams& p, float scale, float decay, float grad,
                                               float master, float* m, float* v) {
  const float g = grad * scale;
  *m = p.beta1 * *m + (1.0f - p.beta1) * g;
  *v = p.beta2 * *v + (1.0f - p.beta2) * g * g;
  const float m_hat = *m / p.bc1;
  const float v_hat = *v / p.bc2;
  return master * decay - p.lr * (m_hat / (sqrtf(v_hat) + p.eps));
}

// The same step on a master held as its two halves (split_master.h), updated in place.
__device__ __forceinline__ void adamw_halves(const AdamWParams& p, float scale, float decay, float grad,
                                             uint16_t* weight, uint16_t* low, float* m, float* v) {
  const SplitMaster w = split_master(adamw_element(p, scale, decay, grad, join_master(*weight, *low), m, v));
  *weight = w.weight;
  *low = w.low;
}

template <typename G>
__device__ __forceinline__ void adamw_scalar(const AdamWParams& p, float scale, float decay, int64_t i) {
  float m = p.m[i], v = p.v[i];
  const float grad = grad_value(static_cast<const G*>(p.grads)[i]);
  adamw_halves(p, scale, decay, grad, &p.weights[i], &p.low[i], &m, &v);
  p.m[i] = m;
  p.v[i] = v;
}

// Four 16-bit halves as one 8-byte word.
union Halves4 {
  uint2 word;
  uint16_t h[4];
};

// The optimizer is a pure stream over 16 bytes per parameter in (gradient, m, v, the master's two
// halves) and 12 out (m, v, the halves), so its speed is memory bandwidth: 16- and 8-byte loads
// and stores of four elements per thread where the chunk allows (chunks begin at 64-element
// offsets), single elements for a ragged end.
template <typename G>
__global__ void __launch_bounds__(kThreads) adamw_kernel(const AdamWParams p) {
  const G* grads = static_cast<const G*>(p.grads);
  const TensorChunk chunk = p.chunks[blockIdx.x];
  const float scale = p.grad_scale_device ? p.grad_scale * *p.grad_scale_device : p.grad_scale;
  const float decay = chunk.weight_decay ? p.decay : 1.0f;
  const int64_t aligned = (chunk.begin + 3) / 4 * 4;
  const int64_t vec_begin = aligned < chunk.end ? aligned : chunk.end;
  const int64_t vec_end = vec_begin + (chunk.end - vec_begin) / 4 * 4;
  for (int64_t i = chunk.begin + threadIdx.x; i < vec_begin; i += kThreads) adamw_scalar<G>(p, scale, decay, i);
  for (int64_t i = vec_begin + 4 * int64_t{threadIdx.x}; i < vec_end; i += 4 * kThreads) {
    float gs[4];
    load_grad4(grads + i, gs);
    float4 m = *reinterpret_cast<const float4*>(p.m + i);
    float4 v = *reinterpret_cast<const float4*>(p.v + i);
    Halves4 hi{*reinterpret_cast<const uint2*>(p.weights + i)}, lo{*reinterpret_cast<const uint2*>(p.low + i)};
    float* ms[4] = {&m.x, &m.y, &m.z, &m.w};
    float* vs[4] = {&v.x, &v.y, &v.z, &v.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) adamw_halves(p, scale, decay, gs[e], &hi.h[e], &lo.h[e], ms[e], vs[e]);
    *reinterpret_cast<float4*>(p.m + i) = m;
    *reinterpret_cast<float4*>(p.v + i) = v;
    *reinterpret_cast<uint2*>(p.weights + i) = hi.word;
    *reinterpret_cast<uint2*>(p.low + i) = lo.word;
  }
  for (int64_t i = vec_end + threadIdx.x; i < chunk.end; i += kThreads) adamw_scalar<G>(p, scale, decay, i);
}

}  // namespace

std::vector<TensorChunk> tensor_chunks(const ParameterLayout& layout, int64_t chunk_elements) {
  std::vector<TensorChunk> out;
  for (const ParamSpec& spec : layout.params) {
    for (int64_t b = spec.offset; b < spec.offset + spec.numel; b += chunk_elements) {
      TensorChunk c;
      c.begin = b;
      c.end = std::min(b + chunk_elements, spec.offset + spec.numel);
      c.weight_decay = spec.weight_decay ? 1 : 0;
      out.push_back(c);
    }
  }
  return out;
}

DeviceChunkTable::~DeviceChunkTable() {
  if (chunks_) cudaFree(chunks_);
}

Status DeviceChunkTable::init(const ParameterLayout& layout) {
  const std::vector<TensorChunk> host = tensor_chunks(layout, kChunkElements);
  if (host.empty()) return invalid("DeviceChunkTable: the layout has no parameters");
  if (host.size() > 0x7fffffffu) return invalid("DeviceChunkTable: ", host.size(), " chunks exceed the grid limit");
  if (chunks_) cudaFree(chunks_);
  chunks_ = nullptr;
  count_ = 0;
  const size_t bytes = host.size() * sizeof(TensorChunk);
  FLARE_RETURN_IF_ERROR(cuda_status(kCudaContext, "DeviceChunkTable", cudaMalloc(&chunks_, bytes)));
  FLARE_RETURN_IF_ERROR(
      cuda_status(kCudaContext, "DeviceChunkTable",
                  cudaMemcpy(chunks_, host.data(), bytes, cudaMemcpyHostToDevice)));
  count_ = static_cast<int64_t>(host.size());
  return Status::ok_status();
}

int64_t gradient_norm_scratch_bytes(const DeviceChunkTable& table) {
  return table.count() * static_cast<int64_t>(sizeof(double));
}

namespace {

void launch_norm_partials(const DeviceChunkTable& table, GradientIn grads, double* partials,
                          cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>(table.count());
  if (grads.is_bf16())
    norm_partials_kernel<<<blocks, kThreads, 0, stream>>>(table.chunks(), grads.b16(), partials);
  else
    norm_partials_kernel<<<blocks, kThreads, 0, stream>>>(table.chunks(), grads.f32(), partials);
}

}  // namespace

Status gradient_norm(const DeviceChunkTable& table, GradientIn grads, double max_norm,
                     float* norm_and_scale, void* scratch, cudaStream_t stream) {
  const char* op = "gradient_norm";
  if (table.count() == 0) return invalid(op, ": the chunk table is not initialised");
  if (!std::isfinite(max_norm) || max_norm < 0)
    return invalid(op, ": max_norm = ", max_norm, " must be finite and >= 0");
  if (!grads || norm_and_scale == nullptr || scratch == nullptr)
    return invalid(op, ": grads, norm_and_scale and scratch must not be null");
  auto* partials = static_cast<double*>(scratch);
  launch_norm_partials(table, grads, partials, stream);
  norm_finish_kernel<<<1, kFinishThreads, 0, stream>>>(partials, table.count(), max_norm,
                                                       norm_and_scale, nullptr);
  return launch_status(kCudaContext, op);
}

Status gradient_sum_of_squares(const DeviceChunkTable& table, GradientIn grads,
                               double* sum_of_squares, void* scratch, cudaStream_t stream) {
  const char* op = "gradient_sum_of_squares";
  if (table.count() == 0) return invalid(op, ": the chunk table is not initialised");
  if (!grads || sum_of_squares == nullptr || scratch == nullptr)
    return invalid(op, ": grads, sum_of_squares and scratch must not be null");
  auto* partials = static_cast<double*>(scratch);
  launch_norm_partials(table, grads, partials, stream);
  norm_finish_kernel<<<1, kFinishThreads, 0, stream>>>(partials, table.count(), 0.0, nullptr,
                                                       sum_of_squares);
  return launch_status(kCudaContext, op);
}

Status norm_from_sums(const double* sums, int64_t count, int64_t stride, double max_norm,
                      float* norm_and_scale, cudaStream_t stream) {
  const char* op = "norm_from_sums";
  if (count < 1 || stride < 1)
    return invalid(op, ": count = ", count, " and stride = ", stride, " must be >= 1");
  if (!std::isfinite(max_norm) || max_norm < 0)
    return invalid(op, ": max_norm = ", max_norm, " must be finite and >= 0");
  if (sums == nullptr || norm_and_scale == nullptr)
    return invalid(op, ": sums and norm_and_scale must not be null");
  norm_from_sums_kernel<<<1, 1, 0, stream>>>(sums, count, stride, max_norm, norm_and_scale);
  return launch_status(kCudaContext, op);
}

Status adamw_update(const DeviceChunkTable& table, const AdamWStep& s,
                    const float* grad_scale_device, GradientIn grads, bf16* weights, uint16_t* low,
                    float* m, float* v, cudaStream_t stream) {
  const char* op = "adamw_update";
  if (table.count() == 0) return invalid(op, ": the chunk table is not initialised");
  if (!grads || weights == nullptr || low == nullptr || m == nullptr || v == nullptr)
    return invalid(op, ": grads, weights, low, m and v must not be null");
  if (s.t < 1) return invalid(op, ": t = ", s.t, " must be >= 1 (steps count from 1)");
  if (!std::isfinite(s.lr) || s.lr < 0) return invalid(op, ": lr = ", s.lr, " must be finite and >= 0");
  if (!(s.beta1 >= 0 && s.beta1 < 1)) return invalid(op, ": beta1 = ", s.beta1, " must be in [0, 1)");
  if (!(s.beta2 >= 0 && s.beta2 < 1)) return invalid(op, ": beta2 = ", s.beta2, " must be in [0, 1)");
  if (!std::isfinite(s.eps) || s.eps <= 0) return invalid(op, ": eps = ", s.eps, " must be finite and > 0");
  if (!std::isfinite(s.weight_decay) || s.weight_decay < 0)
    return invalid(op, ": weight_decay = ", s.weight_decay, " must be finite and >= 0");
  if (!std::isfinite(s.grad_scale) || s.grad_scale < 0)
    return invalid(op, ": grad_scale = ", s.grad_scale, " must be finite and >= 0");
  AdamWParams p{};
  p.chunks = table.chunks();
  p.grads = grads.is_bf16() ? static_cast<const void*>(grads.b16()) : grads.f32();
  p.weights = reinterpret_cast<uint16_t*>(weights);
  p.low = low;
  p.m = m;
  p.v = v;
  p.grad_scale_device = grad_scale_device;
  p.grad_scale = s.grad_scale;
  const double t = static_cast<double>(s.t);
  p.bc1 = static_cast<float>(1.0 - std::pow(s.beta1, t));
  p.bc2 = static_cast<float>(1.0 - std::pow(s.beta2, t));
  p.beta1 = static_cast<float>(s.beta1);
  p.beta2 = static_cast<float>(s.beta2);
  p.lr = static_cast<float>(s.lr);
  p.eps = static_cast<float>(s.eps);
  p.decay = static_cast<float>(1.0 - s.lr * s.weight_decay);
  const unsigned blocks = static_cast<unsigned>(table.count());
  if (grads.is_bf16())
    adamw_kernel<bf16><<<blocks, kThreads, 0, stream>>>(p);
  else
    adamw_kernel<float><<<blocks, kThreads, 0, stream>>>(p);
  return launch_status(kCudaContext, op);
}

}  // namespace flare::train::cuda
