// test_cpu_c_api_kvcache.cpp — the C mirror of KV-cache decoding (flare/c_api.h, "KV-cache
// decoding"): a decoding step driven from C (c_api_from_c.c) must produce exactly the bytes the
// C++ entry point produces, cache included, and a rejected call must come back as a code plus a
// message naming the argument, with nothing written.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "flare/c_api.h"
#include "flare/kvcache.h"

extern "C" int flare_c_kvcache_decode(void* q, void* k_cache, void* v_cache, void* k_new,
                                      void* v_new, void* block_table, void* cache_seqlens,
                                      void* o, void* lse, const int64_t* q_shape,
                                      const int64_t* cache_shape, int64_t max_blocks);

namespace flare {
namespace {

// b = 2 sequences of 5 and 0 cached tokens in a paged cache of 6 blocks of 3 rows.
struct Step {
  static constexpr int64_t b = 2, hq = 4, hkv = 2, d = 8, blocks = 6, bs = 3, max_blocks = 3;
  std::vector<float> q, k_cache, v_cache, k_new, v_new, o, lse;
  std::vector<int32_t> table = {4, 1, -1, 0, -1, -1}, seqlens = {5, 0};
  Step() {
    std::mt19937 rng(7);
    std::normal_distribution<float> n(0.0f, 1.0f);
    auto draw = [&](std::vector<float>& v, int64_t count) {
      v.resize(static_cast<size_t>(count));
      for (float& x : v) x = n(rng);
    };
    draw(q, b * hq * d);
    draw(k_cache, blocks * bs * hkv * d);
    draw(v_cache, blocks * bs * hkv * d);
    draw(k_new, b * hkv * d);
    draw(v_new, b * hkv * d);
    o.assign(static_cast<size_t>(b * hq * d), -7.0f);
    lse.assign(static_cast<size_t>(b * hq), -7.0f);
  }
  int run_c() {
    const int64_t q_shape[4] = {b, 1, hq, d}, cache_shape[4] = {blocks, bs, hkv, d};
    return flare_c_kvcache_decode(q.data(), k_cache.data(), v_cache.data(), k_new.data(),
                                  v_new.data(), table.data(), seqlens.data(), o.data(), lse.data(),
                                  q_shape, cache_shape, max_blocks);
  }
  Status run_cpp() {
    KVCacheArgs a;
    a.k_cache = TensorView::contiguous(k_cache.data(), DType::kFloat32, {blocks, bs, hkv, d});
    a.v_cache = TensorView::contiguous(v_cache.data(), DType::kFloat32, {blocks, bs, hkv, d});
    a.k_new = TensorView::contiguous(k_new.data(), DType::kFloat32, {b, 1, hkv, d});
    a.v_new = TensorView::contiguous(v_new.data(), DType::kFloat32, {b, 1, hkv, d});
    a.block_table = TensorView::contiguous(table.data(), DType::kInt32, {b, max_blocks});
    a.cache_seqlens = TensorView::contiguous(seqlens.data(), DType::kInt32, {b});
    AttentionOptions opt;
    opt.causal = true;
    return attention_with_kvcache(TensorView::contiguous(q.data(), DType::kFloat32, {b, 1, hq, d}),
                                  a, TensorView::contiguous(o.data(), DType::kFloat32, {b, 1, hq, d}),
                                  TensorView::contiguous(lse.data(), DType::kFloat32, {b, hq, 1}),
                                  opt);
  }
};

TEST(CApiKVCache, FromCEqualsCpp) {
  Step from_c, from_cpp;
  ASSERT_EQ(from_c.run_c(), FLARE_OK) << flare_last_error();
  const Status st = from_cpp.run_cpp();
  ASSERT_TRUE(st.ok()) << st.to_string();
  EXPECT_EQ(from_c.o, from_cpp.o);
  EXPECT_EQ(from_c.lse, from_cpp.lse);
  EXPECT_EQ(from_c.k_cache, from_cpp.k_cache);
  EXPECT_EQ(from_c.v_cache, from_cpp.v_cache);
  EXPECT_NE(from_c.k_cache, Step().k_cache) << "the new keys were not appended";
}

TEST(CApiKVCache, RejectionNamesArgumentWritesNothing) {
  Step s;
  s.table[1] = 6;  // sequence 0 holds 5 + 1 tokens: its second block is outside [0, 6)
  const Step before = s;
  EXPECT_EQ(s.run_c(), FLARE_INVALID_ARGUMENT);
  EXPECT_NE(std::string(flare_last_error()).find("block_table[0, 1] = 6"), std::string::npos)
      << flare_last_error();
  EXPECT_EQ(s.o, before.o);
  EXPECT_EQ(s.lse, before.lse);
  EXPECT_EQ(s.k_cache, before.k_cache);
  EXPECT_EQ(s.v_cache, before.v_cache);
}

TEST(CApiKVCache, BadRankAndMissingArguments) {
  Step s;
  const flare_tensor q{s.q.data(), FLARE_FLOAT32, FLARE_CPU, 0, 4, {2, 1, 4, 8}, {32, 32, 8, 1}};
  flare_kvcache_args a{};
  a.k_cache.ndim = 9;
  EXPECT_EQ(flare_attention_with_kvcache(&q, &a, &q, nullptr, nullptr, nullptr),
            FLARE_INVALID_ARGUMENT);
  EXPECT_NE(std::string(flare_last_error()).find("k_cache: ndim = 9"), std::string::npos)
      << flare_last_error();
  EXPECT_EQ(flare_attention_with_kvcache(&q, nullptr, &q, nullptr, nullptr, nullptr),
            FLARE_INVALID_ARGUMENT);
  EXPECT_NE(std::string(flare_last_error()).find("cache"), std::string::npos);
}

}  // namespace
}  // namespace flare
