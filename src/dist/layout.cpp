// layout.cpp — sequence layouts (contiguous, zigzag; one sequence or a packed batch), shard /
// unshard copies and the ring step planner. Pure index arithmetic: nothing here communicates.
#include "dist/layout.h"

#include <algorithm>
#include <cstring>
#include <utility>

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

// The two tensors of a shard / unshard: same rank, dtype and device, equal but for seq_dim.
Status check_pair(const TensorView& full, const TensorView& local, int seq_dim) {
  if (full.ndim < 1 || full.ndim > kMaxDims)
    return invalid("full: expected 1 to ", kMaxDims, " dimensions, got ", full.ndim);
  if (local.ndim != full.ndim)
    return invalid("local: ", local.ndim, " dimensions, but full has ", full.ndim);
  if (seq_dim < 0 || seq_dim >= full.ndim)
    return invalid("seq_dim: ", seq_dim, " is not a dimension of a ", full.ndim, "-d tensor");
  if (local.device != full.device ||
      (full.device == DeviceType::kCUDA && local.device_index != full.device_index))
    return invalid("local: on another device than full; both must be on the CPU or on one CUDA "
                   "device");
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
  const bool empty = full.numel() == 0;
  if (!empty && (full.data == nullptr || (local.numel() > 0 && local.data == nullptr)))
    return invalid("full / local: data pointer is null");
  return {};
}

Status check_local_rows(const TensorView& local, int seq_dim, int64_t rows, int64_t total,
                        Strategy strategy, int size, int rank) {
  if (local.shape[seq_dim] != rows)
    return invalid("local: ", local.shape[seq_dim], " rows in dimension ", seq_dim, ", but rank ",
                   rank, " of ", size, " holds ", rows, " of ", total, " rows (",
                   strategy_name(strategy), ")");
  return {};
}

}  // namespace

void add_runs(const SequenceShard& shard, bool to_local, std::vector<RowRun>* runs) {
  for (int c = 0; c < shard.count; ++c) {
    const SequenceChunk& ch = shard.chunk[c];
    if (ch.length == 0) continue;
    runs->push_back(to_local ? RowRun{ch.global_begin, ch.local_begin, ch.length}
                             : RowRun{ch.local_begin, ch.global_begin, ch.length});
  }
}

namespace {

Status copy_runs(const TensorView& src, const TensorView& dst, int seq_dim,
                 const std::vector<RowRun>& runs, Stream stream) {
  if (src.device == DeviceType::kCUDA) return device_copy_runs(src, dst, seq_dim, runs, stream);
  for (const RowRun& run : runs) copy_rows(src, run.src_row, dst, run.dst_row, run.rows, seq_dim);
  return {};
}

Status shard_copy(const TensorView& full, const TensorView& local, int seq_dim, Strategy strategy,
                  int size, int rank, bool to_local, Stream stream) {
  FLARE_RETURN_IF_ERROR(check_pair(full, local, seq_dim));
  SequenceShard shard;
  FLARE_RETURN_IF_ERROR(sequence_shard(strategy, full.shape[seq_dim], size, rank, &shard));
  FLARE_RETURN_IF_ERROR(
      check_local_rows(local, seq_dim, shard.length, full.shape[seq_dim], strategy, size, rank));
  std::vector<RowRun> runs;
  add_runs(shard, to_local, &runs);
  return to_local ? copy_runs(full, local, seq_dim, runs, stream)
                  : copy_runs(local, full, seq_dim, runs, stream);
}

Status varlen_copy(const TensorView& full, const TensorView& local, int seq_dim,
                   Strategy strategy, const std::vector<int32_t>& cu_seqlens, int size, int rank,
                   bool to_local, Stream stream) {
  FLARE_RETURN_IF_ERROR(check_pair(full, local, seq_dim));
  VarlenShard shard;
  FLARE_RETURN_IF_ERROR(varlen_shard(strategy, cu_seqlens, size, rank, &shard));
  if (full.shape[seq_dim] != cu_seqlens.back())
    return invalid("full: ", full.shape[seq_dim], " rows in dimension ", seq_dim,
                   ", but cu_seqlens ends at ", cu_seqlens.back(),
                   "; the packed token count must match");
  FLARE_RETURN_IF_ERROR(
      check_local_rows(local, seq_dim, shard.length, full.shape[seq_dim], strategy, size, rank));
  std::vector<RowRun> runs;
  for (const SequenceShard& seq : shard.sequences) add_runs(seq, to_local, &runs);
  return to_local ? copy_runs(full, local, seq_dim, runs, stream)
                  : copy_runs(local, full, seq_dim, runs, stream);
}

// The rectangle of global rows of query chunk qc that see a key of chunk kc under the band, and
// the keys they see, as a call (layout.h's header says why the window is exact and non-negative).
// False when the band hides the pair.
bool visible_rectangle(const SequenceChunk& qc, const SequenceChunk& kc, const MaskBand& band,
                       BlockTask* out) {
  if (qc.length == 0 || kc.length == 0) return false;
  const int64_t qa = qc.global_begin, qb = qa + qc.length;
  const int64_t ka = kc.global_begin, kb = ka + kc.length;
  // Row g sees a key of [ka, kb) when g + right >= ka and g - left < kb.
  const int64_t q0 = band.right >= 0 ? std::max(qa, ka - band.right) : qa;
  const int64_t q1 = band.left >= 0 ? std::min(qb, kb + band.left) : qb;
  if (q0 >= q1) return false;
  const int64_t k0 = band.left >= 0 ? std::max(ka, q0 - band.left) : ka;
  const int64_t k1 = band.right >= 0 ? std::min(kb, q1 + band.right) : kb;
  const int64_t shift = q1 - k1;  // the call aligns its last row (global q1 − 1) with key k1 − 1
  BlockTask t;
  t.q_begin = qc.local_begin + (q0 - qa);
  t.q_len = q1 - q0;
  t.k_begin = kc.local_begin + (k0 - ka);
  t.k_len = k1 - k0;
  t.window_left = band.left >= 0 ? band.left - shift : -1;
  t.window_right = band.right >= 0 ? band.right + shift : -1;
  // A side that reaches past every key of the call from every row does not bind.
  if (t.window_left >= t.k_len - 1) t.window_left = -1;
  if (t.window_right >= t.q_len - 1) t.window_right = -1;
  *out = t;
  return true;
}

}  // namespace

