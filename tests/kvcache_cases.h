// kvcache_cases.h — the cases of the KV-cache decoding tests (test_cpu_kvcache.cpp,
// test_gpu_kvcache.cpp): what a case is, how its tensors are laid out, how a call is made of them,
// and what it must return.
//
// A case draws its logical contents first — q, each sequence's cached keys and values, the new
// ones, rotary tables, ALiBi slopes, and at most one injected NaN/±Inf — and only then lays them
// out as a contiguous or paged cache (shuffled blocks, unused block_table entries −1, every unused
// cache slot NaN so a stray read shows). So the paged and the contiguous setup of one seed hold the
// same values, and the same seed drawn twice gives the same setup, byte for byte, for two runs (two
// backends, or the GPU and the CPU path). The expectation is built independently of the decoding
// code: per sequence, fixed-length attention of q (rotated here) over the logical keys, by the
// float64 reference and by the same reference in low precision, for docs/architecture.md's
// tolerance rule (test_util.h's within_tolerance).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/message.h"
#include "flare/kvcache.h"
#include "test_util.h"

namespace flare::test::kvcache {

// One non-finite value written into the logical contents before they are laid out.
enum class Target { kNone, kQ, kCachedK, kCachedV, kNewK, kNewV };

struct Injection {
  Target target = Target::kNone;
  int seq = 0;
  int row = 0;   // q row, cached position or new row
  int head = 0;  // q head (kQ) or kv head
  int dim = 0;
  float value = 0.0f;
  std::string describe() const {
    if (target == Target::kNone) return "none";
    const char* names[] = {"none", "q", "cached k", "cached v", "k_new", "v_new"};
    return cat(std::isnan(value) ? "NaN" : value > 0 ? "+Inf" : "-Inf", " in ",
               names[static_cast<int>(target)], "[seq ", seq, ", row ", row, ", head ", head,
               ", dim ", dim, "]");
  }
};

// One call's sizes, layout and options. The defaults are a small float32 case, which the CPU
// tests start from; the GPU tests start from their own (float32 has no CUDA decoding kernels).
struct Case {
  DType dtype = DType::kFloat32;
  int batch = 2;
  int seqlen_q = 1;
  int heads_q = 4;
  int heads_kv = 2;
  int head_dim = 32;
  std::vector<int> cache_lens = {5, 17};  // tokens already cached, per sequence
  int seqlen_new = 0;
  int capacity = 40;       // seqlen_cache, or at most max_blocks · block_size
  int block_size = 0;      // 0 → contiguous cache
  bool batch_idx = false;  // contiguous only: sequences live in shuffled cache rows
  bool scalar_seqlen = false;
  int rotary = 0;           // 0 none, 1 GPT-NeoX halves, 2 interleaved pairs
  int rotary_dim = 16;
  bool rotary_fp32 = true;  // else cos/sin in q's dtype
  int alibi = 0;            // 0 none, 1 slopes (h_q), 2 slopes (b, h_q)
  int num_splits = 0;
  int64_t cache_pad = 0;    // extra elements after each cached head vector: unaligned rows
  bool with_lse = true;
  AttentionOptions options;
  Injection inj;
  std::string describe() const {
    return cat(dtype_name(dtype), " b=", batch, " s_q=", seqlen_q, " h=", heads_q, "/", heads_kv,
               " d=", head_dim, " lens=", lens_text(), " s_new=", seqlen_new, " capacity=", capacity,
               " block=", block_size, " idx=", batch_idx, " scalar_len=", scalar_seqlen,
               " rotary=", rotary, "/", rotary_dim, rotary_fp32 ? "/fp32" : "/dtype",
               " causal=", options.causal, " window=(", options.window_left, ",",
               options.window_right, ") softcap=", options.softcap, " alibi=", alibi,
               " splits=", num_splits, " pad=", cache_pad, " lse=", with_lse,
               " inject=", inj.describe(), " seed=", test_seed());
  }
  std::string lens_text() const {
    std::string s = "{";
    for (size_t i = 0; i < cache_lens.size(); ++i) s += cat(i ? "," : "", cache_lens[i]);
    return s + "}";
  }
};

inline std::vector<float> draw(std::mt19937_64& rng, DType dt, size_t n) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = round_to(dt, dist(rng));
  return v;
}

