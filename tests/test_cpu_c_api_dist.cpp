// test_cpu_c_api_dist.cpp — the extern "C" mirror of flare/dist.h on in-process ranks (threads):
// it must compute exactly what the C++ API computes, byte for byte; report a rejected call as a
// status code plus a per-thread message naming the argument, writing nothing; and bound a missing
// peer by the timeout. c_api_from_c.c, compiled as C, drives one rank's forward and backward.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "flare/c_api.h"
#include "flare/dist.h"
#include "test_c_api_util.h"
#include "test_dist_util.h"
#include "test_dist_varlen_util.h"
#include "test_util.h"

extern "C" int flare_c_cp_rank(flare_comm* comm, int32_t strategy, int32_t causal, int64_t seqlen,
                               const int64_t* local_shape, int32_t heads_kv, void* q, void* k,
                               void* v, void* o, void* lse, void* dout, void* dq, void* dk,
                               void* dv);

namespace flare::test {
namespace {

using test::to_c;  // test_c_api_util.h's, overloaded below for this file's structs

// The C enums and structs mirror dist.h by value and size; bindings rely on it.
static_assert(FLARE_CP_RING == static_cast<int>(dist::Strategy::kRing));
static_assert(FLARE_CP_ZIGZAG == static_cast<int>(dist::Strategy::kZigzag));
static_assert(FLARE_CP_ALL_TO_ALL == static_cast<int>(dist::Strategy::kAllToAll));
static_assert(sizeof(flare_nccl_id) == sizeof(dist::NcclId));

constexpr int kTimeoutMs = 60000;  // a correct run never waits for it
using Clock = std::chrono::steady_clock;

flare_cp_config to_c(const dist::ContextParallelConfig& cfg) {
  flare_cp_config c = flare_default_cp_config();
  c.strategy = static_cast<int32_t>(cfg.strategy);
  c.batch = cfg.batch;
  c.seqlen = cfg.seqlen;
  c.heads_q = cfg.heads_q;
  c.heads_kv = cfg.heads_kv;
  c.head_dim = cfg.head_dim;
  c.dtype = static_cast<int32_t>(cfg.dtype);
  c.attention.causal = cfg.attention.causal;
  c.attention.softcap = cfg.attention.softcap;
  c.attention.softmax_scale = cfg.attention.softmax_scale;
  c.attention.window_left = cfg.attention.window_left;
  c.attention.window_right = cfg.attention.window_right;
  c.attention.deterministic = cfg.attention.deterministic;
  // A packed plan's offsets stay in cfg, which must outlive the C config.
  c.cu_seqlens = cfg.cu_seqlens.empty() ? nullptr : cfg.cu_seqlens.data();
  c.num_cu_seqlens = static_cast<int32_t>(cfg.cu_seqlens.size());
  return c;
}

// `size` C handles of one in-process group, destroyed with the object.
struct CGroup {
  std::vector<flare_comm*> comms;
  CGroup(int size, int timeout_ms) : comms(static_cast<size_t>(size), nullptr) {
    EXPECT_EQ(flare_comm_create_in_process_group(size, timeout_ms, comms.data()), FLARE_OK)
        << flare_last_error();
  }
  ~CGroup() {
    for (flare_comm* c : comms) flare_comm_destroy(c);
  }
  CGroup(const CGroup&) = delete;
  CGroup& operator=(const CGroup&) = delete;
};

// Runs fn(rank) on one thread per rank; returns each rank's code and last error message.
struct RankResult {
  int code = FLARE_OK;
  std::string error;
};
std::vector<RankResult> run_c_ranks(int world, const std::function<int(int)>& fn) {
  std::vector<RankResult> out(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      out[r].code = fn(r);
      out[r].error = flare_last_error();
    });
  for (std::thread& t : threads) t.join();
  return out;
}

void expect_error(const RankResult& r, int code, const std::string& prefix,
                  const std::string& rule) {
  EXPECT_EQ(r.code, code) << r.error;
  EXPECT_EQ(r.error.rfind(prefix, 0), 0u) << r.error;
  EXPECT_NE(r.error.find(rule), std::string::npos) << r.error;
}

void expect_last_error(const std::string& prefix, const std::string& rule) {
  const std::string message = flare_last_error();
  EXPECT_EQ(message.rfind(prefix, 0), 0u) << message;
  EXPECT_NE(message.find(rule), std::string::npos) << message;
}

// One rank's forward and backward through the C API on its Local tensors.
int c_forward_backward(flare_comm* comm, const flare_cp_config& config, Local& l,
                       flare_cp_timing* timing = nullptr) {
  flare_cp* cp = nullptr;
  int code = flare_cp_create(comm, &config, &cp);
  if (code != FLARE_OK) return code;
  const flare_tensor q = to_c(l.q.view), k = to_c(l.k.view), v = to_c(l.v.view), o = to_c(l.o.view),
                     lse = to_c(l.lse.view), dout = to_c(l.dout.view), dq = to_c(l.dq.view),
                     dk = to_c(l.dk.view), dv = to_c(l.dv.view);
  if (timing != nullptr) code = flare_cp_set_timing(cp, 1);
  if (code == FLARE_OK) code = flare_cp_forward(cp, &q, &k, &v, &o, &lse, nullptr);
  if (code == FLARE_OK)
    code = flare_cp_backward(cp, &dout, &q, &k, &v, &o, &lse, &dq, &dk, &dv, nullptr);
  if (code == FLARE_OK && timing != nullptr) code = flare_cp_take_timing(cp, timing);
  flare_cp_destroy(cp);
  return code;
}

// The same case through the C++ API, on a group of its own.
std::vector<Local> cpp_locals(const CpCase& c, const Problem& pr) {
  std::vector<Local> locals = make_locals(c, pr);
  auto comms = in_process_group(c.world, kTimeoutMs);
  const std::vector<Status> st = run_ranks_forward_backward(c, comms, locals);
  for (int r = 0; r < c.world; ++r)
    EXPECT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r].to_string();
  return locals;
}

