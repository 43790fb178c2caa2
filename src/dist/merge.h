// merge.h — combining partial attention results, the one definition every backend uses.
//
// Attention of a query row over keys split into blocks A and B can be computed block by block:
// each block gives its own (O_A, LSE_A) with LSE = log Σ exp(score) over the block's keys (natural
// log, as attention.h returns it) and O_A the softmax-weighted mean of the block's values. The
// row over both blocks is then
//     LSE = log(exp(LSE_A) + exp(LSE_B)),    O = exp(LSE_A − LSE)·O_A + exp(LSE_B − LSE)·O_B.
// Everything is fp32, whatever the inputs' dtype: the running O and LSE of a ring are fp32
// accumulators, rounded to the output dtype once at the end.
//
// A block in which the row sees no key has LSE = −inf and O = 0 (attention.h). Two such blocks
// must give −inf and weights 0, not the NaN of (−inf) − (−inf): merge_weights tests for it first.
// The larger LSE is taken out before exponentiating, so neither weight overflows.
//
// FLARE_HD: the CPU ring calls it now, and a CUDA merge kernel is meant to call the same function
// per row.
#pragma once

#include <cmath>

#include "core/host_device.h"

namespace flare::dist {

struct MergeWeights {
  float a;    // weight of the running result
  float b;    // weight of the new block
  float lse;  // the merged log-sum-exp
};

FLARE_HD MergeWeights merge_weights(float lse_a, float lse_b) {
  const float hi = lse_a > lse_b ? lse_a : lse_b;
  if (hi == -INFINITY) return {0.0f, 0.0f, -INFINITY};  // neither block has a visible key
  const float wa = expf(lse_a - hi), wb = expf(lse_b - hi);  // one of them is exp(0) = 1
  const float sum = wa + wb;
  const float smaller = lse_a > lse_b ? wb : wa;
  return {wa / sum, wb / sum, hi + log1pf(smaller)};  // log(1 + w) without losing small w
}

}  // namespace flare::dist
