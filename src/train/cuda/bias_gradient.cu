// bias_gradient.cu — a linear layer's bias gradient, Σ over the rows of dy, through the
// deterministic column sum of column_reduce.cuh (matmul.h says why not cuBLASLt's BGRADB).
#include "core/message.h"
#include "train/cuda/column_reduce.cuh"
#include "train/cuda/matmul.h"

namespace flare::train::cuda {

int64_t bias_gradient_scratch_bytes(int64_t rows, int64_t cols) {
  return column_sum_scratch_floats(rows, cols, false) * static_cast<int64_t>(sizeof(float));
}

Status bias_gradient(const bf16* dy, GradientOut dbias, int64_t rows, int64_t cols, bool accumulate,
                     void* scratch, cudaStream_t stream) {
  constexpr int64_t kMaxRows = int64_t{65535} * kChunkRows;
  if (rows < 1 || rows > kMaxRows) return invalid("bias_gradient: rows = ", rows, " must be in [1, ", kMaxRows, "]");
  if (cols < 1) return invalid("bias_gradient: cols = ", cols, " must be >= 1");
  if (dy == nullptr || !dbias || scratch == nullptr)
    return invalid("bias_gradient: dy, dbias and scratch must not be null");
  if (dbias.is_bf16() && accumulate)
    return invalid("bias_gradient: a bf16 gradient is written, never accumulated (accumulate must be false)");
  ColumnSumParams p{};
  p.dy = dy;
  p.out0 = dbias.f32();
  p.out0_bf16 = dbias.b16();
  p.rows = rows;
  p.cols = cols;
  p.accumulate = accumulate;
  launch_column_sum<ColumnSum::kBias>(p, static_cast<float*>(scratch), stream);
  return launch_status(kCudaContext, "bias_gradient");
}

}  // namespace flare::train::cuda
