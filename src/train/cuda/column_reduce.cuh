// column_reduce.cuh — deterministic sums over the rows of a (rows, cols) bf16 matrix into fp32
// vectors of length cols: the bias gradient of a linear layer (Σ_r dy) and the weight and bias
// gradients of LayerNorm and RMSNorm (Σ_r dy·x̂, Σ_r dy, with x̂ = (x − mean_r)·rstd_r).
//
// Why two stages and no atomics: a float sum depends on its order, and atomics make the order a
// race. Here the rows are cut into fixed chunks of kChunkRows; stage 1 gives each (chunk, column
// group) to one block, whose threads walk their rows in order and combine their 8 row-strided
// partials in order through shared memory, writing one partial per (chunk, column) to scratch;
// stage 2 adds the partials of each column in chunk order. Every sum has one order fixed by
// (rows, cols) alone, so the result is the same bits on every run and every device.
//
// Layout: blockDim (32, 8); threadIdx.x owns kVec consecutive columns (16-byte packs when cols is
// a multiple of 8 and the pointers are aligned, else one column), threadIdx.y strides the rows.
#pragma once

#include <cuda_bf16.h>

#include "train/cuda/device.cuh"

namespace flare::train::cuda {

enum class ColumnSum { kBias, kRmsNorm, kLayerNorm };

inline constexpr int kChunkRows = 128;     // rows per stage-1 block
inline constexpr int kColumnThreadsX = 32;  // column groups per block
inline constexpr int kColumnThreadsY = 8;   // row strides per block

struct ColumnSumParams {
  const __nv_bfloat16* dy;  // (rows, cols), row stride cols
  const __nv_bfloat16* x;   // (rows, cols) norm input; null for kBias
  const float* mean;        // (rows) LayerNorm mean; null otherwise
  const float* rstd;        // (rows) norm rstd; null for kBias
  float* partial0;          // (chunks, cols) Σ dy (kBias) or Σ dy·x̂ (norms)
  float* partial1;          // (chunks, cols) Σ dy for kLayerNorm; null otherwise
  float* out0;              // (cols) bias gradient or norm weight gradient (fp32), or null:
  float* out1;              // (cols) LayerNorm bias gradient; null otherwise
  __nv_bfloat16* out0_bf16; // the same written in bf16 (accumulate false) when out0 is null
  __nv_bfloat16* out1_bf16;
  int64_t rows, cols, chunks;
  bool accumulate;  // out += sum instead of out = sum
};

inline int64_t column_sum_chunks(int64_t rows) { return (rows + kChunkRows - 1) / kChunkRows; }

template <ColumnSum kMode, int kVec>
__global__ void __launch_bounds__(kColumnThreadsX* kColumnThreadsY)
    column_sum_partials_kernel(const ColumnSumParams p) {
  constexpr bool kTwo = kMode == ColumnSum::kLayerNorm;
  __shared__ float s0[kColumnThreadsY][kColumnThreadsX * kVec];
  __shared__ float s1[kTwo ? kColumnThreadsY : 1][kColumnThreadsX * kVec];
  const int64_t col = (static_cast<int64_t>(blockIdx.x) * kColumnThreadsX + threadIdx.x) * kVec;
  const int64_t chunk = blockIdx.y;
  const int64_t row_end = min(p.rows, (chunk + 1) * kChunkRows);
  float acc0[kVec], acc1[kVec];
#pragma unroll
  for (int i = 0; i < kVec; ++i) acc0[i] = acc1[i] = 0.0f;
  if (col < p.cols) {
    for (int64_t r = chunk * kChunkRows + threadIdx.y; r < row_end; r += kColumnThreadsY) {
      float dy[kVec];
      load_floats<kVec>(p.dy + r * p.cols + col, dy);
      if constexpr (kMode == ColumnSum::kBias) {
#pragma unroll
        for (int i = 0; i < kVec; ++i) acc0[i] += dy[i];
      } else {
        float x[kVec];
        load_floats<kVec>(p.x + r * p.cols + col, x);
        const float mean = kTwo ? p.mean[r] : 0.0f;
        const float rstd = p.rstd[r];
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          acc0[i] += dy[i] * ((x[i] - mean) * rstd);
          if constexpr (kTwo) acc1[i] += dy[i];
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    s0[threadIdx.y][threadIdx.x * kVec + i] = acc0[i];
    if constexpr (kTwo) s1[threadIdx.y][threadIdx.x * kVec + i] = acc1[i];
  }
  __syncthreads();
  // Row y of the block combines, for its share of the block's columns, the 8 partials in order.
  for (int c = threadIdx.y; c < kColumnThreadsX * kVec; c += kColumnThreadsY) {
    const int64_t gc = static_cast<int64_t>(blockIdx.x) * kColumnThreadsX * kVec + c;
    if (gc >= p.cols) continue;
    float t0 = 0.0f, t1 = 0.0f;
#pragma unroll
    for (int y = 0; y < kColumnThreadsY; ++y) {
      t0 += s0[y][c];
      if constexpr (kTwo) t1 += s1[y][c];
    }
    p.partial0[chunk * p.cols + gc] = t0;
    if constexpr (kTwo) p.partial1[chunk * p.cols + gc] = t1;
  }
}

template <bool kTwo>
__global__ void column_sum_finish_kernel(const ColumnSumParams p) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= p.cols) return;
  float t0 = 0.0f, t1 = 0.0f;
  for (int64_t k = 0; k < p.chunks; ++k) {
    t0 += p.partial0[k * p.cols + c];
    if constexpr (kTwo) t1 += p.partial1[k * p.cols + c];
  }
  if (p.out0 == nullptr) {
    p.out0_bf16[c] = __float2bfloat16_rn(t0);
    if constexpr (kTwo) p.out1_bf16[c] = __float2bfloat16_rn(t1);
    return;
  }
  p.out0[c] = p.accumulate ? p.out0[c] + t0 : t0;
  if constexpr (kTwo) p.out1[c] = p.accumulate ? p.out1[c] + t1 : t1;
}

// Launches both stages on `stream`. The caller has validated the sizes and pointers; scratch
// holds column_sum_scratch_floats() floats.
inline int64_t column_sum_scratch_floats(int64_t rows, int64_t cols, bool two) {
  return column_sum_chunks(rows) * cols * (two ? 2 : 1);
}

template <ColumnSum kMode>
void launch_column_sum(ColumnSumParams p, float* scratch, cudaStream_t stream) {
  constexpr bool kTwo = kMode == ColumnSum::kLayerNorm;
  p.chunks = column_sum_chunks(p.rows);
  p.partial0 = scratch;
  p.partial1 = kTwo ? scratch + p.chunks * p.cols : nullptr;
  const bool vec = p.cols % 8 == 0 && aligned16(p.dy) && (p.x == nullptr || aligned16(p.x));
  const dim3 block(kColumnThreadsX, kColumnThreadsY);
  if (vec) {
    const dim3 grid(ceil_div(p.cols, kColumnThreadsX * 8), static_cast<unsigned>(p.chunks));
    column_sum_partials_kernel<kMode, 8><<<grid, block, 0, stream>>>(p);
  } else {
    const dim3 grid(ceil_div(p.cols, kColumnThreadsX), static_cast<unsigned>(p.chunks));
    column_sum_partials_kernel<kMode, 1><<<grid, block, 0, stream>>>(p);
  }
  column_sum_finish_kernel<kTwo><<<ceil_div(p.cols, 256), 256, 0, stream>>>(p);
}

}  // namespace flare::train::cuda
