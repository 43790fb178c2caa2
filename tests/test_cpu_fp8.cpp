// Tests of attention_forward_fp8 (flare/attention.h): float8_e4m3 q, k and v, each element
// standing for its value times a descale factor, forward only.
//
// On the CPU its result is defined as attention_forward's float32 path on the dequantized inputs
// (each e4m3(x) · descale rounded once to float32), o rounded once to its dtype. The tests form
// those inputs themselves, from the codes and the descales by the rule of attention.h, and
// compare bit for bit over per-tensor, per-head, per-kv-head (GQA) and per-block descales, fixed
// and packed batches, masks, both CPU backends and o in float32, bfloat16 and float16. One small
// case is checked against a softmax written out here in double, and every rejection names its
// argument and leaves the outputs untouched.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "flare/attention.h"
#include "flare/c_api.h"
#include "test_util.h"

namespace flare::test {
namespace {

// e4m3 codes of N(0, sigma²) draws (finite: rounding saturates at ±448).
HostTensor fp8_normal(std::mt19937_64& rng, std::vector<int64_t> shape, float sigma) {
  HostTensor t = HostTensor::make(DType::kFloat8E4M3, std::move(shape));
  std::normal_distribution<float> dist(0.0f, sigma);
  for (unsigned char& b : t.bytes) b = float_to_e4m3(dist(rng));
  return t;
}

// float32 factors in [1/64, 4), every one distinct enough to be told apart.
HostTensor factors(std::mt19937_64& rng, std::vector<int64_t> shape) {
  HostTensor t = HostTensor::make(DType::kFloat32, std::move(shape));
  std::uniform_real_distribution<float> dist(-6.0f, 2.0f);
  auto* f = reinterpret_cast<float*>(t.bytes.data());
  for (size_t i = 0; i < t.bytes.size() / 4; ++i) f[i] = std::exp2(dist(rng));
  return t;
}

// How a case's descales are laid out.
enum class Granularity { kNone, kTensor, kHead, kKvHead, kBlock };

const char* granularity_name(Granularity g) {
  switch (g) {
    case Granularity::kNone: return "none";
    case Granularity::kTensor: return "tensor";
    case Granularity::kHead: return "head";
    case Granularity::kKvHead: return "kv_head";
    case Granularity::kBlock: return "block";
  }
  return "?";
}

struct Fp8Case {
  bool packed;
  int heads_q, heads_kv;
  Granularity granularity;
  DType o_dtype;
  bool causal;
  int window_left;
  Backend backend;
};

std::string case_name(const ::testing::TestParamInfo<Fp8Case>& info) {
  const Fp8Case& c = info.param;
  std::string n = std::string(c.packed ? "packed" : "fixed") + "_h" + std::to_string(c.heads_q) +
                  "_" + std::to_string(c.heads_kv) + "_" + granularity_name(c.granularity) + "_" +
                  dtype_name(c.o_dtype);
  if (c.causal) n += "_causal";
  if (c.window_left >= 0) n += "_window" + std::to_string(c.window_left);
  return n + (c.backend == Backend::kReference ? "_reference" : "_flash");
}

// The sequences of a case: lengths (the packed case's include an empty one), and the rows.
struct Layout {
  std::vector<int32_t> lens_q, lens_k;
  int batch() const { return static_cast<int>(lens_q.size()); }
  int max_q() const { return *std::max_element(lens_q.begin(), lens_q.end()); }
  int max_k() const { return *std::max_element(lens_k.begin(), lens_k.end()); }
};

// A descale of `heads` heads (q's or k's) for this granularity; `group` q heads per kv head.
HostTensor make_descale(std::mt19937_64& rng, Granularity g, int batch, int heads, int kv_heads,
                        int seqlen, int block_rows) {
  switch (g) {
    case Granularity::kTensor: return factors(rng, {1, 1, 1});
    case Granularity::kHead: return factors(rng, {batch, heads, 1});
    case Granularity::kKvHead: return factors(rng, {batch, kv_heads, 1});
    case Granularity::kBlock: return factors(rng, {batch, heads, (seqlen + block_rows - 1) / block_rows});
    case Granularity::kNone: break;
  }
  return HostTensor{};
}

// The stated rule, written out: element (b, row i of its sequence, head h) of an input times
// descale[b | 0, h | h / group | 0, i / block_rows | 0].
float factor_of(const HostTensor& descale, int64_t b, int64_t h, int64_t heads, int64_t group,
                int64_t i, int block_rows) {
  if (!descale.view.defined()) return 1.0f;
  const TensorView& t = descale.view;
  const int64_t hb = t.shape[0] == 1 ? 0 : b;
  const int64_t hh = t.shape[1] == 1 ? 0 : (t.shape[1] == heads ? h : h / group);
  const int64_t hr = t.shape[2] == 1 ? 0 : i / block_rows;
  return reinterpret_cast<const float*>(descale.bytes.data())[hb * t.stride[0] + hh * t.stride[1] +
                                                              hr * t.stride[2]];
}

// The float32 input the fp8 one stands for (same shape, dense).
HostTensor dequantized(const HostTensor& x, const HostTensor& descale, const Layout& lay,
                       bool packed, bool is_q, int64_t group, int block_rows) {
  const TensorView& v = x.view;
  HostTensor out = HostTensor::make(DType::kFloat32, std::vector<int64_t>(v.shape, v.shape + v.ndim));
  const int64_t heads = v.shape[v.ndim - 2], d = v.shape[v.ndim - 1];
  const std::vector<int32_t>& lens = is_q ? lay.lens_q : lay.lens_k;
  int64_t token = 0;
  for (int b = 0; b < lay.batch(); ++b) {
    const int64_t rows = packed ? lens[b] : v.shape[1];
    for (int64_t i = 0; i < rows; ++i, ++token)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t e = 0; e < d; ++e) {
          const int64_t src = packed ? token * v.stride[0] + h * v.stride[1] + e
                                     : b * v.stride[0] + i * v.stride[1] + h * v.stride[2] + e;
          const float value = e4m3_to_float(x.bytes[static_cast<size_t>(src)]) *
                              factor_of(descale, b, h, heads, is_q ? group : 1, i, block_rows);
          reinterpret_cast<float*>(out.bytes.data())[(token * heads + h) * d + e] = value;
        }
  }
  return out;
}

class CpuFp8Forward : public ::testing::TestWithParam<Fp8Case> {};

TEST_P(CpuFp8Forward, IsTheFloat32PathOnTheDequantizedInputs) {
  const Fp8Case c = GetParam();
  std::mt19937_64 rng(test_seed());
  const int d = 40, block_rows = 16;
  const Layout lay = c.packed ? Layout{{19, 0, 40, 7}, {33, 5, 40, 1}} : Layout{{37, 37}, {45, 45}};
  const int batch = lay.batch(), group = c.heads_q / c.heads_kv;
  int total_q = 0, total_k = 0;
  for (int b = 0; b < batch; ++b) total_q += lay.lens_q[b], total_k += lay.lens_k[b];
  auto shape = [&](int rows_fixed, int total, int heads) {
    return c.packed ? std::vector<int64_t>{total, heads, d}
                    : std::vector<int64_t>{batch, rows_fixed, heads, d};
  };
  // Scores of magnitude ~2 after the descales: the softmax is neither flat nor one-hot.
  const HostTensor q = fp8_normal(rng, shape(lay.max_q(), total_q, c.heads_q), 24.0f);
  const HostTensor k = fp8_normal(rng, shape(lay.max_k(), total_k, c.heads_kv), 24.0f);
  const HostTensor v = fp8_normal(rng, shape(lay.max_k(), total_k, c.heads_kv), 24.0f);
  const HostTensor q_descale =
      make_descale(rng, c.granularity, batch, c.heads_q, c.heads_kv, lay.max_q(), block_rows);
  const Granularity kv_granularity =
      c.granularity == Granularity::kKvHead ? Granularity::kHead : c.granularity;
  const HostTensor k_descale =
      make_descale(rng, kv_granularity, batch, c.heads_kv, c.heads_kv, lay.max_k(), block_rows);
  const HostTensor v_descale =
      make_descale(rng, kv_granularity, batch, c.heads_kv, c.heads_kv, lay.max_k(), block_rows);

  VarlenArgs varlen;
  HostTensor cu_q = HostTensor::make(DType::kInt32, {batch + 1});
  HostTensor cu_k = HostTensor::make(DType::kInt32, {batch + 1});
  if (c.packed) {
    auto* cq = reinterpret_cast<int32_t*>(cu_q.bytes.data());
    auto* ck = reinterpret_cast<int32_t*>(cu_k.bytes.data());
    cq[0] = ck[0] = 0;
    for (int b = 0; b < batch; ++b) cq[b + 1] = cq[b] + lay.lens_q[b], ck[b + 1] = ck[b] + lay.lens_k[b];
    varlen = {cu_q.view, cu_k.view, lay.max_q(), lay.max_k()};
  }
  AttentionOptions options;
  options.causal = c.causal;
  options.window_left = c.window_left;
  options.backend = c.backend;

  const HostTensor q32 = dequantized(q, q_descale, lay, c.packed, true, group, block_rows);
  const HostTensor k32 = dequantized(k, k_descale, lay, c.packed, false, group, block_rows);
  const HostTensor v32 = dequantized(v, v_descale, lay, c.packed, false, group, block_rows);
  const std::vector<int64_t> lse_shape = c.packed ? std::vector<int64_t>{c.heads_q, total_q}
                                                  : std::vector<int64_t>{batch, c.heads_q, lay.max_q()};
  HostTensor o_want = HostTensor::make(DType::kFloat32, shape(lay.max_q(), total_q, c.heads_q));
  HostTensor lse_want = HostTensor::make(DType::kFloat32, lse_shape);
  ASSERT_TRUE(attention_forward(q32.view, k32.view, v32.view, o_want.view, lse_want.view, options,
                                varlen)
                  .ok());

  HostTensor o = HostTensor::make(c.o_dtype, shape(lay.max_q(), total_q, c.heads_q));
  HostTensor lse = HostTensor::make(DType::kFloat32, lse_shape);
  o.poison();
  lse.poison();
  const Fp8Descale descale{q_descale.view, k_descale.view, v_descale.view, block_rows};
  const Status st = attention_forward_fp8(q.view, k.view, v.view, o.view, lse.view, descale,
                                          options, varlen);
  ASSERT_TRUE(st.ok()) << st.to_string();
  EXPECT_EQ(0, std::memcmp(lse.bytes.data(), lse_want.bytes.data(), lse.bytes.size()));
  const auto* want = reinterpret_cast<const float*>(o_want.bytes.data());
  const int64_t n = o.view.numel();
  int64_t differ = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float got = load_as_float(o.view.data, i, c.o_dtype);
    const float expect = round_to(c.o_dtype, want[i]);
    if (std::memcmp(&got, &expect, sizeof got) != 0) ++differ;
  }
  EXPECT_EQ(differ, 0) << "of " << n << " output elements";
}