::testing::AssertionResult same_outputs(const std::vector<Local>& a, const std::vector<Local>& b) {
  for (size_t r = 0; r < a.size(); ++r) {
    const char* names[] = {"o", "lse", "dq", "dk", "dv"};
    const HostTensor* ta[] = {&a[r].o, &a[r].lse, &a[r].dq, &a[r].dk, &a[r].dv};
    const HostTensor* tb[] = {&b[r].o, &b[r].lse, &b[r].dq, &b[r].dk, &b[r].dv};
    for (int i = 0; i < 5; ++i)
      if (ta[i]->bytes != tb[i]->bytes)
        return ::testing::AssertionFailure()
               << names[i] << " of rank " << r << " differs between the C and C++ APIs";
  }
  return ::testing::AssertionSuccess();
}

void fill_sentinel(Local& l) {
  for (HostTensor* t : {&l.o, &l.lse, &l.dq, &l.dk, &l.dv}) fill_with_sentinel(t);
}

::testing::AssertionResult untouched(const Local& l) {
  for (const HostTensor* t : {&l.o, &l.lse, &l.dq, &l.dk, &l.dv})
    if (!holds_only_sentinel(*t))
      return ::testing::AssertionFailure() << "an output was written by a rejected call";
  return ::testing::AssertionSuccess();
}

// ---- results --------------------------------------------------------------------------------

