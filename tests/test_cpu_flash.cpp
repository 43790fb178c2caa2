// test_cpu_flash.cpp — the CPU flash backend against the float64 reference.
//
// Every case runs forward and backward through the public API (CPU → flash by default) on
// poisoned outputs and checks O, LSE, dQ, dK, dV under the tolerance rule of docs/architecture.md
// (check_against_reference). Inputs are fresh each run: the spec seed mixes in test_seed(),
// which failures print. Further tests pin the vector exp/tanh accuracy, the exact outputs of rows
// that see no key, and the bitwise determinism of the backward across thread counts and modes.
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "cpu/flash_simd.h"
#include "problem_cases.h"
#include "test_util.h"

namespace flare::test {
namespace {

// ---- vector math ----------------------------------------------------------------------------

// Distance in units in the last place of the float nearest to `exact`.
double ulps(float got, double exact) {
  const float nearest = static_cast<float>(exact);
  const double ulp = std::nextafter(std::fabs(nearest), std::numeric_limits<float>::infinity()) -
                     std::fabs(nearest);
  return std::fabs(static_cast<double>(got) - exact) / ulp;
}

TEST(CpuFlashSimd, ExpWithinOneAndAHalfUlp) {
  // The normal range of results, dense near 0 where the largest softmax weights live.
  double worst = 0.0, worst_x = 0.0;
  for (int i = 0; i <= 2'000'000; ++i) {
    const float x = -87.0f + 175.0f * static_cast<float>(i) / 2'000'000.0f;
    const float got = cpu::simd::exp(cpu::simd::splat(x))[0];
    const double e = ulps(got, std::exp(static_cast<double>(x)));
    if (e > worst) {
      worst = e;
      worst_x = x;
    }
  }
  EXPECT_LE(worst, 1.5) << "at x = " << worst_x;
}

TEST(CpuFlashSimd, ExpEdgeCases) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(cpu::simd::exp(cpu::simd::splat(-inf))[0], 0.0f);
  EXPECT_EQ(cpu::simd::exp(cpu::simd::splat(-1e30f))[0], 0.0f);
  EXPECT_EQ(cpu::simd::exp(cpu::simd::splat(0.0f))[0], 1.0f);
  EXPECT_TRUE(std::isfinite(cpu::simd::exp(cpu::simd::splat(1e30f))[0]));
  // Gradual underflow: subnormal results within one subnormal ulp (2^-149).
  for (float x = -103.0f; x < -87.5f; x += 0.37f)
    EXPECT_LE(std::fabs(cpu::simd::exp(cpu::simd::splat(x))[0] - std::exp(static_cast<double>(x))),
              std::ldexp(1.0, -149))
        << "x = " << x;
  // Every lane computes independently.
  cpu::simd::Vec x{};
  for (int i = 0; i < cpu::simd::kLanes; ++i) x[i] = static_cast<float>(i) - 3.0f;
  const cpu::simd::Vec y = cpu::simd::exp(x);
  for (int i = 0; i < cpu::simd::kLanes; ++i)
    EXPECT_LE(ulps(y[i], std::exp(static_cast<double>(x[i]))), 1.0) << "lane " << i;
}

// The register transpose the fp32 tile loads use: every element lands at its mirror position.
TEST(CpuFlashSimd, TransposeMirrorsEveryElement) {
  constexpr int n = cpu::simd::kLanes;
  cpu::simd::Vec v[n];
  for (int r = 0; r < n; ++r)
    for (int j = 0; j < n; ++j) v[r][j] = static_cast<float>(r * 100 + j);
  cpu::simd::transpose(v);
  for (int r = 0; r < n; ++r)
    for (int j = 0; j < n; ++j) EXPECT_EQ(v[r][j], static_cast<float>(j * 100 + r)) << r << ", " << j;
}

TEST(CpuFlashSimd, TanhWithinFewUlpAndSaturates) {
  double worst = 0.0, worst_x = 0.0;
  for (int i = -1'000'000; i <= 1'000'000; ++i) {
    const float x = 12.0f * static_cast<float>(i) / 1'000'000.0f;
    if (x == 0.0f) continue;
    const float got = cpu::simd::tanh(cpu::simd::splat(x))[0];
    const double e = ulps(got, std::tanh(static_cast<double>(x)));
    if (e > worst) {
      worst = e;
      worst_x = x;
    }
  }
  EXPECT_LE(worst, 4.0) << "at x = " << worst_x;
  EXPECT_EQ(cpu::simd::tanh(cpu::simd::splat(1e4f))[0], 1.0f);
  EXPECT_EQ(cpu::simd::tanh(cpu::simd::splat(-1e4f))[0], -1.0f);
  EXPECT_EQ(cpu::simd::tanh(cpu::simd::splat(0.0f))[0], 0.0f);
}

// ---- attention against the reference ----------------------------------------------------------

struct Case {
  std::string name;
  ProblemSpec spec;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name << ": " << c.spec.describe(); }

using namespace problem_cases;  // fixed, varlen

std::vector<Case> cases() {
  std::vector<Case> c;
  auto add = [&](std::string name, ProblemSpec s) { c.push_back({std::move(name), std::move(s)}); };

  // Shapes.
  add("seqlen1", fixed(1, 1, 1, 2, 2, 32));
  add("seqlen97_d40", fixed(1, 97, 97, 2, 2, 40));
  add("seqlen1025_d64", fixed(1, 1025, 1025, 1, 1, 64));
  add("d1", fixed(1, 70, 97, 2, 2, 1));
  add("d59", fixed(1, 97, 65, 2, 1, 59));
  add("d80", fixed(1, 65, 97, 2, 2, 80));
  add("d111", fixed(1, 97, 97, 1, 1, 111));
  add("d256", fixed(1, 97, 130, 1, 1, 256));
  add("q_longer_than_k", fixed(1, 130, 40, 2, 2, 64));
  add("k_longer_than_q", fixed(1, 40, 200, 2, 2, 64));
  {
    ProblemSpec s = fixed(2, 65, 97, 16, 2, 32);  // GQA 8:1
    add("gqa_8to1", s);
  }
  add("mqa", fixed(1, 97, 80, 4, 1, 48));
  {
    ProblemSpec s = fixed(3, 97, 97, 2, 2, 64);
    s.pad = 5;
    add("padded_strides", s);
  }

  // Variable length, with q-empty and k-empty sequences (the latter: rows that see no key).
  add("varlen", varlen({5, 0, 97, 33, 1}, {7, 12, 0, 70, 130}, 4, 2, 40));
  {
    ProblemSpec s = varlen({64, 1, 0, 100}, {64, 40, 9, 77}, 2, 1, 64);
    s.options.causal = true;
    add("varlen_causal", s);
  }

  // Masks.
  {
    ProblemSpec s = fixed(1, 1025, 1025, 1, 1, 64);
    s.options.causal = true;
    add("causal_1025", s);
  }
  {
    ProblemSpec s = fixed(1, 150, 70, 2, 2, 32);  // the first 80 rows see no key
    s.options.causal = true;
    add("causal_q_longer", s);
  }
  {
    ProblemSpec s = fixed(1, 70, 150, 2, 2, 32);
    s.options.causal = true;
    add("causal_k_longer", s);
  }
  {
    ProblemSpec s = fixed(1, 130, 200, 2, 2, 32);
    s.options.window_left = 16;
    add("window_left_only", s);
  }
  {
    ProblemSpec s = fixed(1, 200, 130, 2, 2, 32);
    s.options.window_right = 8;
    add("window_right_only", s);
  }
  {
    ProblemSpec s = fixed(1, 150, 150, 2, 2, 32);
    s.options.window_left = 10;
    s.options.window_right = 5;
    add("window_both", s);
  }
  {
    ProblemSpec s = fixed(1, 100, 60, 2, 2, 32);  // each row sees at most its own position
    s.options.window_left = 0;
    s.options.window_right = 0;
    add("window_zero", s);
  }

  // Score modifiers and dropout.
  {
    ProblemSpec s = fixed(1, 97, 130, 2, 2, 64);
    s.options.softcap = 3.0f;
    s.magnitude = 2.0f;
    add("softcap", s);
  }
  {
    ProblemSpec s = fixed(1, 97, 130, 4, 2, 32);
    s.alibi = true;
    add("alibi_per_head", s);
  }
  {
    ProblemSpec s = fixed(2, 97, 80, 2, 2, 32);
    s.alibi = true;
    s.alibi_per_batch = true;
    s.options.causal = true;
    add("alibi_per_batch_causal", s);
  }
  {
    ProblemSpec s = fixed(1, 97, 130, 2, 2, 40);
    s.options.dropout_p = 0.17f;
    add("dropout_017", s);
  }
  {
    ProblemSpec s = fixed(1, 130, 97, 2, 1, 32);
    s.options.dropout_p = 0.6f;
    s.options.causal = true;
    add("dropout_06_causal", s);
  }

  // Dtypes and magnitudes.
  {
    ProblemSpec s = fixed(1, 97, 130, 2, 2, 64);
    s.dtype = DType::kFloat16;
    add("fp16", s);
  }
  {
    ProblemSpec s = fixed(1, 130, 97, 2, 2, 80);
    s.dtype = DType::kBFloat16;
    add("bf16", s);
  }
  // bf16 through several key and query blocks (128 keys, 64 queries a block in the backward): the
  // bf16 pair products (AVX-512 BF16) accumulate dK/dV over query blocks and dQ over key blocks,
  // on ragged last blocks, diagonal tiles, windows, GQA and MQA, and a head dim that is no whole
  // number of vectors.
  {
    ProblemSpec s = fixed(1, 300, 333, 4, 2, 128);
    s.dtype = DType::kBFloat16;
    s.options.causal = true;
    add("bf16_gqa_causal_blocks", s);
  }
  {
    ProblemSpec s = fixed(2, 200, 261, 2, 1, 72);
    s.dtype = DType::kBFloat16;
    s.options.window_left = 50;
    s.options.window_right = 10;
    add("bf16_mqa_window_blocks", s);
  }
  {
    ProblemSpec s = fixed(1, 97, 130, 2, 2, 64);
    s.magnitude = 1e3f;
    add("magnitude_1e3", s);
  }
  {
    ProblemSpec s = fixed(1, 97, 97, 2, 2, 64);
    s.magnitude = 1e3f;
    s.dtype = DType::kBFloat16;
    s.options.causal = true;
    add("magnitude_1e3_bf16_causal", s);
  }

  // Decoding: at most 4 query rows per sequence and no dropout take the keys-in-lanes path, a
  // task per (sequence, kv head, head set, chunk of 512+ keys), its partial results merged in
  // chunk order: several chunks, ragged tiles, GQA and MQA groups (a 32-head group is one task's
  // rows), causal and window ranges ending mid-tile, rows that see nothing, varlen with empty
  // sequences, one-hot rows (magnitude 1e3) for the backward's exact recompute.
  {
    ProblemSpec s = fixed(1, 1, 1500, 4, 4, 64);
    add("decode_s1_three_chunks", s);
  }
  {
    ProblemSpec s = fixed(2, 1, 700, 8, 2, 128);
    add("decode_gqa_d128", s);
  }
  {
    ProblemSpec s = fixed(1, 1, 300, 32, 1, 64);
    add("decode_mqa_32_heads", s);
  }
  {
    ProblemSpec s = fixed(1, 4, 1100, 8, 2, 80);
    s.options.causal = true;
    s.dtype = DType::kBFloat16;
    add("decode_s4_causal_bf16", s);
  }
  {
    ProblemSpec s = fixed(1, 3, 900, 4, 2, 59);
    s.alibi = true;
    s.options.window_left = 200;
    s.options.window_right = 0;
    s.options.softcap = 6.0f;
    s.dtype = DType::kFloat16;
    add("decode_window_softcap_alibi_fp16", s);
  }
  {
    ProblemSpec s = varlen({1, 0, 4, 2}, {1000, 5, 0, 70}, 4, 1, 96);
    s.options.causal = true;
    s.pad = 2;
    add("decode_varlen_empty", s);
  }
  {
    ProblemSpec s = fixed(2, 4, 2, 8, 8, 32);
    s.options.causal = true;
    add("decode_rows_before_diagonal", s);
  }
  {
    ProblemSpec s = fixed(1, 2, 40000, 2, 1, 32);
    add("decode_63_chunks", s);
  }
  {
    ProblemSpec s = fixed(1, 1, 600, 2, 2, 64);
    s.magnitude = 1e3f;
    add("decode_magnitude_1e3", s);
  }

  // Everything at once.
  {
    ProblemSpec s = varlen({33, 0, 97, 70}, {50, 20, 0, 111}, 8, 2, 59);
    s.dtype = DType::kBFloat16;
    s.pad = 3;
    s.alibi = true;
    s.options.window_left = 40;
    s.options.window_right = 7;
    s.options.softcap = 4.0f;
    s.options.dropout_p = 0.25f;
    add("all_features_bf16", s);
  }
  {
    ProblemSpec s = fixed(2, 97, 97, 4, 2, 111);
    s.dtype = DType::kFloat16;
    s.pad = 2;
    s.alibi = true;
    s.alibi_per_batch = true;
    s.options.causal = true;
    s.options.softcap = 5.0f;
    s.options.dropout_p = 0.3f;
    s.options.softmax_scale = 0.3f;
    add("all_features_fp16", s);
  }
  return c;
}

class CpuFlash : public ::testing::TestWithParam<Case> {};

TEST_P(CpuFlash, MatchesReference) {
  ProblemSpec spec = GetParam().spec;
  spec.seed = test_seed() ^ std::hash<std::string>{}(GetParam().name);
  spec.options.dropout_seed = spec.seed * 0x9E3779B97F4A7C15ull;
  spec.options.dropout_offset = spec.seed >> 7;
  check_against_reference(spec, /*backward=*/true);
}

INSTANTIATE_TEST_SUITE_P(Cases, CpuFlash, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& param_info) {
                           return param_info.param.name;
                         });