// The tensors of one call, wherever they live.
struct Views {
  TensorView q, k_cache, v_cache, k_new, v_new, table, seqlens, idx, cos, sin, alibi, o, lse;
};

// One call's arguments, before it is made (a test may edit them to break a rule).
struct Call {
  TensorView q, o, lse;
  KVCacheArgs args;
  AttentionOptions options;
};

inline Call make_call(const Case& c, const Views& v, Backend backend) {
  Call call;
  call.q = v.q;
  call.o = v.o;
  if (c.with_lse) call.lse = v.lse;
  KVCacheArgs& a = call.args;
  a.k_cache = v.k_cache;
  a.v_cache = v.v_cache;
  if (c.block_size > 0) a.block_table = v.table;
  if (c.scalar_seqlen)
    a.cache_seqlen = c.cache_lens[0];
  else
    a.cache_seqlens = v.seqlens;
  if (c.batch_idx) a.cache_batch_idx = v.idx;
  if (c.seqlen_new > 0) {
    a.k_new = v.k_new;
    a.v_new = v.v_new;
  }
  if (c.rotary) {
    a.rotary_cos = v.cos;
    a.rotary_sin = v.sin;
    a.rotary_interleaved = c.rotary == 2;
  }
  a.num_splits = c.num_splits;
  call.options = c.options;
  if (c.alibi) call.options.alibi_slopes = v.alibi;
  call.options.backend = backend;
  return call;
}

inline Status invoke(const Call& call, Stream stream = nullptr) {
  return attention_with_kvcache(call.q, call.args, call.o, call.lse, call.options, stream);
}

// A case's host tensors and the logical contents they were laid out from.
struct Decode {
  Case c;
  int max_blocks = 0;
  std::vector<int> cache_row;            // contiguous: cache batch row of sequence i
  std::vector<std::vector<int>> blocks;  // paged: physical block of each logical block
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
  Views views() const {
    return {qt.view,     k_cache.view, v_cache.view, k_new_t.view, v_new_t.view,
            table.view,  seqlens.view, idx.view,     cos_t.view,   sin_t.view,
            alibi_t.view, o.view,      lse.view};
  }
};

inline void inject(Decode& s) {
  const Injection& in = s.c.inj;
  const size_t hkv = static_cast<size_t>(s.c.heads_kv), d = static_cast<size_t>(s.c.head_dim);
  const size_t seq = static_cast<size_t>(in.seq), row = static_cast<size_t>(in.row);
  const size_t head = static_cast<size_t>(in.head), dim = static_cast<size_t>(in.dim);
  switch (in.target) {
    case Target::kNone:
      return;
    case Target::kQ:
      s.q[((seq * static_cast<size_t>(s.c.seqlen_q) + row) * static_cast<size_t>(s.c.heads_q) + head) * d + dim] = in.value;
      return;
    case Target::kCachedK:
      s.k_old[seq][(row * hkv + head) * d + dim] = in.value;
      return;
    case Target::kCachedV:
      s.v_old[seq][(row * hkv + head) * d + dim] = in.value;
      return;
    case Target::kNewK:
      s.k_new[((seq * static_cast<size_t>(s.c.seqlen_new) + row) * hkv + head) * d + dim] = in.value;
      return;
    case Target::kNewV:
      s.v_new[((seq * static_cast<size_t>(s.c.seqlen_new) + row) * hkv + head) * d + dim] = in.value;
      return;
  }
}