TEST(CApiDist, ForwardBackwardMatchCppApiByteForByte) {
  for (dist::Strategy st :
       {dist::Strategy::kRing, dist::Strategy::kZigzag, dist::Strategy::kAllToAll}) {
    for (int world : {2, 3}) {
      CpCase c;
      c.world = world;
      c.seqlen = 5 * world + 2;  // not divisible by the ranks: uneven shards
      c.softcap = 4.0f;
      c = with_strategy(c, st);
      SCOPED_TRACE(describe(c));
      const Problem pr = problem_of(c);
      const std::vector<Local> expected = cpp_locals(c, pr);
      std::vector<Local> locals = make_locals(c, pr);
      CGroup group(world, kTimeoutMs);
      const flare_cp_config config = to_c(config_of(c));
      const auto res = run_c_ranks(
          world, [&](int r) { return c_forward_backward(group.comms[r], config, locals[r]); });
      for (int r = 0; r < world; ++r) ASSERT_EQ(res[r].code, FLARE_OK) << res[r].error;
      EXPECT_TRUE(same_outputs(locals, expected));
    }
  }
}

// Packed batches through the C API (config.cu_seqlens): the C++ API's bytes under every strategy,
// and the packed shard helpers' rows.
TEST(CApiDist, PackedBatchesMatchCppApiByteForByte) {
  for (dist::Strategy st :
       {dist::Strategy::kRing, dist::Strategy::kZigzag, dist::Strategy::kAllToAll}) {
    VarlenCpCase c;
    c.strategy = st;
    c.world = 2;
    c.seqlens = {9, 0, 14, 1};
    SCOPED_TRACE(describe(c));
    Problem pr = make_problem(spec_of(c));
    std::vector<Local> expected = make_locals(c, pr);
    {
      auto comms = in_process_group(c.world, kTimeoutMs);
      const std::vector<Status> s = run_ranks_forward_backward(c, comms, expected);
      for (int r = 0; r < c.world; ++r) ASSERT_TRUE(s[r].ok()) << s[r].to_string();
    }
    std::vector<Local> locals = make_locals(c, pr);
    CGroup group(c.world, kTimeoutMs);
    const dist::ContextParallelConfig cfg = config_of(c);
    const flare_cp_config config = to_c(cfg);
    const auto res = run_c_ranks(
        c.world, [&](int r) { return c_forward_backward(group.comms[r], config, locals[r]); });
    for (int r = 0; r < c.world; ++r) ASSERT_EQ(res[r].code, FLARE_OK) << res[r].error;
    EXPECT_TRUE(same_outputs(locals, expected));

    // flare_shard_varlen gives each rank the rows make_local took through the C++ helper, and
    // flare_unshard_varlen puts them back.
    const std::vector<int32_t> cu = cu_seqlens_of(c);
    HostTensor back = HostTensor::make(
        pr.q.view.dtype, {pr.q.view.shape[0], pr.q.view.shape[1], pr.q.view.shape[2]});
    back.poison();
    for (int r = 0; r < c.world; ++r) {
      const TensorView& want = expected[r].q.view;
      HostTensor mine = HostTensor::make(want.dtype, {want.shape[0], want.shape[1], want.shape[2]});
      mine.poison();
      const flare_tensor full = to_c(pr.q.view), local = to_c(mine.view), into = to_c(back.view);
      ASSERT_EQ(flare_shard_varlen(&full, 0, static_cast<int32_t>(st), cu.data(),
                                   static_cast<int32_t>(cu.size()), c.world, r, &local),
                FLARE_OK)
          << flare_last_error();
      EXPECT_EQ(mine.bytes, expected[r].q.bytes) << "rank " << r;
      ASSERT_EQ(flare_unshard_varlen(&local, 0, static_cast<int32_t>(st), cu.data(),
                                     static_cast<int32_t>(cu.size()), c.world, r, &into),
                FLARE_OK)
          << flare_last_error();
    }
    EXPECT_EQ(back.bytes, pr.q.bytes);
  }
  // Offsets named when they cannot be read.
  CGroup one(1, kTimeoutMs);
  flare_cp_config config = to_c(config_of(VarlenCpCase{}));
  config.cu_seqlens = nullptr;
  config.num_cu_seqlens = 3;
  flare_cp* cp = nullptr;
  EXPECT_EQ(flare_cp_create(one.comms[0], &config, &cp), FLARE_INVALID_ARGUMENT);
  expect_last_error("config.cu_seqlens", "pass both or neither");
  const int32_t cu[] = {0, 4};
  config.cu_seqlens = cu;
  config.num_cu_seqlens = -1;
  EXPECT_EQ(flare_cp_create(one.comms[0], &config, &cp), FLARE_INVALID_ARGUMENT);
  expect_last_error("config.num_cu_seqlens", "must be >= 0");
}

