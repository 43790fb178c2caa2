// test_cpu_nonfinite.cpp — NaN and ±Inf in q, k, v or dO propagate through the CPU flash backend
// exactly as through the float64 reference.
//
// The reference follows IEEE arithmetic over the keys each row sees and never reads the others: a
// NaN score makes its row's O and LSE NaN (and so does a +inf score: exp(inf − inf)); a row whose
// visible scores are all −inf gets NaN from 0/0; a visible ±Inf in v reaches the O entries that
// weigh it, a dropped key's 0 weight included (0·Inf = NaN, as dropout followed by P·V gives); a
// masked key, a padded token of a varlen batch, and a row that sees no key influence nothing.
// The flash backend must give the same pattern: NaN where the reference has NaN, the same signed
// Inf where it has Inf, and every finite entry within the tolerance rule of docs/architecture.md.
//
// Each case is a small problem with awkward sizes (s 1, 2, 17, 97; d 40, 64, 80; GQA; varlen with
// empty sequences; s_q != s_k) and features (causal, window, softcap, ALiBi, dropout; q and k of
// magnitude 1e3), plus one injection: NaN, +Inf or −Inf into one element or one row (one token of
// one head) of q, k, v or dO, at a random place. The case's name says what went where; the trace
// gives the place and the seed (FLARE_TEST_SEED replays it).
//
// Where a softmax weight underflows in fp32 but not in float64 (a score more than ~103 below its
// row's maximum), P·Inf is NaN in fp32 and Inf in float64: no fp32 kernel can agree there. So
// infinities go into v and dO only where scores stay within that range of each other (ALiBi
// slopes at most 0.5 over at most 97 keys; the magnitude-1e3 problems take injections into q and
// k alone).
//
// A large finite value (±1e4; ±1e3 for fp16) in one element or row must stay finite wherever the
// reference is finite: those cases check the pattern only. The tolerance rule compares the fast
// path's largest error with the naive kernel's, and when one injected row dominates both, that is
// one sample against one: in trials about 0.3% of such cases exceeded twice the naive error (by up
// to 5×, never by an amount beyond fp32 rounding of the large row's dot products), which is luck
// of the yardstick, not an error of either kernel. Large magnitudes get the full check in the
// magnitude-1e3 problems, where every row is large.
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cpu/flash_simd.h"
#include "problem_cases.h"
#include "test_util.h"