std::vector<Fp8Case> fp8_cases() {
  std::vector<Fp8Case> cases;
  for (bool packed : {false, true})
    for (Granularity g : {Granularity::kNone, Granularity::kTensor, Granularity::kHead,
                          Granularity::kKvHead, Granularity::kBlock})
      cases.push_back({packed, 4, 2, g, DType::kBFloat16, true, -1, Backend::kFlash});
  cases.push_back({false, 2, 2, Granularity::kBlock, DType::kFloat32, false, -1, Backend::kFlash});
  cases.push_back({false, 2, 2, Granularity::kBlock, DType::kFloat16, false, 9, Backend::kFlash});
  cases.push_back({true, 3, 1, Granularity::kKvHead, DType::kFloat32, false, -1, Backend::kFlash});
  cases.push_back({false, 4, 2, Granularity::kBlock, DType::kBFloat16, true, -1,
                   Backend::kReference});
  cases.push_back({true, 4, 2, Granularity::kBlock, DType::kFloat32, false, 5,
                   Backend::kReference});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cases, CpuFp8Forward, ::testing::ValuesIn(fp8_cases()), case_name);

// One head of three keys, written out in double: q per tensor, k per block of two rows (rows 0-1
// and row 2 scaled apart), v per head; O = softmax(scale · q kᵀ) v.
TEST(CpuFp8, SmallCaseAgainstASoftmaxInDouble) {
  const float qv[2][2] = {{1.5f, -0.75f}, {0.25f, 3.0f}};       // e4m3-exact
  const float kv[3][2] = {{2.0f, 0.5f}, {-1.0f, 1.25f}, {0.375f, -2.5f}};
  const float vv[3][2] = {{1.0f, -4.0f}, {0.5f, 6.0f}, {-3.0f, 0.125f}};
  HostTensor q = HostTensor::make(DType::kFloat8E4M3, {1, 2, 1, 2});
  HostTensor k = HostTensor::make(DType::kFloat8E4M3, {1, 3, 1, 2});
  HostTensor v = HostTensor::make(DType::kFloat8E4M3, {1, 3, 1, 2});
  for (int i = 0; i < 2; ++i)
    for (int e = 0; e < 2; ++e) q.bytes[i * 2 + e] = float_to_e4m3(qv[i][e]);
  for (int j = 0; j < 3; ++j)
    for (int e = 0; e < 2; ++e) {
      k.bytes[j * 2 + e] = float_to_e4m3(kv[j][e]);
      v.bytes[j * 2 + e] = float_to_e4m3(vv[j][e]);
    }
  const float qs = 0.5f, ks[2] = {0.25f, 3.0f}, vs = 0.125f;
  HostTensor q_descale = HostTensor::make(DType::kFloat32, {1, 1, 1});
  HostTensor k_descale = HostTensor::make(DType::kFloat32, {1, 1, 2});
  HostTensor v_descale = HostTensor::make(DType::kFloat32, {1, 1, 1});
  std::memcpy(q_descale.bytes.data(), &qs, 4);
  std::memcpy(k_descale.bytes.data(), ks, 8);
  std::memcpy(v_descale.bytes.data(), &vs, 4);
  HostTensor o = HostTensor::make(DType::kFloat32, {1, 2, 1, 2});
  HostTensor lse = HostTensor::make(DType::kFloat32, {1, 1, 2});
  const Status st = attention_forward_fp8(q.view, k.view, v.view, o.view, lse.view,
                                          {q_descale.view, k_descale.view, v_descale.view, 2});
  ASSERT_TRUE(st.ok()) << st.to_string();
  const double scale = 1.0 / std::sqrt(2.0);
  for (int i = 0; i < 2; ++i) {
    double s[3], m = -INFINITY, sum = 0.0;
    for (int j = 0; j < 3; ++j) {
      const double kf = ks[j / 2];
      s[j] = scale * (qv[i][0] * qs * kv[j][0] * kf + qv[i][1] * qs * kv[j][1] * kf);
      m = std::max(m, s[j]);
    }
    for (double x : s) sum += std::exp(x - m);
    for (int e = 0; e < 2; ++e) {
      double out = 0.0;
      for (int j = 0; j < 3; ++j) out += std::exp(s[j] - m) / sum * vv[j][e] * vs;
      EXPECT_NEAR(o.get({0, i, 0, e}), out, 1e-6 * std::max(1.0, std::fabs(out))) << i << "," << e;
    }
    EXPECT_NEAR(lse.get({0, 0, i}), m + std::log(sum), 1e-6 * std::max(1.0, std::fabs(m))) << i;
  }
}