TEST(CApiDist, MatchesSingleDeviceReference) {
  // The C path end to end against the float64 reference, not only against the C++ API.
  CpCase c;
  c.world = 3;
  c.seqlen = 19;
  Problem pr = problem_of(c);
  std::vector<Local> locals = make_locals(c, pr);
  CGroup group(c.world, kTimeoutMs);
  const flare_cp_config config = to_c(config_of(c));
  const auto res = run_c_ranks(
      c.world, [&](int r) { return c_forward_backward(group.comms[r], config, locals[r]); });
  for (int r = 0; r < c.world; ++r) ASSERT_EQ(res[r].code, FLARE_OK) << res[r].error;
  gather_outputs(c, locals, &pr);
  expect_matches_reference(pr);
}

TEST(CApiDist, HeaderCompilesAsC) {
  // flare_c_cp_rank lives in a C translation unit: its results must be the C++ API's.
  CpCase c;
  c.world = 2;
  c.seqlen = 13;
  c.causal = true;
  const Problem pr = problem_of(c);
  const std::vector<Local> expected = cpp_locals(c, pr);
  std::vector<Local> locals = make_locals(c, pr);
  CGroup group(c.world, kTimeoutMs);
  const auto res = run_c_ranks(c.world, [&](int r) {
    Local& l = locals[r];
    const int64_t shape[4] = {l.q.view.shape[0], l.q.view.shape[1], l.q.view.shape[2],
                              l.q.view.shape[3]};
    return flare_c_cp_rank(group.comms[r], FLARE_CP_ZIGZAG, 1, c.seqlen, shape, c.heads_kv,
                           l.q.view.data, l.k.view.data, l.v.view.data, l.o.view.data,
                           l.lse.view.data, l.dout.view.data, l.dq.view.data, l.dk.view.data,
                           l.dv.view.data);
  });
  for (int r = 0; r < c.world; ++r) ASSERT_EQ(res[r].code, FLARE_OK) << res[r].error;
  EXPECT_TRUE(same_outputs(locals, expected));
}

TEST(CApiDist, TimingCountsTheRingsTraffic) {
  CpCase c;
  c.world = 3;
  c.seqlen = 17;
  Problem pr = problem_of(c);
  std::vector<Local> locals = make_locals(c, pr);
  CGroup group(c.world, kTimeoutMs);
  const flare_cp_config config = to_c(config_of(c));
  std::vector<flare_cp_timing> timing(static_cast<size_t>(c.world));
  const auto res = run_c_ranks(c.world, [&](int r) {
    return c_forward_backward(group.comms[r], config, locals[r], &timing[r]);
  });
  for (int r = 0; r < c.world; ++r) {
    ASSERT_EQ(res[r].code, FLARE_OK) << res[r].error;
    const RingTraffic want = expected_ring_traffic(c, r);
    EXPECT_EQ(timing[r].calls, 2);
    EXPECT_EQ(timing[r].exchanges, want.exchanges);
    EXPECT_EQ(timing[r].bytes_sent, want.bytes);
  }
}

// ---- layout ---------------------------------------------------------------------------------

