// flare/block_sparse.h — block-sparse attention, forward and backward, and the FlashAttention
// paper's fixed sparsity patterns.
//
// A block mask splits the s_q × s_k score matrix of each (batch, query head) into blocks of
// block_m query rows by block_n keys; a block whose mask entry is 0 is skipped entirely (its K and
// V are never read, its scores never computed), so the cost is proportional to the blocks that
// are on. Everything else is flare/attention.h: shapes, options (causal, sliding window, softcap,
// ALiBi, dropout, GQA/MQA), varlen batches, O and LSE conventions. A (row, key) pair is visible
// iff its block is on AND the options' mask keeps it; a row that sees no key gets O = 0 and
// LSE = −inf, and its gradients are 0.
//
// Mask: uint8 or int32, nonzero = on, shape (b or 1, h_q or 1, ceil(s_q / block_m),
// ceil(s_k / block_n)); a dimension of extent 1 broadcasts over batch or heads. Any strides. For
// varlen batches b is the number of sequences, s_q / s_k are max_seqlen_q / max_seqlen_k, and row
// and key blocks count from the start of each sequence. Under GQA the mask is per query head.
//
// Block sizes: the CPU backends take any block_m, block_n ≥ 1. The CUDA kernels skip whole
// tiles, so on CUDA tensors block_m and block_n must be multiples of 128 (every kernel tile
// divides 128; a finer mask is refused with kUnsupported, not rounded); 128 × 128 is the natural
// choice, and a mask written at it runs unchanged on the CPU.
//
// Why separate entry points rather than a field of AttentionOptions: the mask is a tensor plus
// the granularity it is written at, meaningful only together and on the tensors' device; dense
// callers, the C ABI's mirror of AttentionOptions and every dense kernel stay untouched, and a
// backend without block-sparse kernels can refuse the call by name instead of ignoring a field.
#pragma once

#include <cstdint>
#include <vector>

#include "flare/attention.h"
#include "flare/status.h"
#include "flare/tensor.h"

namespace flare {

struct BlockMask {
  TensorView mask;   // uint8 or int32 (b | 1, h_q | 1, ceil(s_q / block_m), ceil(s_k / block_n))
  int block_m = 128;  // query rows per block, ≥ 1
  int block_n = 128;  // keys per block, ≥ 1
};

// Forward pass. Writes o and lse, as attention_forward does.
Status block_sparse_attention_forward(const TensorView& q, const TensorView& k,
                                      const TensorView& v, const TensorView& o,
                                      const TensorView& lse, const BlockMask& mask,
                                      const AttentionOptions& options = {},
                                      const VarlenArgs& varlen = {}, Stream stream = nullptr);

// Backward pass, with the forward's mask, options, O and LSE. Writes dq, dk, dv.
Status block_sparse_attention_backward(const TensorView& dout, const TensorView& q,
                                       const TensorView& k, const TensorView& v,
                                       const TensorView& o, const TensorView& lse,
                                       const TensorView& dq, const TensorView& dk,
                                       const TensorView& dv, const BlockMask& mask,
                                       const AttentionOptions& options = {},
                                       const VarlenArgs& varlen = {}, Stream stream = nullptr);

// ---- fixed patterns (FlashAttention, section 3.3) -------------------------------------------
// Each writes a row-major (row_blocks, col_blocks) uint8 mask into *mask (wrap it with
// TensorView::contiguous(data, DType::kUInt8, {1, 1, row_blocks, col_blocks}) to share it over
// batch and heads). Block (r, c) sits on the diagonal when c = r. Pure functions; *mask is left
// alone when an argument is rejected.

// Local + global: a band of `band` blocks per row around the diagonal, c − r in
// [−⌊band/2⌋, ⌈band/2⌉ − 1] (band 1: the diagonal; 2: it and the block to its left; 3: ±1),
// plus the first `global` block rows (those queries see every key) and the first `global` block
// columns (every query sees those keys). band ≥ 0, global ≥ 0.
Status local_global_block_mask(int64_t row_blocks, int64_t col_blocks, int64_t band,
                               int64_t global, std::vector<uint8_t>* mask);

// Butterfly: block (r, c) is on iff r and c differ in at most one bit (r XOR c is 0 or a power of
// two): the union of the butterfly factors' supports, log2(n) + 1 blocks per row of n.
Status butterfly_block_mask(int64_t row_blocks, int64_t col_blocks, std::vector<uint8_t>* mask);

}  // namespace flare