// ---- rejections ----------------------------------------------------------------------------------

struct Fp8Call {
  HostTensor q = HostTensor::make(DType::kFloat8E4M3, {2, 8, 4, 16});
  HostTensor k = HostTensor::make(DType::kFloat8E4M3, {2, 12, 2, 16});
  HostTensor v = HostTensor::make(DType::kFloat8E4M3, {2, 12, 2, 16});
  HostTensor o = HostTensor::make(DType::kBFloat16, {2, 8, 4, 16});
  HostTensor lse = HostTensor::make(DType::kFloat32, {2, 4, 8});
  HostTensor q_descale = HostTensor::make(DType::kFloat32, {2, 4, 1});
  HostTensor k_descale = HostTensor::make(DType::kFloat32, {2, 2, 3});  // 12 rows in blocks of 4
  HostTensor v_descale = HostTensor::make(DType::kFloat32, {1, 1, 1});
  int block_rows = 4;

  Fp8Call() {
    std::fill(q.bytes.begin(), q.bytes.end(), 0x38);  // 1.0
    std::fill(k.bytes.begin(), k.bytes.end(), 0x38);
    std::fill(v.bytes.begin(), v.bytes.end(), 0x38);
    for (HostTensor* t : {&q_descale, &k_descale, &v_descale}) {
      auto* f = reinterpret_cast<float*>(t->bytes.data());
      for (size_t i = 0; i < t->bytes.size() / 4; ++i) f[i] = 1.0f;
    }
    o.poison();
    lse.poison();
  }
  Status run() {
    return attention_forward_fp8(q.view, k.view, v.view, o.view, lse.view,
                                 {q_descale.view, k_descale.view, v_descale.view, block_rows});
  }
  bool outputs_untouched() const { return all_nan(o) && all_nan(lse); }
};

