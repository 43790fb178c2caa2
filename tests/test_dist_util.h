// test_dist_util.h — what the context-parallel tests share: running one function per rank (an
// in-process group or NCCL communicators, each rank on its own thread), one case's setup (the
// config, the global problem, and each rank's shard of it), and a launcher's environment
// variables set for one test.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "flare/dist.h"
#include "test_util.h"

namespace flare::test {

// Sets or clears environment variables for one test, restoring them when it goes.
class ScopedEnv {
 public:
  void set(const char* name, const char* value) {
    if (const char* old = std::getenv(name)) saved_.push_back({name, old, true});
    else saved_.push_back({name, "", false});
    if (value) ::setenv(name, value, 1);
    else ::unsetenv(name);
  }
  ~ScopedEnv() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
      if (it->had) ::setenv(it->name.c_str(), it->value.c_str(), 1);
      else ::unsetenv(it->name.c_str());
    }
  }

 private:
  struct Saved {
    std::string name, value;
    bool had;
  };
  std::vector<Saved> saved_;
};

// Clears every variable a launcher (torchrun, mpirun) sets, so a test starts from none of them.
inline void clear_launch(ScopedEnv& env) {
  for (const char* v : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                        "OMPI_COMM_WORLD_LOCAL_RANK"})
    env.set(v, nullptr);
}

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

// What a fixed-length case (CpCase) and a packed one (VarlenCpCase, test_dist_varlen_util.h) both
// set: the strategy, the group, the heads, the dtype and the attention options.
struct CpCaseBase {
  dist::Strategy strategy = dist::Strategy::kZigzag;
  int world = 2;
  bool causal = true;
  int heads_q = 4;
  int heads_kv = 2;
  int head_dim = 64;
  DType dtype = DType::kFloat32;
  float softcap = 0.0f;
  int window_left = -1, window_right = -1;
  bool deterministic = false;
};