inline Decode make_setup(const Case& c, uint64_t seed) {
  for (int len : c.cache_lens)  // a mistake in the test itself: its cache would overflow
    if (len + c.seqlen_new > c.capacity)
      throw std::invalid_argument(cat("case holds ", len, " + ", c.seqlen_new,
                                      " tokens in a capacity of ", c.capacity, ": ", c.describe()));
  Decode s;
  s.c = c;
  std::mt19937_64 rng(seed);
  const int b = c.batch, hkv = c.heads_kv, d = c.head_dim;
  const DType dt = c.dtype;
  const DType rot_dt = c.rotary_fp32 ? DType::kFloat32 : dt;
  const size_t row = static_cast<size_t>(hkv) * d;
  // Logical contents, independent of the layout (so paged and contiguous setups of one seed hold
  // the same values).
  s.q = draw(rng, dt, static_cast<size_t>(b) * c.seqlen_q * c.heads_q * d);
  for (int i = 0; i < b; ++i) {
    s.k_old.push_back(draw(rng, dt, static_cast<size_t>(c.cache_lens[static_cast<size_t>(i)]) * row));
    s.v_old.push_back(draw(rng, dt, static_cast<size_t>(c.cache_lens[static_cast<size_t>(i)]) * row));
  }
  s.k_new = draw(rng, dt, static_cast<size_t>(b) * c.seqlen_new * row);
  s.v_new = draw(rng, dt, static_cast<size_t>(b) * c.seqlen_new * row);
  inject(s);
  const int s_rot = c.capacity + 4, half = c.rotary_dim / 2;
  for (int pos = 0; pos < s_rot; ++pos)
    for (int m = 0; m < half; ++m) {
      const double angle = pos * std::pow(10000.0, -2.0 * m / c.rotary_dim);
      s.cos.push_back(round_to(rot_dt, static_cast<float>(std::cos(angle))));
      s.sin.push_back(round_to(rot_dt, static_cast<float>(std::sin(angle))));
    }
  // Slopes up to 0.25, different per sequence when they are (b, h_q).
  const int slope_rows = c.alibi == 2 ? b : 1;
  for (int i = 0; i < slope_rows; ++i)
    for (int h = 0; h < c.heads_q; ++h)
      s.slopes.push_back(std::exp2(-8.0f * static_cast<float>(h + 1) / static_cast<float>(c.heads_q) - 0.5f * static_cast<float>(i)));

  // Layout.
  auto fill = [](HostTensor& t, const std::vector<float>& v) {
    for (size_t e = 0; e < v.size(); ++e)
      store_from_float(t.view.data, static_cast<int64_t>(e), t.view.dtype, v[e]);
  };
  s.qt = HostTensor::make(dt, {b, c.seqlen_q, c.heads_q, d});
  fill(s.qt, s.q);
  std::vector<int64_t> cache_shape;
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
    cache_shape = {num_blocks, c.block_size, hkv, d};
  } else {
    const int b_cache = c.batch_idx ? b + 2 : b;
    std::vector<int> rows(static_cast<size_t>(b_cache));
    std::iota(rows.begin(), rows.end(), 0);
    if (c.batch_idx) std::shuffle(rows.begin(), rows.end(), rng);
    s.cache_row.assign(rows.begin(), rows.begin() + b);
    s.idx = HostTensor::make(DType::kInt32, {b});
    std::copy(s.cache_row.begin(), s.cache_row.end(), static_cast<int32_t*>(s.idx.view.data));
    cache_shape = {b_cache, c.capacity, hkv, d};
  }
  s.k_cache = c.cache_pad > 0 ? HostTensor::make_padded(dt, cache_shape, c.cache_pad)
                              : HostTensor::make(dt, cache_shape);
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
  s.cos_t = HostTensor::make(rot_dt, {s_rot, half});
  s.sin_t = HostTensor::make(rot_dt, {s_rot, half});
  fill(s.cos_t, s.cos);
  fill(s.sin_t, s.sin);
  s.alibi_t = c.alibi == 2 ? HostTensor::make(DType::kFloat32, {b, c.heads_q})
                           : HostTensor::make(DType::kFloat32, {c.heads_q});
  fill(s.alibi_t, s.slopes);
  s.o = HostTensor::make(dt, {b, c.seqlen_q, c.heads_q, d});
  s.lse = HostTensor::make(DType::kFloat32, {b, c.heads_q, c.seqlen_q});
  s.o.poison();
  s.lse.poison();
  return s;
}