// ---- exact behaviour --------------------------------------------------------------------------

// Rows that see no key (k-empty sequence; rows before the causal diagonal when s_q > s_k) get
// exactly O = 0, LSE = −inf and dQ = 0; keys no row sees get dK = dV = 0. Nothing is NaN.
TEST(CpuFlashExact, RowsWithoutKeysAreZero) {
  ProblemSpec spec = varlen({6, 20, 3}, {0, 5, 4}, 2, 1, 24);
  spec.options.causal = true;
  spec.seed = test_seed();
  SCOPED_TRACE(spec.describe());
  Problem pr = make_problem(spec);
  ASSERT_TRUE(attention_forward(pr.q.view, pr.k.view, pr.v.view, pr.o.view, pr.lse.view,
                                pr.options, pr.varlen).ok());
  ASSERT_TRUE(attention_backward(pr.dout.view, pr.q.view, pr.k.view, pr.v.view, pr.o.view,
                                 pr.lse.view, pr.dq.view, pr.dk.view, pr.dv.view, pr.options,
                                 pr.varlen).ok());
  const std::vector<double> o = pr.read_o(), lse = pr.read_lse(), dq = pr.read_dq();
  const std::vector<double> dk = pr.read_dk(), dv = pr.read_dv();
  const int h = spec.heads_q, d = spec.head_dim;
  const int64_t total_q = 6 + 20 + 3;
  // Sequence 0: no keys. Sequence 1: 20 queries, 5 keys, causal → rows 0..14 see nothing.
  // Sequence 2: 3 queries, 4 keys → every row sees a key.
  auto blind = [](int64_t row) { return row < 6 || (row >= 6 && row < 6 + 15); };
  for (int64_t row = 0; row < total_q; ++row)
    for (int hh = 0; hh < h; ++hh) {
      const double l = lse[hh * total_q + row];
      ASSERT_FALSE(std::isnan(l));
      if (blind(row)) EXPECT_EQ(l, -std::numeric_limits<double>::infinity()) << "row " << row;
      else EXPECT_TRUE(std::isfinite(l)) << "row " << row;
      for (int c = 0; c < d; ++c) {
        const double ov = o[(row * h + hh) * d + c], gq = dq[(row * h + hh) * d + c];
        ASSERT_FALSE(std::isnan(ov) || std::isnan(gq)) << "row " << row;
        if (blind(row)) {
          EXPECT_EQ(ov, 0.0) << "row " << row;
          EXPECT_EQ(gq, 0.0) << "row " << row;
        }
      }
    }
  for (size_t i = 0; i < dk.size(); ++i) ASSERT_FALSE(std::isnan(dk[i]) || std::isnan(dv[i]));
}

