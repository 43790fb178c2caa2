// all_to_all_attention.h — head-parallel (Ulysses-style) context parallelism at one rank.
#pragma once

#include "dist/cp_context.h"

namespace flare::dist {

// Where all-to-all's buffers sit in the workspace (sizes from ctx's plan); for a packed plan the
// int32 tables to upload at ws.tables: this rank's pack's cu_seqlens, then the whole pack's
// (`cu_seqlens`) at ws.a2a_pack, whose longest sequence goes to ctx.pack_max_seqlen.
void plan_all_to_all(CpContext& ctx, const std::vector<int32_t>& cu_seqlens,
                     std::vector<int32_t>* tables);

Status all_to_all_attention_forward(CpContext& ctx, const TensorView& q, const TensorView& k,
                                    const TensorView& v, const TensorView& o, const TensorView& lse,
                                    Stream stream);
Status all_to_all_attention_backward(CpContext& ctx, const TensorView& dout, const TensorView& q,
                                     const TensorView& k, const TensorView& v, const TensorView& o,
                                     const TensorView& lse, const TensorView& dq,
                                     const TensorView& dk, const TensorView& dv, Stream stream);

}  // namespace flare::dist