// ---- expectations ------------------------------------------------------------------------------

// The rotation of one head vector at `pos`, written here from the definition (kvcache.h): fp32
// arithmetic, one rounding to the dtype.
inline void rotate(const Decode& s, float* x, int64_t pos) {
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

// Per sequence: fixed-length attention of the rotated q over the logical keys, by the float64
// and the low-precision reference. The keys are read from `s`'s cache after a CPU call, whose
// appended rows test_cpu_kvcache.cpp's check_cache holds to the rotated new keys. Outputs in
// (b, s_q, h_q, d) and (b, h_q, s_q) order.
struct Expected {
  std::vector<double> o, lse, o_naive, lse_naive;
  int64_t reduction = 1;
};

inline Expected expected(const Decode& s) {
  const Case& c = s.c;
  const int hq = c.heads_q, hkv = c.heads_kv, d = c.head_dim, sq = c.seqlen_q;
  Expected ex;
  ex.o.resize(static_cast<size_t>(c.batch) * sq * hq * d);
  ex.o_naive.resize(ex.o.size());
  ex.lse.resize(static_cast<size_t>(c.batch) * hq * sq);
  ex.lse_naive.resize(ex.lse.size());
  const bool per_row = c.options.causal || c.options.window_left >= 0 || c.options.window_right >= 0;
  for (int i = 0; i < c.batch; ++i) {
    const int64_t n = s.n(i), len = c.cache_lens[static_cast<size_t>(i)];
    HostTensor q = HostTensor::make(c.dtype, {1, sq, hq, d});
    HostTensor k = HostTensor::make(c.dtype, {1, n, hkv, d});
    HostTensor v = HostTensor::make(c.dtype, {1, n, hkv, d});
    HostTensor o = HostTensor::make(c.dtype, {1, sq, hq, d});
    HostTensor lse = HostTensor::make(DType::kFloat32, {1, hq, sq});
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
    AttentionOptions opt = c.options;
    opt.backend = Backend::kReference;
    if (c.alibi) {  // this sequence's slopes, as (h_q)
      opt.alibi_slopes = TensorView::contiguous(
          const_cast<float*>(s.slopes.data()) + (c.alibi == 2 ? static_cast<size_t>(i) * hq : 0),
          DType::kFloat32, {hq});
    }
    AttentionParams p;
    const Status st = make_forward_params(q.view, k.view, v.view, o.view, lse.view, opt, {}, &p);
    EXPECT_TRUE(st.ok()) << st.to_string();
    const cpu::RefForward ref = cpu::reference_forward(p, cpu::RefPrecision::kFloat64);
    const cpu::RefForward naive = cpu::reference_forward(p, cpu::RefPrecision::kLowPrecision);
    const auto o0 = static_cast<std::ptrdiff_t>(static_cast<size_t>(i) * sq * hq * d);
    const auto l0 = static_cast<std::ptrdiff_t>(static_cast<size_t>(i) * hq * sq);
    std::copy(ref.o.begin(), ref.o.end(), ex.o.begin() + o0);
    std::copy(naive.o.begin(), naive.o.end(), ex.o_naive.begin() + o0);
    std::copy(ref.lse.begin(), ref.lse.end(), ex.lse.begin() + l0);
    std::copy(naive.lse.begin(), naive.lse.end(), ex.lse_naive.begin() + l0);
    ex.reduction = std::max<int64_t>({ex.reduction, d, n, static_cast<int64_t>(sq) * (hq / hkv)});
  }
  return ex;
}

// Every element of a contiguous tensor (o, lse), in storage order.
inline std::vector<double> read_all(const HostTensor& t) {
  std::vector<double> r(static_cast<size_t>(t.view.numel()));
  for (size_t e = 0; e < r.size(); ++e)
    r[e] = load_as_float(t.view.data, static_cast<int64_t>(e), t.view.dtype);
  return r;
}

}  // namespace flare::test::kvcache