TEST(CApiDist, SequenceShardMatchesCpp) {
  for (int32_t strategy : {FLARE_CP_RING, FLARE_CP_ZIGZAG, FLARE_CP_ALL_TO_ALL})
    for (int world : {1, 2, 3, 8})
      for (int64_t s : {int64_t{0}, int64_t{5}, int64_t{37}})
        for (int r = 0; r < world; ++r) {
          flare_sequence_shard c;
          dist::SequenceShard cpp;
          ASSERT_EQ(flare_get_sequence_shard(strategy, s, world, r, &c), FLARE_OK);
          ASSERT_TRUE(
              dist::sequence_shard(static_cast<dist::Strategy>(strategy), s, world, r, &cpp).ok());
          EXPECT_EQ(c.count, cpp.count);
          EXPECT_EQ(c.length, cpp.length);
          for (int i = 0; i < cpp.count; ++i) {
            EXPECT_EQ(c.chunk[i].global_begin, cpp.chunk[i].global_begin);
            EXPECT_EQ(c.chunk[i].local_begin, cpp.chunk[i].local_begin);
            EXPECT_EQ(c.chunk[i].length, cpp.chunk[i].length);
          }
        }
  flare_sequence_shard shard;
  EXPECT_EQ(flare_get_sequence_shard(7, 10, 2, 0, &shard), FLARE_INVALID_ARGUMENT);
  expect_last_error("strategy:", "unknown value 7");
  EXPECT_EQ(flare_get_sequence_shard(FLARE_CP_RING, 10, 2, 2, &shard), FLARE_INVALID_ARGUMENT);
  expect_last_error("rank:", "must be in [0, 2)");
  EXPECT_EQ(flare_get_sequence_shard(FLARE_CP_RING, 10, 2, 0, nullptr), FLARE_INVALID_ARGUMENT);
  expect_last_error("shard:", "is null");
}

TEST(CApiDist, ShardUnshardRoundTrip) {
  const int world = 3;
  const int64_t s = 11;
  HostTensor full = HostTensor::make(DType::kFloat32, {2, s, 2, 3});
  for (size_t i = 0; i < full.bytes.size(); ++i) full.bytes[i] = static_cast<unsigned char>(i * 7);
  HostTensor back = HostTensor::make(DType::kFloat32, {2, s, 2, 3});
  const flare_tensor cfull = to_c(full.view), cback = to_c(back.view);
  for (int r = 0; r < world; ++r) {
    dist::SequenceShard sh;
    ASSERT_TRUE(dist::sequence_shard(dist::Strategy::kZigzag, s, world, r, &sh).ok());
    HostTensor c_local = HostTensor::make(DType::kFloat32, {2, sh.length, 2, 3});
    HostTensor cpp_local = HostTensor::make(DType::kFloat32, {2, sh.length, 2, 3});
    const flare_tensor clocal = to_c(c_local.view);
    ASSERT_EQ(flare_shard_sequence(&cfull, 1, FLARE_CP_ZIGZAG, world, r, &clocal), FLARE_OK)
        << flare_last_error();
    ASSERT_TRUE(
        dist::shard_sequence(full.view, 1, dist::Strategy::kZigzag, world, r, cpp_local.view).ok());
    EXPECT_EQ(c_local.bytes, cpp_local.bytes);
    ASSERT_EQ(flare_unshard_sequence(&clocal, 1, FLARE_CP_ZIGZAG, world, r, &cback), FLARE_OK)
        << flare_last_error();
  }
  EXPECT_EQ(back.bytes, full.bytes);

  flare_tensor bad = cfull;
  bad.ndim = 9;
  EXPECT_EQ(flare_shard_sequence(&bad, 1, FLARE_CP_ZIGZAG, world, 0, &cback),
            FLARE_INVALID_ARGUMENT);
  expect_last_error("full:", "ndim = 9 must be in [0, 4]");
  EXPECT_EQ(flare_unshard_sequence(&bad, 1, FLARE_CP_ZIGZAG, world, 0, &cback),
            FLARE_INVALID_ARGUMENT);
  expect_last_error("local:", "ndim = 9 must be in [0, 4]");
}

// ---- communicators ----------------------------------------------------------------------------

