// rope.cu — rotary position embedding on the qkv rows (rope.h).
//
// One block per row (a token's q and k heads share its position's table row). Each thread takes
// kVec consecutive pairs (i … i + kVec − 1 of one head, with their partners i + D/2 …): one 8-byte
// (or 4-, or 2-byte) load and store per half of the head and one vector load per table, where the
// head dim, the row stride and the pointers allow it. All index arithmetic is 32-bit within the
// row: a row holds fewer than 2^31 elements. The backward is the same kernel with the sine negated.
#include "train/cuda/rope.h"

#include <cstdint>

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

template <int kVec>
struct alignas(4 * kVec) FloatVec {
  float v[kVec];
};
template <int kVec>
struct alignas(2 * kVec) Bf16Vec {
  bf16 v[kVec];
};

template <int kVec>
__global__ void __launch_bounds__(128) rope_kernel(const RopeParams p) {
  const int64_t row = blockIdx.x;
  const int half = static_cast<int>(p.half), per_head = half / kVec;
  const int per_row = static_cast<int>(p.rotated_heads) * per_head;
  const int64_t table_row = row % p.seq_len * p.half;
  bf16* x_row = p.qkv + row * p.row_stride;
  for (int t = threadIdx.x; t < per_row; t += blockDim.x) {
    const int head = t / per_head, i = t % per_head * kVec;
    const FloatVec<kVec> c = *reinterpret_cast<const FloatVec<kVec>*>(p.cos_table + table_row + i);
    const FloatVec<kVec> s = *reinterpret_cast<const FloatVec<kVec>*>(p.sin_table + table_row + i);
    Bf16Vec<kVec>* lo = reinterpret_cast<Bf16Vec<kVec>*>(x_row + head * 2 * half + i);
    Bf16Vec<kVec>* hi = reinterpret_cast<Bf16Vec<kVec>*>(x_row + head * 2 * half + half + i);
    Bf16Vec<kVec> a = *lo, b = *hi;
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const float x1 = __bfloat162float(a.v[e]), x2 = __bfloat162float(b.v[e]);
      const float sn = p.sin_sign * s.v[e];
      a.v[e] = __float2bfloat16_rn(x1 * c.v[e] - x2 * sn);
      b.v[e] = __float2bfloat16_rn(x2 * c.v[e] + x1 * sn);
    }
    *lo = a;
    *hi = b;
  }
}

// The widest vector (4, 2 or 1 pairs) that every access of the call is aligned to.
int rope_vector(const RopeParams& p) {
  auto aligned = [](const void* ptr, int bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; };
  for (int vec : {4, 2}) {
    if (p.half % vec == 0 && p.row_stride % vec == 0 && aligned(p.qkv, 2 * vec) &&
        aligned(p.cos_table, 4 * vec) && aligned(p.sin_table, 4 * vec))
      return vec;
  }
  return 1;
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
  if (p.rotated_heads * p.half >= (int64_t{1} << 31) || rows >= (int64_t{1} << 31))
    return invalid(op, ": rows = ", rows, " and the row's rotated pairs must each be below 2^31");
  const unsigned blocks = static_cast<unsigned>(rows);
  switch (rope_vector(p)) {
    case 4: rope_kernel<4><<<blocks, 128, 0, stream>>>(p); break;
    case 2: rope_kernel<2><<<blocks, 128, 0, stream>>>(p); break;
    default: rope_kernel<1><<<blocks, 128, 0, stream>>>(p); break;
  }
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
