// norm.h — LayerNorm (GPT) and RMSNorm (LLaMA) over the last dimension of a (rows, channels)
// bf16 tensor, forward and backward, with the residual add fused into the forward.
//
// Numerics: every statistic and every gradient is computed in fp32 from the bf16 inputs; outputs
// are rounded once (to nearest even) at the store. The forward saves mean (LayerNorm) and rstd
// per row in fp32 for the backward. The parameter gradients are fp32 (the trainer accumulates
// them in fp32, see adamw.h) and are reduced over the rows in a fixed order without atomics, so
// every run gives the same bits.
//
// Arguments: inputs, outputs, sizes, options, scratch, stream (the order of cpu/ops.h). The
// backward's dx = dresidual + ∂L/∂x: pass dresidual = dx to accumulate in place, as the CPU
// reference's norms do (a norm's input is the residual stream, whose gradient holds the skip
// connection's share).
//
// Sizes: rows ≥ 1 (at most 65535·128), channels ≥ 1; channels that are a multiple of 8 with
// 16-byte aligned pointers take the 16-byte path, anything else the scalar path.
#pragma once

#include <cstdint>

#include "train/cuda/common.h"

namespace flare::train::cuda {

// out = (x − mean)·rstd·weight + bias, rstd = 1/sqrt(var + eps) (biased variance).
// mean and rstd (rows, fp32) may be null when no backward follows.
Status layernorm_forward(const bf16* x, const bf16* weight, const bf16* bias, bf16* out,
                         float* mean, float* rstd, int64_t rows, int64_t channels, float eps,
                         cudaStream_t stream);
// out = x·rstd·weight, rstd = 1/sqrt(mean(x²) + eps).
Status rmsnorm_forward(const bf16* x, const bf16* weight, bf16* out, float* rstd, int64_t rows,
                       int64_t channels, float eps, cudaStream_t stream);

// The residual stream's update fused with the next norm: residual_out = residual + branch
// (rounded to bf16, the value the unfused pair would store), then the norm of residual_out —
// one read of each input instead of a separate add pass. residual_out may alias residual.
Status residual_layernorm_forward(const bf16* residual, const bf16* branch, const bf16* weight,
                                  const bf16* bias, bf16* residual_out, bf16* out, float* mean,
                                  float* rstd, int64_t rows, int64_t channels, float eps,
                                  cudaStream_t stream);
Status residual_rmsnorm_forward(const bf16* residual, const bf16* branch, const bf16* weight,
                                bf16* residual_out, bf16* out, float* rstd, int64_t rows,
                                int64_t channels, float eps, cudaStream_t stream);

// Bytes of scratch the backward passes need for their two-stage parameter-gradient reduction.
int64_t norm_backward_scratch_bytes(int64_t rows, int64_t channels);

// dx = dresidual + ∂L/∂x (dresidual may be null: dx = ∂L/∂x); dweight, dbias (fp32) = or +=
// (accumulate) their gradients, or (bf16, both) = them. dx may alias dresidual or dout (the reductions read dout first).
Status layernorm_backward(const bf16* dout, const bf16* x, const bf16* weight, const float* mean,
                          const float* rstd, const bf16* dresidual, bf16* dx, GradientOut dweight,
                          GradientOut dbias, int64_t rows, int64_t channels, bool accumulate,
                          void* scratch, cudaStream_t stream);
Status rmsnorm_backward(const bf16* dout, const bf16* x, const bf16* weight, const float* rstd,
                        const bf16* dresidual, bf16* dx, GradientOut dweight, int64_t rows,
                        int64_t channels, bool accumulate, void* scratch, cudaStream_t stream);

}  // namespace flare::train::cuda
