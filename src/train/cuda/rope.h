// rope.h — rotary position embedding (LLaMA), forward and backward, in place on the q and k
// heads of the fused qkv rows.
//
// The rotate-half convention of cpu/ops.h (Hugging Face LLaMA): for i < head_dim/2 the pair
// (x[i], x[i + head_dim/2]) of each q and k head turns by the angle position · inv_freq[i]:
//   x'[i] = x[i]·cos − x[i + D/2]·sin,   x'[i + D/2] = x[i + D/2]·cos + x[i]·sin
// and the backward turns the gradient back by −angle. Row n of qkv is token n % seq_len of its
// sequence. The cos/sin tables (max_pos, head_dim/2) fp32 are computed once, in double and rounded
// to fp32, by cpu::rope_table<float> (LLaMA-3 frequency scaling included) and copied to the device
// at setup; the kernels only read them. Math in fp32, one bf16 rounding per stored value.
#pragma once

#include <cstdint>

#include "train/cuda/common.h"

namespace flare::train::cuda {

// qkv (rows, (n_head + 2·n_kv_head)·head_dim), rotated in place; v untouched. cos_table and
// sin_table hold at least seq_len rows of head_dim/2. head_dim must be even.
Status rope_forward(const float* cos_table, const float* sin_table, bf16* qkv, int64_t rows,
                    int64_t seq_len, int64_t n_head, int64_t n_kv_head, int64_t head_dim,
                    cudaStream_t stream);
// dqkv: the same layout, the dq and dk parts turned back in place; dv untouched.
Status rope_backward(const float* cos_table, const float* sin_table, bf16* dqkv, int64_t rows,
                     int64_t seq_len, int64_t n_head, int64_t n_kv_head, int64_t head_dim,
                     cudaStream_t stream);

}  // namespace flare::train::cuda
