// test_dist_util.h — what the context-parallel tests share: running one function per rank (an
// in-process group or NCCL communicators, each rank on its own thread), and one case's setup (the
// config, the global problem, and each rank's shard of it).
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "flare/dist.h"
#include "test_util.h"

namespace flare::test {

inline std::vector<std::unique_ptr<dist::Communicator>> in_process_group(int size, int timeout_ms) {
  std::vector<std::unique_ptr<dist::Communicator>> comms;
  const Status s = dist::make_in_process_group(size, {timeout_ms}, &comms);
  EXPECT_TRUE(s.ok()) << s.to_string();
  return comms;
}

// Runs fn(comm) for every rank at once, each on its own thread; returns each rank's status.
inline std::vector<Status> run_ranks(std::vector<std::unique_ptr<dist::Communicator>>& comms,
                                     const std::function<Status(dist::Communicator&)>& fn) {
  std::vector<Status> result(comms.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < comms.size(); ++r)
    threads.emplace_back([&, r] { result[r] = fn(*comms[r]); });
  for (std::thread& t : threads) t.join();
  return result;
}

// Creates `n` NCCL communicators from threads (device r for rank r) and runs fn on each; returns
// each rank's status. absent_rank's thread never creates its communicator.
inline std::vector<Status> run_nccl(int n, int timeout_ms,
                                    const std::function<Status(dist::Communicator&)>& fn,
                                    int absent_rank = -1) {
  dist::NcclId id;
  const Status made = dist::nccl_unique_id(&id);
  EXPECT_TRUE(made.ok()) << made.to_string();
  std::vector<Status> st(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      if (r == absent_rank) return;
      std::unique_ptr<dist::Communicator> comm;
      st[r] = dist::make_nccl_communicator(id, r, n, r, {timeout_ms}, &comm);
      if (st[r].ok()) st[r] = fn(*comm);
    });
  for (std::thread& t : threads) t.join();
  return st;
}

inline bool has(const Status& s, const std::string& text) {
  return s.message().find(text) != std::string::npos;
}

// ---- one context-parallel case ------------------------------------------------------------------

struct CpCase {
  dist::Strategy strategy = dist::Strategy::kZigzag;
  int world = 2;
  bool causal = true;
  int batch = 2;
  int seqlen = 24;
  int heads_q = 4;
  int heads_kv = 2;
  int head_dim = 64;
  DType dtype = DType::kFloat32;
  float softcap = 0.0f;
  int window_left = -1, window_right = -1;
  bool deterministic = false;
  int64_t pad = 0;  // extra row stride of the local tensors
};

inline std::string describe(const CpCase& c) {
  return std::string(dist::strategy_name(c.strategy)) + " world=" + std::to_string(c.world) +
         " causal=" + std::to_string(c.causal) + " s=" + std::to_string(c.seqlen) +
         " b=" + std::to_string(c.batch) + " h=" + std::to_string(c.heads_q) + "/" +
         std::to_string(c.heads_kv) + " d=" + std::to_string(c.head_dim) + " " +
         dtype_name(c.dtype) + " softcap=" + std::to_string(c.softcap) + " window=(" +
         std::to_string(c.window_left) + "," + std::to_string(c.window_right) +
         ") deterministic=" + std::to_string(c.deterministic) + " pad=" + std::to_string(c.pad);
}

// `c` under strategy st; all-to-all hands out whole heads, so it gets 2:1 GQA with as many K/V
// heads as ranks.
inline CpCase with_strategy(CpCase c, dist::Strategy st) {
  c.strategy = st;
  if (st == dist::Strategy::kAllToAll) {
    c.heads_q = 2 * c.world;
    c.heads_kv = c.world;
  }
  return c;
}

inline AttentionOptions options_of(const CpCase& c) {
  AttentionOptions o;
  o.causal = c.causal;
  o.softcap = c.softcap;
  o.window_left = c.window_left;
  o.window_right = c.window_right;
  o.deterministic = c.deterministic;
  return o;
}

inline dist::ContextParallelConfig config_of(const CpCase& c) {
  dist::ContextParallelConfig cfg;
  cfg.strategy = c.strategy;
  cfg.batch = c.batch;
  cfg.seqlen = c.seqlen;
  cfg.heads_q = c.heads_q;
  cfg.heads_kv = c.heads_kv;
  cfg.head_dim = c.head_dim;
  cfg.dtype = c.dtype;
  cfg.attention = options_of(c);
  return cfg;
}