void expect_rejected(Fp8Call& call, const std::string& message) {
  const Status st = call.run();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find(message), std::string::npos) << st.message();
  EXPECT_TRUE(call.outputs_untouched());
}

TEST(CpuFp8, TheBaseCallRuns) {
  Fp8Call call;
  const Status st = call.run();
  ASSERT_TRUE(st.ok()) << st.to_string();
  EXPECT_FLOAT_EQ(call.o.get({1, 7, 3, 15}), 1.0f);  // every value 1: the mean of ones
}

TEST(CpuFp8, RejectsInputsThatAreNotFp8) {
  Fp8Call call;
  call.k = HostTensor::make(DType::kFloat16, {2, 12, 2, 16});
  expect_rejected(call, "k: dtype float16 must be float8_e4m3");
}

TEST(CpuFp8, RejectsAnFp8Output) {
  Fp8Call call;
  call.o = HostTensor::make(DType::kFloat8E4M3, {2, 8, 4, 16});
  const Status st = call.run();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("o: float8_e4m3 is an input type"), std::string::npos)
      << st.message();
}

TEST(CpuFp8, RejectsDescalesOfTheWrongTypeRankOrShape) {
  {
    Fp8Call call;
    call.q_descale = HostTensor::make(DType::kFloat16, {2, 4, 1});
    expect_rejected(call, "q_descale: dtype must be float32, got float16");
  }
  {
    Fp8Call call;
    call.q_descale = HostTensor::make(DType::kFloat32, {2, 4});
    expect_rejected(call, "q_descale: expected 3 dimensions");
  }
  {
    Fp8Call call;
    call.q_descale = HostTensor::make(DType::kFloat32, {3, 4, 1});
    expect_rejected(call, "q_descale: shape[0] = 3 must be batch = 2 or 1");
  }
  {
    Fp8Call call;
    call.q_descale = HostTensor::make(DType::kFloat32, {2, 3, 1});
    expect_rejected(call, "q_descale: shape[1] = 3 must be heads_q = 4, heads_kv = 2 or 1");
  }
  {
    Fp8Call call;
    call.k_descale = HostTensor::make(DType::kFloat32, {2, 4, 3});  // q's heads, not k's
    expect_rejected(call, "k_descale: shape[1] = 4 must be heads = 2 or 1");
  }
  {
    Fp8Call call;
    call.v_descale = HostTensor::make(DType::kFloat32, {2, 2, 4});
    expect_rejected(call, "v_descale: shape[2] = 4 blocks must be ceil(seqlen_k / block_rows) = "
                          "ceil(12 / 4) = 3, or 1");
  }
}

