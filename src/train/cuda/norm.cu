// norm.cu — LayerNorm and RMSNorm, forward and backward (norm.h).
//
// Forward: one warp per row. The row is read up to three times — sums, centred sum of squares
// (LayerNorm; two passes keep the variance accurate when |mean| ≫ std), normalise and store — and
// the re-reads of a 5 KB row (d 2560) come from L1/L2, so HBM sees one read and one write. With
// the residual fused, pass 1 adds residual + branch, rounds to bf16 and stores residual_out, and
// the later passes read it back: the norm sees exactly the bf16 residual the unfused pair would.
//
// Backward: the parameter gradients go first, through the deterministic two-stage column sum
// (column_reduce.cuh) — they read dout and x before dx may overwrite dout; then one warp per row
// forms the two row means E[g] and E[g·x̂] (g = dout·weight) and writes
//   dx = rstd·(g − E[g] − x̂·E[g·x̂])   (RMSNorm: no E[g] term, x̂ = x·rstd)
// plus dresidual, the gradient already flowing down the residual stream.
#include "train/cuda/norm.h"

#include "core/message.h"
#include "train/cuda/column_reduce.cuh"
#include "train/cuda/device.cuh"

namespace flare::train::cuda {
namespace {

constexpr int kRowThreads = 256;  // 8 warps: 8 rows per block
constexpr int kRowsPerBlock = kRowThreads / 32;

// The contract between the launchers and the row kernels.
struct NormParams {
  const bf16* x;         // (rows, channels): the input, or the residual when fused
  const bf16* branch;    // (rows, channels): the branch output added to the residual; fused only
  bf16* residual_out;    // (rows, channels): residual + branch; fused only
  const bf16* weight;    // (channels)
  const bf16* bias;      // (channels), LayerNorm only
  bf16* out;             // (rows, channels) forward output
  float* mean;           // (rows) LayerNorm statistics: written by the forward, read by the backward
  float* rstd;           // (rows)
  const bf16* dout;      // (rows, channels) backward: gradient of out
  const bf16* dresidual; // (rows, channels) backward: added to dx; may be null
  bf16* dx;              // (rows, channels) backward output
  int64_t rows, channels;
  float inv_channels;    // 1 / channels
  float eps;
};

__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

template <bool kRms, bool kResidual, int kVec>
__global__ void __launch_bounds__(kRowThreads) norm_forward_kernel(const NormParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= p.rows) return;
  const int64_t base = row * p.channels;
  // The values normalised: the input, or the stored bf16 residual (written by this same lane).
  const bf16* x = kResidual ? p.residual_out + base : p.x + base;

  float sum = 0.0f, sumsq = 0.0f;
  for (int64_t c = lane * kVec; c < p.channels; c += 32 * kVec) {
    float v[kVec];
    if constexpr (kResidual) {
      float b[kVec];
      load_floats<kVec>(p.x + base + c, v);
      load_floats<kVec>(p.branch + base + c, b);
#pragma unroll
      for (int i = 0; i < kVec; ++i) v[i] = round_bf16(v[i] + b[i]);
      store_floats<kVec>(p.residual_out + base + c, v);
    } else {
      load_floats<kVec>(x + c, v);
    }
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      sum += v[i];
      sumsq += v[i] * v[i];
    }
  }
  float mean = 0.0f, var;
  if constexpr (kRms) {
    var = warp_sum(sumsq) * p.inv_channels;
  } else {
    mean = warp_sum(sum) * p.inv_channels;
    float centred = 0.0f;
    for (int64_t c = lane * kVec; c < p.channels; c += 32 * kVec) {
      float v[kVec];
      load_floats<kVec>(x + c, v);
#pragma unroll
      for (int i = 0; i < kVec; ++i) centred += (v[i] - mean) * (v[i] - mean);
    }
    var = warp_sum(centred) * p.inv_channels;
  }
  const float rstd = 1.0f / sqrtf(var + p.eps);
  if (lane == 0) {
    if (!kRms && p.mean) p.mean[row] = mean;
    if (p.rstd) p.rstd[row] = rstd;
  }
  for (int64_t c = lane * kVec; c < p.channels; c += 32 * kVec) {
    float v[kVec], w[kVec], b[kVec];
    load_floats<kVec>(x + c, v);
    load_floats<kVec>(p.weight + c, w);
    if constexpr (!kRms) load_floats<kVec>(p.bias + c, b);
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      v[i] = (v[i] - mean) * rstd * w[i];
      if constexpr (!kRms) v[i] += b[i];
    }
    store_floats<kVec>(p.out + base + c, v);
  }
}