Status shard_sequence(const TensorView& full, int seq_dim, Strategy strategy, int size, int rank,
                      const TensorView& local, Stream stream) {
  return shard_copy(full, local, seq_dim, strategy, size, rank, true, stream);
}

Status unshard_sequence(const TensorView& local, int seq_dim, Strategy strategy, int size,
                        int rank, const TensorView& full, Stream stream) {
  return shard_copy(full, local, seq_dim, strategy, size, rank, false, stream);
}

Status shard_sequence(const TensorView& full, int seq_dim, Strategy strategy, int size, int rank,
                      const TensorView& local) {
  return shard_sequence(full, seq_dim, strategy, size, rank, local, nullptr);
}

Status unshard_sequence(const TensorView& local, int seq_dim, Strategy strategy, int size,
                        int rank, const TensorView& full) {
  return unshard_sequence(local, seq_dim, strategy, size, rank, full, nullptr);
}

Status varlen_shard(Strategy strategy, const std::vector<int32_t>& cu_seqlens, int size, int rank,
                    VarlenShard* shard) {
  if (shard == nullptr) return invalid("varlen_shard: shard is null");
  if (cu_seqlens.empty()) return invalid("cu_seqlens: empty; a packed batch has batch + 1 >= 1 offsets");
  if (cu_seqlens[0] != 0) return invalid("cu_seqlens[0] must be 0, got ", cu_seqlens[0]);
  VarlenShard out;
  out.cu_seqlens.push_back(0);
  for (size_t i = 0; i + 1 < cu_seqlens.size(); ++i) {
    if (cu_seqlens[i + 1] < cu_seqlens[i])
      return invalid("cu_seqlens: must be non-decreasing, but [", i + 1, "] = ", cu_seqlens[i + 1],
                     " < [", i, "] = ", cu_seqlens[i]);
    SequenceShard seq;
    FLARE_RETURN_IF_ERROR(
        sequence_shard(strategy, cu_seqlens[i + 1] - cu_seqlens[i], size, rank, &seq));
    for (int c = 0; c < seq.count; ++c) {
      seq.chunk[c].global_begin += cu_seqlens[i];
      seq.chunk[c].local_begin += out.length;
    }
    out.length += seq.length;
    out.max_seqlen = std::max(out.max_seqlen, static_cast<int>(seq.length));
    out.cu_seqlens.push_back(static_cast<int32_t>(out.length));
    out.sequences.push_back(seq);
  }
  *shard = std::move(out);
  return {};
}

Status shard_varlen(const TensorView& full, int seq_dim, Strategy strategy,
                    const std::vector<int32_t>& cu_seqlens, int size, int rank,
                    const TensorView& local, Stream stream) {
  return varlen_copy(full, local, seq_dim, strategy, cu_seqlens, size, rank, true, stream);
}

Status unshard_varlen(const TensorView& local, int seq_dim, Strategy strategy,
                      const std::vector<int32_t>& cu_seqlens, int size, int rank,
                      const TensorView& full, Stream stream) {
  return varlen_copy(full, local, seq_dim, strategy, cu_seqlens, size, rank, false, stream);
}

