// test_cpu_kvcache.cpp — attention_with_kvcache on the CPU (flare/kvcache.h).
//
// Cases come from kvcache_cases.h: logical contents drawn first, then laid out as a contiguous or
// paged cache, NaN in every unused slot; the expectation is the float64 reference of each
// sequence's fixed-length attention, with the tolerance rule of docs/architecture.md against the
// same reference in low precision. Appended cache rows must equal the rotated new keys; every other
// cache byte must be unchanged. Bad inputs must be rejected with a message naming the argument,
// leaving outputs and caches byte for byte as they were.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/message.h"
#include "flare/kvcache.h"
#include "kvcache_cases.h"
#include "test_util.h"

namespace flare::test {
namespace {

using namespace kvcache;  // Case, Decode, make_setup, make_call, expected, ...

// Appended cache rows equal the rotated new keys (within one rounding of the dtype) and the new
// values exactly; every other cache element is bit for bit what it was.
void check_cache(const Decode& s, const Decode& before) {
  const int hkv = s.c.heads_kv, d = s.c.head_dim;
  const DType dt = s.c.dtype;
  const size_t es = dtype_size(dt);
  std::vector<char> written(s.k_cache.bytes.size() / es, 0);
  for (int i = 0; i < s.c.batch; ++i)
    for (int j = 0; j < s.c.seqlen_new; ++j) {
      const int64_t pos = s.c.cache_lens[static_cast<size_t>(i)] + j;
      for (int h = 0; h < hkv; ++h) {
        std::vector<float> k(static_cast<size_t>(d));
        for (int e = 0; e < d; ++e)
          k[static_cast<size_t>(e)] = s.k_new[((static_cast<size_t>(i) * s.c.seqlen_new + j) * hkv + h) * d + e];
        float bound = 0.0f;  // |x0·cos − x1·sin| rounds with error ≤ u·(|x0| + |x1|) ≤ 2u·max|k|
        for (float x : k) bound = std::max(bound, std::fabs(x));
        bound *= 4.0f * static_cast<float>(unit_roundoff(dt));
        if (s.c.rotary) rotate(s, k.data(), pos);
        for (int e = 0; e < d; ++e) {
          const int64_t at = s.slot(i, pos, h) + e;
          written[static_cast<size_t>(at)] = 1;
          const float got = load_as_float(s.k_cache.view.data, at, dt);
          const float want = k[static_cast<size_t>(e)];
          ASSERT_LE(std::fabs(got - want), bound)
              << "k_cache at sequence " << i << " position " << pos << " head " << h << " dim " << e;
          ASSERT_EQ(load_as_float(s.v_cache.view.data, at, dt),
                    s.v_new[((static_cast<size_t>(i) * s.c.seqlen_new + j) * hkv + h) * d + e]);
        }
      }
    }
  for (size_t e = 0; e < written.size(); ++e) {
    if (written[e]) continue;
    ASSERT_EQ(std::memcmp(&s.k_cache.bytes[e * es], &before.k_cache.bytes[e * es], es), 0)
        << "k_cache element " << e << " changed but was not appended to";
    ASSERT_EQ(std::memcmp(&s.v_cache.bytes[e * es], &before.v_cache.bytes[e * es], es), 0)
        << "v_cache element " << e << " changed but was not appended to";
  }
}

// Runs one case on both CPU backends and checks outputs and caches; returns the flash run.
Decode run_case(const Case& c) {
  const Decode before = make_setup(c, test_seed());
  Decode last;
  for (Backend backend : {Backend::kReference, Backend::kAuto}) {
    Decode s = make_setup(c, test_seed());
    const Status st = invoke(make_call(c, s.views(), backend));
    EXPECT_TRUE(st.ok()) << st.to_string() << " | " << c.describe();
    if (!st.ok()) return s;
    check_cache(s, before);
    const Expected ex = expected(s);
    const std::string what = cat(backend == Backend::kReference ? "reference " : "flash ", c.describe());
    EXPECT_TRUE(within_tolerance("o " + what, read_all(s.o), ex.o, ex.o_naive, c.dtype, ex.reduction));
    EXPECT_TRUE(within_tolerance("lse " + what, read_all(s.lse), ex.lse, ex.lse_naive, DType::kFloat32,
                                 ex.reduction));
    last = std::move(s);
  }
  return last;
}

TEST(KVCache, DecodeOneTokenContiguous) { run_case({}); }

TEST(KVCache, PagedBlockSizes) {
  for (int bs : {1, 3, 16, 256, 7}) {
    Case c;
    c.block_size = bs;
    c.capacity = 300;
    c.cache_lens = {0, 33, 257};
    c.batch = 3;
    c.seqlen_new = 2;
    c.options.causal = true;
    run_case(c);
  }
}

TEST(KVCache, PagedEqualsContiguousBitForBit) {
  for (int bs : {1, 5, 16}) {
    Case c;
    c.batch = 3;
    c.cache_lens = {3, 0, 40};
    c.seqlen_q = 3;
    c.seqlen_new = 3;
    c.capacity = 48;
    c.rotary = 1;
    c.options.causal = true;
    c.dtype = DType::kBFloat16;
    const Decode contiguous = run_case(c);
    c.block_size = bs;
    const Decode paged = run_case(c);
    EXPECT_EQ(contiguous.o.bytes, paged.o.bytes) << "block_size " << bs;
    EXPECT_EQ(contiguous.lse.bytes, paged.lse.bytes) << "block_size " << bs;
  }
}

TEST(KVCache, MultiQueryCausalRightAligned) {
  for (bool causal : {true, false}) {
    Case c;
    c.seqlen_q = 5;
    c.cache_lens = {2, 20};  // sequence 0 has fewer keys than queries: its first rows see none
    c.options.causal = causal;
    c.dtype = DType::kFloat16;
    run_case(c);
  }
}

TEST(KVCache, AppendWithAndWithoutRotary) {
  for (int rotary : {0, 1, 2})
    for (int sq : {1, 4}) {
      Case c;
      c.seqlen_q = sq;
      c.seqlen_new = sq;
      c.rotary = rotary;
            c.head_dim = 40;
      c.options.causal = sq > 1;
      c.block_size = rotary == 2 ? 16 : 0;
      run_case(c);
    }
}

TEST(KVCache, RotaryWholeHeadNonCausal) {
  Case c;
  c.seqlen_q = 3;  // not causal: every query rotated at the first new position
  c.seqlen_new = 2;
  c.rotary = 2;
  c.rotary_dim = 32;
  run_case(c);
}

TEST(KVCache, GqaMqaWindowSoftcapAlibi) {
  Case c;
  c.heads_q = 8;
  c.heads_kv = 1;
  c.seqlen_q = 2;
  c.seqlen_new = 2;
  c.cache_lens = {30, 11};
  c.options.causal = true;
  c.options.window_left = 6;
  c.options.softcap = 5.0f;
  c.alibi = 1;
  c.dtype = DType::kBFloat16;
  run_case(c);
  c.block_size = 4;
  c.heads_kv = 2;
  run_case(c);
}

TEST(KVCache, CacheBatchIdxAndScalarSeqlen) {
  Case c;
  c.batch_idx = true;
  c.seqlen_new = 1;
  run_case(c);
  c.scalar_seqlen = true;
  c.cache_lens = {9, 9};
  run_case(c);
}

TEST(KVCache, EmptyCacheAppend) {
  Case c;
  c.cache_lens = {0, 0};
  c.seqlen_new = 3;
  c.seqlen_q = 3;
  c.options.causal = true;
  run_case(c);
  c.seqlen_new = 0;  // nothing to attend to: O = 0, LSE = −inf
  c.seqlen_q = 1;
  const Decode s = run_case(c);
  EXPECT_EQ(s.lse.get({0, 0, 0}), -INFINITY);
}

TEST(KVCache, LseIsOptional) {
  Case c;
  c.seqlen_new = 1;
  c.block_size = 4;
  Decode with = make_setup(c, test_seed()), without = make_setup(c, test_seed());
  Status st = invoke(make_call(c, with.views(), Backend::kAuto));
  ASSERT_TRUE(st.ok()) << st.to_string();
  Case no_lse = c;
  no_lse.with_lse = false;
  st = invoke(make_call(no_lse, without.views(), Backend::kAuto));
  ASSERT_TRUE(st.ok()) << st.to_string();
  EXPECT_EQ(with.o.bytes, without.o.bytes);
  EXPECT_EQ(with.k_cache.bytes, without.k_cache.bytes);
}

// ---- rejected calls ------------------------------------------------------------------------

struct Rejection {
  std::string expect;  // text the message must contain (the argument's name and the rule)
  std::function<void(Decode&, KVCacheArgs&, AttentionOptions&)> mutate;
};

void expect_rejected(const Case& c, const Rejection& r) {
  Decode s = make_setup(c, test_seed());
  Call call = make_call(c, s.views(), Backend::kAuto);
  KVCacheArgs& a = call.args;
  AttentionOptions& opt = call.options;
  r.mutate(s, a, opt);
  const auto o = s.o.bytes, lse = s.lse.bytes, kc = s.k_cache.bytes, vc = s.v_cache.bytes;
  const Status st = attention_with_kvcache(s.qt.view, a, s.o.view, s.lse.view, opt);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << r.expect << ": " << st.to_string();
  EXPECT_NE(st.message().find(r.expect), std::string::npos)
      << "message \"" << st.message() << "\" should contain \"" << r.expect << "\"";
  EXPECT_EQ(s.o.bytes, o) << r.expect << ": o was written";
  EXPECT_EQ(s.lse.bytes, lse) << r.expect << ": lse was written";
  EXPECT_EQ(s.k_cache.bytes, kc) << r.expect << ": k_cache was written";
  EXPECT_EQ(s.v_cache.bytes, vc) << r.expect << ": v_cache was written";
}

TEST(KVCache, BadInputsNamedNothingWritten) {
  Case paged;
  paged.block_size = 8;
  paged.seqlen_new = 2;
  paged.rotary = 1;
  Case contiguous;
  contiguous.seqlen_new = 1;
  contiguous.batch_idx = true;
  contiguous.rotary = 2;
  auto set_int = [](HostTensor& t, int64_t e, int32_t v) { static_cast<int32_t*>(t.view.data)[e] = v; };
  const std::vector<std::pair<Case, Rejection>> cases = {
      {paged, {"block_table[1, 2] = 99", [&](Decode& s, KVCacheArgs&, AttentionOptions&) { set_int(s.table, s.max_blocks + 2, 99); }}},
      {paged, {"block_table[0, 0] = -1", [&](Decode& s, KVCacheArgs&, AttentionOptions&) { set_int(s.table, 0, -1); }}},
      {paged, {"appended to by sequence", [&](Decode& s, KVCacheArgs&, AttentionOptions&) {
         set_int(s.table, 0, static_cast<int32_t*>(s.table.view.data)[s.max_blocks + 2]); }}},
      {paged, {"cache_seqlens[1] = 39 plus seqlen_new = 2 exceeds the cache capacity 40",
               [&](Decode& s, KVCacheArgs&, AttentionOptions&) { set_int(s.seqlens, 1, 39); }}},
      {paged, {"cache_seqlens[0] = -1", [&](Decode& s, KVCacheArgs&, AttentionOptions&) { set_int(s.seqlens, 0, -1); }}},
      {paged, {"block_table: dtype must be int32", [&](Decode&, KVCacheArgs& a, AttentionOptions&) { a.block_table.dtype = DType::kFloat32; }}},
      {paged, {"block_table: batch", [&](Decode&, KVCacheArgs& a, AttentionOptions&) { a.block_table.shape[0] = 1; }}},
      {paged, {"cache_batch_idx: not supported with a paged cache", [&](Decode& s, KVCacheArgs& a, AttentionOptions&) { a.cache_batch_idx = s.seqlens.view; }}},
      {paged, {"v_cache: dtype", [&](Decode&, KVCacheArgs& a, AttentionOptions&) { a.v_cache.dtype = DType::kFloat16; }}},
      {paged, {"k_cache: head_dim = 16", [&](Decode&, KVCacheArgs& a, AttentionOptions&) { a.k_cache.shape[3] = 16; a.v_cache.shape[3] = 16; }}},
      {paged, {"k_cache: heads = 3", [&](Decode&, KVCacheArgs& a, AttentionOptions&) { a.k_cache.shape[2] = 3; a.v_cache.shape[2] = 3; }}},
      {paged, {"k_new: shape[2]", [&](Decode&, KVCacheArgs& a, AttentionOptions&) { a.k_new.shape[2] = 1; }}},
      {paged, {"v_new: k_new and v_new come together", [&](Decode&, KVCacheArgs& a, AttentionOptions&) { a.v_new = {}; }}},
      {paged, {"rotary_cos: rotary_dim", [&](Decode&, KVCacheArgs& a, AttentionOptions&) { a.rotary_cos.shape[1] = 17; a.rotary_sin.shape[1] = 17; }}},
      {paged, {"rotary_sin: shape must equal", [&](Decode&, KVCacheArgs& a, AttentionOptions&) { a.rotary_sin.shape[0] = 3; }}},
      {paged, {"rotary_cos: seqlen_rotary = 10 is too short", [&](Decode&, KVCacheArgs& a, AttentionOptions&) { a.rotary_cos.shape[0] = 10; a.rotary_sin.shape[0] = 10; }}},
      {paged, {"rotary_cos: needs k_new", [&](Decode&, KVCacheArgs& a, AttentionOptions&) { a.k_new = {}; a.v_new = {}; }}},
      {paged, {"dropout_p", [&](Decode&, KVCacheArgs&, AttentionOptions& o) { o.dropout_p = 0.1f; }}},
      {paged, {"num_splits", [&](Decode&, KVCacheArgs& a, AttentionOptions&) { a.num_splits = -1; }}},
      {paged, {"o: shares memory with k_cache", [&](Decode& s, KVCacheArgs& a, AttentionOptions&) {
         a.k_cache.data = s.o.view.data; a.k_cache.shape[0] = 1; a.v_cache.shape[0] = 1; }}},
      {paged, {"k_cache: shares memory with v_new", [&](Decode&, KVCacheArgs& a, AttentionOptions&) { a.v_new.data = a.k_cache.data; }}},
      {contiguous, {"cache_batch_idx[1] = 4 is outside [0, batch_cache = 4)",
                    [&](Decode& s, KVCacheArgs&, AttentionOptions&) { set_int(s.idx, 1, 4); }}},
      {contiguous, {"share cache row", [&](Decode& s, KVCacheArgs&, AttentionOptions&) { set_int(s.idx, 1, static_cast<int32_t*>(s.idx.view.data)[0]); }}},
      {contiguous, {"cache_seqlens: length 1", [&](Decode&, KVCacheArgs& a, AttentionOptions&) { a.cache_seqlens.shape[0] = 1; }}},
      {contiguous, {"cache_seqlens[1] = 40 plus seqlen_new = 1 exceeds the cache capacity 40 (seqlen_cache)",
                    [&](Decode& s, KVCacheArgs&, AttentionOptions&) { set_int(s.seqlens, 1, 40); }}},
      {contiguous, {"q: expected 4 dimensions", [&](Decode& s, KVCacheArgs&, AttentionOptions&) { s.qt.view.ndim = 3; }}},
      {contiguous, {"q: batch * heads_q * seqlen_q exceeds", [&](Decode& s, KVCacheArgs&, AttentionOptions&) {
         s.qt.view.shape[0] = int64_t{1} << 40; s.qt.view.shape[2] = 1024; }}},
      {contiguous, {"lse: shape", [&](Decode& s, KVCacheArgs&, AttentionOptions&) { s.lse.view.shape[2] = 2; }}},
      {contiguous, {"rotary_cos: dtype", [&](Decode&, KVCacheArgs& a, AttentionOptions&) { a.rotary_cos.dtype = DType::kBFloat16; }}},
  };
  for (const auto& [c, r] : cases) expect_rejected(c, r);
}

// CUDA tensors reach the CUDA kernels (test_gpu_kvcache); a build without CUDA says what it lacks,
// after the host-side checks, with nothing written.
TEST(KVCache, CudaTensorsNeedACudaBuild) {
  if (cuda_built()) GTEST_SKIP() << "this build has the CUDA kernels: test_gpu_kvcache runs them";
  Decode s = make_setup({}, test_seed());
  KVCacheArgs a = make_call(s.c, s.views(), Backend::kAuto).args;
  TensorView q = s.qt.view, o = s.o.view, lse = s.lse.view;
  for (TensorView* t : {&q, &o, &lse, &a.k_cache, &a.v_cache, &a.cache_seqlens}) t->device = DeviceType::kCUDA;
  const Status st = attention_with_kvcache(q, a, o, lse);
  EXPECT_EQ(st.code(), StatusCode::kUnsupported) << st.to_string();
  EXPECT_NE(st.message().find("-DFLARE_CUDA=ON"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace flare::test