template <bool kRms, int kVec>
__global__ void __launch_bounds__(kRowThreads) norm_backward_dx_kernel(const NormParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= p.rows) return;
  const int64_t base = row * p.channels;
  const float mean = kRms ? 0.0f : p.mean[row];
  const float rstd = p.rstd[row];

  float sum_g = 0.0f, sum_gx = 0.0f;
  for (int64_t c = lane * kVec; c < p.channels; c += 32 * kVec) {
    float dy[kVec], x[kVec], w[kVec];
    load_floats<kVec>(p.dout + base + c, dy);
    load_floats<kVec>(p.x + base + c, x);
    load_floats<kVec>(p.weight + c, w);
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const float g = dy[i] * w[i];
      sum_g += g;
      sum_gx += g * ((x[i] - mean) * rstd);
    }
  }
  const float mean_g = kRms ? 0.0f : warp_sum(sum_g) * p.inv_channels;
  const float mean_gx = warp_sum(sum_gx) * p.inv_channels;
  for (int64_t c = lane * kVec; c < p.channels; c += 32 * kVec) {
    float dy[kVec], x[kVec], w[kVec], d[kVec];
    load_floats<kVec>(p.dout + base + c, dy);
    load_floats<kVec>(p.x + base + c, x);
    load_floats<kVec>(p.weight + c, w);
    if (p.dresidual) {
      load_floats<kVec>(p.dresidual + base + c, d);
    } else {
#pragma unroll
      for (int i = 0; i < kVec; ++i) d[i] = 0.0f;
    }
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const float xhat = (x[i] - mean) * rstd;
      d[i] += rstd * (dy[i] * w[i] - mean_g - xhat * mean_gx);
    }
    store_floats<kVec>(p.dx + base + c, d);
  }
}

constexpr int64_t kMaxRows = int64_t{65535} * kChunkRows;  // the column sum's grid.y limit

Status check_sizes(const char* op, int64_t rows, int64_t channels, float eps) {
  if (rows < 1 || rows > kMaxRows)
    return invalid(op, ": rows = ", rows, " must be in [1, ", kMaxRows, "]");
  if (channels < 1) return invalid(op, ": channels = ", channels, " must be >= 1");
  if (!(eps >= 0.0f) || eps == INFINITY) return invalid(op, ": eps = ", eps, " must be finite and >= 0");
  return Status::ok_status();
}

Status check_pointer(const char* op, const char* name, const void* ptr) {
  if (ptr == nullptr) return invalid(op, ": ", name, " is null");
  return Status::ok_status();
}

// The 16-byte path needs channels % 8 == 0 and every pointer the kernel touches aligned.
bool vector_path(const NormParams& p) {
  const void* ptrs[] = {p.x, p.branch, p.residual_out, p.weight, p.bias,
                        p.out, p.dout, p.dresidual, p.dx};
  if (p.channels % 8 != 0) return false;
  for (const void* ptr : ptrs)
    if (ptr != nullptr && !aligned16(ptr)) return false;
  return true;
}

template <bool kRms, bool kResidual>
Status launch_forward(const NormParams& p, cudaStream_t stream, const char* op) {
  const unsigned grid = ceil_div(p.rows, kRowsPerBlock);
  if (vector_path(p))
    norm_forward_kernel<kRms, kResidual, 8><<<grid, kRowThreads, 0, stream>>>(p);
  else
    norm_forward_kernel<kRms, kResidual, 1><<<grid, kRowThreads, 0, stream>>>(p);
  return launch_status(kCudaContext, op);
}

