// ring_attention.h — one rank's side of ring attention, forward and backward, on host memory or a
// CUDA device (ctx.ops).
//
// The caller (context_parallel.cpp) has validated the tensors and agreed on the plan with every
// other rank; these functions run the ring. See ring_attention.cpp for the step structure.
#pragma once

#include "dist/cp_context.h"

namespace flare::dist {

// Where the ring's buffers sit in the workspace (sizes from ctx's plan).
void plan_ring_workspace(const CpContext& ctx, CpWorkspace* ws);

Status ring_attention_forward(CpContext& ctx, const TensorView& q, const TensorView& k,
                              const TensorView& v, const TensorView& o, const TensorView& lse,
                              Stream stream);
Status ring_attention_backward(CpContext& ctx, const TensorView& dout, const TensorView& q,
                               const TensorView& k, const TensorView& v, const TensorView& o,
                               const TensorView& lse, const TensorView& dq, const TensorView& dk,
                               const TensorView& dv, Stream stream);

}  // namespace flare::dist
