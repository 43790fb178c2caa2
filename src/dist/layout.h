// layout.h — the ring's plan as data: which attention calls one ring step makes.
//
// At ring step i rank r holds the K/V block of rank (r − i) mod size. Which of its queries see
// which of those keys follows from the global rows of the two shards alone (sequence_shard), so
// the whole plan is a pure function, tested by itself (tests/test_dist_layout.cpp) against the
// definition of the causal mask.
#pragma once

#include <cstdint>
#include <vector>

#include "flare/dist.h"

namespace flare::dist {

// One single-device attention call of a ring step: this rank's local query rows
// [q_begin, q_begin + q_len) against rows [k_begin, k_begin + k_len) of the K/V block it holds,
// with a causal mask (bottom-right aligned, as attention.h defines it) or none.
struct BlockTask {
  int64_t q_begin = 0;
  int64_t q_len = 0;
  int64_t k_begin = 0;
  int64_t k_len = 0;
  bool causal = false;
};

// The calls that attend the queries of shard `q` to the K/V of shard `kv` (same_rank: the rank's
// own block). Together the tasks of all steps cover every visible (query, key) pair exactly once.
//
// Why one call per task is exact: shards are made of whole chunks, so two chunks of different
// ranks are disjoint and one lies entirely before the other — under a causal mask the pair is then
// fully visible or fully hidden. A rank's own block is the same set of rows on both sides, kept
// in global order, so a causal mask over its local rows is the global one.
std::vector<BlockTask> ring_step_tasks(const SequenceShard& q, const SequenceShard& kv,
                                       bool causal, bool same_rank);

// Copies `rows` rows along seq_dim from src (from row src_row) to dst (from row dst_row), element
// by element through any strides. Host memory; one dtype; the other dimensions must agree.
void copy_rows(const TensorView& src, int64_t src_row, const TensorView& dst, int64_t dst_row,
               int64_t rows, int seq_dim);

}  // namespace flare::dist
