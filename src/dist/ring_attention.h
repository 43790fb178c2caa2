// ring_attention.h — one rank's side of ring attention, forward and backward, on host memory or a
// CUDA device (ctx.ops).
//
// The caller (context_parallel.cpp) has validated the tensors and agreed on the plan with every
// other rank; these functions run the ring. See ring_attention.cpp for the step structure.
#pragma once

#include <cstdint>
#include <vector>

#include "dist/cp_context.h"

namespace flare::dist {

// The ring's plan at this rank: the calls of every step (ctx.steps, from the shards and
// ctx.band) and where the buffers sit in the workspace (ctx.ws). A packed plan's int32 tables go to
// *tables, to be uploaded to ctx.ws.tables once the workspace exists.
void plan_ring(CpContext& ctx, std::vector<int32_t>* tables);
// Where the ring's buffers sit in the workspace (sizes from ctx's steps), with table_bytes of
// tables first.
void plan_ring_workspace(const CpContext& ctx, CpWorkspace* ws, int64_t table_bytes);

Status ring_attention_forward(CpContext& ctx, const TensorView& q, const TensorView& k,
                              const TensorView& v, const TensorView& o, const TensorView& lse,
                              Stream stream);
Status ring_attention_backward(CpContext& ctx, const TensorView& dout, const TensorView& q,
                               const TensorView& k, const TensorView& v, const TensorView& o,
                               const TensorView& lse, const TensorView& dq, const TensorView& dk,
                               const TensorView& dv, Stream stream);

}  // namespace flare::dist
