// test_cpu_kvcache_in_place.cpp — the CPU path of attention_with_kvcache reads the cache in place.
//
// Until the backends could find key rows through a locator (src/cpu/key_rows.h), the call copied
// every sequence's used cache rows into a packed (total_k, h_kv, d) buffer and ran the varlen
// attention on it. That path is kept here as the reference: after a call (which appends the new
// keys to the cache), the test gathers the cache rows itself, packs q rotated as the call does,
// and runs the same backend on the packed copy. The call's o and lse must be the same bits, for
// contiguous caches (with permuted cache_batch_idx), paged ones of block sizes 1, 3, 16 and 256,
// both forward modes of the flash kernel (at most 4 query rows, and more) and the reference.
// And no cache-sized buffer may be allocated: every heap allocation of this binary is counted
// (heap_counter.h), and the peak growth during a call over a 16 MiB cache must stay far
// below one copy of the keys.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/backends.h"
#include "heap_counter.h"
#include "kvcache_cases.h"
#include "test_util.h"

namespace flare::test {
namespace {

using namespace kvcache;  // Case, Decode, make_setup, make_call, rotate, ...

// The previous CPU path, after the call `s` went through (its cache holds the appended keys):
// gather each sequence's n_i rows into packed K and V, pack q rotated at its positions, and run
// `backend` on the varlen problem. Returns packed o (total_q, h_q, d) and lse (h_q, total_q).
struct Gathered {
  HostTensor o, lse;
};

Gathered gathered_reference(const Decode& s, Backend backend) {
  const Case& c = s.c;
  const int b = c.batch, sq = c.seqlen_q, hq = c.heads_q, hkv = c.heads_kv, d = c.head_dim;
  const bool per_row = c.options.causal || c.options.window_left >= 0 || c.options.window_right >= 0;
  std::vector<int32_t> cu_q(static_cast<size_t>(b) + 1, 0), cu_k(static_cast<size_t>(b) + 1, 0);
  int max_k = 0;
  for (int i = 0; i < b; ++i) {
    cu_q[static_cast<size_t>(i) + 1] = (i + 1) * sq;
    cu_k[static_cast<size_t>(i) + 1] = cu_k[static_cast<size_t>(i)] + static_cast<int32_t>(s.n(i));
    max_k = std::max(max_k, static_cast<int>(s.n(i)));
  }
  const int64_t total_q = int64_t{b} * sq, total_k = cu_k[static_cast<size_t>(b)];
  HostTensor q = HostTensor::make(c.dtype, {total_q, hq, d});
  HostTensor k = HostTensor::make(c.dtype, {total_k, hkv, d});
  HostTensor v = HostTensor::make(c.dtype, {total_k, hkv, d});
  Gathered g{HostTensor::make(c.dtype, {total_q, hq, d}),
             HostTensor::make(DType::kFloat32, {hq, total_q})};
  for (int i = 0; i < b; ++i) {
    for (int j = 0; j < sq; ++j)
      for (int h = 0; h < hq; ++h) {
        std::vector<float> x(static_cast<size_t>(d));
        for (int e = 0; e < d; ++e)
          x[static_cast<size_t>(e)] = s.q[((static_cast<size_t>(i) * sq + j) * hq + h) * d + e];
        if (c.rotary) rotate(s, x.data(), c.cache_lens[static_cast<size_t>(i)] + (per_row ? j : 0));
        for (int e = 0; e < d; ++e) q.set({int64_t{i} * sq + j, h, e}, x[static_cast<size_t>(e)]);
      }
    for (int64_t t = 0; t < s.n(i); ++t)
      for (int h = 0; h < hkv; ++h)
        for (int e = 0; e < d; ++e) {
          const int64_t row = cu_k[static_cast<size_t>(i)] + t;
          k.set({row, h, e}, load_as_float(s.k_cache.view.data, s.slot(i, t, h) + e, c.dtype));
          v.set({row, h, e}, load_as_float(s.v_cache.view.data, s.slot(i, t, h) + e, c.dtype));
        }
  }
  VarlenArgs varlen;
  varlen.cu_seqlens_q = TensorView::contiguous(cu_q.data(), DType::kInt32, {b + 1});
  varlen.cu_seqlens_k = TensorView::contiguous(cu_k.data(), DType::kInt32, {b + 1});
  varlen.max_seqlen_q = sq;
  varlen.max_seqlen_k = max_k;
  AttentionOptions opt = c.options;
  opt.backend = backend;
  if (c.alibi) opt.alibi_slopes = s.alibi_t.view;
  const Status st = attention_forward(q.view, k.view, v.view, g.o.view, g.lse.view, opt, varlen);
  EXPECT_TRUE(st.ok()) << st.to_string();
  return g;
}

// One case: the call's o and lse against the gathered reference, bit for bit, on `backend`.
void expect_same_bits(const Case& c, Backend backend, uint64_t seed) {
  Decode s = make_setup(c, seed);
  const Status st = invoke(make_call(c, s.views(), backend));
  ASSERT_TRUE(st.ok()) << st.to_string() << " | " << c.describe();
  const Gathered g = gathered_reference(s, backend);
  const int b = c.batch, sq = c.seqlen_q, hq = c.heads_q, d = c.head_dim;
  const size_t es = dtype_size(c.dtype);
  int64_t o_diffs = 0, lse_diffs = 0;
  for (int i = 0; i < b; ++i)
    for (int j = 0; j < sq; ++j)
      for (int h = 0; h < hq; ++h) {
        const int64_t row = int64_t{i} * sq + j;
        const auto* got = s.o.bytes.data() + static_cast<size_t>(((row * hq) + h) * d) * es;
        const auto* want = g.o.bytes.data() + static_cast<size_t>(((row * hq) + h) * d) * es;
        o_diffs += std::memcmp(got, want, static_cast<size_t>(d) * es) != 0;
        const float l_got = s.lse.get({i, h, j}), l_want = g.lse.get({h, row});
        lse_diffs += std::memcmp(&l_got, &l_want, sizeof(float)) != 0;
      }
  const char* name = backend == Backend::kReference ? "reference " : "flash ";
  EXPECT_EQ(o_diffs, 0) << "o head vectors differing from the gathered path: " << name
                        << c.describe() << " (setup seed " << seed << ")";
  EXPECT_EQ(lse_diffs, 0) << "lse entries differing from the gathered path: " << name
                          << c.describe() << " (setup seed " << seed << ")";
}

// The layouts: contiguous (cache_batch_idx off and on: a fresh permutation per seed) and paged
// with pages of 1, 3, 16 and 256 rows (pages straddle the kernels' 64-key tiles and 512-key
// chunks, or hold several of them).
void for_each_layout(Case c, Backend backend, uint64_t seed = test_seed()) {
  for (bool idx : {false, true}) {
    c.block_size = 0;
    c.batch_idx = idx;
    expect_same_bits(c, backend, seed);
  }
  c.batch_idx = false;
  for (int bs : {1, 3, 16, 256}) {
    c.block_size = bs;
    expect_same_bits(c, backend, seed);
  }
}

Case long_case() {
  Case c;
  c.batch = 3;
  c.heads_q = 8;
  c.heads_kv = 2;
  c.head_dim = 40;
  c.cache_lens = {0, 70, 1100};  // empty, two tiles, several decoding chunks
  c.capacity = 1110;
  return c;
}

TEST(KVCacheInPlace, DecodingPathSameBitsAsGathered) {
  for (Backend backend : {Backend::kFlash, Backend::kReference}) {
    Case c = long_case();
    c.seqlen_q = 1;
    c.seqlen_new = 1;
    c.rotary = 1;
    for_each_layout(c, backend);
    c.seqlen_q = 4;  // the decoding path's most query rows, causal, bf16
    c.seqlen_new = 4;
    c.options.causal = true;
    c.dtype = DType::kBFloat16;
    for_each_layout(c, backend);
  }
}

TEST(KVCacheInPlace, QueryTilePathSameBitsAsGathered) {
  Case c = long_case();
  c.seqlen_q = 9;  // more than 4 query rows: the queries-in-lanes forward
  c.seqlen_new = 3;
  c.rotary = 2;
  c.options.causal = true;
  c.options.window_left = 200;
  c.options.softcap = 4.0f;
  c.alibi = 2;
  c.dtype = DType::kFloat16;
  for_each_layout(c, Backend::kFlash);
}

TEST(KVCacheInPlace, ManySeedsOfPermutedRowsAndPages) {
  // Each seed shuffles the cache rows and the pages anew.
  for (uint64_t extra = 1; extra <= 4; ++extra) {
    Case c;
    c.batch = 4;
    c.cache_lens = {13, 0, 64, 65};
    c.capacity = 70;
    c.seqlen_new = 2;
    c.seqlen_q = 2;
    c.options.causal = true;
    for_each_layout(c, Backend::kFlash, test_seed() + extra);
  }
}

#if FLARE_HEAP_COUNTER
// Peak heap growth during one flash call over a cache of s_cache 4096 × 8 kv heads × 128 fp32
// (16 MiB of keys): the gathered path allocated two copies of it (32 MiB); in place, the call
// holds packed q and o, per-thread tiles and the decoding path's partial results.
TEST(KVCacheInPlace, NoCacheSizedAllocation) {
  for (int block_size : {0, 16}) {
    Case c;
    c.batch = 1;
    c.heads_q = 32;
    c.heads_kv = 8;
    c.head_dim = 128;
    c.cache_lens = {4095};
    c.capacity = 4096;
    c.seqlen_new = 1;
    c.block_size = block_size;
    Decode s = make_setup(c, test_seed());
    const int64_t key_bytes = int64_t{4096} * c.heads_kv * c.head_dim * 4;
    const Call call = make_call(c, s.views(), Backend::kFlash);
    const HeapGrowth growth;
    const Status st = invoke(call);
    const int64_t extra = growth.bytes();
    ASSERT_TRUE(st.ok()) << st.to_string();
    RecordProperty(block_size ? "extra_bytes_paged" : "extra_bytes_contiguous", std::to_string(extra));
    EXPECT_LT(extra, key_bytes / 8) << "block_size " << block_size << ": a call allocated " << extra
                                    << " bytes; the keys it reads are " << key_bytes << " bytes";
  }
}
#endif

}  // namespace
}  // namespace flare::test
