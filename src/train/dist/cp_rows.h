// cp_rows.h — context parallelism's arithmetic for the models and backends (backend.h,
// BackendOptions::cp_comm): which rows of each sequence a rank holds, gathering those rows of a
// batch, and the context-parallel attention plan a model's layers share.
//
// A rank of a group of c holds the zigzag share of every sequence (dist.h sequence_shard: chunks r
// and 2c − 1 − r of 2c, in that order), so causal attention costs every rank the same. The
// sequence length must be a multiple of 2c: every rank then holds the same number of rows, which
// the models' fixed-size buffers and the per-rank loss weighting rely on.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "flare/attention.h"
#include "flare/dist.h"
#include "flare/status.h"
#include "train/core/model_config.h"

namespace flare::train::dp {

// The global positions of the rows this rank of `cp` holds (cp null or of one rank: 0 … seq − 1).
// Fails, naming seq_len, when seq is not a multiple of 2 · cp->size().
Status context_parallel_rows(int64_t seq, const dist::Communicator* cp, std::vector<int64_t>* positions);

// The rows at `positions` of each of the sequences of `seq` tokens in `full`, gathered into
// *local (resized); `full` itself when the positions are all of 0 … seq − 1.
std::span<const int32_t> gather_rows(std::span<const int32_t> full, int64_t seq,
                                     const std::vector<int64_t>& positions, std::vector<int32_t>* local);

// The zigzag plan of a model's self-attention (batch sequences of seq tokens, the config's heads)
// over `cp`, every layer's call going through it: collective over cp.
Status make_context_parallel_attention(dist::Communicator* cp, const ModelConfig& config, int64_t batch,
                                       int64_t seq, DType dtype, const AttentionOptions& attention,
                                       std::unique_ptr<dist::ContextParallelAttention>* out);

}  // namespace flare::train::dp
