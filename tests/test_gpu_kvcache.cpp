// test_gpu_kvcache.cpp — attention_with_kvcache on CUDA tensors (flare/kvcache.h) against the
// float64 CPU reference.
//
// Cases come from kvcache_cases.h, as test_cpu_kvcache.cpp's do: the logical contents first — q,
// each sequence's cached keys and values, the new ones, rotary tables, ALiBi slopes — then a
// contiguous or paged layout of them (shuffled blocks, unused block_table entries −1, every unused
// cache slot NaN, so a stray read shows). The same setup, drawn twice from one seed, goes to the
// GPU (every tensor copied to the device, outputs poisoned with NaN) and to the CPU path with
// Backend::kReference. Then:
//   - the caches after the GPU call equal the CPU path's caches bit for bit (the append, rotation
//     in fp32 rounded once, lands in the same slots with the same bits; nothing else changes);
//   - o and lse follow docs/architecture.md's tolerance rule (test_util.h's within_tolerance, as
//     test_gpu_forward.cpp uses it) against the float64 reference of each sequence's fixed-length
//     attention over its logical keys (read from the CPU path's cache), with the naive
//     low-precision reference's error as the budget.
// Paged equals contiguous and run equals run bit for bit on the GPU; split-KV launches (num_splits
// 1, 3, 7, more splits than key blocks, automatic) each pass the rule against the same reference.
// NaN/±Inf in one element of q, k or v (a key every row sees, or one only the last causal row
// sees) must give the NaN/Inf pattern of the CPU reference's o and lse exactly. Integer arguments
// the host cannot read without a synchronisation (cache_seqlens, block_table, cache_batch_idx on
// the device) are checked by the kernels: a sequence that breaks a rule gets NaN in all its o and
// lse rows and nothing appended, while the other sequences of the call come out right. Errors the
// host can see return kInvalidArgument (or kUnsupported) with nothing written.
//
// Every case names itself (SCOPED_TRACE with its description and the seed; FLARE_TEST_SEED
// replays it). Without a CUDA device every test skips, saying so.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "core/message.h"
#include "flare/kvcache.h"
#include "gpu_util.h"
#include "kvcache_cases.h"
#include "test_util.h"

