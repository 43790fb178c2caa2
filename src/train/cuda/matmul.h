// matmul.h — the linear layers' matrix products on cuBLASLt: bf16 inputs, fp32 accumulation.
//
// Shapes are row-major as in torch.nn.Linear: x (tokens, in), weight (out, in), y (tokens, out).
//   forward          y  = x · Wᵀ (+ bias)                 bf16 out; epilogue BIAS, or GELU_AUX_BIAS
//                    (y = gelu(x·Wᵀ + b), pre_gelu = x·Wᵀ + b kept for the backward)
//   backward input   dx = dy · W                          bf16 out; epilogue DGELU multiplies by
//                    gelu'(pre_gelu) when the layer below was the GELU one
//   backward weight  dW (+)= dyᵀ · x,  db (+)= Σ_t dy     fp32 out: the trainer's gradients are
//                    fp32 (adamw.h says why) and accumulate over micro-batches with beta = 1.
//
// cuBLASLt's GELU epilogues use the tanh approximation, 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))),
// the GELU of GPT-2 and of the CPU reference (cpu/ops.h gelu_forward).
//
// A written bias gradient (accumulate false: a step's first micro-batch) comes from cuBLASLt's
// BGRADB epilogue, the sum over tokens of dy inside the product. That epilogue can only write, so
// an accumulated one (+=, later micro-batches), or a shape cuBLASLt has no such plan for, comes
// from the deterministic column sum (column_reduce.cuh), at the cost of one more read of dy (at
// GPT-3 2.7B's fc layer, tokens 4096 × out 10240 bf16: 84 MB, some 30 µs on an H100).
//
// A MatmulContext owns the cuBLASLt handle, one 32 MiB workspace and a cache of plans: the
// descriptors and the algorithm cuBLASLt's heuristic chose, per (pass, shape, epilogue, pointer
// alignment). The heuristic runs on the first call of a shape only; later calls reuse the plan.
// Split-K reductions that work in place on the output are excluded from the heuristic's choice,
// so every plan runs in a fixed order and gives the same bits each run. The workspace (shared
// with the bias-gradient reduction) is used in stream order: a context serves one stream at a
// time, from one host thread.
#pragma once

#include <cstdint>
#include <memory>

#include "train/cuda/common.h"

namespace flare::train::cuda {

class MatmulContext {
 public:
  MatmulContext();
  ~MatmulContext();
  MatmulContext(const MatmulContext&) = delete;
  MatmulContext& operator=(const MatmulContext&) = delete;

  // Creates the cuBLASLt handle and allocates the workspace (a setup call: it may synchronise).
  Status init();

  static constexpr int64_t kWorkspaceBytes = int64_t{32} << 20;

  struct State;  // the handle, the workspace and the plan cache (matmul.cpp)
  State* state() const { return state_.get(); }

 private:
  std::unique_ptr<State> state_;
};

// x (tokens, in), weight (out, in), bias (out) or null; y (tokens, out) written.
// pre_gelu null: y = x·Wᵀ (+ bias). pre_gelu (tokens, out) given: pre_gelu = x·Wᵀ (+ bias) and
// y = gelu(pre_gelu); then out must be a multiple of 8 (cuBLASLt's rule for the aux buffer).
Status matmul_forward(MatmulContext& ctx, const bf16* x, const bf16* weight, const bf16* bias,
                      bf16* y, bf16* pre_gelu, int64_t tokens, int64_t in, int64_t out,
                      cudaStream_t stream);

// dy (tokens, out), weight (out, in); dx (tokens, in) written: dx = dy · W, or, with pre_gelu
// (tokens, in) the forward's pre-activation of the layer below, dx = (dy · W) ⊙ gelu'(pre_gelu)
// (then in must be a multiple of 8).
Status matmul_backward_input(MatmulContext& ctx, const bf16* dy, const bf16* weight,
                             const bf16* pre_gelu, bf16* dx, int64_t tokens, int64_t in,
                             int64_t out, cudaStream_t stream);

// dy (tokens, out), x (tokens, in); dweight (out, in) fp32 and dbias (out) fp32 or null:
// accumulate ? += : =. The bias gradient needs column_sum scratch in the context's workspace:
// tokens/128 · out floats, at most 32 MiB (tokens 16384 with out 50304 fit).
// In bf16 (GradientOut of a bf16*, both or neither) the gradient is written only (accumulate
// false), by cuBLASLt's bf16-output kernels; the bias from the BGRADB epilogue, or where cuBLASLt
// has no such plan, from the column sum written in bf16.
Status matmul_backward_weight(MatmulContext& ctx, const bf16* dy, const bf16* x, GradientOut dweight,
                              GradientOut dbias, int64_t tokens, int64_t in, int64_t out,
                              bool accumulate, cudaStream_t stream);

// The bias gradient alone: dbias (cols) fp32 (+)= Σ_r dy[r] over dy (rows, cols) bf16, in a fixed
// order (two stages, no atomics). scratch holds bias_gradient_scratch_bytes(rows, cols).
int64_t bias_gradient_scratch_bytes(int64_t rows, int64_t cols);
Status bias_gradient(const bf16* dy, GradientOut dbias, int64_t rows, int64_t cols, bool accumulate,
                     void* scratch, cudaStream_t stream);

}  // namespace flare::train::cuda