TEST(CApiDist, InProcessGroupInfoAndDefaults) {
  CGroup group(3, 0);  // 0: the default timeout
  for (int r = 0; r < 3; ++r) {
    flare_comm_info info;
    ASSERT_EQ(flare_comm_get_info(group.comms[r], &info), FLARE_OK) << flare_last_error();
    EXPECT_EQ(info.rank, r);
    EXPECT_EQ(info.size, 3);
    EXPECT_EQ(info.device, FLARE_CPU);
    EXPECT_EQ(info.timeout_ms, dist::CommOptions{}.timeout_ms);
    EXPECT_STREQ(info.kind, "in-process");
  }
  const auto res = run_c_ranks(3, [&](int r) {
    const int code = flare_comm_barrier(group.comms[r]);
    return code != FLARE_OK ? code : flare_comm_health(group.comms[r]);
  });
  for (const RankResult& r : res) EXPECT_EQ(r.code, FLARE_OK) << r.error;

  const flare_cp_config defaults = flare_default_cp_config();
  const dist::ContextParallelConfig cpp;
  EXPECT_EQ(defaults.strategy, static_cast<int>(cpp.strategy));
  EXPECT_EQ(defaults.dtype, static_cast<int>(cpp.dtype));
  EXPECT_EQ(defaults.attention.window_left, -1);
  EXPECT_EQ(defaults.attention.window_right, -1);
  EXPECT_EQ(defaults.batch, 0);
  EXPECT_EQ(defaults.seqlen, 0);
}

TEST(CApiDist, BadHandlesAndArgumentsNamed) {
  flare_comm* comms[2] = {nullptr, nullptr};
  EXPECT_EQ(flare_comm_create_in_process_group(2, -5, comms), FLARE_INVALID_ARGUMENT);
  expect_last_error("timeout_ms:", "-5 must be >= 0 (0 = the default");
  EXPECT_EQ(flare_comm_create_in_process_group(0, 100, comms), FLARE_INVALID_ARGUMENT);
  EXPECT_EQ(comms[0], nullptr);  // nothing written on failure
  EXPECT_EQ(flare_comm_create_in_process_group(2, 100, nullptr), FLARE_INVALID_ARGUMENT);
  expect_last_error("comms:", "is null");

  flare_comm_info info;
  EXPECT_EQ(flare_comm_get_info(nullptr, &info), FLARE_INVALID_ARGUMENT);
  expect_last_error("comm:", "handle is null");
  EXPECT_EQ(flare_comm_barrier(nullptr), FLARE_INVALID_ARGUMENT);
  expect_last_error("comm:", "handle is null");
  EXPECT_EQ(flare_comm_health(nullptr), FLARE_INVALID_ARGUMENT);
  expect_last_error("comm:", "handle is null");

  const flare_cp_config config = flare_default_cp_config();
  flare_cp* cp = nullptr;
  EXPECT_EQ(flare_cp_create(nullptr, &config, &cp), FLARE_INVALID_ARGUMENT);
  expect_last_error("comm:", "handle is null");
  CGroup one(1, 1000);
  EXPECT_EQ(flare_cp_create(one.comms[0], nullptr, &cp), FLARE_INVALID_ARGUMENT);
  expect_last_error("config:", "is null");
  EXPECT_EQ(flare_cp_create(one.comms[0], &config, nullptr), FLARE_INVALID_ARGUMENT);
  expect_last_error("cp:", "is null");
  // The defaults leave the sizes to the caller: the library names the first one missing.
  EXPECT_EQ(flare_cp_create(one.comms[0], &config, &cp), FLARE_INVALID_ARGUMENT);
  expect_last_error("config.batch:", "must be >= 1");
  EXPECT_EQ(cp, nullptr);
  flare_cp_config bad_ndim = config;
  bad_ndim.attention.alibi_slopes.ndim = 6;
  EXPECT_EQ(flare_cp_create(one.comms[0], &bad_ndim, &cp), FLARE_INVALID_ARGUMENT);
  expect_last_error("alibi_slopes:", "ndim = 6");

  flare_tensor t{};
  EXPECT_EQ(flare_cp_forward(nullptr, &t, &t, &t, &t, &t, nullptr), FLARE_INVALID_ARGUMENT);
  expect_last_error("cp:", "handle is null");
  EXPECT_EQ(flare_cp_backward(nullptr, &t, &t, &t, &t, &t, &t, &t, &t, &t, nullptr),
            FLARE_INVALID_ARGUMENT);
  expect_last_error("cp:", "handle is null");
  flare_sequence_shard shard;
  EXPECT_EQ(flare_cp_get_shard(nullptr, &shard), FLARE_INVALID_ARGUMENT);
  expect_last_error("cp:", "handle is null");
  EXPECT_EQ(flare_cp_set_timing(nullptr, 1), FLARE_INVALID_ARGUMENT);
  flare_cp_timing timing;
  EXPECT_EQ(flare_cp_take_timing(nullptr, &timing), FLARE_INVALID_ARGUMENT);
  expect_last_error("cp:", "handle is null");
  flare_comm_destroy(nullptr);  // both ignore null, as free() does
  flare_cp_destroy(nullptr);
}

