// embedding.h — the token (+ learned position) embedding, forward and deterministic backward.
//
// Forward: out[n] = token_table[tokens[n]] (+ position_table[n % seq_len]), added in fp32 and
// rounded once. A token outside [0, vocab_size) cannot be reported without a host wait, so its
// row is written as NaN, which the loss then shows; cpu::embedding_forward rejects such tokens
// with a Status, and the data loader validates them before they reach the device.
//
// Backward, without sorting and without float atomics: each vocabulary row is owned by the block
// of its first occurrence in the batch (an integer atomicMin finds it, the same value whatever
// the order of the atomics). That block walks the rest of the batch in order, collects the later
// occurrences in order, and adds their dout rows into the fp32 table row one after another, in
// ascending token position — the order of the CPU reference. The position table's gradient is a
// sum over the batch in sequence order, one thread per (position, channel).
#pragma once

#include <cstdint>

#include "train/cuda/common.h"

namespace flare::train::cuda {

// tokens (rows) int32; token_table (≥ vocab_size, channels); position_table (≥ seq_len, channels)
// or null (LLaMA); out (rows, channels) written. positions (device, seq_len distinct entries) or
// null: the table row of the j-th row of each sequence is positions[j], or j (a context-parallel
// rank's rows of a longer sequence sit at their global positions; cpu/ops.h likewise).
Status embedding_forward(const int32_t* tokens, const bf16* token_table,
                         const bf16* position_table, bf16* out, int64_t rows, int64_t seq_len,
                         int64_t vocab_size, int64_t channels, cudaStream_t stream,
                         const int64_t* positions = nullptr);

int64_t embedding_backward_scratch_bytes(int64_t vocab_size);

// dout (rows, channels), tokens (rows); dtoken_table (≥ vocab_size, channels) accumulated (+=) at
// the rows of the tokens; dposition_table accumulated at the rows' table rows (as the forward's:
// positions or the first seq_len), or null. Both fp32, or both bf16 (each element's sum is formed
// in fp32 from its old value and rounded once). Tokens outside [0, vocab_size) add nothing.
Status embedding_backward(const bf16* dout, const int32_t* tokens, GradientOut dtoken_table,
                          GradientOut dposition_table, int64_t rows, int64_t seq_len,
                          int64_t vocab_size, int64_t channels, void* scratch,
                          cudaStream_t stream, const int64_t* positions = nullptr);

}  // namespace flare::train::cuda
