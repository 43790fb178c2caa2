// all_to_all_attention.h — head-parallel (Ulysses-style) context parallelism at one rank.
#pragma once

#include "dist/cp_context.h"

namespace flare::dist {

// Where all-to-all's buffers sit in the workspace (sizes from ctx's plan).
void plan_all_to_all_workspace(const CpContext& ctx, CpWorkspace* ws);

Status all_to_all_attention_forward(CpContext& ctx, const TensorView& q, const TensorView& k,
                                    const TensorView& v, const TensorView& o,
                                    const TensorView& lse, Stream stream);
Status all_to_all_attention_backward(CpContext& ctx, const TensorView& dout, const TensorView& q,
                                     const TensorView& k, const TensorView& v,
                                     const TensorView& o, const TensorView& lse,
                                     const TensorView& dq, const TensorView& dk,
                                     const TensorView& dv, Stream stream);

}  // namespace flare::dist
