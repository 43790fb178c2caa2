// adamw.h — the optimizer step on the CPU: AdamW over the flat fp32 master weights, with the
// global gradient-norm clip, writing the bf16 weights the model reads. This is the reference the
// CUDA optimizer is tested against, so every operation and its order is written down here.
//
// Per element of every tensor of the layout (the alignment gaps are never touched), in fp32,
// following torch.optim.AdamW (decoupled weight decay, bias correction, eps outside the sqrt):
//   g  = grad · grad_scale                    grad_scale = clip_scale(...) / any loss scale
//   m  = beta1 · m + (1 − beta1) · g
//   v  = beta2 · v + (1 − beta2) · g · g
//   p  = p · decay                            decay = fp32(1 − lr · weight_decay) (in double),
//                                             only where the layout marks weight_decay
//   p  = p − lr · (m / bc1) / (sqrt(v / bc2) + eps)
//   w  = bf16(p)                              round to nearest even (core/numeric.h)
// with the constants beta1, beta2, 1 − beta1, 1 − beta2, bc1 = 1 − beta1^t and bc2 = 1 − beta2^t
// computed once per step in double, then rounded to fp32; t counts optimizer steps from 1.
#pragma once

#include <cstdint>

#include "flare/status.h"
#include "train/core/model_config.h"

namespace flare::train {

struct AdamWStep {
  int64_t t = 1;              // this step's number, from 1 (bias correction)
  double lr = 0.0;            // this step's learning rate (schedule.h)
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.0;  // applied to the tensors whose ParamSpec says weight_decay
  float grad_scale = 1.0f;    // multiplies every gradient: the clip scale (and 1/loss-scale)
};

// The global L2 norm of the gradients over every tensor of the layout: squares summed in double,
// tensor by tensor in layout order, element by element in memory order, then sqrt. Summing in
// double makes the result independent of the order to within double rounding, so a GPU sum in
// another order agrees to fp32 precision. NaN or Inf gradients give a non-finite norm.
double gradient_norm(const ParameterLayout& layout, const float* grads);

// The factor torch.nn.utils.clip_grad_norm_ applies: min(1, max_norm / (norm + 1e-6)); 1 when
// max_norm is 0 (clipping off). Computed in double, returned as the fp32 grad_scale.
float clip_scale(double norm, double max_norm);

// One AdamW step over buffers of layout.total elements each: grads (read), master, m, v (updated)
// and weights (bf16 bits, written; may be null when the caller converts separately). The caller
// decides what to do with a non-finite norm (skip the step) before calling this.
Status adamw_step(const ParameterLayout& layout, const AdamWStep& step, const float* grads,
                  float* master, float* m, float* v, uint16_t* weights);

}  // namespace flare::train
