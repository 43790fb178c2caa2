// layout.cpp — sequence layouts (contiguous, zigzag), shard / unshard copies and the ring step
// planner. Pure index arithmetic: nothing here communicates.
#include "dist/layout.h"

#include <algorithm>
#include <cstring>

#include "dist/dist_internal.h"

namespace flare::dist {
namespace {

// Chunk `index` of a sequence of `seqlen` rows cut into `count` chunks: the first seqlen mod count
// chunks get one row more.
void cut(int64_t seqlen, int64_t count, int64_t index, int64_t* begin, int64_t* length) {
  const int64_t base = seqlen / count, extra = seqlen % count;
  *begin = index * base + std::min(index, extra);
  *length = base + (index < extra ? 1 : 0);
}

}  // namespace

const char* strategy_name(Strategy strategy) {
  switch (strategy) {
    case Strategy::kRing: return "ring";
    case Strategy::kZigzag: return "zigzag";
    case Strategy::kAllToAll: return "all-to-all";
  }
  return "unknown";
}

Status sequence_shard(Strategy strategy, int64_t seqlen, int size, int rank,
                      SequenceShard* shard) {
  if (shard == nullptr) return invalid("sequence_shard: shard is null");
  if (strategy != Strategy::kRing && strategy != Strategy::kZigzag &&
      strategy != Strategy::kAllToAll)
    return invalid("strategy: unknown value ", static_cast<int>(strategy),
                   "; must be ring (0), zigzag (1) or all-to-all (2)");
  if (seqlen < 0) return invalid("seqlen: ", seqlen, " must be >= 0");
  if (size < 1) return invalid("size: ", size, " must be >= 1");
  if (rank < 0 || rank >= size) return invalid("rank: ", rank, " must be in [0, ", size, ")");
  SequenceShard s;
  if (strategy != Strategy::kZigzag) {
    s.count = 1;
    cut(seqlen, size, rank, &s.chunk[0].global_begin, &s.chunk[0].length);
  } else {
    s.count = 2;
    cut(seqlen, 2 * int64_t{size}, rank, &s.chunk[0].global_begin, &s.chunk[0].length);
    cut(seqlen, 2 * int64_t{size}, 2 * int64_t{size} - 1 - rank, &s.chunk[1].global_begin,
        &s.chunk[1].length);
    s.chunk[1].local_begin = s.chunk[0].length;
  }
  s.length = s.chunk[0].length + (s.count == 2 ? s.chunk[1].length : 0);
  *shard = s;
  return {};
}

void copy_rows(const TensorView& src, int64_t src_row, const TensorView& dst, int64_t dst_row,
               int64_t rows, int seq_dim) {
  if (rows == 0) return;
  const size_t elem = dtype_size(src.dtype);
  int64_t shape[kMaxDims] = {1, 1, 1, 1};
  int64_t ss[kMaxDims] = {0, 0, 0, 0}, ds[kMaxDims] = {0, 0, 0, 0};
  for (int i = 0; i < src.ndim; ++i) {
    shape[i] = i == seq_dim ? rows : src.shape[i];
    ss[i] = src.stride[i];
    ds[i] = dst.stride[i];
  }
  const auto* s = static_cast<const unsigned char*>(src.data) + src_row * ss[seq_dim] * elem;
  auto* d = static_cast<unsigned char*>(dst.data) + dst_row * ds[seq_dim] * elem;
  for (int64_t a = 0; a < shape[0]; ++a)
    for (int64_t b = 0; b < shape[1]; ++b)
      for (int64_t c = 0; c < shape[2]; ++c)
        for (int64_t e = 0; e < shape[3]; ++e) {
          const int64_t so = a * ss[0] + b * ss[1] + c * ss[2] + e * ss[3];
          const int64_t dof = a * ds[0] + b * ds[1] + c * ds[2] + e * ds[3];
          std::memcpy(d + dof * elem, s + so * elem, elem);
        }
}

namespace {

Status check_shard_args(const TensorView& full, const TensorView& local, int seq_dim,
                        Strategy strategy, int size, int rank, SequenceShard* shard) {
  if (full.ndim < 1 || full.ndim > kMaxDims)
    return invalid("full: expected 1 to ", kMaxDims, " dimensions, got ", full.ndim);
  if (local.ndim != full.ndim)
    return invalid("local: ", local.ndim, " dimensions, but full has ", full.ndim);
  if (seq_dim < 0 || seq_dim >= full.ndim)
    return invalid("seq_dim: ", seq_dim, " is not a dimension of a ", full.ndim, "-d tensor");
  if (full.device != DeviceType::kCPU || local.device != DeviceType::kCPU)
    return Status::unsupported("shard_sequence / unshard_sequence: CPU tensors only for now");
  if (local.dtype != full.dtype)
    return invalid("local: dtype ", dtype_name(local.dtype), " differs from full's ",
                   dtype_name(full.dtype));
  for (int i = 0; i < full.ndim; ++i) {
    if (full.shape[i] < 0 || local.shape[i] < 0)
      return invalid("full / local: negative extent in dimension ", i);
    if (i != seq_dim && local.shape[i] != full.shape[i])
      return invalid("local: dimension ", i, " is ", local.shape[i], " but full's is ",
                     full.shape[i], "; only the sequence dimension ", seq_dim, " may differ");
  }
  FLARE_RETURN_IF_ERROR(sequence_shard(strategy, full.shape[seq_dim], size, rank, shard));
  if (local.shape[seq_dim] != shard->length)
    return invalid("local: ", local.shape[seq_dim], " rows in dimension ", seq_dim, ", but rank ",
                   rank, " of ", size, " holds ", shard->length, " of ", full.shape[seq_dim],
                   " rows (", strategy_name(strategy), ")");
  const bool empty = full.numel() == 0;
  if (!empty && (full.data == nullptr || (local.numel() > 0 && local.data == nullptr)))
    return invalid("full / local: data pointer is null");
  return {};
}

}  // namespace

Status shard_sequence(const TensorView& full, int seq_dim, Strategy strategy, int size, int rank,
                      const TensorView& local) {
  SequenceShard shard;
  FLARE_RETURN_IF_ERROR(check_shard_args(full, local, seq_dim, strategy, size, rank, &shard));
  for (int c = 0; c < shard.count; ++c)
    copy_rows(full, shard.chunk[c].global_begin, local, shard.chunk[c].local_begin,
              shard.chunk[c].length, seq_dim);
  return {};
}

Status unshard_sequence(const TensorView& local, int seq_dim, Strategy strategy, int size,
                        int rank, const TensorView& full) {
  SequenceShard shard;
  FLARE_RETURN_IF_ERROR(check_shard_args(full, local, seq_dim, strategy, size, rank, &shard));
  for (int c = 0; c < shard.count; ++c)
    copy_rows(local, shard.chunk[c].local_begin, full, shard.chunk[c].global_begin,
              shard.chunk[c].length, seq_dim);
  return {};
}

std::vector<BlockTask> ring_step_tasks(const SequenceShard& q, const SequenceShard& kv,
                                       bool causal, bool same_rank) {
  std::vector<BlockTask> tasks;
  if (q.length == 0 || kv.length == 0) return tasks;
  if (same_rank) {
    tasks.push_back({0, q.length, 0, kv.length, causal});
    return tasks;
  }
  for (int i = 0; i < q.count; ++i) {
    const SequenceChunk& qc = q.chunk[i];
    if (qc.length == 0) continue;
    // The local K/V rows this query chunk sees: a union of whole, locally adjacent chunks.
    int64_t k_begin = -1, k_end = -1;
    for (int j = 0; j < kv.count; ++j) {
      const SequenceChunk& kc = kv.chunk[j];
      if (kc.length == 0) continue;
      const bool visible = !causal || kc.global_begin + kc.length <= qc.global_begin;
      if (!visible) continue;
      if (k_begin < 0) k_begin = kc.local_begin;
      k_end = kc.local_begin + kc.length;
    }
    if (k_begin < 0) continue;
    const BlockTask next{qc.local_begin, qc.length, k_begin, k_end - k_begin, false};
    BlockTask* prev = tasks.empty() ? nullptr : &tasks.back();
    // Adjacent query rows that see the same keys become one call.
    if (prev != nullptr && prev->q_begin + prev->q_len == next.q_begin &&
        prev->k_begin == next.k_begin && prev->k_len == next.k_len)
      prev->q_len += next.q_len;
    else
      tasks.push_back(next);
  }
  return tasks;
}

}  // namespace flare::dist
