// swiglu.h — the SwiGLU of LLaMA's MLP: out = silu(gate) · up, silu(g) = g · sigmoid(g).
//
// gate_up is the output of the fused gate_up linear layer: each row holds ffn gate values, then
// ffn up values (model_config.h). Math in fp32 from the bf16 inputs, one rounding per store;
// the backward recomputes sigmoid(gate) rather than saving it.
//   dgate = dout · up · σ(g) · (1 + g · (1 − σ(g))),   dup = dout · silu(g)
#pragma once

#include <cstdint>

#include "train/cuda/common.h"

namespace flare::train::cuda {

// gate_up (rows, 2·ffn); out (rows, ffn) written.
Status swiglu_forward(const bf16* gate_up, bf16* out, int64_t rows, int64_t ffn,
                      cudaStream_t stream);
// dout (rows, ffn), gate_up (rows, 2·ffn) the forward's input; dgate_up (rows, 2·ffn) written
// (it may alias gate_up: each element is read before its own store).
Status swiglu_backward(const bf16* dout, const bf16* gate_up, bf16* dgate_up, int64_t rows,
                       int64_t ffn, cudaStream_t stream);

}  // namespace flare::train::cuda