struct CpCase : CpCaseBase {
  int batch = 2;
  int seqlen = 24;
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

inline AttentionOptions options_of(const CpCaseBase& c) {
  AttentionOptions o;
  o.causal = c.causal;
  o.softcap = c.softcap;
  o.window_left = c.window_left;
  o.window_right = c.window_right;
  o.deterministic = c.deterministic;
  return o;
}

// The config's fields every layout shares; the layout's own (batch and seqlen, or cu_seqlens) are
// the caller's to set.
inline dist::ContextParallelConfig base_config_of(const CpCaseBase& c) {
  dist::ContextParallelConfig cfg;
  cfg.strategy = c.strategy;
  cfg.heads_q = c.heads_q;
  cfg.heads_kv = c.heads_kv;
  cfg.head_dim = c.head_dim;
  cfg.dtype = c.dtype;
  cfg.attention = options_of(c);
  return cfg;
}

inline dist::ContextParallelConfig config_of(const CpCase& c) {
  dist::ContextParallelConfig cfg = base_config_of(c);
  cfg.batch = c.batch;
  cfg.seqlen = c.seqlen;
  return cfg;
}

// The global problem of a case (fresh seed; printed on failure by the checks). make_problem of
// one spec twice gives the same inputs. base_spec_of fills what every layout shares.
inline ProblemSpec base_spec_of(const CpCaseBase& c) {
  ProblemSpec spec;
  spec.heads_q = c.heads_q;
  spec.heads_kv = c.heads_kv;
  spec.head_dim = c.head_dim;
  spec.dtype = c.dtype;
  spec.options = options_of(c);
  spec.seed = test_seed();
  return spec;
}
inline ProblemSpec spec_of(const CpCase& c) {
  ProblemSpec spec = base_spec_of(c);
  spec.batch = c.batch;
  spec.seqlen_q = spec.seqlen_k = c.seqlen;
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

// Every rank's local tensors of case c (CpCase, or VarlenCpCase with its own make_local).
template <typename Case>
std::vector<Local> make_locals(const Case& c, const Problem& pr) {
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

// One rank's forward then backward on its host tensors.
inline Status forward_backward(dist::ContextParallelAttention& cp, Local& l) {
  FLARE_RETURN_IF_ERROR(cp.forward(l.q.view, l.k.view, l.v.view, l.o.view, l.lse.view));
  return cp.backward(l.dout.view, l.q.view, l.k.view, l.v.view, l.o.view, l.lse.view, l.dq.view,
                     l.dk.view, l.dv.view);
}

// Case c's forward and backward on in-process ranks, all at once, rank r with a plan of its own
// on locals[r]; returns each rank's status.
template <typename Case>
std::vector<Status> run_ranks_forward_backward(
    const Case& c, std::vector<std::unique_ptr<dist::Communicator>>& comms,
    std::vector<Local>& locals) {
  return run_ranks(comms, [&](dist::Communicator& comm) -> Status {
    std::unique_ptr<dist::ContextParallelAttention> cp;
    FLARE_RETURN_IF_ERROR(dist::ContextParallelAttention::create(&comm, config_of(c), &cp));
    return forward_backward(*cp, locals[comm.rank()]);
  });
}

// ---- a grid of cases: strategy × rank count × mask ----------------------------------------------

struct CpGridParam {
  dist::Strategy strategy;
  int world;
  bool causal;
};

inline std::vector<CpGridParam> cp_grid(std::initializer_list<dist::Strategy> strategies) {
  std::vector<CpGridParam> g;
  for (dist::Strategy st : strategies)
    for (int world : {2, 3, 4, 8})
      for (bool causal : {false, true}) g.push_back({st, world, causal});
  return g;
}

// A test's name in the grid; GoogleTest names take letters, digits and underscores only.
inline std::string cp_grid_name(const ::testing::TestParamInfo<CpGridParam>& i) {
  std::string name = dist::strategy_name(i.param.strategy);
  if (i.param.strategy == dist::Strategy::kAllToAll) name = "alltoall";
  return name + "_" + std::to_string(i.param.world) + "ranks_" +
         (i.param.causal ? "causal" : "full");
}

// ---- the references of a case, on every core of the host ----------------------------------------
// cpu::reference_forward / reference_backward run on one core and are quadratic in the length: for
// the GPU cases they cost far more than the GPUs do (all four for one result of 2053 causal rows,
// 4 heads of 128: ~14 s on one core). The (batch entry, query head) pairs of a problem are
// independent problems, so here each reference runs as one call per slice of the problem, the
// slices on every core at once, and is put back together. A slice computes its rows exactly as the
// whole call does, and dK/dV are summed over a group's query heads in the order the whole call sums
// them, so the result is the whole call's, bit for bit. The low-precision backward rounds dK/dV
// after that sum, so it is sliced by whole head groups.

// Part of a problem as a problem of its own, and where its rows and heads sit in the whole.
struct RefSlice {
  AttentionParams p;
  int64_t q_row0 = 0, k_row0 = 0;  // first query / key row in the whole problem's packed rows
  int head0 = 0, kv_head0 = 0;     // first query / K/V head in the whole problem
};

inline const void* element_at(const void* base, int64_t index, DType dtype) {
  return base == nullptr ? base
                         : static_cast<const unsigned char*>(base) +
                               index * static_cast<int64_t>(dtype_size(dtype));
}
inline void* element_at(void* base, int64_t index, DType dtype) {
  return base == nullptr
             ? base
             : static_cast<unsigned char*>(base) + index * static_cast<int64_t>(dtype_size(dtype));
}

// Query heads [head0, head0 + heads) of one K/V group, of batch entry b of a fixed-length batch or
// (b = -1) of every sequence of a packed one.
inline RefSlice make_slice(const AttentionParams& p, int b, int head0, int heads) {
  RefSlice s;
  s.p = p;
  s.head0 = head0;
  s.kv_head0 = head0 / p.head_group;
  const int64_t entry = std::max(b, 0);
  auto q_at = [&](int64_t batch_stride, int64_t head_stride) {
    return entry * batch_stride + head0 * head_stride;
  };
  auto k_at = [&](int64_t batch_stride, int64_t head_stride) {
    return entry * batch_stride + s.kv_head0 * head_stride;
  };
  s.p.q = element_at(p.q, q_at(p.q_batch_stride, p.q_head_stride), p.dtype);
  s.p.o = element_at(p.o, q_at(p.o_batch_stride, p.o_head_stride), p.dtype);
  s.p.dout = element_at(p.dout, q_at(p.do_batch_stride, p.do_head_stride), p.dtype);
  s.p.dq = element_at(p.dq, q_at(p.dq_batch_stride, p.dq_head_stride), p.dtype);
  s.p.k = element_at(p.k, k_at(p.k_batch_stride, p.k_head_stride), p.dtype);
  s.p.v = element_at(p.v, k_at(p.v_batch_stride, p.v_head_stride), p.dtype);
  s.p.dk = element_at(p.dk, k_at(p.dk_batch_stride, p.dk_head_stride), p.dtype);
  s.p.dv = element_at(p.dv, k_at(p.dv_batch_stride, p.dv_head_stride), p.dtype);
  if (p.lse != nullptr) s.p.lse = p.lse + q_at(p.lse_batch_stride, p.lse_head_stride);
  s.p.heads_q = heads;
  s.p.heads_kv = 1;
  s.p.head_group = heads;
  if (b >= 0) {
    s.p.batch = 1;
    s.p.total_q = p.seqlen_q;
    s.p.total_k = p.seqlen_k;
    s.q_row0 = int64_t{b} * p.seqlen_q;
    s.k_row0 = int64_t{b} * p.seqlen_k;
  }
  return s;
}

// p's slices: one per query head (whole_groups: per K/V group) and fixed-length batch entry.
// Dropout masks, ALiBi slopes and block masks are indexed by (batch, head), which a slice would
// renumber: a problem with any of them stays whole, as must one with any other input so indexed.
inline std::vector<RefSlice> slices_of(const AttentionParams& p, bool whole_groups) {
  if (p.dropout_p > 0.0f || p.alibi_slopes != nullptr || p.block_mask != nullptr) {
    RefSlice whole;
    whole.p = p;
    return {whole};
  }
  std::vector<RefSlice> slices;
  const int heads = whole_groups ? p.head_group : 1;
  for (int b = 0; b < (p.is_varlen() ? 1 : p.batch); ++b)
    for (int h = 0; h < p.heads_q; h += heads)
      slices.push_back(make_slice(p, p.is_varlen() ? -1 : b, h, heads));
  return slices;
}

// A slice's packed (rows, heads, d) part into the whole's; `add` sums it in (dK, dV), else copies.
inline void put_rows(const std::vector<double>& part, int64_t rows, int heads, int d, int64_t row0,
                     int head0, int all_heads, bool add, std::vector<double>* all) {
  for (int64_t r = 0; r < rows; ++r)
    for (int h = 0; h < heads; ++h)
      for (int c = 0; c < d; ++c) {
        double& x = (*all)[static_cast<size_t>(((row0 + r) * all_heads + head0 + h) * d + c)];
        const double y = part[static_cast<size_t>((r * heads + h) * d + c)];
        x = add ? x + y : y;
      }
}

// One reference of a whole problem, computed slice by slice: the calls to run, then the merge.
template <typename Out>
struct SlicedReference {
  AttentionParams whole;
  std::vector<RefSlice> slices;
  std::vector<Out> parts;

  SlicedReference(const AttentionParams& p, bool whole_groups)
      : whole(p), slices(slices_of(p, whole_groups)), parts(slices.size()) {}
  SlicedReference(const SlicedReference&) = delete;  // its calls write into parts
  SlicedReference& operator=(const SlicedReference&) = delete;

  void add_calls(Out (*reference)(const AttentionParams&, cpu::RefPrecision),
                 cpu::RefPrecision precision, std::vector<std::function<void()>>* calls) {
    for (size_t i = 0; i < slices.size(); ++i)
      calls->push_back(
          [this, i, reference, precision] { parts[i] = reference(slices[i].p, precision); });
  }
  cpu::RefForward merged_forward() const {
    const AttentionParams& p = whole;
    cpu::RefForward out;
    out.o.assign(static_cast<size_t>(p.total_q * p.heads_q * p.head_dim), 0.0);
    out.lse.assign(static_cast<size_t>(p.total_q * p.heads_q), 0.0);
    for (size_t i = 0; i < slices.size(); ++i) {
      const RefSlice& s = slices[i];
      put_rows(parts[i].o, s.p.total_q, s.p.heads_q, p.head_dim, s.q_row0, s.head0, p.heads_q,
               false, &out.o);
      for (int h = 0; h < s.p.heads_q; ++h)
        for (int64_t r = 0; r < s.p.total_q; ++r)
          out.lse[static_cast<size_t>((s.head0 + h) * p.total_q + s.q_row0 + r)] =
              parts[i].lse[static_cast<size_t>(h * s.p.total_q + r)];
    }
    return out;
  }
  // Slices in order of their query heads, so each dK/dV element sums its heads as the whole call
  // does.
  cpu::RefBackward merged_backward() const {
    const AttentionParams& p = whole;
    cpu::RefBackward out;
    out.dq.assign(static_cast<size_t>(p.total_q * p.heads_q * p.head_dim), 0.0);
    out.dk.assign(static_cast<size_t>(p.total_k * p.heads_kv * p.head_dim), 0.0);
    out.dv.assign(out.dk.size(), 0.0);
    for (size_t i = 0; i < slices.size(); ++i) {
      const RefSlice& s = slices[i];
      put_rows(parts[i].dq, s.p.total_q, s.p.heads_q, p.head_dim, s.q_row0, s.head0, p.heads_q,
               false, &out.dq);
      put_rows(parts[i].dk, s.p.total_k, s.p.heads_kv, p.head_dim, s.k_row0, s.kv_head0, p.heads_kv,
               true, &out.dk);
      put_rows(parts[i].dv, s.p.total_k, s.p.heads_kv, p.head_dim, s.k_row0, s.kv_head0, p.heads_kv,
               true, &out.dv);
    }
    return out;
  }
};

// Runs every call once, as many at a time as the host has cores, in the order given.
inline void run_on_all_cores(const std::vector<std::function<void()>>& calls) {
  std::atomic<size_t> next{0};
  const size_t workers =
      std::clamp<size_t>(std::thread::hardware_concurrency(), 1, std::max<size_t>(calls.size(), 1));
  std::vector<std::thread> threads;
  for (size_t w = 0; w < workers; ++w)
    threads.emplace_back([&] {
      for (size_t i = next++; i < calls.size(); i = next++) calls[i]();
    });
  for (std::thread& t : threads) t.join();
}

inline bool same_inputs(const Problem& a, const Problem& b) {
  return a.spec.describe() == b.spec.describe() && a.q.bytes == b.q.bytes &&
         a.k.bytes == b.k.bytes && a.v.bytes == b.v.bytes && a.dout.bytes == b.dout.bytes &&
         a.cu_q.bytes == b.cu_q.bytes && a.cu_k.bytes == b.cu_k.bytes;
}

// One result to check: a name for the failure messages and the problem holding its outputs.
struct CheckedResult {
  std::string name;
  const Problem* pr;
};

// Each result — problems of the same inputs, outputs of different runs — against the float64
// reference of those inputs under the tolerance rule: O and LSE against its forward, dQ, dK and dV
// against its backward. The float64 references and the low-precision forward read no output and
// are computed once for all results; each result's gradient budget comes from the low-precision
// backward of its own O and LSE (as a fast backward reads them).
inline void expect_all_match_reference(const std::vector<CheckedResult>& results) {
  ASSERT_FALSE(results.empty());
  const Problem& inputs = *results.front().pr;
  for (const CheckedResult& r : results)
    ASSERT_TRUE(same_inputs(inputs, *r.pr))
        << r.name << ": not the inputs of " << results.front().name;
  const AttentionParams fp = inputs.forward_params();
  SlicedReference<cpu::RefForward> forward(fp, false), naive_forward(fp, false);
  SlicedReference<cpu::RefBackward> backward(inputs.backward_params(), false);
  // The naive backward of each result in both summation orders (test_util.h: NaiveBackward).
  std::vector<std::unique_ptr<SlicedReference<cpu::RefBackward>>> naive_in_order, naive_reversed;
  for (const CheckedResult& r : results) {
    naive_in_order.push_back(
        std::make_unique<SlicedReference<cpu::RefBackward>>(r.pr->backward_params(), true));
    naive_reversed.push_back(
        std::make_unique<SlicedReference<cpu::RefBackward>>(r.pr->backward_params(), true));
  }
  std::vector<std::function<void()>> calls;  // the longest first
  for (size_t i = 0; i < results.size(); ++i) {
    naive_in_order[i]->add_calls(cpu::reference_backward, cpu::RefPrecision::kLowPrecision, &calls);
    naive_reversed[i]->add_calls(cpu::reference_backward, cpu::RefPrecision::kLowPrecisionReversed,
                                 &calls);
  }
  backward.add_calls(cpu::reference_backward, cpu::RefPrecision::kFloat64, &calls);
  forward.add_calls(cpu::reference_forward, cpu::RefPrecision::kFloat64, &calls);
  naive_forward.add_calls(cpu::reference_forward, cpu::RefPrecision::kLowPrecision, &calls);
  run_on_all_cores(calls);
  const cpu::RefForward ref_forward = forward.merged_forward();
  const cpu::RefForward ref_naive_forward = naive_forward.merged_forward();
  const cpu::RefBackward ref_backward = backward.merged_backward();
  for (size_t i = 0; i < results.size(); ++i) {
    SCOPED_TRACE(results[i].name);
    const Problem& pr = *results[i].pr;
    expect_forward_matches(pr, ref_forward, ref_naive_forward);
    expect_gradients_match(pr, naive_in_order[i]->whole, ref_backward,
                           {naive_in_order[i]->merged_backward(),
                            naive_reversed[i]->merged_backward()});
  }
}

inline void expect_matches_reference(const Problem& pr) {
  expect_all_match_reference({{"against the float64 reference", &pr}});
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
