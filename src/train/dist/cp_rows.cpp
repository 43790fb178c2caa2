// cp_rows.cpp — context parallelism's rows and plan for the trainer (cp_rows.h).
#include "train/dist/cp_rows.h"

#include <numeric>

#include "core/message.h"

namespace flare::train::dp {

Status context_parallel_rows(int64_t seq, const dist::Communicator* cp, std::vector<int64_t>* positions) {
  const int ranks = cp ? cp->size() : 1;
  if (ranks == 1) {
    positions->resize(static_cast<size_t>(seq));
    std::iota(positions->begin(), positions->end(), int64_t{0});
    return Status::ok_status();
  }
  if (seq % (2 * ranks) != 0) {
    return invalid("seq_len = ", seq, " must be a multiple of 2 x ", ranks,
                   " context-parallel ranks (the zigzag layout's equal chunks)");
  }
  dist::SequenceShard shard;
  FLARE_RETURN_IF_ERROR(dist::sequence_shard(dist::Strategy::kZigzag, seq, ranks, cp->rank(), &shard));
  positions->clear();
  for (int c = 0; c < shard.count; ++c) {
    for (int64_t i = 0; i < shard.chunk[c].length; ++i) positions->push_back(shard.chunk[c].global_begin + i);
  }
  return Status::ok_status();
}

std::span<const int32_t> gather_rows(std::span<const int32_t> full, int64_t seq,
                                     const std::vector<int64_t>& positions, std::vector<int32_t>* local) {
  const auto rows = static_cast<int64_t>(positions.size());
  if (rows == seq) return full;  // context_parallel_rows gives seq rows only as 0 … seq − 1
  const int64_t sequences = static_cast<int64_t>(full.size()) / seq;
  local->resize(static_cast<size_t>(sequences * rows));
  for (int64_t q = 0; q < sequences; ++q) {
    for (int64_t j = 0; j < rows; ++j) {
      (*local)[static_cast<size_t>(q * rows + j)] = full[static_cast<size_t>(q * seq + positions[static_cast<size_t>(j)])];
    }
  }
  return *local;
}

Status make_context_parallel_attention(dist::Communicator* cp, const ModelConfig& config, int64_t batch,
                                       int64_t seq, DType dtype, const AttentionOptions& attention,
                                       std::unique_ptr<dist::ContextParallelAttention>* out) {
  dist::ContextParallelConfig cfg;
  cfg.strategy = dist::Strategy::kZigzag;
  cfg.batch = static_cast<int>(batch);
  cfg.seqlen = seq;
  cfg.heads_q = static_cast<int>(config.n_head);
  cfg.heads_kv = static_cast<int>(config.n_kv_head);
  cfg.head_dim = static_cast<int>(config.head_dim);
  cfg.dtype = dtype;
  cfg.attention = attention;
  return dist::ContextParallelAttention::create(cp, cfg, out);
}

}  // namespace flare::train::dp
