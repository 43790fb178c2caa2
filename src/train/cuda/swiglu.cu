// swiglu.cu — SwiGLU forward and backward (swiglu.h). Elementwise: one thread per 8 outputs
// (16-byte packs) when ffn is a multiple of 8 and the pointers are aligned, else one per output.
#include "train/cuda/swiglu.h"

#include "core/message.h"
#include "train/cuda/device.cuh"

namespace flare::train::cuda {
namespace {

struct SwigluParams {
  const bf16* gate_up;  // (rows, 2·ffn)
  const bf16* dout;     // (rows, ffn), backward
  bf16* out;            // (rows, ffn) forward output, or (rows, 2·ffn) dgate_up
  int64_t rows, ffn;
};

__device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

template <int kVec>
__global__ void swiglu_forward_kernel(const SwigluParams p) {
  const int64_t idx = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kVec;
  if (idx >= p.rows * p.ffn) return;
  const int64_t row = idx / p.ffn, j = idx % p.ffn;
  float g[kVec], u[kVec], y[kVec];
  load_floats<kVec>(p.gate_up + row * 2 * p.ffn + j, g);
  load_floats<kVec>(p.gate_up + row * 2 * p.ffn + p.ffn + j, u);
#pragma unroll
  for (int i = 0; i < kVec; ++i) y[i] = g[i] * sigmoid(g[i]) * u[i];
  store_floats<kVec>(p.out + idx, y);
}

template <int kVec>
__global__ void swiglu_backward_kernel(const SwigluParams p) {
  const int64_t idx = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kVec;
  if (idx >= p.rows * p.ffn) return;
  const int64_t row = idx / p.ffn, j = idx % p.ffn;
  float g[kVec], u[kVec], dy[kVec], dg[kVec], du[kVec];
  load_floats<kVec>(p.gate_up + row * 2 * p.ffn + j, g);
  load_floats<kVec>(p.gate_up + row * 2 * p.ffn + p.ffn + j, u);
  load_floats<kVec>(p.dout + idx, dy);
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    const float s = sigmoid(g[i]);
    dg[i] = dy[i] * u[i] * s * (1.0f + g[i] * (1.0f - s));
    du[i] = dy[i] * g[i] * s;
  }
  store_floats<kVec>(p.out + row * 2 * p.ffn + j, dg);
  store_floats<kVec>(p.out + row * 2 * p.ffn + p.ffn + j, du);
}

Status check(const char* op, const void* a, const void* b, const void* c, int64_t rows, int64_t ffn) {
  if (rows < 1) return invalid(op, ": rows = ", rows, " must be >= 1");
  if (ffn < 1) return invalid(op, ": ffn = ", ffn, " must be >= 1");
  if (a == nullptr || b == nullptr || c == nullptr) return invalid(op, ": a pointer argument is null");
  return Status::ok_status();
}

bool vector_path(const SwigluParams& p) {
  return p.ffn % 8 == 0 && aligned16(p.gate_up) && aligned16(p.out) &&
         (p.dout == nullptr || aligned16(p.dout));
}

}  // namespace

Status swiglu_forward(const bf16* gate_up, bf16* out, int64_t rows, int64_t ffn,
                      cudaStream_t stream) {
  FLARE_RETURN_IF_ERROR(check("swiglu_forward", gate_up, out, out, rows, ffn));
  const SwigluParams p{gate_up, nullptr, out, rows, ffn};
  if (vector_path(p))
    swiglu_forward_kernel<8><<<ceil_div(rows * ffn / 8, 256), 256, 0, stream>>>(p);
  else
    swiglu_forward_kernel<1><<<ceil_div(rows * ffn, 256), 256, 0, stream>>>(p);
  return launch_status(kCudaContext, "swiglu_forward");
}

Status swiglu_backward(const bf16* dout, const bf16* gate_up, bf16* dgate_up, int64_t rows,
                       int64_t ffn, cudaStream_t stream) {
  FLARE_RETURN_IF_ERROR(check("swiglu_backward", dout, gate_up, dgate_up, rows, ffn));
  const SwigluParams p{gate_up, dout, dgate_up, rows, ffn};
  if (vector_path(p))
    swiglu_backward_kernel<8><<<ceil_div(rows * ffn / 8, 256), 256, 0, stream>>>(p);
  else
    swiglu_backward_kernel<1><<<ceil_div(rows * ffn, 256), 256, 0, stream>>>(p);
  return launch_status(kCudaContext, "swiglu_backward");
}

}  // namespace flare::train::cuda
