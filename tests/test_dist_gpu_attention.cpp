// test_dist_gpu_attention.cpp — context-parallel attention on real GPUs over NCCL (labels gpu,
// dist): one thread per visible device in this process, rank r on device r, as
// test_dist_gpu_nccl.cpp runs the communicator. Each test skips, saying so, without NCCL in the
// build or with fewer than two CUDA devices.
//
// A case builds one global problem on the host, shards it to the ranks (test_dist_util.h), runs
// forward then backward on every rank's device, gathers every rank's o, lse, dq, dk and dv (each
// poisoned with NaN first: every element must be written) and checks them against the float64
// reference under the tolerance rule (docs/architecture.md). The same inputs also run as one
// single-GPU flare call over the whole sequence on device 0, which must pass the same rule: the
// context-parallel result is held to what one device achieves on those inputs, and the largest
// difference between the two is recorded (cp_vs_single_*).
//
// What the file costs is host work, so it is spent once: every case runs over one NCCL group per
// world size, made on first use and kept for the binary (a fresh group per case cost seconds of
// NCCL init each on 4 GPUs); the float64 reference of a case is computed once for both results,
// on every host core (expect_all_match_reference); and lengths stop growing past 4 ranks
// (grown_length).
//
// Also: two runs bitwise equal (deterministic backward), the timing counters against the bytes
// the plan must move, and inputs refused by name. A dead peer has its own binary
// (test_dist_gpu_dead_peer.cpp): its aborted communicator must not share a process with these.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "flare/dist.h"
#include "gpu_util.h"
#include "test_dist_gpu_util.h"
#include "test_dist_util.h"
#include "test_dist_varlen_util.h"
#include "test_util.h"