namespace flare::test {
namespace {

using namespace problem_cases;  // fixed, varlen, causal, window, softcap, alibi, dropout, ...

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// ---- problems --------------------------------------------------------------------------------

struct Config {
  const char* name;
  ProblemSpec spec;  // seed set per case
};

std::vector<Config> configs() {
  return {
      // Tiny sequences in many (batch, head) pairs: the tolerance rule compares largest errors,
      // which over a handful of rows would be one sample against another.
      {"s1_d40", fixed(4, 1, 1, 4, 2, 40)},
      {"s2_causal_d64", causal(fixed(4, 2, 2, 4, 2, 64))},
      {"s17_gqa_d80", fixed(2, 17, 17, 4, 2, 80)},
      {"s97_causal_d64", causal(fixed(1, 97, 97, 2, 2, 64))},
      {"sq17_sk97_causal_d40", causal(fixed(1, 17, 97, 2, 1, 40))},
      {"sq97_sk17_causal_d64", causal(fixed(1, 97, 17, 2, 2, 64))},  // rows that see nothing
      {"s97_window_mqa_d80", window(fixed(1, 97, 97, 2, 1, 80), 7, 3)},
      {"s97_causal_softcap_d64", softcap(causal(fixed(1, 97, 97, 2, 2, 64)), 4.0f)},
      {"s97_alibi_d40", alibi(fixed(1, 97, 97, 2, 2, 40))},
      {"s97_dropout_d64", dropout(fixed(1, 97, 97, 2, 2, 64), 0.25f)},
      {"s97_causal_dropout_gqa_d80", dropout(causal(fixed(1, 97, 97, 4, 1, 80)), 0.4f)},
      {"varlen_empty_causal_d64", causal(varlen({5, 3, 17, 0, 1}, {9, 0, 20, 4, 1}, 2, 1, 64))},
      {"varlen_window_softcap_alibi_d40",
       alibi(softcap(window(varlen({17, 0, 97}, {17, 0, 97}, 2, 2, 40), 16, 0), 8.0f))},
      {"bf16_s97_causal_dropout_d64", dropout(causal(fixed(1, 97, 97, 2, 2, 64, DType::kBFloat16)), 0.2f)},
      {"fp16_s17_window_gqa_d80", window(fixed(2, 17, 17, 4, 2, 80, DType::kFloat16), 3, 5)},
      // Decoding shapes (at most 4 query rows per sequence: the keys-in-lanes path, chunks of
      // 512+ keys merged).
      {"decode_s1_sk600_gqa_d64", fixed(2, 1, 600, 8, 2, 64)},
      {"decode_s4_sk1100_causal_window_mqa_d80", window(causal(fixed(1, 4, 1100, 4, 1, 80)), 300, 0)},
      {"decode_varlen_alibi_softcap_d40", alibi(softcap(varlen({1, 0, 3}, {97, 4, 0}, 4, 2, 40), 6.0f))},
      {"mag1e3_s97_causal_d64", magnitude(causal(fixed(1, 97, 97, 2, 2, 64)), 1e3f)},
      {"mag1e3_varlen_window_gqa_d40",
       magnitude(window(varlen({17, 0, 97}, {40, 3, 97}, 4, 2, 40), 20, 2), 1e3f)},
  };
}

// Scores of q and k drawn at magnitude 1e3 lie hundreds apart, where fp32 weights underflow and
// float64 ones need not (see the top): infinities in v or dO cannot be compared there.
bool takes_infinite_values(const ProblemSpec& spec) { return spec.magnitude <= 1.0f; }

// ---- injections -----------------------------------------------------------------------------

enum class Target { kQ, kK, kV, kDout };
enum class Value { kNan, kPosInf, kNegInf, kPosLarge, kNegLarge };

struct Injection {
  Target target;
  Value value;
  bool row;  // all head_dim entries of one token of one head, else one element
};

const char* target_name(Target t) {
  switch (t) {
    case Target::kQ: return "q";
    case Target::kK: return "k";
    case Target::kV: return "v";
    default: return "dout";
  }
}

const char* value_name(Value v) {
  switch (v) {
    case Value::kNan: return "nan";
    case Value::kPosInf: return "posinf";
    case Value::kNegInf: return "neginf";
    case Value::kPosLarge: return "poslarge";
    default: return "neglarge";
  }
}

float value_of(Value v, DType dtype) {
  const float large = dtype == DType::kFloat16 ? 1e3f : 1e4f;  // fp16 outputs stay below 65504
  switch (v) {
    case Value::kNan: return kNaN;
    case Value::kPosInf: return kInf;
    case Value::kNegInf: return -kInf;
    case Value::kPosLarge: return large;
    default: return -large;
  }
}

std::vector<Injection> injections(const ProblemSpec& spec, std::vector<Value> values) {
  std::vector<Injection> out;
  for (Target t : {Target::kQ, Target::kK, Target::kV, Target::kDout}) {
    const bool value_side = t == Target::kV || t == Target::kDout;
    if (value_side && !takes_infinite_values(spec)) continue;
    for (Value v : values)
      for (bool row : {false, true}) out.push_back({t, v, row});
  }
  return out;
}

struct Case {
  Config config;
  Injection injection;
};

std::vector<Case> cases(std::vector<Value> values, bool large_magnitudes) {
  std::vector<Case> out;
  for (const Config& config : configs()) {
    if (!large_magnitudes && !takes_infinite_values(config.spec)) continue;
    for (const Injection& in : injections(config.spec, values)) out.push_back({config, in});
  }
  return out;
}

std::string case_name(const Case& c) {
  return std::string(c.config.name) + "__" + target_name(c.injection.target) +
         (c.injection.row ? "_row_" : "_element_") + value_name(c.injection.value);
}

// Writes `x` into token `token` (packed order: b·s + i for fixed length), head `head`, columns
// [c0, c1) of a q-like or k-like tensor.
void write_token(const Problem& pr, HostTensor& t, int64_t token, int head, int c0, int c1,
                 float x) {
  for (int c = c0; c < c1; ++c) {
    if (pr.is_varlen()) {
      t.set({token, head, c}, x);
    } else {
      const int64_t s = t.view.shape[1];
      t.set({token / s, token % s, head, c}, x);
    }
  }
}

// Injects c.injection at a place drawn from `rng`; returns where, for the trace.
std::string inject(const Injection& in, Problem& pr, std::mt19937_64& rng) {
  const bool query_side = in.target == Target::kQ || in.target == Target::kDout;
  HostTensor& t = in.target == Target::kQ   ? pr.q
                  : in.target == Target::kK ? pr.k
                  : in.target == Target::kV ? pr.v
                                            : pr.dout;
  const int64_t tokens = pr.is_varlen() ? t.view.shape[0] : t.view.shape[0] * t.view.shape[1];
  const int heads = query_side ? pr.spec.heads_q : pr.spec.heads_kv;
  const int d = pr.spec.head_dim;
  const int64_t token = std::uniform_int_distribution<int64_t>(0, tokens - 1)(rng);
  const int head = std::uniform_int_distribution<int>(0, heads - 1)(rng);
  const int col = std::uniform_int_distribution<int>(0, d - 1)(rng);
  const float x = value_of(in.value, pr.spec.dtype);
  const int c0 = in.row ? 0 : col, c1 = in.row ? d : col + 1;
  write_token(pr, t, token, head, c0, c1, x);
  std::ostringstream where;
  where << target_name(in.target) << "[token " << token << ", head " << head << ", ";
  if (in.row) {
    where << "all columns";
  } else {
    where << "column " << col;
  }
  where << "] = " << x;
  return where.str();
}

// Keeps every ALiBi bias within 0.5 · 96 of the row's largest score (see the top of the file).
void halve_alibi_slopes(Problem& pr) {
  if (!pr.spec.alibi) return;
  auto* slopes = reinterpret_cast<float*>(pr.alibi.bytes.data());
  for (int64_t i = 0; i < pr.alibi.view.numel(); ++i) slopes[i] *= 0.5f;
}

uint64_t case_seed(const std::string& name) {
  return test_seed() * 0x9E3779B97F4A7C15ull + std::hash<std::string>{}(name);
}

// ---- the test -------------------------------------------------------------------------------

enum class Check { kPatternAndValues, kPatternOnly };

// Forward, then backward from the forward's own O and LSE, both through the public API (CPU:
// flash), each output against the references.
void run_and_check(Problem& pr, Check check = Check::kPatternAndValues,
                   const NaiveErrors* budget = nullptr) {
  Status s = attention_forward(pr.q.view, pr.k.view, pr.v.view, pr.o.view, pr.lse.view,
                               pr.options, pr.varlen);
  ASSERT_TRUE(s.ok()) << s.to_string();
  const AttentionParams fp = pr.forward_params();
  if (check == Check::kPatternAndValues) {
    expect_forward_matches_nonfinite(pr, budget);
  } else {
    const cpu::RefForward ref = cpu::reference_forward(fp, cpu::RefPrecision::kFloat64);
    EXPECT_TRUE(same_nonfinite_pattern("O", pr.read_o(), ref.o));
    EXPECT_TRUE(same_nonfinite_pattern("LSE", pr.read_lse(), ref.lse));
  }
  s = attention_backward(pr.dout.view, pr.q.view, pr.k.view, pr.v.view, pr.o.view, pr.lse.view,
                         pr.dq.view, pr.dk.view, pr.dv.view, pr.options, pr.varlen);
  ASSERT_TRUE(s.ok()) << s.to_string();
  const AttentionParams bp = pr.backward_params();
  const cpu::RefBackward ref = cpu::reference_backward(bp, cpu::RefPrecision::kFloat64);
  if (check == Check::kPatternAndValues) {
    expect_gradients_match_nonfinite(pr, bp, ref, naive_backward(bp), budget);
  } else {
    EXPECT_TRUE(same_nonfinite_pattern("dQ", pr.read_dq(), ref.dq));
    EXPECT_TRUE(same_nonfinite_pattern("dK", pr.read_dk(), ref.dk));
    EXPECT_TRUE(same_nonfinite_pattern("dV", pr.read_dv(), ref.dv));
  }
}

// Builds the case's problem, injects, runs and checks.
void run_case(const Case& c, Check check) {
  ProblemSpec spec = c.config.spec;
  spec.seed = case_seed(case_name(c));
  std::mt19937_64 rng(spec.seed ^ 0x5DEECE66Dull);
  Problem twin = make_problem(spec);  // the same data, nothing injected
  halve_alibi_slopes(twin);
  const NaiveErrors budget = naive_errors(twin);
  Problem pr = make_problem(spec);
  halve_alibi_slopes(pr);
  const std::string where = inject(c.injection, pr, rng);
  SCOPED_TRACE(where + "; " + spec.describe() + " (test seed " + std::to_string(test_seed()) +
               ")");
  run_and_check(pr, check, &budget);
}

class CpuNonfinite : public ::testing::TestWithParam<Case> {};

TEST_P(CpuNonfinite, PatternAndValuesMatchReference) {
  run_case(GetParam(), Check::kPatternAndValues);
}

class CpuLargeFinite : public ::testing::TestWithParam<Case> {};

TEST_P(CpuLargeFinite, FiniteWhereReferenceIsFinite) { run_case(GetParam(), Check::kPatternOnly); }

// gtest prints a failing case's parameter by its name.
void PrintTo(const Case& c, std::ostream* os) { *os << case_name(c); }

std::string param_name(const ::testing::TestParamInfo<Case>& param) {
  return case_name(param.param);
}

INSTANTIATE_TEST_SUITE_P(Features, CpuNonfinite,
                         ::testing::ValuesIn(cases({Value::kNan, Value::kPosInf, Value::kNegInf},
                                                   true)),
                         param_name);
INSTANTIATE_TEST_SUITE_P(Features, CpuLargeFinite,
                         ::testing::ValuesIn(cases({Value::kPosLarge, Value::kNegLarge}, false)),
                         param_name);

// ---- the vector math ---------------------------------------------------------------------------

// The backend's exp once clamped NaN to its lower bound, giving a NaN score the weight 0.
TEST(CpuNonfiniteSimd, ExpAndTanhKeepNan) {
  EXPECT_TRUE(std::isnan(cpu::simd::exp(cpu::simd::splat(kNaN))[0]));
  EXPECT_TRUE(std::isnan(cpu::simd::exp(cpu::simd::splat(-kNaN))[0]));
  EXPECT_TRUE(std::isnan(cpu::simd::tanh(cpu::simd::splat(kNaN))[0]));
  EXPECT_EQ(cpu::simd::tanh(cpu::simd::splat(kInf))[0], 1.0f);
  EXPECT_EQ(cpu::simd::tanh(cpu::simd::splat(-kInf))[0], -1.0f);
  cpu::simd::Vec x = cpu::simd::splat(1.0f);  // lanes stay independent
  x[0] = kNaN;
  const cpu::simd::Vec e = cpu::simd::exp(x);
  EXPECT_TRUE(std::isnan(e[0]));
  for (int i = 1; i < cpu::simd::kLanes; ++i) EXPECT_EQ(e[i], cpu::simd::exp(cpu::simd::splat(1.0f))[0]);
}

// ---- the cases that were found wrong, pinned ---------------------------------------------------

// b 1, h 1, d 1, scale 1: the examples of the report, each with a single clear expectation on
// top of the reference comparison. Inputs are small integers and halves (q = 1, k = (1, 0.5),
// v = (1, 2), dO = 1) but for the injected ones, so that the finite results are exact to within
// the final rounding and the comparison is not one rounding error against another.
struct Tiny {
  Problem pr;
  explicit Tiny(int s, bool is_causal) {
    ProblemSpec spec = fixed(1, s, s, 1, 1, 1);
    spec.options.causal = is_causal;
    spec.options.softmax_scale = 1.0f;
    pr = make_problem(spec);
    for (int i = 0; i < s; ++i) {
      pr.q.set({0, i, 0, 0}, 1.0f);
      pr.k.set({0, i, 0, 0}, i % 2 ? 0.5f : 1.0f);
      pr.v.set({0, i, 0, 0}, i % 2 ? 2.0f : 1.0f);
      pr.dout.set({0, i, 0, 0}, 1.0f);
    }
  }
  void set(HostTensor& t, std::vector<float> x) {
    for (size_t i = 0; i < x.size(); ++i) t.set({0, static_cast<int64_t>(i), 0, 0}, x[i]);
  }
};

TEST(CpuNonfiniteExamples, NanQueryGivesNanRow) {
  Tiny t(1, false);
  t.set(t.pr.q, {kNaN});
  run_and_check(t.pr);
  EXPECT_TRUE(std::isnan(t.pr.o.get({0, 0, 0, 0})));
  EXPECT_TRUE(std::isnan(t.pr.lse.get({0, 0, 0})));  // not −inf: the row sees a key
}

TEST(CpuNonfiniteExamples, NanKeyPoisonsEveryRowThatSeesIt) {
  Tiny t(2, false);
  t.set(t.pr.k, {kNaN, 1.0f});
  run_and_check(t.pr);
  EXPECT_TRUE(std::isnan(t.pr.o.get({0, 0, 0, 0})));
  EXPECT_TRUE(std::isnan(t.pr.o.get({0, 1, 0, 0})));
}

TEST(CpuNonfiniteExamples, MaskedInfiniteValueIsNeverRead) {
  Tiny t(2, true);
  t.set(t.pr.v, {1.0f, kInf});
  run_and_check(t.pr);
  EXPECT_EQ(t.pr.o.get({0, 0, 0, 0}), 1.0f);  // row 0 sees key 0 alone
  EXPECT_EQ(t.pr.o.get({0, 1, 0, 0}), kInf);
}

TEST(CpuNonfiniteExamples, InfiniteOutputGradientOfAMaskedRowIsNeverRead) {
  Tiny t(2, true);
  t.set(t.pr.dout, {kInf, 1.0f});
  run_and_check(t.pr);
  // Key 1 is seen by row 1 alone, whose dO is finite.
  EXPECT_TRUE(std::isfinite(t.pr.dk.get({0, 1, 0, 0})));
  EXPECT_TRUE(std::isfinite(t.pr.dv.get({0, 1, 0, 0})));
}

TEST(CpuNonfiniteExamples, AllVisibleScoresMinusInfinityGiveNan) {
  // q = +inf against negative keys: every score is −inf, the softmax 0/0.
  Tiny t(2, false);
  t.set(t.pr.q, {kInf, 1.0f});
  t.set(t.pr.k, {-1.0f, -2.0f});
  run_and_check(t.pr);
  EXPECT_TRUE(std::isnan(t.pr.o.get({0, 0, 0, 0})));
  EXPECT_TRUE(std::isnan(t.pr.lse.get({0, 0, 0})));
  EXPECT_TRUE(std::isfinite(t.pr.o.get({0, 1, 0, 0})));
}

}  // namespace
}  // namespace flare::test