namespace flare::test {
namespace {

using namespace kvcache;  // Case, Decode, make_setup, make_call, expected, ...

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// ---- cases -------------------------------------------------------------------------------------

// The defaults of the GPU cases: longer caches and a wider head than kvcache_cases.h's CPU
// defaults, in a dtype the CUDA decoding kernels take.
Case gpu_case(DType dtype) {
  Case c;
  c.dtype = dtype;
  c.head_dim = 64;
  c.cache_lens = {5, 170};
  c.capacity = 200;
  return c;
}

// ---- the two runs ------------------------------------------------------------------------------

// A Decode's tensors on the device, byte for byte (padding and poison included).
struct GpuDecode {
  GpuTensor q, k_cache, v_cache, k_new, v_new, table, seqlens, idx, cos, sin, alibi, o, lse;
  explicit GpuDecode(const Decode& s) {
    q.upload(s.qt);
    k_cache.upload(s.k_cache);
    v_cache.upload(s.v_cache);
    k_new.upload(s.k_new_t);
    v_new.upload(s.v_new_t);
    table.upload(s.table);
    seqlens.upload(s.seqlens);
    idx.upload(s.idx);
    cos.upload(s.cos_t);
    sin.upload(s.sin_t);
    alibi.upload(s.alibi_t);
    o.upload(s.o);
    lse.upload(s.lse);
  }
  Views views() const {
    return {q.view(),     k_cache.view(), v_cache.view(), k_new.view(), v_new.view(),
            table.view(), seqlens.view(), idx.view(),     cos.view(),   sin.view(),
            alibi.view(), o.view(),       lse.view()};
  }
};

using CallEdit = std::function<void(Call&)>;

// Runs `s` on the GPU (its host integer tensors as they are now, `edit` applied to the device
// call), waits, and copies o, lse and both caches back into `s`.
Status run_on_gpu(Decode* s, const CallEdit& edit = {}, Stream stream = nullptr) {
  GpuDecode g(*s);
  if (::testing::Test::HasFatalFailure()) return Status::internal("device upload failed");
  Call call = make_call(s->c, g.views(), Backend::kAuto);
  if (edit) edit(call);
  const Status st = invoke(call, stream);
  const cudaError_t err = cudaDeviceSynchronize();
  EXPECT_EQ(err, cudaSuccess) << cudaGetErrorString(err);
  g.o.download(&s->o);
  g.lse.download(&s->lse);
  g.k_cache.download(&s->k_cache);
  g.v_cache.download(&s->v_cache);
  return st;
}

// The CPU path on the float64 reference backend.
void run_on_cpu(Decode* s) {
  const Status st = invoke(make_call(s->c, s->views(), Backend::kReference));
  ASSERT_TRUE(st.ok()) << "CPU reference run: " << st.to_string();
}

// ---- expectations ------------------------------------------------------------------------------

// Every element of two same-layout tensors (padding included) has the same bits, or, where
// `nan_equal`, both are NaN. On failure: the first element that differs.
::testing::AssertionResult compare_elements(const std::string& name, const HostTensor& got,
                                            const HostTensor& want, bool nan_equal) {
  const DType dt = want.view.dtype;
  const size_t es = dtype_size(dt);
  if (got.bytes.size() != want.bytes.size())
    return ::testing::AssertionFailure() << name << ": size " << got.bytes.size() << " vs "
                                         << want.bytes.size();
  for (size_t e = 0; e < want.bytes.size() / es; ++e) {
    if (std::memcmp(&got.bytes[e * es], &want.bytes[e * es], es) == 0) continue;
    const float g = load_as_float(got.bytes.data(), static_cast<int64_t>(e), dt);
    const float w = load_as_float(want.bytes.data(), static_cast<int64_t>(e), dt);
    if (nan_equal && std::isnan(g) && std::isnan(w)) continue;
    return ::testing::AssertionFailure() << name << " element " << e << " is " << g << ", expected "
                                         << w << (std::isnan(g) && std::isnan(w) ? " (other NaN bits)" : "")
                                         << " (seed " << test_seed() << ")";
  }
  return ::testing::AssertionSuccess();
}

// Bit for bit, except that any NaN equals any NaN: a NaN's payload is no part of the contract (a
// NaN key rotates to a NaN on either device, not necessarily the same one).
::testing::AssertionResult same_elements(const std::string& name, const HostTensor& got,
                                         const HostTensor& want) {
  return compare_elements(name, got, want, true);
}
// Bit for bit, NaNs included: a determinism check, or "nothing was written".
::testing::AssertionResult same_bits(const std::string& name, const HostTensor& got,
                                     const HostTensor& want) {
  return compare_elements(name, got, want, false);
}

void expect_outputs_match(const Decode& gpu, const Expected& ex) {
  EXPECT_TRUE(within_tolerance("o", read_all(gpu.o), ex.o, ex.o_naive, gpu.c.dtype, ex.reduction));
  if (gpu.c.with_lse) {
    EXPECT_TRUE(within_tolerance("lse", read_all(gpu.lse), ex.lse, ex.lse_naive, DType::kFloat32,
                                 ex.reduction));
  }
}

// One case end to end; returns the GPU run (outputs and caches as the device left them).
Decode check_case(const Case& c) {
  SCOPED_TRACE(c.describe());
  Decode gpu = make_setup(c, test_seed());
  const Status st = run_on_gpu(&gpu);
  EXPECT_TRUE(st.ok()) << st.to_string();
  if (!st.ok()) return gpu;
  Decode cpu = make_setup(c, test_seed());
  run_on_cpu(&cpu);
  EXPECT_TRUE(same_bits("k_cache", gpu.k_cache, cpu.k_cache));
  EXPECT_TRUE(same_bits("v_cache", gpu.v_cache, cpu.v_cache));
  expect_outputs_match(gpu, expected(cpu));
  return gpu;
}

// ---- fixtures ----------------------------------------------------------------------------------

class GpuKVCache : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override { FLARE_SKIP_WITHOUT_CUDA(); }
  Case base() const { return gpu_case(GetParam()); }
};

std::string dtype_param_name(const ::testing::TestParamInfo<DType>& info) {
  return info.param == DType::kFloat16 ? "fp16" : "bf16";
}

// ---- shapes and layouts ------------------------------------------------------------------------

// Every head dim bucket, at its edges and in between: odd and unaligned dims (20, 59, 111) take
// the element-by-element loads; contiguous and paged, with an append rotated over 16 dims.
TEST_P(GpuKVCache, HeadDims) {
  for (int d : {20, 32, 40, 59, 64, 72, 80, 96, 111, 128, 160, 200, 256})
    for (int block : {0, 16}) {
      Case c = base();
      c.head_dim = d;
      c.block_size = block;
      c.seqlen_new = 1;
      c.rotary = 1;
      c.cache_lens = {5, 170};
      check_case(c);
    }
}

// Rotary over the whole head, interleaved, at the largest head dim.
TEST_P(GpuKVCache, RotaryWholeHeadAtD256) {
  Case c = base();
  c.head_dim = 256;
  c.rotary = 2;
  c.rotary_dim = 256;
  c.seqlen_new = 2;
  c.seqlen_q = 2;
  c.options.causal = true;
  c.block_size = 16;
  check_case(c);
}

// Cache rows whose strides are not multiples of 8 elements: the 16-byte copies must give way to
// element loads even where head_dim is a multiple of 8.
TEST_P(GpuKVCache, UnalignedCacheRows) {
  for (int d : {64, 128})
    for (int block : {0, 3, 16}) {
      Case c = base();
      c.head_dim = d;
      c.block_size = block;
      c.cache_pad = 3;
      c.seqlen_new = 2;
      c.seqlen_q = 2;
      c.options.causal = true;
      c.rotary = 2;
      check_case(c);
    }
}

TEST_P(GpuKVCache, PagedBlockSizes) {
  for (int bs : {1, 3, 16, 256})
    for (int s_new : {0, 3}) {
      Case c = base();
      c.block_size = bs;
      c.batch = 3;
      c.cache_lens = {0, 33, 600};
      c.capacity = 700;
      c.seqlen_q = 3;
      c.seqlen_new = s_new;
      c.options.causal = true;
      check_case(c);
    }
}

// The same logical cache, contiguous and paged at every block size, gives the same bits. The
// capacity (768) is a multiple of every block size, so even the automatic split count, which may
// follow the capacity, is the same in every layout.
TEST_P(GpuKVCache, PagedEqualsContiguousBitForBit) {
  for (int splits : {0, 1, 3}) {
    Case c = base();
    c.batch = 3;
    c.cache_lens = {3, 0, 700};
    c.capacity = 768;
    c.seqlen_q = 3;
    c.seqlen_new = 3;
    c.heads_q = 8;
    c.heads_kv = 2;
    c.rotary = 1;
    c.options.causal = true;
    c.num_splits = splits;
    const Decode contiguous = check_case(c);
    for (int bs : {1, 3, 16, 256}) {
      c.block_size = bs;
      const Decode paged = check_case(c);
      const std::string what = cat(" of block_size ", bs, " against contiguous | ", c.describe());
      EXPECT_TRUE(same_bits("o" + what, paged.o, contiguous.o));
      EXPECT_TRUE(same_bits("lse" + what, paged.lse, contiguous.lse));
    }
  }
}

TEST_P(GpuKVCache, CacheBatchIdxAndScalarSeqlen) {
  for (int s_new : {0, 1, 4})
    for (bool scalar : {false, true}) {
      Case c = base();
      c.batch = 3;
      c.batch_idx = true;
      c.scalar_seqlen = scalar;
      c.cache_lens = scalar ? std::vector<int>{90, 90, 90} : std::vector<int>{17, 90, 4};
      c.seqlen_new = s_new;
      c.seqlen_q = std::max(1, s_new);
      c.options.causal = true;
      check_case(c);
      c.batch_idx = false;  // one length for every sequence of a paged cache
      c.block_size = 16;
      check_case(c);
    }
}

// ---- the append and rotary ---------------------------------------------------------------------

// Both rotary layouts, tables in fp32 and in q's dtype, rotary_dim below head_dim; causal calls
// rotate query row j at cache_seqlens + j, the others every row at cache_seqlens.
TEST_P(GpuKVCache, RotaryLayoutsAndTableDtypes) {
  for (int rotary : {1, 2})
    for (bool fp32 : {true, false})
      for (bool causal : {true, false})
        for (int sq : {1, 3}) {
          Case c = base();
          c.head_dim = 128;
          c.rotary = rotary;
          c.rotary_dim = 64;
          c.rotary_fp32 = fp32;
          c.seqlen_q = sq;
          c.seqlen_new = sq;
          c.options.causal = causal;
          c.block_size = rotary == 2 ? 16 : 0;
          check_case(c);
        }
}

TEST_P(GpuKVCache, AppendWithoutRotary) {
  for (int s_new : {1, 3, 17})
    for (int block : {0, 1, 16}) {
      Case c = base();
      c.seqlen_new = s_new;
      c.seqlen_q = s_new;
      c.cache_lens = {0, 150};
      c.options.causal = true;
      c.block_size = block;
      check_case(c);
    }
}

// ---- masks, score modifiers, GQA, query rows --------------------------------------------------

// s_q 1, 3 and 17, the causal mask aligned to the right: sequence 0 holds fewer keys than there
// are query rows, so its first rows see no key (o = 0, lse = −inf).
TEST_P(GpuKVCache, QueryRowsCausalRightAligned) {
  for (int sq : {1, 3, 17})
    for (bool causal : {true, false})
      for (bool append : {false, true}) {
        Case c = base();
        c.seqlen_q = sq;
        c.cache_lens = {2, 300};
        c.capacity = 340;
        c.seqlen_new = append ? std::min(sq, 3) : 0;
        c.options.causal = causal;
        c.block_size = append ? 16 : 0;
        check_case(c);
      }
}

TEST_P(GpuKVCache, SlidingWindows) {
  const int windows[][2] = {{8, 0}, {4, 2}, {-1, 1}, {0, 0}, {100, -1}};
  for (const auto& w : windows)
    for (int sq : {1, 3}) {
      Case c = base();
      c.seqlen_q = sq;
      c.seqlen_new = sq;
      c.cache_lens = {30, 300};
      c.capacity = 320;
      c.options.window_left = w[0];
      c.options.window_right = w[1];
      c.rotary = 1;  // windowed: q rotated per row
      c.block_size = 16;
      check_case(c);
    }
}

TEST_P(GpuKVCache, SoftcapAndAlibi) {
  for (int alibi : {0, 1, 2})
    for (float softcap : {0.0f, 2.0f}) {
      if (alibi == 0 && softcap == 0.0f) continue;
      Case c = base();
      c.seqlen_q = 3;
      c.seqlen_new = 1;
      c.batch = 3;
      c.cache_lens = {12, 190, 60};
      c.alibi = alibi;
      c.options.softcap = softcap;
      c.options.causal = alibi == 2;
      c.options.window_left = alibi == 1 ? 40 : -1;
      c.block_size = alibi == 1 ? 0 : 16;
      check_case(c);
    }
}

// h_q / h_kv = 1, 4, 8 and 32, with the query rows of a group packed together (s_q · group up to
// 544 rows per kv head).
TEST_P(GpuKVCache, GqaAndMqa) {
  const int heads[][2] = {{4, 4}, {8, 2}, {8, 1}, {32, 1}};
  for (const auto& h : heads)
    for (int sq : {1, 3, 17}) {
      Case c = base();
      c.heads_q = h[0];
      c.heads_kv = h[1];
      c.seqlen_q = sq;
      c.seqlen_new = 1;
      c.cache_lens = {40, 260};
      c.capacity = 300;
      c.options.causal = true;
      c.head_dim = 128;
      c.block_size = sq == 3 ? 0 : 16;
      c.rotary = 2;
      check_case(c);
    }
}

// ---- split-KV ----------------------------------------------------------------------------------

// Long caches with 1, 3, 7 splits, more splits than a sequence has key blocks (the 37-key
// sequence has at most a few blocks at any head dim), more than the kernels take, and the
// automatic count; each against the same reference.
TEST_P(GpuKVCache, SplitKv) {
  for (int d : {64, 128, 256})
    for (int splits : {0, 1, 3, 7, 64, 200}) {
      Case c = base();
      c.head_dim = d;
      c.batch = 3;
      c.cache_lens = {1000, 37, 2500};
      c.capacity = 2600;
      c.seqlen_new = 1;
      c.num_splits = splits;
      c.block_size = d == 128 ? 0 : 16;
      c.heads_q = 8;
      c.heads_kv = 2;
      check_case(c);
    }
}

TEST_P(GpuKVCache, SplitKvShortSequencesAndCausalRows) {
  for (int splits : {3, 7, 64}) {
    Case c = base();
    c.cache_lens = {10, 40};
    c.capacity = 64;
    c.seqlen_q = 3;
    c.seqlen_new = 3;
    c.options.causal = true;
    c.num_splits = splits;
    c.block_size = 1;
    check_case(c);
  }
}

// ---- empty sequences, lse, determinism ---------------------------------------------------------

// Sequences with nothing cached and nothing appended: o = 0 and lse = −inf exactly, with and
// without splits (the merge of empty partials must not make NaN of −inf − −inf).
TEST_P(GpuKVCache, EmptySequences) {
  for (int splits : {0, 1, 3})
    for (int block : {0, 16}) {
      Case c = base();
      c.batch = 3;
      c.cache_lens = {0, 12, 0};
      c.seqlen_q = 2;
      c.num_splits = splits;
      c.block_size = block;
      const Decode gpu = check_case(c);
      SCOPED_TRACE(c.describe());
      for (int i : {0, 2})
        for (int j = 0; j < c.seqlen_q; ++j)
          for (int h = 0; h < c.heads_q; ++h) {
            EXPECT_EQ(gpu.lse.get({i, h, j}), -kInf) << "sequence " << i << " row " << j << " head " << h;
            for (int e = 0; e < c.head_dim; ++e)
              ASSERT_EQ(gpu.o.get({i, j, h, e}), 0.0f) << "sequence " << i << " row " << j << " head " << h;
          }
    }
  Case all_empty = base();
  all_empty.cache_lens = {0, 0};
  all_empty.num_splits = 7;
  check_case(all_empty);
}

TEST_P(GpuKVCache, LseIsOptional) {
  Case c = base();
  c.seqlen_new = 2;
  c.seqlen_q = 2;
  c.options.causal = true;
  c.block_size = 16;
  c.num_splits = 3;
  const Decode with = check_case(c);
  c.with_lse = false;
  const Decode without = check_case(c);
  EXPECT_TRUE(same_bits("o without lse | " + c.describe(), without.o, with.o));
  EXPECT_TRUE(same_bits("k_cache without lse | " + c.describe(), without.k_cache, with.k_cache));
}

// The same call twice gives the same bits, on the default stream and on a stream of its own.
TEST_P(GpuKVCache, BitwiseRunToRunAndOnAStream) {
  for (int splits : {0, 1, 7}) {
    Case c = base();
    c.heads_q = 8;
    c.heads_kv = 1;
    c.seqlen_q = 2;
    c.seqlen_new = 2;
    c.cache_lens = {700, 1300};
    c.capacity = 1400;
    c.options.causal = true;
    c.rotary = 1;
    c.block_size = 16;
    c.num_splits = splits;
    SCOPED_TRACE(c.describe());
    const Decode first = check_case(c);
    Decode again = make_setup(c, test_seed());
    ASSERT_TRUE(run_on_gpu(&again).ok());
    cudaStream_t stream = nullptr;
    ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
    Decode streamed = make_setup(c, test_seed());
    const Status st = run_on_gpu(&streamed, {}, stream);
    ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
    ASSERT_TRUE(st.ok()) << st.to_string();
    for (const Decode* run : {&again, &streamed}) {
      const std::string which = run == &again ? "second run: " : "run on a stream: ";
      EXPECT_TRUE(same_bits(which + "o", run->o, first.o));
      EXPECT_TRUE(same_bits(which + "lse", run->lse, first.lse));
      EXPECT_TRUE(same_bits(which + "k_cache", run->k_cache, first.k_cache));
      EXPECT_TRUE(same_bits(which + "v_cache", run->v_cache, first.v_cache));
    }
  }
}

// ---- NaN and ±Inf ------------------------------------------------------------------------------

// One injected value: the non-finite pattern of o and lse must be the CPU reference's exactly;
// the finite entries follow the tolerance rule with the naive kernel's error measured on the
// case's finite twin (same seed, nothing injected), as test_util.h's NaiveErrors explains.
void check_nonfinite_case(const Case& c) {
  SCOPED_TRACE(c.describe());
  Case twin_case = c;
  twin_case.inj = {};
  Decode twin = make_setup(twin_case, test_seed());
  run_on_cpu(&twin);
  const Expected tw = expected(twin);
  const double o_budget = naive_error(tw.o_naive, tw.o), lse_budget = naive_error(tw.lse_naive, tw.lse);

  Decode gpu = make_setup(c, test_seed());
  const Status st = run_on_gpu(&gpu);
  ASSERT_TRUE(st.ok()) << st.to_string();
  Decode cpu = make_setup(c, test_seed());
  run_on_cpu(&cpu);
  EXPECT_TRUE(same_elements("k_cache", gpu.k_cache, cpu.k_cache));
  EXPECT_TRUE(same_elements("v_cache", gpu.v_cache, cpu.v_cache));
  const Expected ex = expected(cpu);
  std::vector<double> o = read_all(gpu.o), lse = read_all(gpu.lse);
  EXPECT_TRUE(same_nonfinite_pattern("o", o, read_all(cpu.o)));
  EXPECT_TRUE(same_nonfinite_pattern("lse", lse, read_all(cpu.lse)));
  std::vector<double> o_ref = ex.o, lse_ref = ex.lse;
  auto finite_part = [](std::vector<double>& fast, std::vector<double>& ref) {
    for (size_t e = 0; e < ref.size(); ++e)
      if (!std::isfinite(ref[e])) fast[e] = ref[e] = 0.0;  // the pattern check covered them
  };
  finite_part(o, o_ref);
  finite_part(lse, lse_ref);
  EXPECT_TRUE(within_tolerance("o (finite entries)", o, o_ref, o_budget, c.dtype, ex.reduction));
  EXPECT_TRUE(within_tolerance("lse (finite entries)", lse, lse_ref, lse_budget, DType::kFloat32,
                               ex.reduction));
}

// Causal, s_q 3: the last new key (position n − 1) is seen by the last query row alone, the first
// new key and the cached ones by every row. Paged with an append, rotary and three splits; then
// contiguous without an append, where the last cached key plays the masked one.
TEST_P(GpuKVCache, NonFiniteInputsFollowTheReference) {
  Case appended = base();
  appended.seqlen_q = 3;
  appended.seqlen_new = 3;
  appended.cache_lens = {40, 75};
  appended.capacity = 96;
  appended.options.causal = true;
  appended.block_size = 16;
  appended.rotary = 1;
  appended.num_splits = 3;
  Case cached = base();
  cached.seqlen_q = 3;
  cached.cache_lens = {40, 75};
  cached.capacity = 96;
  cached.options.causal = true;
  const int last_cached = cached.cache_lens[1] - 1;
  struct Where {
    const Case* c;
    Target target;
    int row;
  };
  const Where places[] = {
      {&appended, Target::kQ, 1},      {&appended, Target::kCachedK, 10},
      {&appended, Target::kCachedV, 10}, {&appended, Target::kNewK, 0},
      {&appended, Target::kNewV, 0},   {&appended, Target::kNewK, 2},  // masked for rows 0, 1
      {&appended, Target::kNewV, 2},   {&cached, Target::kQ, 2},
      {&cached, Target::kCachedK, 0},  {&cached, Target::kCachedV, 0},
      {&cached, Target::kCachedK, last_cached},  // masked for rows 0, 1
      {&cached, Target::kCachedV, last_cached},
  };
  for (const Where& w : places)
    for (float value : {kNaN, kInf, -kInf}) {
      Case c = *w.c;
      c.inj = {w.target, 1, w.row, 1, 5, value};
      check_nonfinite_case(c);
    }
}

// ---- values only the device can check ----------------------------------------------------------

// A sequence whose integer arguments break a rule gets NaN in every o and lse row and appends
// nothing; the other sequences of the call are computed as if it were valid.
constexpr int kBad = 1;

struct BadValue {
  std::string what;
  bool paged;
  std::function<void(Decode&)> corrupt;  // the host copy of an integer tensor, before upload
  CallEdit edit;                         // or the device call's views
};

void check_bad_sequence(const Case& base_case, const BadValue& bad) {
  Case c = base_case;
  if (bad.paged) {
    c.block_size = 16;
  } else {
    c.batch_idx = true;
  }
  SCOPED_TRACE(bad.what + " | " + c.describe());
  const uint64_t seed = test_seed();
  const Decode before = make_setup(c, seed);
  Decode cpu = make_setup(c, seed);  // the valid call
  run_on_cpu(&cpu);
  Decode gpu = make_setup(c, seed);
  if (bad.corrupt) bad.corrupt(gpu);
  const Status st = run_on_gpu(&gpu, bad.edit);
  ASSERT_TRUE(st.ok()) << "a device-side value cannot fail the call: " << st.to_string();

  // Caches: the valid call's, except that the bad sequence's new rows were never written (they
  // keep their poison's exact bits: a NaN written over them shows too).
  const size_t es = dtype_size(c.dtype);
  for (int j = 0; j < c.seqlen_new; ++j)
    for (int h = 0; h < c.heads_kv; ++h) {
      const int64_t at = cpu.slot(kBad, c.cache_lens[kBad] + j, h);
      const size_t bytes = static_cast<size_t>(c.head_dim) * es, off = static_cast<size_t>(at) * es;
      std::memcpy(&cpu.k_cache.bytes[off], &before.k_cache.bytes[off], bytes);
      std::memcpy(&cpu.v_cache.bytes[off], &before.v_cache.bytes[off], bytes);
    }
  EXPECT_TRUE(same_bits("k_cache", gpu.k_cache, cpu.k_cache));
  EXPECT_TRUE(same_bits("v_cache", gpu.v_cache, cpu.v_cache));

  // Outputs: sequence i owns a contiguous run of o (b, s_q, h_q, d) and of lse (b, h_q, s_q).
  const Expected ex = expected(cpu);
  const std::vector<double> o = read_all(gpu.o), lse = read_all(gpu.lse);
  const size_t o_rows = static_cast<size_t>(c.seqlen_q) * c.heads_q * c.head_dim;
  const size_t l_rows = static_cast<size_t>(c.seqlen_q) * c.heads_q;
  Expected good;
  std::vector<double> good_o, good_lse;
  for (int i = 0; i < c.batch; ++i) {
    const size_t o0 = static_cast<size_t>(i) * o_rows, l0 = static_cast<size_t>(i) * l_rows;
    if (i == kBad) {
      for (size_t e = o0; e < o0 + o_rows; ++e) ASSERT_TRUE(std::isnan(o[e])) << "o[" << e << "] = " << o[e];
      for (size_t e = l0; e < l0 + l_rows; ++e) ASSERT_TRUE(std::isnan(lse[e])) << "lse[" << e << "] = " << lse[e];
      continue;
    }
    auto take = [](std::vector<double>& to, const std::vector<double>& from, size_t at, size_t n) {
      to.insert(to.end(), from.begin() + static_cast<std::ptrdiff_t>(at),
                from.begin() + static_cast<std::ptrdiff_t>(at + n));
    };
    take(good_o, o, o0, o_rows);
    take(good.o, ex.o, o0, o_rows);
    take(good.o_naive, ex.o_naive, o0, o_rows);
    take(good_lse, lse, l0, l_rows);
    take(good.lse, ex.lse, l0, l_rows);
    take(good.lse_naive, ex.lse_naive, l0, l_rows);
  }
  EXPECT_TRUE(within_tolerance("o of the valid sequences", good_o, good.o, good.o_naive, c.dtype,
                               ex.reduction));
  EXPECT_TRUE(within_tolerance("lse of the valid sequences", good_lse, good.lse, good.lse_naive,
                               DType::kFloat32, ex.reduction));
}

void set_int(HostTensor& t, int64_t e, int32_t v) { static_cast<int32_t*>(t.view.data)[e] = v; }

TEST_P(GpuKVCache, BadDeviceValuesPoisonTheirSequenceOnly) {
  Case c = base();
  c.batch = 3;
  c.cache_lens = {20, 50, 37};  // the bad sequence is the longest (the rotary case needs it)
  c.capacity = 64;
  c.seqlen_q = 2;
  c.seqlen_new = 2;
  c.options.causal = true;
  c.rotary = 1;
  const int over = c.capacity - c.seqlen_new + 1;
  const std::vector<BadValue> bad_values = {
      {"cache_seqlens past the capacity (paged)", true, [&](Decode& s) { set_int(s.seqlens, kBad, over); }, {}},
      {"cache_seqlens past the capacity (contiguous)", false, [&](Decode& s) { set_int(s.seqlens, kBad, over); }, {}},
      {"cache_seqlens near INT32_MAX", true, [](Decode& s) { set_int(s.seqlens, kBad, INT32_MAX - 1); }, {}},
      {"cache_seqlens negative", false, [](Decode& s) { set_int(s.seqlens, kBad, -1); }, {}},
      {"block_table entry = num_blocks", true,
       [](Decode& s) { set_int(s.table, kBad * s.max_blocks, static_cast<int32_t>(s.k_cache.view.shape[0])); }, {}},
      {"block_table entry -1 in use (the appended block)", true,
       [](Decode& s) { set_int(s.table, kBad * s.max_blocks + (s.n(kBad) - 1) / s.c.block_size, -1); }, {}},
      {"block_table entry INT32_MAX", true, [](Decode& s) { set_int(s.table, kBad * s.max_blocks + 1, INT32_MAX); }, {}},
      {"cache_batch_idx = batch_cache", false,
       [](Decode& s) { set_int(s.idx, kBad, static_cast<int32_t>(s.k_cache.view.shape[0])); }, {}},
      {"cache_batch_idx negative", false, [](Decode& s) { set_int(s.idx, kBad, -1); }, {}},
      {"rotary tables too short for this sequence", true, {}, [&](Call& call) {
         const int64_t rows = c.cache_lens[kBad] + c.seqlen_new - 1;  // one short of its need
         call.args.rotary_cos.shape[0] = rows;
         call.args.rotary_sin.shape[0] = rows;
       }},
  };
  for (int splits : {0, 3})
    for (const BadValue& bad : bad_values) {
      c.num_splits = splits;
      check_bad_sequence(c, bad);
    }
}

// ---- errors the host sees ----------------------------------------------------------------------

// The call on device tensors fails with `code` and a message containing `expect`, and o, lse and
// both caches are byte for byte as they were.
void expect_rejected(const Case& c, StatusCode code, const std::string& expect, const CallEdit& edit) {
  SCOPED_TRACE(expect + " | " + c.describe());
  const Decode before = make_setup(c, test_seed());
  Decode gpu = make_setup(c, test_seed());
  const Status st = run_on_gpu(&gpu, edit);
  EXPECT_EQ(st.code(), code) << st.to_string();
  EXPECT_NE(st.message().find(expect), std::string::npos)
      << "message \"" << st.message() << "\" should contain \"" << expect << "\"";
  EXPECT_TRUE(same_bits("o (must be unwritten)", gpu.o, before.o));
  EXPECT_TRUE(same_bits("lse (must be unwritten)", gpu.lse, before.lse));
  EXPECT_TRUE(same_bits("k_cache (must be unwritten)", gpu.k_cache, before.k_cache));
  EXPECT_TRUE(same_bits("v_cache (must be unwritten)", gpu.v_cache, before.v_cache));
}

TEST_P(GpuKVCache, HostCheckedErrorsNameTheArgumentAndWriteNothing) {
  Case c = base();
  c.block_size = 8;
  c.capacity = 40;
  c.cache_lens = {5, 17};
  c.seqlen_new = 2;
  c.rotary = 1;
  c.alibi = 1;
  const DType other = c.dtype == DType::kFloat16 ? DType::kBFloat16 : DType::kFloat16;
  const StatusCode kInvalid = StatusCode::kInvalidArgument;
  struct Bad {
    std::string expect;
    CallEdit edit;
  };
  const std::vector<Bad> cases = {
      {"v_cache: dtype", [&](Call& k) { k.args.v_cache.dtype = other; }},
      {"k_new: dtype", [&](Call& k) { k.args.k_new.dtype = other; }},
      {"k_new: shape[2]", [](Call& k) { k.args.k_new.shape[2] = 1; }},
      {"v_new: k_new and v_new come together", [](Call& k) { k.args.v_new = {}; }},
      {"k_cache: head_dim = 16", [](Call& k) { k.args.k_cache.shape[3] = 16; k.args.v_cache.shape[3] = 16; }},
      {"k_cache: heads = 3", [](Call& k) { k.args.k_cache.shape[2] = 3; k.args.v_cache.shape[2] = 3; }},
      {"block_table: dtype must be int32", [](Call& k) { k.args.block_table.dtype = DType::kFloat32; }},
      {"block_table: batch", [](Call& k) { k.args.block_table.shape[0] = 1; }},
      {"cache_seqlens: length 1", [](Call& k) { k.args.cache_seqlens.shape[0] = 1; }},
      {"cache_seqlens: dtype must be int32", [](Call& k) { k.args.cache_seqlens.dtype = DType::kFloat32; }},
      {"cache_seqlens: on ", [](Call& k) { k.args.cache_seqlens.device = DeviceType::kCPU; }},
      {"cache_batch_idx: not supported with a paged cache",
       [](Call& k) { k.args.cache_batch_idx = k.args.cache_seqlens; }},
      {"cache_seqlen = 39 plus seqlen_new = 2 exceeds the cache capacity 40",
       [](Call& k) { k.args.cache_seqlens = {}; k.args.cache_seqlen = 39; }},
      {"rotary_cos: seqlen_rotary = 6 is too short", [](Call& k) {
         k.args.cache_seqlens = {};
         k.args.cache_seqlen = 5;  // positions 5 and 6 rotate
         k.args.rotary_cos.shape[0] = 6;
         k.args.rotary_sin.shape[0] = 6;
       }},
      {"rotary_cos: dtype", [&](Call& k) { k.args.rotary_cos.dtype = other; }},
      {"rotary_cos: rotary_dim", [](Call& k) { k.args.rotary_cos.shape[1] = 33; k.args.rotary_sin.shape[1] = 33; }},
      {"rotary_cos: needs k_new", [](Call& k) { k.args.k_new = {}; k.args.v_new = {}; }},
      {"alibi_slopes: dtype must be float32", [&](Call& k) { k.options.alibi_slopes.dtype = other; }},
      {"lse: shape", [](Call& k) { k.lse.shape[2] = 2; }},
      {"o: dtype", [&](Call& k) { k.o.dtype = other; }},
      {"num_splits", [](Call& k) { k.args.num_splits = -1; }},
      {"dropout_p", [](Call& k) { k.options.dropout_p = 0.1f; }},
      {"backend: the reference backend runs on CPU tensors only",
       [](Call& k) { k.options.backend = Backend::kReference; }},
      {"o: shares memory with k_cache", [](Call& k) {
         k.args.k_cache.data = k.o.data;
         k.args.k_cache.shape[0] = 1;
         k.args.v_cache.shape[0] = 1;
       }},
      {"k_cache: shares memory with v_new", [](Call& k) { k.args.v_new.data = k.args.k_cache.data; }},
  };
  for (const Bad& bad : cases) expect_rejected(c, kInvalid, bad.expect, bad.edit);
}

// float32 tensors are valid but have no CUDA decoding kernels; head dims past 256 are invalid on
// any device. Neither call writes anything.
TEST(GpuKVCacheRefusals, Float32UnsupportedHeadDimPast256InvalidNothingWritten) {
  FLARE_SKIP_WITHOUT_CUDA();
  Case fp32 = gpu_case(DType::kFloat32);
  fp32.seqlen_new = 1;
  expect_rejected(fp32, StatusCode::kUnsupported, "float32", {});
  Case wide = gpu_case(DType::kBFloat16);
  wide.head_dim = 264;
  wide.seqlen_new = 1;
  wide.block_size = 16;
  expect_rejected(wide, StatusCode::kInvalidArgument, "q: head_dim = 264", {});
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GpuKVCache, ::testing::Values(DType::kFloat16, DType::kBFloat16),
                         dtype_param_name);

}  // namespace
}  // namespace flare::test