TEST(CApiDist, RejectedCallNamesTheTensorAndWritesNothing) {
  // Every rank passes a q of the wrong length: each rejects its own call before communicating.
  CpCase c;
  c.world = 2;
  c.seqlen = 12;
  const Problem pr = problem_of(c);
  std::vector<Local> locals = make_locals(c, pr);
  for (Local& l : locals) fill_sentinel(l);
  CGroup group(c.world, kTimeoutMs);
  const flare_cp_config config = to_c(config_of(c));
  const auto res = run_c_ranks(c.world, [&](int r) {
    flare_cp* cp = nullptr;
    int code = flare_cp_create(group.comms[r], &config, &cp);
    if (code != FLARE_OK) return code;
    Local& l = locals[r];
    flare_tensor q = to_c(l.q.view);
    q.shape[1] -= 1;
    const flare_tensor k = to_c(l.k.view), v = to_c(l.v.view), o = to_c(l.o.view),
                       lse = to_c(l.lse.view);
    code = flare_cp_forward(cp, &q, &k, &v, &o, &lse, nullptr);
    flare_cp_destroy(cp);
    return code;
  });
  for (int r = 0; r < c.world; ++r) {
    expect_error(res[r], FLARE_INVALID_ARGUMENT, "q:", "must be");
    EXPECT_TRUE(untouched(locals[r]));
  }
}

TEST(CApiDist, ConfigsThatDisagreeFailOnEveryRank) {
  CGroup group(2, kTimeoutMs);
  const auto res = run_c_ranks(2, [&](int r) {
    flare_cp_config config = flare_default_cp_config();
    config.batch = 1;
    config.seqlen = r == 0 ? 16 : 18;
    config.heads_q = config.heads_kv = 2;
    config.head_dim = 8;
    config.dtype = FLARE_FLOAT32;
    flare_cp* cp = nullptr;
    const int code = flare_cp_create(group.comms[r], &config, &cp);
    flare_cp_destroy(cp);
    return code;
  });
  for (const RankResult& r : res) expect_error(r, FLARE_INVALID_ARGUMENT, "config:", "seqlen");
}

