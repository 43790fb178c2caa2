// layout.h — the ring's plan as data: which attention calls one ring step makes.
//
// At ring step i rank r holds the K/V block of rank (r − i) mod size. Which of its queries see
// which of those keys follows from the global rows of the two shards and the mask alone, so the
// whole plan is a pure function, tested by itself (tests/test_dist_layout.cpp) against the
// definition of the mask.
//
// The mask is a band over global positions: query row g sees key j when g − left ≤ j ≤ g + right
// (−1: unbounded on that side; causal is right = 0), attention.h's window. A block call's mask is
// the single-device one, aligned bottom-right within the call: the call's last query row sits at
// its last key. So a call over query rows ending at global row qe and keys ending at ke sees the
// global band when given the window (left − (qe − ke), right + (qe − ke)); the planner cuts each
// (query chunk, key chunk) pair down to the rows that see a key and the keys seen, which makes
// both of those non-negative (the pair's last query row sees a key of the chunk, and no key past
// its own right edge is kept), and drops a side that cannot bind within the call (−1).
#pragma once

#include <cstdint>
#include <vector>

#include "flare/dist.h"

namespace flare::dist {

// The attention mask over global positions, as bounds of a band (−1: unbounded).
struct MaskBand {
  int64_t left = -1;
  int64_t right = -1;
  bool bounded() const { return left >= 0 || right >= 0; }
};
// attention.h's options as a band: causal is the window (left, 0).
MaskBand mask_band(const AttentionOptions& options);

// One sequence of a packed call: q_len query rows against k_len keys, consecutive in the call's
// rows (a sequence with one side empty fills a gap between two others: its rows see no key, or
// its keys are seen by no row).
struct Segment {
  int64_t q_len = 0;
  int64_t k_len = 0;
};

// One single-device attention call of a ring step: this rank's local query rows
// [q_begin, q_begin + q_len) against rows [k_begin, k_begin + k_len) of the K/V block it holds,
// with the window (window_left, window_right) in the call's own bottom-right-aligned coordinates
// ((−1, 0): causal; (−1, −1): no mask). Packed plans: the call is a varlen call whose sequences are
// `segments` (their q_len and k_len sum to the call's); fixed-length plans: no segments, every
// batch row alike.
struct BlockTask {
  int64_t q_begin = 0;
  int64_t q_len = 0;
  int64_t k_begin = 0;
  int64_t k_len = 0;
  int64_t window_left = -1;
  int64_t window_right = -1;
  std::vector<Segment> segments;
  bool causal() const { return window_left == -1 && window_right == 0; }
  bool masked() const { return window_left >= 0 || window_right >= 0; }
};

// The calls that attend the queries of shard `q` to the K/V of shard `kv` (same_rank: the rank's
// own block) under `mask`. Together the tasks of all steps cover every visible (query, key) pair
// exactly once; a pair of chunks the mask hides entirely gives no call.
//
// Why each call is exact: shards are made of whole chunks and two chunks of different ranks are
// disjoint, so each (query chunk, key chunk) pair is one rectangle of the global mask, which one
// call with the window above computes. Without a bounded window a rectangle of two ranks' chunks
// is fully visible or hidden, and a rank's own block is one call over its local rows (kept in
// global order, so the causal mask over them is the global one).
std::vector<BlockTask> ring_step_tasks(const SequenceShard& q, const SequenceShard& kv,
                                       const MaskBand& mask, bool same_rank);

// The same for packed batches: each sequence's rectangles (as ring_step_tasks), packed into varlen
// calls. Rectangles with one window share a call when their rows and keys come in the same order;
// the rows between them in the call become sequences of no keys and keys of no rows.
std::vector<BlockTask> varlen_step_tasks(const VarlenShard& q, const VarlenShard& kv,
                                         const MaskBand& mask, bool same_rank);

// How many ring steps carry a call at some rank: 1 + the last step i at which a rank's queries see
// a key of the block it then holds, rank (r − i) mod n's (shards[r] or varlen[r], every rank's,
// so every rank counts the same). A ring may stop there: the blocks of later steps would travel
// for nothing. Only a band bounded on the left and closed on the right (a causal window) stops
// early: keys to the right of a rank's rows arrive last.
int visible_ring_steps(const std::vector<SequenceShard>& shards, const MaskBand& mask);
int visible_ring_steps(const std::vector<VarlenShard>& shards, const MaskBand& mask);

// A run of rows to copy: src rows [src_row, src_row + rows) to dst rows from dst_row.
struct RowRun {
  int64_t src_row = 0;
  int64_t dst_row = 0;
  int64_t rows = 0;
};

// Appends the runs of a shard's non-empty chunks: from the full tensor's rows to the local ones
// (to_local), or the reverse.
void add_runs(const SequenceShard& shard, bool to_local, std::vector<RowRun>* runs);

// Copies `rows` rows along seq_dim from src (from row src_row) to dst (from row dst_row), element
// by element through any strides. Host memory; one dtype; the other dimensions must agree.
void copy_rows(const TensorView& src, int64_t src_row, const TensorView& dst, int64_t dst_row,
               int64_t rows, int seq_dim);

// Every run of `runs` from src to dst along seq_dim on the tensors' CUDA device, enqueued on
// `stream` (device_ops.cu; kUnsupported in builds without CUDA).
Status device_copy_runs(const TensorView& src, const TensorView& dst, int seq_dim,
                        const std::vector<RowRun>& runs, Stream stream);

}  // namespace flare::dist
