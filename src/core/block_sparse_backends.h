// block_sparse_backends.h — what src/core/block_sparse.cpp offers tests and tools, and the CPU
// backend it dispatches to (src/cpu/block_sparse_flash.cpp). The float64 reference
// (cpu::reference_forward / reference_backward in core/backends.h) reads the mask itself.
#pragma once

#include <cstdint>

#include "core/params.h"
#include "flare/block_sparse.h"

namespace flare {

// Validate the arguments of block_sparse_attention_forward / _backward and fill params; *p is
// written only when every check passes.
Status make_block_sparse_forward_params(const TensorView& q, const TensorView& k,
                                        const TensorView& v, const TensorView& o,
                                        const TensorView& lse, const BlockMask& mask,
                                        const AttentionOptions& options, const VarlenArgs& varlen,
                                        AttentionParams* p);
Status make_block_sparse_backward_params(const TensorView& dout, const TensorView& q,
                                         const TensorView& k, const TensorView& v,
                                         const TensorView& o, const TensorView& lse,
                                         const TensorView& dq, const TensorView& dk,
                                         const TensorView& dv, const BlockMask& mask,
                                         const AttentionOptions& options,
                                         const VarlenArgs& varlen, AttentionParams* p);

namespace cpu {

// Tiled online-softmax block-sparse attention in fp32 (threads; deterministic backward). Visits
// only the (query block, key block) pairs whose mask entry is on and that the window reaches.
// *tiles_run, where given, receives the (query block, key block, query head) tiles the call
// computed (the backward's two passes summed), so tests can check that masked blocks are skipped
// without timing.
Status block_sparse_flash_forward(const AttentionParams& p, int64_t* tiles_run = nullptr);
Status block_sparse_flash_backward(const AttentionParams& p, int64_t* tiles_run = nullptr);

}  // namespace cpu
}  // namespace flare