TEST(CApiDist, MissingPeerFailsWithinTheTimeout) {
  // Rank 1 never joins: rank 0's collective create fails at the timeout naming it, and the
  // communicator stays failed (health reports the same error).
  constexpr int kShortMs = 300;
  CGroup group(2, kShortMs);
  flare_cp_config config = flare_default_cp_config();
  config.batch = 1;
  config.seqlen = 8;
  config.heads_q = config.heads_kv = 1;
  config.head_dim = 8;
  config.dtype = FLARE_FLOAT32;
  flare_cp* cp = nullptr;
  const auto t0 = Clock::now();
  EXPECT_EQ(flare_cp_create(group.comms[0], &config, &cp), FLARE_DEVICE_ERROR);
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  const std::string message = flare_last_error();
  EXPECT_NE(message.find("rank 1"), std::string::npos) << message;
  EXPECT_NE(message.find("300 ms"), std::string::npos) << message;
  EXPECT_GE(ms, kShortMs * 0.9);
  EXPECT_LT(ms, kShortMs * 10.0);
  EXPECT_EQ(cp, nullptr);
  EXPECT_EQ(flare_comm_health(group.comms[0]), FLARE_DEVICE_ERROR);
  EXPECT_EQ(std::string(flare_last_error()), message);
}

// ---- NCCL and the launch environment ------------------------------------------------------------

TEST(CApiDist, NcclEntryPointsWithoutNccl) {
  EXPECT_EQ(flare_nccl_built() != 0, dist::nccl_built());
  flare_comm* comm = nullptr;
  EXPECT_EQ(flare_comm_adopt_nccl(nullptr, 0, 0, &comm), FLARE_INVALID_ARGUMENT);
  expect_last_error("nccl_comm:", "is null");
  EXPECT_EQ(flare_nccl_unique_id(nullptr), FLARE_INVALID_ARGUMENT);
  expect_last_error("id:", "is null");
  EXPECT_EQ(flare_comm_create_nccl(nullptr, 0, 1, 0, 0, &comm), FLARE_INVALID_ARGUMENT);
  expect_last_error("id:", "is null");
  if (flare_nccl_built()) GTEST_SKIP() << "this build has NCCL; the GPU tests cover it";
  flare_nccl_id id;
  EXPECT_EQ(flare_nccl_unique_id(&id), FLARE_UNSUPPORTED);
  expect_last_error("NCCL communicator:", "no NCCL");
  EXPECT_EQ(flare_comm_create_nccl(&id, 0, 2, 0, 0, &comm), FLARE_UNSUPPORTED);
  int dummy = 0;
  EXPECT_EQ(flare_comm_adopt_nccl(&dummy, 0, 0, &comm), FLARE_UNSUPPORTED);
  EXPECT_EQ(flare_comm_create_nccl_from_env(0, &comm, nullptr), FLARE_UNSUPPORTED);
  EXPECT_EQ(comm, nullptr);
}

TEST(CApiDist, LaunchInfoFromEnv) {
  ScopedEnv env;
  clear_launch(env);
  env.set("RANK", "3");
  env.set("WORLD_SIZE", "4");
  env.set("LOCAL_RANK", "1");
  env.set("MASTER_ADDR", "10.1.2.3");
  env.set("MASTER_PORT", "1234");
  flare_launch_info info;
  ASSERT_EQ(flare_launch_info_from_env(&info), FLARE_OK) << flare_last_error();
  EXPECT_EQ(info.rank, 3);
  EXPECT_EQ(info.size, 4);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.master_port, 1234);
  EXPECT_STREQ(info.master_addr, "10.1.2.3");
  EXPECT_STREQ(info.source, "torchrun");
  const std::string long_host(300, 'a');
  env.set("MASTER_ADDR", long_host.c_str());
  EXPECT_EQ(flare_launch_info_from_env(&info), FLARE_INVALID_ARGUMENT);
  expect_last_error("MASTER_ADDR:", "longer than 255 characters");
  EXPECT_STREQ(info.master_addr, "10.1.2.3");  // nothing written on failure
  env.set("RANK", "4");
  EXPECT_EQ(flare_launch_info_from_env(&info), FLARE_INVALID_ARGUMENT);
  EXPECT_EQ(flare_launch_info_from_env(nullptr), FLARE_INVALID_ARGUMENT);
  expect_last_error("info:", "is null");
}

}  // namespace
}  // namespace flare::test