// The four forwards in one: kRms has no mean and no bias; kResidual adds `branch` to x (then
// named residual) and writes the sum to residual_out. Pointers are checked outputs first, then
// inputs in argument order.
template <bool kRms, bool kResidual>
Status norm_forward(const char* op, const bf16* x, const bf16* branch, const bf16* weight,
                    const bf16* bias, bf16* residual_out, bf16* out, float* mean, float* rstd,
                    int64_t rows, int64_t channels, float eps, cudaStream_t stream) {
  FLARE_RETURN_IF_ERROR(check_sizes(op, rows, channels, eps));
  if (kResidual) FLARE_RETURN_IF_ERROR(check_pointer(op, "residual_out", residual_out));
  FLARE_RETURN_IF_ERROR(check_pointer(op, "out", out));
  FLARE_RETURN_IF_ERROR(check_pointer(op, kResidual ? "residual" : "x", x));
  if (kResidual) FLARE_RETURN_IF_ERROR(check_pointer(op, "branch", branch));
  FLARE_RETURN_IF_ERROR(check_pointer(op, "weight", weight));
  if (!kRms) FLARE_RETURN_IF_ERROR(check_pointer(op, "bias", bias));
  NormParams p{};
  p.x = x;
  p.branch = kResidual ? branch : nullptr;
  p.weight = weight;
  p.bias = kRms ? nullptr : bias;
  p.residual_out = kResidual ? residual_out : nullptr;
  p.out = out;
  p.mean = kRms ? nullptr : mean;
  p.rstd = rstd;
  p.rows = rows;
  p.channels = channels;
  p.inv_channels = 1.0f / static_cast<float>(channels);
  p.eps = eps;
  return launch_forward<kRms, kResidual>(p, stream, op);
}

}  // namespace

Status layernorm_forward(const bf16* x, const bf16* weight, const bf16* bias, bf16* out,
                         float* mean, float* rstd, int64_t rows, int64_t channels, float eps,
                         cudaStream_t stream) {
  return norm_forward<false, false>("layernorm_forward", x, nullptr, weight, bias, nullptr, out,
                                    mean, rstd, rows, channels, eps, stream);
}

Status rmsnorm_forward(const bf16* x, const bf16* weight, bf16* out, float* rstd, int64_t rows,
                       int64_t channels, float eps, cudaStream_t stream) {
  return norm_forward<true, false>("rmsnorm_forward", x, nullptr, weight, nullptr, nullptr, out,
                                   nullptr, rstd, rows, channels, eps, stream);
}

Status residual_layernorm_forward(const bf16* residual, const bf16* branch, const bf16* weight,
                                  const bf16* bias, bf16* residual_out, bf16* out, float* mean,
                                  float* rstd, int64_t rows, int64_t channels, float eps,
                                  cudaStream_t stream) {
  return norm_forward<false, true>("residual_layernorm_forward", residual, branch, weight, bias,
                                   residual_out, out, mean, rstd, rows, channels, eps, stream);
}

Status residual_rmsnorm_forward(const bf16* residual, const bf16* branch, const bf16* weight,
                                bf16* residual_out, bf16* out, float* rstd, int64_t rows,
                                int64_t channels, float eps, cudaStream_t stream) {
  return norm_forward<true, true>("residual_rmsnorm_forward", residual, branch, weight, nullptr,
                                  residual_out, out, nullptr, rstd, rows, channels, eps, stream);
}

int64_t norm_backward_scratch_bytes(int64_t rows, int64_t channels) {
  return column_sum_scratch_floats(rows, channels, true) * static_cast<int64_t>(sizeof(float));
}