TEST(CpuFp8, RejectsBlocksWithoutValidBlockRows) {
  {
    Fp8Call call;
    call.block_rows = 0;
    expect_rejected(call, "block_rows: must be >= 1 where k_descale has 3 blocks of rows, got 0");
  }
  {
    Fp8Call call;
    call.block_rows = -2;
    expect_rejected(call, "block_rows: must be >= 0");
  }
}

TEST(CpuFp8, RejectsOutputsOverlappingADescale) {
  Fp8Call call;
  // lse placed over k_descale's floats (same dtype, so the views can alias).
  call.lse.view.data = call.k_descale.bytes.data();
  call.lse.view.shape[0] = 1;
  call.lse.view.shape[1] = 1;
  call.lse.view.shape[2] = 8;
  call.lse.view.stride[0] = 8;
  call.lse.view.stride[1] = 8;
  call.lse.view.stride[2] = 1;
  call.q = HostTensor::make(DType::kFloat8E4M3, {1, 8, 1, 16});
  call.k = HostTensor::make(DType::kFloat8E4M3, {1, 12, 1, 16});
  call.v = HostTensor::make(DType::kFloat8E4M3, {1, 12, 1, 16});
  call.o = HostTensor::make(DType::kBFloat16, {1, 8, 1, 16});
  call.q_descale = HostTensor::make(DType::kFloat32, {1, 1, 1});
  call.k_descale.view.shape[0] = 1;
  call.k_descale.view.shape[1] = 1;
  const std::vector<unsigned char> before = call.k_descale.bytes;
  const Status st = call.run();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("lse: shares memory with k_descale"), std::string::npos)
      << st.message();
  EXPECT_EQ(before, call.k_descale.bytes);
}

