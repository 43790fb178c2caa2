// rope.cu — rotary position embedding on the qkv rows (rope.h).
//
// One thread per rotated pair (row, head among the n_head + n_kv_head rotated ones, i < D/2):
// consecutive threads take consecutive i, so both halves of a head are read and written
// coalesced; the table row of the position is shared by every head of the row (L1/L2 hits).
// The backward is the same kernel with the sine negated.
#include "train/cuda/rope.h"

#include "core/message.h"
#include "train/cuda/device.cuh"

namespace flare::train::cuda {
namespace {

struct RopeParams {
  const float* cos_table;  // (≥ seq_len, half)
  const float* sin_table;  // (≥ seq_len, half)
  bf16* qkv;               // (rows, row_stride); q heads, k heads, v heads
  int64_t rows, seq_len;
  int64_t rotated_heads;   // n_head + n_kv_head: the q and k heads, which come first in a row
  int64_t half;            // head_dim / 2
  int64_t row_stride;      // (n_head + 2·n_kv_head)·head_dim
  float sin_sign;          // +1 forward, −1 backward (rotation by −angle)
};

__global__ void rope_kernel(const RopeParams p) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t pairs_per_row = p.rotated_heads * p.half;
  if (idx >= p.rows * pairs_per_row) return;
  const int64_t row = idx / pairs_per_row;
  const int64_t head = (idx % pairs_per_row) / p.half;
  const int64_t i = idx % p.half;
  const int64_t pos = row % p.seq_len;
  const float c = p.cos_table[pos * p.half + i];
  const float s = p.sin_sign * p.sin_table[pos * p.half + i];
  bf16* x = p.qkv + row * p.row_stride + head * 2 * p.half;
  const float x1 = __bfloat162float(x[i]);
  const float x2 = __bfloat162float(x[i + p.half]);
  x[i] = __float2bfloat16_rn(x1 * c - x2 * s);
  x[i + p.half] = __float2bfloat16_rn(x2 * c + x1 * s);
}

Status rope(const char* op, const float* cos_table, const float* sin_table, bf16* qkv,
            int64_t rows, int64_t seq_len, int64_t n_head, int64_t n_kv_head, int64_t head_dim,
            float sin_sign, cudaStream_t stream) {
  if (rows < 1) return invalid(op, ": rows = ", rows, " must be >= 1");
  if (seq_len < 1) return invalid(op, ": seq_len = ", seq_len, " must be >= 1");
  if (n_head < 1) return invalid(op, ": n_head = ", n_head, " must be >= 1");
  if (n_kv_head < 1) return invalid(op, ": n_kv_head = ", n_kv_head, " must be >= 1");
  if (head_dim < 2 || head_dim % 2 != 0)
    return invalid(op, ": head_dim = ", head_dim, " must be even and >= 2");
  if (cos_table == nullptr || sin_table == nullptr || qkv == nullptr)
    return invalid(op, ": cos_table, sin_table and qkv must not be null");
  RopeParams p{};
  p.cos_table = cos_table;
  p.sin_table = sin_table;
  p.qkv = qkv;
  p.rows = rows;
  p.seq_len = seq_len;
  p.rotated_heads = n_head + n_kv_head;
  p.half = head_dim / 2;
  p.row_stride = (n_head + 2 * n_kv_head) * head_dim;
  p.sin_sign = sin_sign;
  const int64_t threads = rows * p.rotated_heads * p.half;
  rope_kernel<<<ceil_div(threads, 256), 256, 0, stream>>>(p);
  return launch_status(kCudaContext, op);
}

}  // namespace

Status rope_forward(const float* cos_table, const float* sin_table, bf16* qkv, int64_t rows,
                    int64_t seq_len, int64_t n_head, int64_t n_kv_head, int64_t head_dim,
                    cudaStream_t stream) {
  return rope("rope_forward", cos_table, sin_table, qkv, rows, seq_len, n_head, n_kv_head,
              head_dim, 1.0f, stream);
}

Status rope_backward(const float* cos_table, const float* sin_table, bf16* dqkv, int64_t rows,
                     int64_t seq_len, int64_t n_head, int64_t n_kv_head, int64_t head_dim,
                     cudaStream_t stream) {
  return rope("rope_backward", cos_table, sin_table, dqkv, rows, seq_len, n_head, n_kv_head,
              head_dim, -1.0f, stream);
}

}  // namespace flare::train::cuda
