// test_cpu_kvcache.cpp — attention_with_kvcache on the CPU (flare/kvcache.h).
//
// Each case draws its logical contents first — q, each sequence's cached keys and values, the new
// ones, rotary tables — and only then lays them out as a contiguous or paged cache (shuffled
// blocks, unused block_table entries −1, every unused cache slot NaN so a stray read shows). The
// expectation is built independently of the decoding code: per sequence, fixed-length attention
// of q (rotated here) over the logical keys, by the float64 reference, with the tolerance rule
// of DESIGN.md against the same reference in low precision. Appended cache rows must equal the
// rotated new keys; every other cache byte must be unchanged. Bad inputs must be rejected with a
// message naming the argument, leaving outputs and caches byte for byte as they were.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/message.h"
#include "flare/kvcache.h"
#include "test_util.h"

namespace flare::test {
namespace {

struct Case {
  int batch = 2;
  int seqlen_q = 1;
  int heads_q = 4;
  int heads_kv = 2;
  int head_dim = 32;
  DType dtype = DType::kFloat32;
  std::vector<int> cache_lens = {5, 17};  // tokens already cached, per sequence
  int seqlen_new = 0;
  int capacity = 40;        // seqlen_cache, or at least max_blocks · block_size
  int block_size = 0;       // 0 → contiguous cache
  bool batch_idx = false;   // contiguous only: sequences live in shuffled cache rows
  bool scalar_seqlen = false;
  int rotary = 0;           // 0 none, 1 GPT-NeoX halves, 2 interleaved pairs
  int rotary_dim = 16;
  bool alibi = false;
  AttentionOptions options;
  std::string describe() const {
    return cat("b=", batch, " s_q=", seqlen_q, " h=", heads_q, "/", heads_kv, " d=", head_dim,
               " dtype=", dtype_name(dtype), " s_new=", seqlen_new, " block=", block_size,
               " idx=", batch_idx, " rotary=", rotary, " causal=", options.causal, " window=(",
               options.window_left, ",", options.window_right, ") softcap=", options.softcap,
               " alibi=", alibi, " seed=", test_seed());
  }
};

std::vector<float> draw(std::mt19937_64& rng, DType dt, size_t n) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = round_to(dt, dist(rng));
  return v;
}

struct Decode {
  Case c;
  int max_blocks = 0;
  std::vector<int> cache_row;              // contiguous: cache batch row of sequence i
  std::vector<std::vector<int>> blocks;    // paged: physical block of each logical block
  std::vector<float> q, k_new, v_new, cos, sin, slopes;
  std::vector<std::vector<float>> k_old, v_old;  // (len_i, h_kv, d) per sequence
  HostTensor qt, k_cache, v_cache, k_new_t, v_new_t, table, seqlens, idx, cos_t, sin_t, alibi_t,
      o, lse;

  int64_t n(int i) const { return c.cache_lens[static_cast<size_t>(i)] + c.seqlen_new; }
  // Element offset of (sequence i, token t, head h, 0) in a cache.
  int64_t slot(int i, int64_t t, int h) const {
    const TensorView& v = k_cache.view;
    if (c.block_size > 0)
      return blocks[static_cast<size_t>(i)][static_cast<size_t>(t / c.block_size)] * v.stride[0] +
             (t % c.block_size) * v.stride[1] + h * v.stride[2];
    return cache_row[static_cast<size_t>(i)] * v.stride[0] + t * v.stride[1] + h * v.stride[2];
  }