// Forward then backward of a fresh `spec` problem on `threads` OpenMP threads.
Problem run_with_threads(const ProblemSpec& spec, int threads) {
  Problem pr = make_problem(spec);
  const int saved = omp_get_max_threads();
  omp_set_num_threads(threads);
  EXPECT_TRUE(attention_forward(pr.q.view, pr.k.view, pr.v.view, pr.o.view, pr.lse.view,
                                pr.options, pr.varlen).ok());
  EXPECT_TRUE(attention_backward(pr.dout.view, pr.q.view, pr.k.view, pr.v.view, pr.o.view,
                                 pr.lse.view, pr.dq.view, pr.dk.view, pr.dv.view, pr.options,
                                 pr.varlen).ok());
  omp_set_num_threads(saved);
  return pr;
}

// A causal problem with dropout in `dtype`, its inputs from this run's seed: the exact tests'.
ProblemSpec exact_case(ProblemSpec spec, DType dtype) {
  spec.dtype = dtype;
  spec.options.causal = true;
  spec.options.dropout_p = 0.1f;
  spec.seed = test_seed();
  return spec;
}

// The backward is a pure function of its inputs: same bits with 1 thread or many, run after run
// (fp32, and bf16, whose products run in bf16 pairs where the CPU has AVX-512 BF16).
TEST(CpuFlashExact, BackwardIsDeterministicAcrossThreadCounts) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    const ProblemSpec spec = exact_case(fixed(2, 300, 260, 4, 2, 48), dtype);
    SCOPED_TRACE(spec.describe());
    const Problem one = run_with_threads(spec, 1), many = run_with_threads(spec, 4),
                  again = run_with_threads(spec, 4);
    EXPECT_EQ(one.o.bytes, many.o.bytes);
    EXPECT_EQ(one.lse.bytes, many.lse.bytes);
    for (const Problem* pr : {&many, &again}) {
      EXPECT_EQ(one.dq.bytes, pr->dq.bytes);
      EXPECT_EQ(one.dk.bytes, pr->dk.bytes);
      EXPECT_EQ(one.dv.bytes, pr->dv.bytes);
    }
  }
}

// The backward runs in one pass per (batch, kv head) when those tasks keep the threads busy, and
// in two passes (dK/dV per key block, then dQ per query block) when they cannot. Both sum every
// element in one order: one sequence of one kv head takes one pass on 1 thread and two on 4, and
// the bits must agree (fp32, and bf16 with its pair products).
TEST(CpuFlashExact, BackwardModesGiveTheSameBits) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    const ProblemSpec spec = exact_case(fixed(1, 300, 333, 3, 1, 40), dtype);
    SCOPED_TRACE(spec.describe());
    const Problem one_pass = run_with_threads(spec, 1), two_passes = run_with_threads(spec, 4);
    EXPECT_EQ(one_pass.o.bytes, two_passes.o.bytes);
    EXPECT_EQ(one_pass.dq.bytes, two_passes.dq.bytes);
    EXPECT_EQ(one_pass.dk.bytes, two_passes.dk.bytes);
    EXPECT_EQ(one_pass.dv.bytes, two_passes.dv.bytes);
  }
}

}  // namespace
}  // namespace flare::test
