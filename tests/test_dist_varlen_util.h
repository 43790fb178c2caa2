// test_dist_varlen_util.h — one packed variable-length context-parallel case, shared by the CPU
// tests (test_dist_varlen.cpp) and the GPU ones (test_dist_gpu_attention.cpp): the config, the
// global packed problem, and each rank's pack of it (shard_varlen / unshard_varlen).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "flare/dist.h"
#include "test_dist_util.h"
#include "test_util.h"

namespace flare::test {

struct VarlenCpCase : CpCaseBase {
  std::vector<int> seqlens = {9, 0, 14};
};

inline std::string describe(const VarlenCpCase& c) {
  std::string lens;
  for (size_t i = 0; i < c.seqlens.size(); ++i) {
    if (i > 0) lens += ",";
    lens += std::to_string(c.seqlens[i]);
  }
  return std::string(dist::strategy_name(c.strategy)) + " world=" + std::to_string(c.world) +
         " seqlens=[" + lens + "] causal=" + std::to_string(c.causal) +
         " h=" + std::to_string(c.heads_q) + "/" + std::to_string(c.heads_kv) +
         " d=" + std::to_string(c.head_dim) + " " + dtype_name(c.dtype) + " window=(" +
         std::to_string(c.window_left) + "," + std::to_string(c.window_right) + ")";
}

inline std::vector<int32_t> cu_seqlens_of(const VarlenCpCase& c) {
  std::vector<int32_t> cu = {0};
  for (int len : c.seqlens) cu.push_back(cu.back() + len);
  return cu;
}

// batch and seqlen left 0: the plan takes them from cu_seqlens.
inline dist::ContextParallelConfig config_of(const VarlenCpCase& c) {
  dist::ContextParallelConfig cfg = base_config_of(c);
  cfg.cu_seqlens = cu_seqlens_of(c);
  return cfg;
}

inline ProblemSpec spec_of(const VarlenCpCase& c) {
  ProblemSpec spec = base_spec_of(c);
  spec.batch = static_cast<int>(c.seqlens.size());
  spec.varlen_q = spec.varlen_k = c.seqlens;
  return spec;
}

// One rank's pack: inputs sharded from the problem, outputs poisoned.
inline Local make_local(const VarlenCpCase& c, const Problem& pr, int rank) {
  const std::vector<int32_t> cu = cu_seqlens_of(c);
  dist::VarlenShard sh;
  EXPECT_TRUE(dist::varlen_shard(c.strategy, cu, c.world, rank, &sh).ok());
  const int64_t s = sh.length;
  auto qlike = [&] { return HostTensor::make(c.dtype, {s, c.heads_q, c.head_dim}); };
  auto kvlike = [&] { return HostTensor::make(c.dtype, {s, c.heads_kv, c.head_dim}); };
  Local l{qlike(), kvlike(), kvlike(), qlike(), HostTensor::make(DType::kFloat32, {c.heads_q, s}),
          qlike(), qlike(), kvlike(), kvlike()};
  for (auto [full, local] : {std::pair{&pr.q, &l.q}, {&pr.k, &l.k}, {&pr.v, &l.v}, {&pr.dout, &l.dout}}) {
    const Status st = dist::shard_varlen(full->view, 0, c.strategy, cu, c.world, rank, local->view);
    EXPECT_TRUE(st.ok()) << st.to_string();
  }
  for (HostTensor* t : {&l.o, &l.lse, &l.dq, &l.dk, &l.dv}) t->poison();
  return l;
}

// Every rank's outputs back into the problem's packed o, lse, dq, dk and dv.
inline void gather_outputs(const VarlenCpCase& c, const std::vector<Local>& locals, Problem* pr) {
  const std::vector<int32_t> cu = cu_seqlens_of(c);
  for (int r = 0; r < c.world; ++r) {
    const Local& l = locals[r];
    for (auto [local, full, dim] : {std::tuple{&l.o, &pr->o, 0}, {&l.lse, &pr->lse, 1}, {&l.dq, &pr->dq, 0},
                                    {&l.dk, &pr->dk, 0}, {&l.dv, &pr->dv, 0}}) {
      const Status st = dist::unshard_varlen(local->view, dim, c.strategy, cu, c.world, r, full->view);
      ASSERT_TRUE(st.ok()) << st.to_string();
    }
  }
}

}  // namespace flare::test