namespace flare::test {
namespace {

using dist::Communicator;
using dist::ContextParallelAttention;
using dist::Strategy;

constexpr int kTimeoutMs = 120000;  // a correct run never waits for it

// ---- one NCCL group per world size, kept for the whole binary
// ------------------------------------

struct GroupCache {
  std::map<int, std::unique_ptr<NcclGroup>> groups;
  std::map<int, Status> failed;  // a group that could not be made is not tried again per case
};
GroupCache& group_cache() {
  static GroupCache cache;
  return cache;
}

// The group of `size` ranks every case of that world size shares; null, with the reason as a test
// failure, when NCCL could not make it. A case that breaks a communicator (a timeout aborts it)
// makes every later case on the group fail at once with that error, rather than wait.
NcclGroup* shared_group(int size) {
  GroupCache& cache = group_cache();
  if (auto it = cache.groups.find(size); it != cache.groups.end()) return it->second.get();
  Status made;
  if (auto it = cache.failed.find(size); it != cache.failed.end()) {
    made = it->second;
  } else {
    std::unique_ptr<NcclGroup> group;
    made = NcclGroup::create(size, kTimeoutMs, &group);
    if (made.ok()) return (cache.groups[size] = std::move(group)).get();
    cache.failed[size] = made;
  }
  ADD_FAILURE() << "NCCL group of " << size << " ranks: " << made.to_string();
  return nullptr;
}

// Destroys the shared groups after the last test, while CUDA and NCCL are certainly still up (a
// static destructor runs at exit, in no set order with the CUDA runtime's own teardown).
class SharedGroupsTeardown final : public ::testing::Environment {
 public:
  void TearDown() override { group_cache().groups.clear(); }
};
[[maybe_unused]] ::testing::Environment* const kSharedGroupsTeardown =
    ::testing::AddGlobalTestEnvironment(new SharedGroupsTeardown);

// A length of `per_rank` rows per rank plus `extra`, for `world` ranks. Lengths grow with the ranks
// so each rank's block keeps its shape (rows per chunk against the kernels' tiles, windows
// narrower or wider than a chunk), but not past 4 ranks: the float64 reference on the host is
// quadratic in the length, so 8 GPUs would pay 4× what 4 GPUs pay (16× what 2 pay) for the same
// checks, and the run would be the host's, not the GPUs'. On 8 ranks a rank then holds half the
// rows it holds on 4; every length below stays one no rank count from 2 to 8 divides where it was
// before, except MqaSoftcapAndStridedLocals' on 7 ranks (259 = 7·37), which claims no such thing.
// Lengths no reference is computed for (BitwiseReproducible, TimingCountsTheRingsTraffic) and the
// short structural ones (2·world − 1 rows, fewer than the chunks; 64·world, split evenly) still
// grow with the ranks: they cost the host little.
int grown_length(int per_rank, int world, int extra) {
  return per_rank * std::min(world, 4) + extra;
}

// Forward then backward of one rank on its stream, waiting for the device at the end.
Status forward_backward(ContextParallelAttention& cp, const DeviceLocal& d, cudaStream_t stream) {
  d.poison_outputs();
  FLARE_RETURN_IF_ERROR(cp.forward(d.at(d.q), d.at(d.k), d.at(d.v), d.at(d.o), d.at(d.lse), stream));
  FLARE_RETURN_IF_ERROR(cp.backward(d.at(d.dout), d.at(d.q), d.at(d.k), d.at(d.v), d.at(d.o),
                                    d.at(d.lse), d.at(d.dq), d.at(d.dk), d.at(d.dv), stream));
  return cuda_ok(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
}

// Runs case c (CpCase, or VarlenCpCase for packed batches) `runs` times on c.world GPUs with one
// plan per rank; run i's outputs land in (*outs)[i], one Local per rank (inputs sharded from pr).
template <typename Case>
void run_on_gpus(const Case& c, const Problem& pr, int runs, std::vector<std::vector<Local>>* outs) {
  for (int i = 0; i < runs; ++i) outs->push_back(make_locals(c, pr));
  NcclGroup* group = shared_group(c.world);
  ASSERT_NE(group, nullptr);
  const std::vector<Status> st = group->run([&](Communicator& comm) -> Status {
    const int r = comm.rank();
    std::unique_ptr<ContextParallelAttention> cp;
    FLARE_RETURN_IF_ERROR(ContextParallelAttention::create(&comm, config_of(c), &cp));
    const DeviceLocal d((*outs)[0][r], comm.device_index());
    cudaStream_t stream = nullptr;
    FLARE_RETURN_IF_ERROR(cuda_ok(cudaStreamCreate(&stream), "cudaStreamCreate"));
    Status s;
    for (int i = 0; i < runs && s.ok(); ++i) {
      s = forward_backward(*cp, d, stream);
      if (s.ok()) d.download_outputs(&(*outs)[i][r]);
    }
    cudaStreamDestroy(stream);
    return s;
  });
  for (int r = 0; r < c.world; ++r) ASSERT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r].to_string();
}

// The whole problem as one single-GPU flare call on device 0; outputs into pr.
void run_single_gpu(Problem* pr) {
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  GpuTensor q, k, v, o, lse, dout, dq, dk, dv, cu_q, cu_k;
  for (auto [d, h] : {std::pair{&q, &pr->q}, {&k, &pr->k}, {&v, &pr->v}, {&o, &pr->o}, {&lse, &pr->lse},
                      {&dout, &pr->dout}, {&dq, &pr->dq}, {&dk, &pr->dk}, {&dv, &pr->dv}})
    d->upload(*h);
  VarlenArgs varlen;
  if (pr->is_varlen()) {
    cu_q.upload(pr->cu_q);
    cu_k.upload(pr->cu_k);
    varlen = pr->varlen;
    varlen.cu_seqlens_q = cu_q.view();
    varlen.cu_seqlens_k = cu_k.view();
  }
  for (const GpuTensor* t : {&o, &lse, &dq, &dk, &dv}) t->poison();
  Status s = attention_forward(q.view(), k.view(), v.view(), o.view(), lse.view(), pr->options, varlen);
  ASSERT_TRUE(s.ok()) << s.to_string();
  s = attention_backward(dout.view(), q.view(), k.view(), v.view(), o.view(), lse.view(), dq.view(),
                         dk.view(), dv.view(), pr->options, varlen);
  ASSERT_TRUE(s.ok()) << s.to_string();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  o.download(&pr->o);
  lse.download(&pr->lse);
  dq.download(&pr->dq);
  dk.download(&pr->dk);
  dv.download(&pr->dv);
}

double max_difference(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0.0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i)
    if (std::isfinite(a[i]) && std::isfinite(b[i])) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

// The whole check of one case: context parallel and single GPU, each against the reference of
// their common inputs (computed once for both).
template <typename Case>
void run_gpu_case(const Case& c) {
  SCOPED_TRACE(describe(c));
  const ProblemSpec spec = spec_of(c);
  Problem pr = make_problem(spec);
  std::vector<std::vector<Local>> outs;
  run_on_gpus(c, pr, 1, &outs);
  if (::testing::Test::HasFatalFailure()) return;
  gather_outputs(c, outs[0], &pr);
  if (::testing::Test::HasFatalFailure()) return;
  std::vector<CheckedResult> results = {{"context parallel against the float64 reference", &pr}};
  Problem single = make_problem(spec);
  run_single_gpu(&single);
  const bool single_ran = !::testing::Test::HasFatalFailure();
  if (single_ran)
    results.push_back({"single-GPU flare against the float64 reference (same inputs)", &single});
  expect_all_match_reference(results);
  if (!single_ran) return;
  ::testing::Test::RecordProperty("cp_vs_single_o", std::to_string(max_difference(pr.read_o(), single.read_o())));
  ::testing::Test::RecordProperty("cp_vs_single_dq", std::to_string(max_difference(pr.read_dq(), single.read_dq())));
  ::testing::Test::RecordProperty("cp_vs_single_dk", std::to_string(max_difference(pr.read_dk(), single.read_dk())));
  ::testing::Test::RecordProperty("cp_vs_single_dv", std::to_string(max_difference(pr.read_dv(), single.read_dv())));
}

// ---- ring and zigzag × mask × dtype, forward and backward ----------------------------------------

struct GridParam {
  Strategy strategy;
  bool causal;
  DType dtype;
};

class GpuGrid : public ::testing::TestWithParam<GridParam> {};

// GQA 4:1, head_dim 128, a length divisible neither by the ranks nor by twice the ranks.
TEST_P(GpuGrid, MatchesReferenceAndSingleGpu) {
  FLARE_SKIP_WITHOUT_TWO_GPUS();
  CpCase c;
  c.world = usable_devices();
  c.strategy = GetParam().strategy;
  c.causal = GetParam().causal;
  c.dtype = GetParam().dtype;
  c.batch = 2;
  c.seqlen = grown_length(96, c.world, 37);
  c.heads_q = 8;
  c.heads_kv = 2;
  c.head_dim = 128;
  run_gpu_case(c);
}

std::vector<GridParam> grid() {
  std::vector<GridParam> g;
  for (Strategy st : {Strategy::kRing, Strategy::kZigzag})
    for (bool causal : {false, true})
      for (DType dt : {DType::kBFloat16, DType::kFloat16}) g.push_back({st, causal, dt});
  return g;
}

INSTANTIATE_TEST_SUITE_P(Dist, GpuGrid, ::testing::ValuesIn(grid()),
                         [](const ::testing::TestParamInfo<GridParam>& i) {
                           return std::string(dist::strategy_name(i.param.strategy)) + "_" +
                                  (i.param.causal ? "causal" : "full") + "_" +
                                  dtype_name(i.param.dtype);
                         });

// ---- features ------------------------------------------------------------------------------------

TEST(ContextParallelGpu, HeadDims64And80) {
  FLARE_SKIP_WITHOUT_TWO_GPUS();
  for (int d : {64, 80}) {
    CpCase c;
    c.world = usable_devices();
    c.dtype = DType::kBFloat16;
    c.seqlen = grown_length(77, c.world, 5);
    c.heads_q = 4;
    c.heads_kv = 2;
    c.head_dim = d;
    run_gpu_case(c);
  }
}

// Blocks of several kernel tiles each, so tile edges fall inside the ring's blocks (up to 4 ranks;
// past 4 the zigzag's chunks shrink toward one 128-row tile, on 8 some a row longer: grown_length).
TEST(ContextParallelGpu, LongerSequence) {
  FLARE_SKIP_WITHOUT_TWO_GPUS();
  for (Strategy st : {Strategy::kRing, Strategy::kZigzag}) {
    CpCase c;
    c.world = usable_devices();
    c.strategy = st;
    c.dtype = DType::kBFloat16;
    c.batch = 1;
    c.seqlen = grown_length(512, c.world, 5);
    c.heads_q = 4;
    c.heads_kv = 1;
    c.head_dim = 128;
    run_gpu_case(c);
  }
}

// Fewer rows than chunks: empty chunks and ranks, zero-byte transfers skipped on both sides.
TEST(ContextParallelGpu, FewerRowsThanChunks) {
  FLARE_SKIP_WITHOUT_TWO_GPUS();
  for (Strategy st : {Strategy::kRing, Strategy::kZigzag}) {
    CpCase c;
    c.world = usable_devices();
    c.strategy = st;
    c.dtype = DType::kBFloat16;
    c.seqlen = 2 * c.world - 1;
    run_gpu_case(c);
  }
}

// MQA, softcap, and local tensors with padded rows: K/V are packed before they travel.
TEST(ContextParallelGpu, MqaSoftcapAndStridedLocals) {
  FLARE_SKIP_WITHOUT_TWO_GPUS();
  CpCase c;
  c.world = usable_devices();
  c.dtype = DType::kFloat16;
  c.seqlen = grown_length(64, c.world, 3);
  c.heads_q = 8;
  c.heads_kv = 1;
  c.softcap = 5.0f;
  c.pad = 8;
  run_gpu_case(c);
}

TEST(ContextParallelGpu, AllToAll) {
  FLARE_SKIP_WITHOUT_TWO_GPUS();
  CpCase c;
  c.world = usable_devices();
  c.dtype = DType::kBFloat16;
  c.seqlen = grown_length(80, c.world, 7);
  c.head_dim = 128;
  run_gpu_case(with_strategy(c, Strategy::kAllToAll));
  c.causal = false;
  c.window_left = 33;
  c.window_right = 9;
  c.dtype = DType::kFloat16;
  run_gpu_case(with_strategy(c, Strategy::kAllToAll));
}

// Sliding windows under the ring and zigzag: every block call gets its own window, blocks the
// window hides are skipped; left only, right only, both, and with causal, windows narrower than a
// chunk and wider than one, over several kernel tiles per block.
TEST(ContextParallelGpu, SlidingWindows) {
  FLARE_SKIP_WITHOUT_TWO_GPUS();
  struct Band {
    int left, right;
    bool causal;
  };
  for (Strategy st : {Strategy::kRing, Strategy::kZigzag})
    for (const Band& b : {Band{100, -1, true}, Band{37, 0, false}, Band{-1, 50, false},
                          Band{300, 200, false}, Band{1000, -1, true}}) {
      CpCase c;
      c.world = usable_devices();
      c.strategy = st;
      c.dtype = DType::kBFloat16;
      c.batch = 2;
      c.seqlen = grown_length(192, c.world, 29);
      c.heads_q = 8;
      c.heads_kv = 2;
      c.head_dim = 128;
      c.window_left = b.left;
      c.window_right = b.right;
      c.causal = b.causal;
      run_gpu_case(c);
    }
}

// Packed variable-length batches: each sequence split across the GPUs on its own; empty
// sequences, sequences shorter than the chunk count, lengths not divisible by the ranks; causal
// and not, a sliding window, fp16 and bf16, GQA.
TEST(ContextParallelGpu, PackedVariableLength) {
  FLARE_SKIP_WITHOUT_TWO_GPUS();
  for (Strategy st : {Strategy::kRing, Strategy::kZigzag})
    for (bool causal : {true, false}) {
      VarlenCpCase c;
      c.world = usable_devices();
      c.strategy = st;
      c.causal = causal;
      c.dtype = causal ? DType::kBFloat16 : DType::kFloat16;
      c.heads_q = 8;
      c.heads_kv = 2;
      c.head_dim = 128;
      c.seqlens = {grown_length(300, c.world, 7), 0, 1, 2 * c.world - 1, 129, 64 * c.world, 0};
      run_gpu_case(c);
      c.window_left = 90;
      c.window_right = causal ? -1 : 17;
      run_gpu_case(c);
    }
}

// shard_varlen / unshard_varlen on device tensors: the same bytes as on the host.
TEST(ContextParallelGpu, DeviceShardHelpers) {
  if (usable_devices() < 1) GTEST_SKIP() << "needs a CUDA device";
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  const std::vector<int32_t> cu = {0, 37, 37, 38, 171};
  std::mt19937_64 rng(test_seed());
  HostTensor full = HostTensor::make(DType::kBFloat16, {171, 3, 40});
  full.fill_normal(rng);
  for (Strategy st : {Strategy::kRing, Strategy::kZigzag})
    for (int n : {2, 3}) {
      SCOPED_TRACE(::testing::Message() << dist::strategy_name(st) << " n=" << n);
      HostTensor back = HostTensor::make(DType::kBFloat16, {171, 3, 40});
      GpuTensor d_full, d_back;
      d_full.upload(full);
      d_back.upload(back);
      for (int r = 0; r < n; ++r) {
        dist::VarlenShard sh;
        ASSERT_TRUE(dist::varlen_shard(st, cu, n, r, &sh).ok());
        HostTensor want = HostTensor::make(DType::kBFloat16, {sh.length, 3, 40});
        ASSERT_TRUE(dist::shard_varlen(full.view, 0, st, cu, n, r, want.view).ok());
        HostTensor got = HostTensor::make(DType::kBFloat16, {sh.length, 3, 40});
        GpuTensor d_local;
        d_local.upload(got);
        Status s = dist::shard_varlen(d_full.view(), 0, st, cu, n, r, d_local.view());
        ASSERT_TRUE(s.ok()) << s.to_string();
        s = dist::unshard_varlen(d_local.view(), 0, st, cu, n, r, d_back.view());
        ASSERT_TRUE(s.ok()) << s.to_string();
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        d_local.download(&got);
        EXPECT_EQ(got.bytes, want.bytes) << "rank " << r;
      }
      d_back.download(&back);
      EXPECT_EQ(back.bytes, full.bytes);
    }
}

// Two runs of one plan on the same inputs give the same bytes (deterministic backward; the ring's
// own sums have a fixed order).
TEST(ContextParallelGpu, BitwiseReproducible) {
  FLARE_SKIP_WITHOUT_TWO_GPUS();
  for (Strategy st : {Strategy::kRing, Strategy::kZigzag, Strategy::kAllToAll}) {
    CpCase c;
    c.world = usable_devices();
    c.dtype = DType::kBFloat16;
    c.seqlen = 128 * c.world + 11;
    c.deterministic = true;
    c = with_strategy(c, st);
    SCOPED_TRACE(describe(c));
    const Problem pr = problem_of(c);
    std::vector<std::vector<Local>> outs;
    run_on_gpus(c, pr, 2, &outs);
    if (HasFatalFailure()) return;
    for (int r = 0; r < c.world; ++r) {
      const Local &a = outs[0][r], &b = outs[1][r];
      for (auto [x, y, name] : {std::tuple{&a.o, &b.o, "o"}, {&a.lse, &b.lse, "lse"},
                                {&a.dq, &b.dq, "dq"}, {&a.dk, &b.dk, "dk"}, {&a.dv, &b.dv, "dv"}})
        EXPECT_EQ(std::memcmp(x->bytes.data(), y->bytes.data(), x->bytes.size()), 0)
            << name << " of rank " << r << " differs between two runs";
    }
  }
}

// The timing counters: every exchange and byte the plan implies, and times that were measured.
TEST(ContextParallelGpu, TimingCountsTheRingsTraffic) {
  FLARE_SKIP_WITHOUT_TWO_GPUS();
  CpCase c;
  c.world = usable_devices();
  c.dtype = DType::kBFloat16;
  c.seqlen = 64 * c.world + 3;
  const Problem pr = problem_of(c);
  std::vector<Local> locals = make_locals(c, pr);
  std::vector<dist::CpTiming> timing(static_cast<size_t>(c.world));
  NcclGroup* group = shared_group(c.world);
  ASSERT_NE(group, nullptr);
  const std::vector<Status> st = group->run([&](Communicator& comm) -> Status {
    std::unique_ptr<ContextParallelAttention> cp;
    FLARE_RETURN_IF_ERROR(ContextParallelAttention::create(&comm, config_of(c), &cp));
    FLARE_RETURN_IF_ERROR(cp->set_timing(true));
    const DeviceLocal d(locals[comm.rank()], comm.device_index());
    FLARE_RETURN_IF_ERROR(forward_backward(*cp, d, nullptr));
    return cp->take_timing(&timing[comm.rank()]);
  });
  for (int r = 0; r < c.world; ++r) {
    ASSERT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r].to_string();
    const RingTraffic want = expected_ring_traffic(c, r);
    const dist::CpTiming& t = timing[r];
    EXPECT_EQ(t.calls, 2) << "rank " << r;
    EXPECT_EQ(t.exchanges, want.exchanges) << "rank " << r << ": n−1 forward, n+1 backward";
    EXPECT_EQ(t.bytes_sent, want.bytes) << "rank " << r;
    EXPECT_GT(t.comm_ms, 0.0) << "rank " << r;
    EXPECT_GT(t.compute_ms, 0.0) << "rank " << r;
  }
}

// ---- failures --------------------------------------------------------------------------------------

// Its own fresh groups, not the shared ones: a refusal that one rank took after another had begun a
// collective would leave the group mid-operation, and that bug should fail here, not in the cases
// that run after it.
TEST(ContextParallelGpu, BadInputsAreNamed) {
  FLARE_SKIP_WITHOUT_TWO_GPUS();
  CpCase c;
  c.world = 2;
  c.dtype = DType::kFloat32;
  const std::vector<Status> fp32 = run_nccl(2, kTimeoutMs, [&](Communicator& comm) -> Status {
    std::unique_ptr<ContextParallelAttention> cp;
    return ContextParallelAttention::create(&comm, config_of(c), &cp);
  });
  for (const Status& s : fp32) {
    EXPECT_EQ(s.code(), StatusCode::kUnsupported) << s.to_string();
    EXPECT_TRUE(has(s, "float32")) << s.message();
  }
  // Every rank hands in tensors of the other rank's device: refused before any transfer.
  c.dtype = DType::kBFloat16;
  const Problem pr = problem_of(c);
  std::vector<Local> locals = make_locals(c, pr);
  const std::vector<Status> st = run_nccl(2, kTimeoutMs, [&](Communicator& comm) -> Status {
    std::unique_ptr<ContextParallelAttention> cp;
    FLARE_RETURN_IF_ERROR(ContextParallelAttention::create(&comm, config_of(c), &cp));
    DeviceLocal d(locals[comm.rank()], comm.device_index());
    d.device = 1 - comm.device_index();
    return cp->forward(d.at(d.q), d.at(d.k), d.at(d.v), d.at(d.o), d.at(d.lse), nullptr);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(st[r].code(), StatusCode::kInvalidArgument) << st[r].to_string();
    EXPECT_TRUE(has(st[r], "q: on cuda:" + std::to_string(1 - r))) << st[r].message();
  }
}

}  // namespace
}  // namespace flare::test