  KVCacheArgs args() const {
    KVCacheArgs a;
    a.k_cache = k_cache.view;
    a.v_cache = v_cache.view;
    if (c.block_size > 0) a.block_table = table.view;
    if (c.scalar_seqlen)
      a.cache_seqlen = c.cache_lens[0];
    else
      a.cache_seqlens = seqlens.view;
    if (c.batch_idx) a.cache_batch_idx = idx.view;
    if (c.seqlen_new > 0) {
      a.k_new = k_new_t.view;
      a.v_new = v_new_t.view;
    }
    if (c.rotary) {
      a.rotary_cos = cos_t.view;
      a.rotary_sin = sin_t.view;
      a.rotary_interleaved = c.rotary == 2;
    }
    return a;
  }
  AttentionOptions options(Backend backend) const {
    AttentionOptions opt = c.options;
    if (c.alibi) opt.alibi_slopes = alibi_t.view;
    opt.backend = backend;
    return opt;
  }
};

Decode make_setup(const Case& c, uint64_t seed) {
  Decode s;
  s.c = c;
  std::mt19937_64 rng(seed);
  const int b = c.batch, hkv = c.heads_kv, d = c.head_dim;
  const DType dt = c.dtype;
  const size_t row = static_cast<size_t>(hkv) * d;
  // Logical contents, independent of the layout.
  s.q = draw(rng, dt, static_cast<size_t>(b) * c.seqlen_q * c.heads_q * d);
  for (int i = 0; i < b; ++i) {
    s.k_old.push_back(draw(rng, dt, static_cast<size_t>(c.cache_lens[static_cast<size_t>(i)]) * row));
    s.v_old.push_back(draw(rng, dt, static_cast<size_t>(c.cache_lens[static_cast<size_t>(i)]) * row));
  }
  s.k_new = draw(rng, dt, static_cast<size_t>(b) * c.seqlen_new * row);
  s.v_new = draw(rng, dt, static_cast<size_t>(b) * c.seqlen_new * row);
  const int s_rot = c.capacity + 4, half = c.rotary_dim / 2;
  for (int pos = 0; pos < s_rot; ++pos)
    for (int m = 0; m < half; ++m) {
      const double angle = pos * std::pow(10000.0, -2.0 * m / c.rotary_dim);
      s.cos.push_back(static_cast<float>(std::cos(angle)));
      s.sin.push_back(static_cast<float>(std::sin(angle)));
    }
  for (int h = 0; h < c.heads_q; ++h) s.slopes.push_back(std::exp2(-8.0f * (h + 1) / c.heads_q));

  // Layout.
  auto fill = [&](HostTensor& t, const std::vector<float>& v) {
    for (size_t e = 0; e < v.size(); ++e) store_from_float(t.view.data, static_cast<int64_t>(e), dt, v[e]);
  };
  s.qt = HostTensor::make(dt, {b, c.seqlen_q, c.heads_q, d});
  fill(s.qt, s.q);
  if (c.block_size > 0) {
    s.max_blocks = (c.capacity + c.block_size - 1) / c.block_size;
    const int num_blocks = b * s.max_blocks + 3;
    std::vector<int> perm(static_cast<size_t>(num_blocks));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    s.table = HostTensor::make(DType::kInt32, {b, s.max_blocks});
    auto* tb = static_cast<int32_t*>(s.table.view.data);
    s.blocks.resize(static_cast<size_t>(b));
    for (int i = 0; i < b; ++i)
      for (int lb = 0; lb < s.max_blocks; ++lb) {
        const int blk = perm[static_cast<size_t>(i * s.max_blocks + lb)];
        s.blocks[static_cast<size_t>(i)].push_back(blk);
        const bool used = lb < (s.n(i) + c.block_size - 1) / c.block_size;
        tb[i * s.max_blocks + lb] = used ? blk : -1;  // unused entries must not be read
      }
    s.k_cache = HostTensor::make(dt, {num_blocks, c.block_size, hkv, d});
  } else {
    const int b_cache = c.batch_idx ? b + 2 : b;
    std::vector<int> rows(static_cast<size_t>(b_cache));
    std::iota(rows.begin(), rows.end(), 0);
    if (c.batch_idx) std::shuffle(rows.begin(), rows.end(), rng);
    s.cache_row.assign(rows.begin(), rows.begin() + b);
    s.idx = HostTensor::make(DType::kInt32, {b});
    std::copy(s.cache_row.begin(), s.cache_row.end(), static_cast<int32_t*>(s.idx.view.data));
    s.k_cache = HostTensor::make(dt, {b_cache, c.capacity, hkv, d});
  }
  s.k_cache.poison();
  s.v_cache = s.k_cache;
  s.v_cache.view.data = s.v_cache.bytes.data();
  for (int i = 0; i < b; ++i)
    for (int t = 0; t < c.cache_lens[static_cast<size_t>(i)]; ++t)
      for (int h = 0; h < hkv; ++h)
        for (int e = 0; e < d; ++e) {
          const size_t src = (static_cast<size_t>(t) * hkv + h) * d + e;
          store_from_float(s.k_cache.view.data, s.slot(i, t, h) + e, dt, s.k_old[static_cast<size_t>(i)][src]);
          store_from_float(s.v_cache.view.data, s.slot(i, t, h) + e, dt, s.v_old[static_cast<size_t>(i)][src]);
        }
  s.seqlens = HostTensor::make(DType::kInt32, {b});
  std::copy(c.cache_lens.begin(), c.cache_lens.end(), static_cast<int32_t*>(s.seqlens.view.data));
  s.k_new_t = HostTensor::make(dt, {b, c.seqlen_new, hkv, d});
  s.v_new_t = HostTensor::make(dt, {b, c.seqlen_new, hkv, d});
  fill(s.k_new_t, s.k_new);
  fill(s.v_new_t, s.v_new);
  s.cos_t = HostTensor::make(DType::kFloat32, {s_rot, half});
  s.sin_t = HostTensor::make(DType::kFloat32, {s_rot, half});
  std::copy(s.cos.begin(), s.cos.end(), static_cast<float*>(s.cos_t.view.data));
  std::copy(s.sin.begin(), s.sin.end(), static_cast<float*>(s.sin_t.view.data));
  s.alibi_t = HostTensor::make(DType::kFloat32, {c.heads_q});
  std::copy(s.slopes.begin(), s.slopes.end(), static_cast<float*>(s.alibi_t.view.data));
  s.o = HostTensor::make(dt, {b, c.seqlen_q, c.heads_q, d});
  s.lse = HostTensor::make(DType::kFloat32, {b, c.heads_q, c.seqlen_q});
  s.o.poison();
  s.lse.poison();
  return s;
}

// The rotation of one head vector at `pos`, written here from the definition (kvcache.h).
void rotate(const Decode& s, float* x, int64_t pos) {
  const int half = s.c.rotary_dim / 2;
  for (int m = 0; m < half; ++m) {
    const float co = s.cos[static_cast<size_t>(pos * half + m)];
    const float si = s.sin[static_cast<size_t>(pos * half + m)];
    const int e0 = s.c.rotary == 2 ? 2 * m : m, e1 = s.c.rotary == 2 ? 2 * m + 1 : m + half;
    const float x0 = x[e0], x1 = x[e1];
    x[e0] = round_to(s.c.dtype, x0 * co - x1 * si);
    x[e1] = round_to(s.c.dtype, x0 * si + x1 * co);
  }
}

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

// Per sequence: fixed-length attention of the rotated q over the logical keys (the cache as
// read back at the appended rows, checked by check_cache), by the float64 and the low-precision
// reference. Outputs in (b, s_q, h_q, d) and (b, h_q, s_q) order.
struct Expected {
  std::vector<double> o, lse, o_naive, lse_naive;
  int64_t reduction = 1;
};

Expected expected(const Decode& s) {
  const Case& c = s.c;
  const int hq = c.heads_q, hkv = c.heads_kv, d = c.head_dim, sq = c.seqlen_q;
  Expected ex;
  ex.o.resize(static_cast<size_t>(c.batch) * sq * hq * d);
  ex.o_naive.resize(ex.o.size());
  ex.lse.resize(static_cast<size_t>(c.batch) * hq * sq);
  ex.lse_naive.resize(ex.lse.size());
  for (int i = 0; i < c.batch; ++i) {
    const int64_t n = s.n(i), len = c.cache_lens[static_cast<size_t>(i)];
    HostTensor q = HostTensor::make(c.dtype, {1, sq, hq, d});
    HostTensor k = HostTensor::make(c.dtype, {1, n, hkv, d});
    HostTensor v = HostTensor::make(c.dtype, {1, n, hkv, d});
    HostTensor o = HostTensor::make(c.dtype, {1, sq, hq, d});
    HostTensor lse = HostTensor::make(DType::kFloat32, {1, hq, sq});
    const bool per_row = c.options.causal || c.options.window_left >= 0 || c.options.window_right >= 0;
    for (int j = 0; j < sq; ++j)
      for (int h = 0; h < hq; ++h) {
        std::vector<float> x(static_cast<size_t>(d));
        for (int e = 0; e < d; ++e)
          x[static_cast<size_t>(e)] = s.q[((static_cast<size_t>(i) * sq + j) * hq + h) * d + e];
        if (c.rotary) rotate(s, x.data(), len + (per_row ? j : 0));
        for (int e = 0; e < d; ++e) q.set({0, j, h, e}, x[static_cast<size_t>(e)]);
      }
    for (int64_t t = 0; t < n; ++t)
      for (int h = 0; h < hkv; ++h)
        for (int e = 0; e < d; ++e) {
          k.set({0, t, h, e}, load_as_float(s.k_cache.view.data, s.slot(i, t, h) + e, c.dtype));
          v.set({0, t, h, e}, load_as_float(s.v_cache.view.data, s.slot(i, t, h) + e, c.dtype));
        }
    AttentionOptions opt = s.options(Backend::kReference);
    AttentionParams p;
    const Status st = make_forward_params(q.view, k.view, v.view, o.view, lse.view, opt, {}, &p);
    EXPECT_TRUE(st.ok()) << st.to_string();
    const cpu::RefForward ref = cpu::reference_forward(p, cpu::RefPrecision::kFloat64);
    const cpu::RefForward naive = cpu::reference_forward(p, cpu::RefPrecision::kLowPrecision);
    const size_t o0 = static_cast<size_t>(i) * sq * hq * d, l0 = static_cast<size_t>(i) * hq * sq;
    std::copy(ref.o.begin(), ref.o.end(), ex.o.begin() + static_cast<std::ptrdiff_t>(o0));
    std::copy(naive.o.begin(), naive.o.end(), ex.o_naive.begin() + static_cast<std::ptrdiff_t>(o0));
    std::copy(ref.lse.begin(), ref.lse.end(), ex.lse.begin() + static_cast<std::ptrdiff_t>(l0));
    std::copy(naive.lse.begin(), naive.lse.end(), ex.lse_naive.begin() + static_cast<std::ptrdiff_t>(l0));
    ex.reduction = std::max<int64_t>({ex.reduction, d, n, static_cast<int64_t>(sq) * (hq / hkv)});
  }
  return ex;
}

std::vector<double> read_all(const HostTensor& t) {
  std::vector<double> r(static_cast<size_t>(t.view.numel()));
  for (size_t e = 0; e < r.size(); ++e) r[e] = load_as_float(t.view.data, static_cast<int64_t>(e), t.view.dtype);
  return r;
}

// Runs one case on both CPU backends and checks outputs and caches; returns the flash run.
Decode run_case(const Case& c) {
  const Decode before = make_setup(c, test_seed());
  Decode last;
  for (Backend backend : {Backend::kReference, Backend::kAuto}) {
    Decode s = make_setup(c, test_seed());
    const Status st = attention_with_kvcache(s.qt.view, s.args(), s.o.view, s.lse.view, s.options(backend));
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
  for (int bs : {1, 16, 256, 7}) {
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
  c.alibi = true;
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
  Status st = attention_with_kvcache(with.qt.view, with.args(), with.o.view, with.lse.view,
                                     with.options(Backend::kAuto));
  ASSERT_TRUE(st.ok()) << st.to_string();
  st = attention_with_kvcache(without.qt.view, without.args(), without.o.view, TensorView{},
                              without.options(Backend::kAuto));
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
  KVCacheArgs a = s.args();
  AttentionOptions opt = s.options(Backend::kAuto);
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
  KVCacheArgs a = s.args();
  TensorView q = s.qt.view, o = s.o.view, lse = s.lse.view;
  for (TensorView* t : {&q, &o, &lse, &a.k_cache, &a.v_cache, &a.cache_seqlens}) t->device = DeviceType::kCUDA;
  const Status st = attention_with_kvcache(q, a, o, lse);
  EXPECT_EQ(st.code(), StatusCode::kUnsupported) << st.to_string();
  EXPECT_NE(st.message().find("-DFLARE_CUDA=ON"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace flare::test