namespace {

template <bool kRms>
Status norm_backward(const char* op, bf16* dx, GradientOut dweight, GradientOut dbias, const bf16* dresidual,
                     const bf16* dout, const bf16* x, const bf16* weight, const float* mean,
                     const float* rstd, int64_t rows, int64_t channels, bool accumulate,
                     void* scratch, cudaStream_t stream) {
  FLARE_RETURN_IF_ERROR(check_sizes(op, rows, channels, 0.0f));
  FLARE_RETURN_IF_ERROR(check_pointer(op, "dx", dx));
  FLARE_RETURN_IF_ERROR(check_pointer(op, "dweight", dweight.data()));
  if (!kRms) FLARE_RETURN_IF_ERROR(check_pointer(op, "dbias", dbias.data()));
  if (!kRms && dbias.is_bf16() != dweight.is_bf16())
    return invalid(op, ": dweight and dbias must have one type (both fp32 or both bf16)");
  if (dweight.is_bf16() && accumulate)
    return invalid(op, ": a bf16 gradient is written, never accumulated (accumulate must be false)");
  FLARE_RETURN_IF_ERROR(check_pointer(op, "dout", dout));
  FLARE_RETURN_IF_ERROR(check_pointer(op, "x", x));
  FLARE_RETURN_IF_ERROR(check_pointer(op, "weight", weight));
  if (!kRms) FLARE_RETURN_IF_ERROR(check_pointer(op, "mean", mean));
  FLARE_RETURN_IF_ERROR(check_pointer(op, "rstd", rstd));
  FLARE_RETURN_IF_ERROR(check_pointer(op, "scratch", scratch));
  if (dx == x) return invalid(op, ": dx must not alias x (the reductions read x)");

  ColumnSumParams c{};
  c.dy = dout;
  c.x = x;
  c.mean = kRms ? nullptr : mean;
  c.rstd = rstd;
  c.out0 = dweight.f32();
  c.out1 = kRms ? nullptr : dbias.f32();
  c.out0_bf16 = dweight.b16();
  c.out1_bf16 = kRms ? nullptr : dbias.b16();
  c.rows = rows;
  c.cols = channels;
  c.accumulate = accumulate;
  launch_column_sum<kRms ? ColumnSum::kRmsNorm : ColumnSum::kLayerNorm>(
      c, static_cast<float*>(scratch), stream);
  FLARE_RETURN_IF_ERROR(launch_status(kCudaContext, op));

  NormParams p{};
  p.x = x;
  p.weight = weight;
  p.mean = const_cast<float*>(mean);
  p.rstd = const_cast<float*>(rstd);
  p.dout = dout;
  p.dresidual = dresidual;
  p.dx = dx;
  p.rows = rows;
  p.channels = channels;
  p.inv_channels = 1.0f / static_cast<float>(channels);
  const unsigned grid = ceil_div(rows, kRowsPerBlock);
  if (vector_path(p))
    norm_backward_dx_kernel<kRms, 8><<<grid, kRowThreads, 0, stream>>>(p);
  else
    norm_backward_dx_kernel<kRms, 1><<<grid, kRowThreads, 0, stream>>>(p);
  return launch_status(kCudaContext, op);
}

}  // namespace

Status layernorm_backward(const bf16* dout, const bf16* x, const bf16* weight, const float* mean,
                          const float* rstd, const bf16* dresidual, bf16* dx, GradientOut dweight,
                          GradientOut dbias, int64_t rows, int64_t channels, bool accumulate,
                          void* scratch, cudaStream_t stream) {
  return norm_backward<false>("layernorm_backward", dx, dweight, dbias, dresidual, dout, x, weight,
                              mean, rstd, rows, channels, accumulate, scratch, stream);
}

Status rmsnorm_backward(const bf16* dout, const bf16* x, const bf16* weight, const float* rstd,
                        const bf16* dresidual, bf16* dx, GradientOut dweight, int64_t rows,
                        int64_t channels, bool accumulate, void* scratch, cudaStream_t stream) {
  return norm_backward<true>("rmsnorm_backward", dx, dweight, nullptr, dresidual, dout, x, weight,
                             nullptr, rstd, rows, channels, accumulate, scratch, stream);
}

}  // namespace flare::train::cuda
