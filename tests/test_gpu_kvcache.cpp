// test_gpu_kvcache.cpp — attention_with_kvcache on CUDA tensors (flare/kvcache.h) against the
// float64 CPU reference.
//
// Each case is built as tests/test_cpu_kvcache.cpp builds its cases: the logical contents first —
// q, each sequence's cached keys and values, the new ones, rotary tables, ALiBi slopes — then a
// contiguous or paged layout of them (shuffled blocks, unused block_table entries −1, every unused
// cache slot NaN, so a stray read shows). The same setup, drawn twice from one seed, goes to the
// GPU (every tensor copied to the device, outputs poisoned with NaN) and to the CPU path with
// Backend::kReference. Then:
//   - the caches after the GPU call equal the CPU path's caches bit for bit (the append, rotation
//     in fp32 rounded once, lands in the same slots with the same bits; nothing else changes);
//   - o and lse follow DESIGN.md's tolerance rule (test_util.h's within_tolerance, as
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
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/message.h"
#include "flare/kvcache.h"
#include "gpu_util.h"
#include "test_util.h"

namespace flare::test {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// ---- cases -------------------------------------------------------------------------------------

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

struct Case {
  DType dtype = DType::kBFloat16;
  int batch = 2;
  int seqlen_q = 1;
  int heads_q = 4;
  int heads_kv = 2;
  int head_dim = 64;
  std::vector<int> cache_lens = {5, 170};  // tokens already cached, per sequence
  int seqlen_new = 0;
  int capacity = 200;      // seqlen_cache, or at most max_blocks · block_size
  int block_size = 0;      // 0 → contiguous cache
  bool batch_idx = false;  // contiguous only: sequences live in shuffled cache rows
  bool scalar_seqlen = false;
  int rotary = 0;          // 0 none, 1 GPT-NeoX halves, 2 interleaved pairs
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

std::vector<float> draw(std::mt19937_64& rng, DType dt, size_t n) {
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

Call make_call(const Case& c, const Views& v, Backend backend) {
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

Status invoke(const Call& call, Stream stream = nullptr) {
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

void inject(Decode& s) {
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

Decode make_setup(const Case& c, uint64_t seed) {
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

// The rotation of one head vector at `pos`, written here from the definition (kvcache.h): fp32
// arithmetic, one rounding to the dtype.
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

// Per sequence: fixed-length attention of the rotated q over the logical keys (read from the
// cache of a CPU run, whose append test_cpu_kvcache.cpp checks), by the float64 and the
// low-precision reference. Outputs in (b, s_q, h_q, d) and (b, h_q, s_q) order.
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

std::vector<double> read_all(const HostTensor& t) {
  std::vector<double> r(static_cast<size_t>(t.view.numel()));
  for (size_t e = 0; e < r.size(); ++e)
    r[e] = load_as_float(t.view.data, static_cast<int64_t>(e), t.view.dtype);
  return r;
}

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
  Case base() const {
    Case c;
    c.dtype = GetParam();
    return c;
  }
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
  Case fp32;
  fp32.dtype = DType::kFloat32;
  fp32.seqlen_new = 1;
  expect_rejected(fp32, StatusCode::kUnsupported, "float32", {});
  Case wide;
  wide.head_dim = 264;
  wide.seqlen_new = 1;
  wide.block_size = 16;
  expect_rejected(wide, StatusCode::kInvalidArgument, "q: head_dim = 264", {});
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GpuKVCache, ::testing::Values(DType::kFloat16, DType::kBFloat16),
                         dtype_param_name);

}  // namespace
}  // namespace flare::test