MaskBand mask_band(const AttentionOptions& options) {
  return {options.window_left, options.causal ? 0 : options.window_right};
}

std::vector<BlockTask> ring_step_tasks(const SequenceShard& q, const SequenceShard& kv,
                                       const MaskBand& mask, bool same_rank) {
  std::vector<BlockTask> tasks;
  if (q.length == 0 || kv.length == 0) return tasks;
  const int64_t q_start = q.chunk[0].local_begin, k_start = kv.chunk[0].local_begin;
  if (same_rank && mask.left < 0 && mask.right <= 0) {
    // No mask, or causal: one call over the rank's rows, in global order on both sides.
    BlockTask own;
    own.q_begin = q_start;
    own.q_len = q.length;
    own.k_begin = k_start;
    own.k_len = kv.length;
    own.window_right = mask.right;
    tasks.push_back(own);
    return tasks;
  }
  for (int i = 0; i < q.count; ++i) {
    // This query chunk's rectangles; two unmasked ones over locally adjacent keys become one.
    std::vector<BlockTask> row;
    for (int j = 0; j < kv.count; ++j) {
      BlockTask t;
      if (!visible_rectangle(q.chunk[i], kv.chunk[j], mask, &t)) continue;
      BlockTask* prev = row.empty() ? nullptr : &row.back();
      if (prev != nullptr && !prev->masked() && !t.masked() && prev->q_begin == t.q_begin &&
          prev->q_len == t.q_len && prev->k_begin + prev->k_len == t.k_begin)
        prev->k_len += t.k_len;
      else
        row.push_back(t);
    }
    for (const BlockTask& t : row) {
      // Adjacent query rows that see the same keys unmasked become one call.
      BlockTask* prev = tasks.empty() ? nullptr : &tasks.back();
      if (prev != nullptr && !prev->masked() && !t.masked() &&
          prev->q_begin + prev->q_len == t.q_begin && prev->k_begin == t.k_begin &&
          prev->k_len == t.k_len)
        prev->q_len += t.q_len;
      else
        tasks.push_back(t);
    }
  }
  return tasks;
}

std::vector<BlockTask> varlen_step_tasks(const VarlenShard& q, const VarlenShard& kv,
                                         const MaskBand& mask, bool same_rank) {
  std::vector<BlockTask> calls;
  for (size_t s = 0; s < q.sequences.size() && s < kv.sequences.size(); ++s)
    for (const BlockTask& piece : ring_step_tasks(q.sequences[s], kv.sequences[s], mask, same_rank)) {
      // The first call of this window that the piece can follow (rows and keys both after the
      // call's), else a new one.
      BlockTask* into = nullptr;
      for (BlockTask& c : calls)
        if (c.window_left == piece.window_left && c.window_right == piece.window_right &&
            piece.q_begin >= c.q_begin + c.q_len && piece.k_begin >= c.k_begin + c.k_len) {
          into = &c;
          break;
        }
      if (into == nullptr) {
        calls.push_back(piece);
        calls.back().segments = {{piece.q_len, piece.k_len}};
        continue;
      }
      const int64_t gap_q = piece.q_begin - (into->q_begin + into->q_len);
      const int64_t gap_k = piece.k_begin - (into->k_begin + into->k_len);
      if (gap_q > 0) into->segments.push_back({gap_q, 0});  // rows of no key in this call
      if (gap_k > 0) into->segments.push_back({0, gap_k});  // keys of no row in this call
      into->segments.push_back({piece.q_len, piece.k_len});
      into->q_len += gap_q + piece.q_len;
      into->k_len += gap_k + piece.k_len;
    }
  return calls;
}

namespace {

template <typename Shard, typename Tasks>
int visible_steps(const std::vector<Shard>& shards, Tasks tasks) {
  const int n = static_cast<int>(shards.size());
  for (int step = n - 1; step > 0; --step)
    for (int r = 0; r < n; ++r)
      if (!tasks(shards[r], shards[((r - step) % n + n) % n]).empty()) return step + 1;
  return 1;
}

}  // namespace

int visible_ring_steps(const std::vector<SequenceShard>& shards, const MaskBand& mask) {
  return visible_steps(shards, [&](const SequenceShard& q, const SequenceShard& kv) {
    return ring_step_tasks(q, kv, mask, false);
  });
}

int visible_ring_steps(const std::vector<VarlenShard>& shards, const MaskBand& mask) {
  return visible_steps(shards, [&](const VarlenShard& q, const VarlenShard& kv) {
    return varlen_step_tasks(q, kv, mask, false);
  });
}

}  // namespace flare::dist