// The global problem of a case (fresh seed; printed on failure by the checks). make_problem of
// one spec twice gives the same inputs.
inline ProblemSpec spec_of(const CpCase& c) {
  ProblemSpec spec;
  spec.batch = c.batch;
  spec.seqlen_q = spec.seqlen_k = c.seqlen;
  spec.heads_q = c.heads_q;
  spec.heads_kv = c.heads_kv;
  spec.head_dim = c.head_dim;
  spec.dtype = c.dtype;
  spec.options = options_of(c);
  spec.seed = test_seed();
  return spec;
}
inline Problem problem_of(const CpCase& c) { return make_problem(spec_of(c)); }

// One rank's local tensors on the host: inputs sharded from the problem, outputs poisoned.
struct Local {
  HostTensor q, k, v, o, lse, dout, dq, dk, dv;
};

inline Local make_local(const CpCase& c, const Problem& pr, int rank) {
  dist::SequenceShard sh;
  EXPECT_TRUE(dist::sequence_shard(c.strategy, c.seqlen, c.world, rank, &sh).ok());
  const int64_t s = sh.length;
  auto qlike = [&] { return HostTensor::make_padded(c.dtype, {c.batch, s, c.heads_q, c.head_dim}, c.pad); };
  auto kvlike = [&] { return HostTensor::make_padded(c.dtype, {c.batch, s, c.heads_kv, c.head_dim}, c.pad); };
  Local l{qlike(), kvlike(), kvlike(), qlike(), HostTensor::make(DType::kFloat32, {c.batch, c.heads_q, s}),
          qlike(), qlike(), kvlike(), kvlike()};
  for (auto [full, local] : {std::pair{&pr.q, &l.q}, {&pr.k, &l.k}, {&pr.v, &l.v}, {&pr.dout, &l.dout}})
    EXPECT_TRUE(dist::shard_sequence(full->view, 1, c.strategy, c.world, rank, local->view).ok());
  for (HostTensor* t : {&l.o, &l.lse, &l.dq, &l.dk, &l.dv}) t->poison();
  return l;
}

inline std::vector<Local> make_locals(const CpCase& c, const Problem& pr) {
  std::vector<Local> locals;
  for (int r = 0; r < c.world; ++r) locals.push_back(make_local(c, pr, r));
  return locals;
}

// Every rank's outputs back into the problem's global o, lse, dq, dk and dv.
inline void gather_outputs(const CpCase& c, const std::vector<Local>& locals, Problem* pr) {
  for (int r = 0; r < c.world; ++r) {
    const Local& l = locals[r];
    for (auto [local, full, dim] : {std::tuple{&l.o, &pr->o, 1}, {&l.lse, &pr->lse, 2}, {&l.dq, &pr->dq, 1},
                                    {&l.dk, &pr->dk, 1}, {&l.dv, &pr->dv, 1}})
      ASSERT_TRUE(dist::unshard_sequence(local->view, dim, c.strategy, c.world, r, full->view).ok());
  }
}

// The problem's outputs against the float64 reference under the tolerance rule: O and LSE against
// its forward, dQ, dK and dV against the backward from its own O and LSE.
inline void expect_matches_reference(const Problem& pr) {
  expect_forward_matches(pr);
  const AttentionParams bp = pr.backward_params();
  const cpu::RefBackward ref = cpu::reference_backward(bp, cpu::RefPrecision::kFloat64);
  const cpu::RefBackward naive = cpu::reference_backward(bp, cpu::RefPrecision::kLowPrecision);
  expect_gradients_match(pr, bp, ref, naive);
}

// What a ring or zigzag forward + backward makes rank `rank` send: K/V of the block it holds at
// steps 0 … n−2 (each pass), then the backward's fp32 dK/dV of the blocks it holds at steps
// 0 … n−1 (sent one step later, the last one home); 2n exchanges when no shard is empty.
struct RingTraffic {
  int exchanges = 0;
  int64_t bytes = 0;
};
inline RingTraffic expected_ring_traffic(const CpCase& c, int rank) {
  const int n = c.world;
  int64_t kv = 0, dkv = 0;
  for (int step = 0; step < n; ++step) {
    dist::SequenceShard held;
    EXPECT_TRUE(dist::sequence_shard(c.strategy, c.seqlen, n, ((rank - step) % n + n) % n, &held).ok());
    const int64_t elems = int64_t{c.batch} * held.length * c.heads_kv * c.head_dim;
    if (step + 1 < n) kv += 2 * elems * static_cast<int64_t>(dtype_size(c.dtype));
    dkv += 2 * elems * 4;
  }
  return {2 * n, 2 * kv + dkv};
}

}  // namespace flare::test