TEST(CpuFp8, OtherEntryPointsRejectFp8Inputs) {
  Fp8Call call;
  // FP8 outputs hold the NaN code (HostTensor::poison writes floats); they must keep it.
  auto nan_codes = [](HostTensor t) {
    std::fill(t.bytes.begin(), t.bytes.end(), 0x7f);
    return t;
  };
  HostTensor o = nan_codes(HostTensor::make(DType::kFloat8E4M3, {2, 8, 4, 16}));
  Status st = attention_forward(call.q.view, call.k.view, call.v.view, o.view, call.lse.view);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("q: float8_e4m3 is an input type of attention_forward_fp8 only"),
            std::string::npos)
      << st.message();
  HostTensor dq = nan_codes(HostTensor::make(DType::kFloat8E4M3, {2, 8, 4, 16}));
  HostTensor dk = nan_codes(HostTensor::make(DType::kFloat8E4M3, {2, 12, 2, 16}));
  HostTensor dv = nan_codes(HostTensor::make(DType::kFloat8E4M3, {2, 12, 2, 16}));
  st = attention_backward(call.q.view, call.q.view, call.k.view, call.v.view, o.view,
                          call.lse.view, dq.view, dk.view, dv.view);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("float8_e4m3 is an input type of attention_forward_fp8 only"),
            std::string::npos)
      << st.message();
  EXPECT_TRUE(call.outputs_untouched());
  for (const HostTensor* t : {&o, &dq, &dk, &dv})
    EXPECT_EQ(std::count(t->bytes.begin(), t->bytes.end(), 0x7f),
              static_cast<std::ptrdiff_t>(t->bytes.size()));
}

// The C mirror gives the C++ call's result; a NULL descale means every factor 1.
TEST(CpuFp8, TheCApiGivesTheSameResult) {
  Fp8Call cpp, c;
  std::mt19937_64 rng(test_seed());
  std::normal_distribution<float> dist(0.0f, 30.0f);
  for (size_t i = 0; i < cpp.q.bytes.size(); ++i) c.q.bytes[i] = cpp.q.bytes[i] = float_to_e4m3(dist(rng));
  for (size_t i = 0; i < cpp.k.bytes.size(); ++i) c.k.bytes[i] = cpp.k.bytes[i] = float_to_e4m3(dist(rng));
  ASSERT_TRUE(cpp.run().ok());
  auto to_c = [](const TensorView& t) {
    flare_tensor r{};
    r.data = t.data;
    r.dtype = static_cast<int32_t>(t.dtype);
    r.device = FLARE_CPU;
    r.ndim = t.ndim;
    for (int i = 0; i < t.ndim; ++i) r.shape[i] = t.shape[i], r.stride[i] = t.stride[i];
    return r;
  };
  const flare_tensor q = to_c(c.q.view), k = to_c(c.k.view), v = to_c(c.v.view),
                     o = to_c(c.o.view), lse = to_c(c.lse.view);
  flare_fp8_descale ds{};
  ds.q_descale = to_c(c.q_descale.view);
  ds.k_descale = to_c(c.k_descale.view);
  ds.v_descale = to_c(c.v_descale.view);
  ds.block_rows = c.block_rows;
  ASSERT_EQ(flare_attention_forward_fp8(&q, &k, &v, &o, &lse, &ds, nullptr, nullptr, nullptr),
            FLARE_OK)
      << flare_last_error();
  EXPECT_EQ(cpp.o.bytes, c.o.bytes);
  EXPECT_EQ(cpp.lse.bytes, c.lse.bytes);
  // Every descale here is 1: NULL gives the same again.
  c.o.poison();
  ASSERT_EQ(flare_attention_forward_fp8(&q, &k, &v, &o, &lse, nullptr, nullptr, nullptr, nullptr),
            FLARE_OK)
      << flare_last_error();
  EXPECT_EQ(cpp.o.bytes, c.o.bytes);
  ds.block_rows = -1;
  c.o.poison();
  EXPECT_EQ(flare_attention_forward_fp8(&q, &k, &v, &o, &lse, &ds, nullptr, nullptr, nullptr),
            FLARE_INVALID_ARGUMENT);
  EXPECT_NE(std::string(flare_last_error()).find("block_rows: must be >= 0"), std::string::npos);
  EXPECT_TRUE(all_nan(c.o));
}

}  // namespace
}  // namespace flare::test
