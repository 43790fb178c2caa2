// test_gpu_nonfinite.cpp — NaN and ±Inf through the CUDA kernels, against the float64 reference.
//
// The reference (src/cpu/reference.cpp) defines what a non-finite input does: a NaN or +Inf score
// makes its row's softmax NaN, a row whose every visible score is −Inf is NaN too (exp(−inf −
// −inf)), a row that sees no key is O = 0 and LSE = −inf, and a masked pair is never visited, so a
// key a row cannot see never touches that row, and a query row never touches the gradients of the
// keys it cannot see. The kernels' tensor-core products do multiply masked pairs (by P = 0 or dS =
// 0), and 0·Inf = NaN; their epilogues find the non-finite rows and recompute them exactly
// (src/cuda/nonfinite_fixup.cuh). Each case here is a small seeded problem with one non-finite
// value (NaN, +Inf or −Inf) written into one element or one whole row of q, k, v or dO; every
// output of the CUDA forward (O, LSE) and backward (dQ, dK, dV) must then carry exactly the
// reference's non-finite pattern — NaN where it has NaN, +Inf where +Inf, −Inf where −Inf, nothing
// else — and its finite entries must follow docs/architecture.md's tolerance rule, with the naive
// low-precision kernel's error measured on the problem's finite twin (same seed, nothing injected:
// test_util.h's NaiveErrors), as tests/test_cpu_nonfinite.cpp does.
//
// Paths: the sm80 kernels (forced, cuda/dispatch.h) for every compiled head-dim bucket under a
// causal mask, and for each feature they support — rows that see no key, sliding windows with GQA,
// varlen with an empty sequence, softcap, ALiBi, dropout, deterministic mode, ragged ends, full
// unmasked tiles (where the backward launches no fixup); then the sm90 kernels (taken on their own
// on an sm_90 device for d 64, 128 and 256) under the masks they support. The masked pairs these
// problems exercise sit on partially masked tiles: causal diagonals, window edges, ragged sequence
// ends (rows past the last query, keys past the last key), varlen boundaries. Scores stay within a
// few units (N(0, 1) inputs, ALiBi only under windows of 4 keys: slopes up to 1) so no visible
// probability underflows where the float64 reference keeps it positive (P·Inf would then differ for
// a reason no kernel can avoid). Every case names what was injected where.
// Without a CUDA device every test skips, saying so.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <iterator>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cuda/dispatch.h"
#include "gpu_bwd_util.h"
#include "gpu_util.h"
#include "problem_cases.h"
#include "test_util.h"

namespace flare::test {
namespace {

// ---- injections --------------------------------------------------------------------------------

enum class Target { kQ, kK, kV, kDout };
enum class Extent { kElement, kRow };

struct Injection {
  Target target;
  float value;  // NaN, +Inf or −Inf
  Extent extent;
};

const char* target_name(Target t) {
  switch (t) {
    case Target::kQ:
      return "q";
    case Target::kK:
      return "k";
    case Target::kV:
      return "v";
    case Target::kDout:
      return "dout";
  }
  return "?";
}

std::string value_name(float x) { return std::isnan(x) ? "NaN" : (x > 0 ? "+Inf" : "-Inf"); }

// Every (tensor, value, extent) combination: 4 × 3 × 2.
std::vector<Injection> all_injections() {
  std::vector<Injection> out;
  const float values[] = {std::numeric_limits<float>::quiet_NaN(),
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity()};
  for (Target t : {Target::kQ, Target::kK, Target::kV, Target::kDout})
    for (float x : values)
      for (Extent e : {Extent::kElement, Extent::kRow}) out.push_back({t, x, e});
  return out;
}

HostTensor& target_tensor(Problem& pr, Target t) {
  switch (t) {
    case Target::kQ:
      return pr.q;
    case Target::kK:
      return pr.k;
    case Target::kV:
      return pr.v;
    case Target::kDout:
      return pr.dout;
  }
  return pr.q;
}

// Writes the injection into the problem's host tensor at a position drawn from `rng` (a token of
// a non-empty sequence, a head, a column) and returns where, for the failure message.
std::string inject(Problem& pr, const Injection& inj, std::mt19937_64& rng) {
  HostTensor& t = target_tensor(pr, inj.target);
  const TensorView& v = t.view;
  const bool varlen = v.ndim == 3;  // (tokens, heads, d) packed, else (b, s, heads, d)
  auto draw = [&](int64_t n) { return std::uniform_int_distribution<int64_t>(0, n - 1)(rng); };
  const int64_t batch = varlen ? 0 : draw(v.shape[0]);
  const int64_t token = draw(v.shape[varlen ? 0 : 1]);
  const int64_t head = draw(v.shape[varlen ? 1 : 2]);
  const int64_t d = v.shape[varlen ? 2 : 3];
  const int64_t col = draw(d);
  for (int64_t c = 0; c < d; ++c) {
    if (inj.extent == Extent::kElement && c != col) continue;
    if (varlen)
      t.set({token, head, c}, inj.value);
    else
      t.set({batch, token, head, c}, inj.value);
  }
  std::ostringstream where;
  where << value_name(inj.value) << " in " << target_name(inj.target)
        << (varlen ? "[token " : "[b ") << (varlen ? token : batch);
  if (!varlen) where << ", s " << token;
  where << ", head " << head << ", "
        << (inj.extent == Extent::kRow ? "whole row" : "column " + std::to_string(col)) << "]";
  return where.str();
}

// ---- the check ---------------------------------------------------------------------------------

// The naive kernel's error on every output of `spec`'s finite twin, from the inputs the CUDA calls
// get: the forward's from the problem alone, the backward's with O and LSE from the float64
// reference, which is what GpuBackwardProblem uploads.
NaiveErrors twin_budget(const ProblemSpec& spec) {
  Problem twin = make_problem(spec);
  const AttentionParams fp = twin.forward_params();
  const cpu::RefForward ref = cpu::reference_forward(fp, cpu::RefPrecision::kFloat64);
  const cpu::RefForward naive = cpu::reference_forward(fp, cpu::RefPrecision::kLowPrecision);
  with_reference_forward(&twin);
  const AttentionParams bp = twin.backward_params();
  const cpu::RefBackward rb = cpu::reference_backward(bp, cpu::RefPrecision::kFloat64);
  const GradientErrors g = gradient_errors(naive_backward(bp), rb);
  return {naive_error(naive.o, ref.o), naive_error(naive.lse, ref.lse), g.dq, g.dk, g.dv};
}

// The checks run with `overrides` and tell `record` which kernels ran.
void check_forward(const ProblemSpec& spec, const Injection& inj, uint64_t salt,
                   const NaiveErrors& budget, const cuda::DispatchOverrides& overrides,
                   cuda::DispatchRecord* record) {
  Problem pr = make_problem(spec);
  std::mt19937_64 rng(spec.seed ^ salt);
  SCOPED_TRACE("forward, " + inject(pr, inj, rng));
  {
    GpuProblem gpu(pr);
    ASSERT_FALSE(::testing::Test::HasFatalFailure());
    const Status s = gpu.forward(nullptr, overrides, record);
    ASSERT_TRUE(s.ok()) << s.to_string();
    gpu.download_forward(&pr);
  }
  expect_forward_matches_nonfinite(pr, &budget);
}

void check_backward(const ProblemSpec& spec, const Injection& inj, uint64_t salt,
                    const NaiveErrors& budget, const cuda::DispatchOverrides& overrides,
                    cuda::DispatchRecord* record) {
  Problem pr = make_problem(spec);
  std::mt19937_64 rng(spec.seed ^ salt);
  SCOPED_TRACE("backward, " + inject(pr, inj, rng));
  {
    GpuBackwardProblem gpu(&pr);  // O and LSE from the float64 reference, non-finite ones too
    ASSERT_FALSE(::testing::Test::HasFatalFailure());
    const Status s = gpu.backward(nullptr, overrides, record);
    ASSERT_TRUE(s.ok()) << s.to_string();
    gpu.download_backward(&pr);
  }
  const AttentionParams bp = pr.backward_params();
  const cpu::RefBackward ref = cpu::reference_backward(bp, cpu::RefPrecision::kFloat64);
  expect_gradients_match_nonfinite(pr, bp, ref, naive_backward(bp), &budget);
}

// Every injection into `spec`, forward (not for dO, which the forward does not read) and backward,
// with `overrides`; `record` is left telling which kernels the last calls ran.
void check_all_injections(const ProblemSpec& spec, const cuda::DispatchOverrides& overrides = {},
                          cuda::DispatchRecord* record = nullptr) {
  SCOPED_TRACE(spec.describe());
  const NaiveErrors budget = twin_budget(spec);
  uint64_t salt = 0;
  for (const Injection& inj : all_injections()) {
    ++salt;
    if (inj.target != Target::kDout) check_forward(spec, inj, salt, budget, overrides, record);
    check_backward(spec, inj, salt, budget, overrides, record);
  }
}

// ---- problems ----------------------------------------------------------------------------------

// Two sequences of 75 tokens and two heads, seeded from this run's seed and `salt`.
ProblemSpec base_spec(DType dtype, int head_dim, uint64_t salt) {
  return problem_cases::with_seed(problem_cases::fixed(2, 75, 75, 2, 2, head_dim, dtype),
                                  test_seed() + salt);
}

struct Feature {
  const char* name;
  ProblemSpec (*make)(DType dtype);
};

// The sm80 features, each at a head dim whose bucket differs from its neighbours'.
const Feature kSm80Features[] = {
    {"CausalQueriesMoreThanKeys",  // bottom-right aligned: the first 11 rows see no key
     [](DType dt) {
       ProblemSpec s = base_spec(dt, 80, 101);
       s.seqlen_q = 40;
       s.seqlen_k = 29;
       s.options.causal = true;
       return s;
     }},
    {"WindowGqa",
     [](DType dt) {
       ProblemSpec s = base_spec(dt, 128, 102);
       s.seqlen_q = 90;
       s.seqlen_k = 100;
       s.heads_q = 4;
       s.heads_kv = 2;
       s.options.window_left = 17;
       s.options.window_right = 5;
       return s;
     }},
    {"VarlenCausalWithEmptySequence",
     [](DType dt) {
       ProblemSpec s = base_spec(dt, 64, 103);
       s.varlen_q = {33, 0, 70};
       s.varlen_k = {41, 12, 70};
       s.options.causal = true;
       return s;
     }},
    {"SoftcapCausal",
     [](DType dt) {
       ProblemSpec s = base_spec(dt, 32, 104);
       s.options.softcap = 5.0f;
       s.options.causal = true;
       return s;
     }},
    {"AlibiShortWindow",  // distances ≤ 4: no visible probability underflows fp16
     [](DType dt) {
       ProblemSpec s = base_spec(dt, 96, 105);
       s.alibi = true;
       s.options.causal = true;
       s.options.window_left = 4;
       return s;
     }},
    {"DropoutCausal",
     [](DType dt) {
       ProblemSpec s = base_spec(dt, 64, 106);
       s.options.causal = true;
       s.options.dropout_p = 0.2f;
       s.options.dropout_seed = 7 + test_seed();
       return s;
     }},
    {"RaggedEndsNoMask",  // rows past the last query and keys past the last key in the tiles
     [](DType dt) {
       ProblemSpec s = base_spec(dt, 64, 107);
       s.seqlen_q = 50;
       s.seqlen_k = 45;
       return s;
     }},
    {"DeterministicWindowGqa",  // CTAs own runs of key blocks and dQ slices
     [](DType dt) {
       ProblemSpec s = base_spec(dt, 128, 109);
       s.seqlen_q = 90;
       s.seqlen_k = 100;
       s.heads_q = 4;
       s.heads_kv = 2;
       s.options.window_left = 17;
       s.options.window_right = 5;
       s.options.deterministic = true;
       return s;
     }},
    {"DeterministicVarlenCausal",
     [](DType dt) {
       ProblemSpec s = base_spec(dt, 64, 110);
       s.varlen_q = {70, 0, 33};
       s.varlen_k = {70, 12, 41};
       s.options.causal = true;
       s.options.deterministic = true;
       return s;
     }},
    {"FullTilesNoMask",  // no masked pair anywhere: the backward launches no fixup kernel
     [](DType dt) {
       ProblemSpec s = base_spec(dt, 64, 111);
       s.seqlen_q = s.seqlen_k = 128;
       return s;
     }},
    {"EveryModifierWindowed",
     [](DType dt) {
       ProblemSpec s = base_spec(dt, 192, 108);
       s.seqlen_q = 60;
       s.seqlen_k = 70;
       s.alibi = true;
       s.options.softcap = 8.0f;
       s.options.causal = true;
       s.options.window_left = 4;
       s.options.dropout_p = 0.1f;
       s.options.dropout_seed = 11 + test_seed();
       return s;
     }},
};

// The sm90 masks (fixed-length batches, no score modifier or dropout), at a given head dim.
const Feature kSm90Masks[] = {
    {"Causal",
     [](DType dt) {
       ProblemSpec s = base_spec(dt, 0, 201);
       s.seqlen_q = s.seqlen_k = 150;
       s.options.causal = true;
       return s;
     }},
    {"CausalQueriesMoreThanKeys",
     [](DType dt) {
       ProblemSpec s = base_spec(dt, 0, 202);
       s.seqlen_q = 200;
       s.seqlen_k = 130;
       s.options.causal = true;
       return s;
     }},
    {"WindowGqa",
     [](DType dt) {
       ProblemSpec s = base_spec(dt, 0, 203);
       s.seqlen_q = 170;
       s.seqlen_k = 190;
       s.heads_q = 4;
       s.heads_kv = 2;
       s.options.window_left = 33;
       s.options.window_right = 7;
       return s;
     }},
    {"RaggedEndsNoMask",
     [](DType dt) {
       ProblemSpec s = base_spec(dt, 0, 204);
       s.seqlen_q = 150;
       s.seqlen_k = 140;
       return s;
     }},
    {"FullTilesNoMask",  // no masked pair anywhere: the backward launches no fixup kernel
     [](DType dt) {
       ProblemSpec s = base_spec(dt, 0, 205);
       s.seqlen_q = s.seqlen_k = 256;
       return s;
     }},
};

std::string dtype_name_of(DType dt) { return dt == DType::kFloat16 ? "fp16" : "bf16"; }

// ---- sm80 (forced) -----------------------------------------------------------------------------

std::vector<int> sm80_buckets() {
  std::vector<int> out;
#define FLARE_CUDA_FWD_VARIANT(DT, HD) \
  if (DType::DT == DType::kBFloat16) out.push_back(HD);
#include "flare/cuda_fwd_variants.inc"
#undef FLARE_CUDA_FWD_VARIANT
  return out;
}

struct BucketCase {
  DType dtype;
  int head_dim;
};

class GpuNonfiniteSm80Bucket : public ::testing::TestWithParam<BucketCase> {};

// Every compiled bucket at its own head dim (the register-tight, pipelined and skewed tiles
// among them), causal: diagonal tiles in both passes.
TEST_P(GpuNonfiniteSm80Bucket, Causal) {
  FLARE_SKIP_WITHOUT_CUDA();
  ProblemSpec s = base_spec(GetParam().dtype, GetParam().head_dim, 1);
  s.options.causal = true;
  check_all_injections(s, sm80_forced());
}

std::vector<BucketCase> bucket_cases() {
  std::vector<BucketCase> out;
  for (DType dt : {DType::kBFloat16, DType::kFloat16})
    for (int d : sm80_buckets()) out.push_back({dt, d});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Compiled, GpuNonfiniteSm80Bucket, ::testing::ValuesIn(bucket_cases()),
                         [](const ::testing::TestParamInfo<BucketCase>& param) {
                           return dtype_name_of(param.param.dtype) + "_d" +
                                  std::to_string(param.param.head_dim);
                         });

struct FeatureCase {
  DType dtype;
  int feature;  // index into the feature table
};

class GpuNonfiniteSm80Feature : public ::testing::TestWithParam<FeatureCase> {};

TEST_P(GpuNonfiniteSm80Feature, AllInjections) {
  FLARE_SKIP_WITHOUT_CUDA();
  check_all_injections(kSm80Features[GetParam().feature].make(GetParam().dtype), sm80_forced());
}

std::vector<FeatureCase> sm80_feature_cases() {
  std::vector<FeatureCase> out;
  for (DType dt : {DType::kBFloat16, DType::kFloat16})
    for (int f = 0; f < static_cast<int>(std::size(kSm80Features)); ++f) out.push_back({dt, f});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Features, GpuNonfiniteSm80Feature,
                         ::testing::ValuesIn(sm80_feature_cases()),
                         [](const ::testing::TestParamInfo<FeatureCase>& param) {
                           return std::string(kSm80Features[param.param.feature].name) + "_" +
                                  dtype_name_of(param.param.dtype);
                         });

// ---- sm90 (the device's own choice) ------------------------------------------------------------

struct Sm90Case {
  DType dtype;
  int head_dim;
  int mask;  // index into kSm90Masks
};

class GpuNonfiniteSm90 : public ::testing::TestWithParam<Sm90Case> {};

// check_all_injections on the device's own choice, which must take both sm90 kernels.
void check_all_injections_on_sm90(const ProblemSpec& s) {
  cuda::DispatchRecord ran;
  check_all_injections(s, {}, &ran);
  EXPECT_EQ(ran.forward, cuda::KernelFamily::kSm90)
      << "the sm90 forward did not take " << s.describe();
  EXPECT_EQ(ran.backward, cuda::KernelFamily::kSm90)
      << "the sm90 backward did not take " << s.describe();
}

TEST_P(GpuNonfiniteSm90, AllInjections) {
  FLARE_SKIP_WITHOUT_CUDA();
  if (!cuda::runs_sm90_kernels())
    GTEST_SKIP() << "the sm90 kernels need an sm_90 device and sm_90a code in the build";
  ProblemSpec s = kSm90Masks[GetParam().mask].make(GetParam().dtype);
  s.head_dim = GetParam().head_dim;
  check_all_injections_on_sm90(s);
}

std::vector<Sm90Case> sm90_cases() {
  std::vector<Sm90Case> out;
  for (DType dt : {DType::kBFloat16, DType::kFloat16})
    for (int d : {64, 128, 256})
      for (int m = 0; m < static_cast<int>(std::size(kSm90Masks)); ++m) out.push_back({dt, d, m});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Masks, GpuNonfiniteSm90, ::testing::ValuesIn(sm90_cases()),
                         [](const ::testing::TestParamInfo<Sm90Case>& param) {
                           return std::string(kSm90Masks[param.param.mask].name) + "_" +
                                  dtype_name_of(param.param.dtype) + "_d" +
                                  std::to_string(param.param.head_dim);
                         });

// Packed batches on the device's own choice: the sm90 kernels' tiles run on into the next
// sequence's rows, whose ±Inf/NaN V (forward) or Q, dO (backward) meets P = 0 or dS = 0 in the
// products; the rows it pollutes are marked and recomputed (fwd_fixup.h, nonfinite_fixup.cuh).
// Without a mask (every key of a row's own sequence visible) and causal.
TEST(GpuNonfiniteSm90Packed, AllInjections) {
  FLARE_SKIP_WITHOUT_CUDA();
  if (!cuda::runs_sm90_kernels())
    GTEST_SKIP() << "the sm90 kernels need an sm_90 device and sm_90a code in the build";
  for (bool causal : {false, true})
    for (int d : {64, 128}) {
      ProblemSpec s = base_spec(DType::kBFloat16, d, 112);
      s.varlen_q = {33, 0, 70, 5};
      s.varlen_k = {41, 12, 70, 9};
      s.options.causal = causal;
      check_all_injections_on_sm90(s);
    }
}

// The persistent sm90 forward's rows are recomputed by the CTA that finishes last, which then
// leaves its counters at 0 (sm90/fwd_kernel.cuh, tile_counter.h): three CTAs over many tiles,
// ±Inf/NaN in V hidden from the rows before it in every (batch, head), causal and under a window,
// launched on one stream with a finite call between; a counter left dirty would leave a later
// launch's rows unfixed, which the reference sees.
TEST(GpuNonfiniteSm90Persistent, LastCtaRecomputesOnEveryLaunch) {
  FLARE_SKIP_WITHOUT_CUDA();
  if (!cuda::runs_sm90_kernels())
    GTEST_SKIP() << "the sm90 kernels need an sm_90 device and sm_90a code in the build";
  const cuda::DispatchOverrides cap = forward_ctas_capped(3);
  const float values[] = {std::numeric_limits<float>::quiet_NaN(),
                          std::numeric_limits<float>::infinity(), 0.0f,
                          -std::numeric_limits<float>::infinity()};
  for (int d : {64, 128})
    for (bool window : {false, true})
      for (float value : values) {  // 0: the finite call between
        ProblemSpec s = base_spec(DType::kBFloat16, d, 114);
        s.seqlen_q = s.seqlen_k = 700;
        s.heads_q = s.heads_kv = 3;
        s.options.causal = !window;
        if (window) s.options.window_left = s.options.window_right = 150;
        const NaiveErrors budget = twin_budget(s);
        Problem pr = make_problem(s);
        if (value != 0.0f)
          for (int64_t b = 0; b < s.batch; ++b)
            for (int64_t h = 0; h < s.heads_kv; ++h)
              for (int64_t c = 0; c < d; ++c) pr.v.set({b, 400, h, c}, value);
        SCOPED_TRACE(s.describe() + (value != 0.0f ? ", " + value_name(value) +
                                                         " in the whole row of v at s 400"
                                                   : ", finite"));
        GpuProblem gpu(pr);
        cuda::DispatchRecord record;
        const Status st = gpu.forward(nullptr, cap, &record);
        ASSERT_TRUE(st.ok()) << st.to_string();
        EXPECT_EQ(record.forward, cuda::KernelFamily::kSm90);
        gpu.download_forward(&pr);
        expect_forward_matches_nonfinite(pr, &budget);
      }
}

// Deterministic mode on the device's own choice: the sm90 forward where the device has it, and the
// sm80 backward's split dQ slices (the sm90 backward takes one slice only).
TEST(GpuNonfiniteDeterministic, DeviceChoiceCausal) {
  FLARE_SKIP_WITHOUT_CUDA();
  ProblemSpec s = base_spec(DType::kBFloat16, 128, 401);
  s.seqlen_q = s.seqlen_k = 150;
  s.options.causal = true;
  s.options.deterministic = true;
  check_all_injections(s);
}

// ---- the examples, on both paths ---------------------------------------------------

// The parameter is DispatchOverrides::arch: 80 the sm80 kernels forced, 0 the device's choice.
class GpuNonfiniteExamples : public ::testing::TestWithParam<int> {
 protected:
  cuda::DispatchOverrides path() const {
    cuda::DispatchOverrides o;
    o.arch = GetParam();
    return o;
  }
};

// Causal, s 2, v = [1, +Inf] (key 1's row): row 0 cannot see key 1, so O[0] is finite.
TEST_P(GpuNonfiniteExamples, HiddenInfiniteValueLeavesRowZeroFinite) {
  FLARE_SKIP_WITHOUT_CUDA();
  ProblemSpec s = base_spec(DType::kBFloat16, 64, 301);
  s.batch = 1;
  s.seqlen_q = s.seqlen_k = 2;
  s.heads_q = s.heads_kv = 1;
  s.options.causal = true;
  Problem pr = make_problem(s);
  for (int c = 0; c < s.head_dim; ++c)
    pr.v.set({0, 1, 0, c}, std::numeric_limits<float>::infinity());
  SCOPED_TRACE(s.describe() + ", +Inf in the whole row of v at s 1");
  GpuProblem gpu(pr);
  ASSERT_TRUE(gpu.forward(nullptr, path()).ok());
  gpu.download_forward(&pr);
  for (int c = 0; c < s.head_dim; ++c) {
    ASSERT_TRUE(std::isfinite(pr.o.get({0, 0, 0, c}))) << "O[0][" << c << "]";
    ASSERT_TRUE(std::isinf(pr.o.get({0, 1, 0, c}))) << "O[1][" << c << "]";
  }
}

// Packed, no mask, sequences of 3 and 2 tokens, v of sequence 1's first token +Inf: sequence 0's
// rows never see it (on sm90 it sits inside sequence 0's key tile with P = 0), so their O is
// finite; sequence 1's rows see it, so theirs is infinite.
TEST_P(GpuNonfiniteExamples, NextSequencesInfiniteValueLeavesEarlierRowsFinite) {
  FLARE_SKIP_WITHOUT_CUDA();
  ProblemSpec s = base_spec(DType::kBFloat16, 64, 303);
  s.varlen_q = {3, 2};
  s.varlen_k = {3, 2};
  s.heads_q = s.heads_kv = 1;
  Problem pr = make_problem(s);
  for (int c = 0; c < s.head_dim; ++c) pr.v.set({3, 0, c}, std::numeric_limits<float>::infinity());
  SCOPED_TRACE(s.describe() + ", +Inf in the whole row of v at token 3");
  GpuProblem gpu(pr);
  ASSERT_TRUE(gpu.forward(nullptr, path()).ok());
  gpu.download_forward(&pr);
  for (int c = 0; c < s.head_dim; ++c) {
    for (int64_t token : {0, 1, 2})
      ASSERT_TRUE(std::isfinite(pr.o.get({token, 0, c}))) << "O[" << token << "][" << c << "]";
    for (int64_t token : {3, 4})
      ASSERT_TRUE(std::isinf(pr.o.get({token, 0, c}))) << "O[" << token << "][" << c << "]";
  }
}

// Causal, s 2, dO = [+Inf, 1] (row 0): row 0 sees key 0 only, so dK and dV of key 1 are finite.
TEST_P(GpuNonfiniteExamples, InfiniteGradientOfRowZeroLeavesKeyOneFinite) {
  FLARE_SKIP_WITHOUT_CUDA();
  ProblemSpec s = base_spec(DType::kBFloat16, 64, 302);
  s.batch = 1;
  s.seqlen_q = s.seqlen_k = 2;
  s.heads_q = s.heads_kv = 1;
  s.options.causal = true;
  Problem pr = make_problem(s);
  for (int c = 0; c < s.head_dim; ++c)
    pr.dout.set({0, 0, 0, c}, std::numeric_limits<float>::infinity());
  SCOPED_TRACE(s.describe() + ", +Inf in the whole row of dout at s 0");
  GpuBackwardProblem gpu(&pr);
  ASSERT_TRUE(gpu.backward(nullptr, path()).ok());
  gpu.download_backward(&pr);
  for (int c = 0; c < s.head_dim; ++c) {
    ASSERT_TRUE(std::isfinite(pr.dk.get({0, 1, 0, c}))) << "dK[1][" << c << "]";
    ASSERT_TRUE(std::isfinite(pr.dv.get({0, 1, 0, c}))) << "dV[1][" << c << "]";
  }
}

// q = +Inf against keys with negative entries only: every score of row 0 is −Inf, and the
// reference's softmax is exp(−inf − −inf) = NaN, not the O = 0, LSE = −inf of a row that sees no
// key. Causal (the forward fixup kernel recomputes the row) and unmasked (the kernel writes NaN
// itself). With `overrides`.
void expect_minus_infinity_row_is_nan(bool causal, const cuda::DispatchOverrides& overrides) {
  ProblemSpec s = base_spec(DType::kBFloat16, 64, causal ? 303 : 304);
  s.batch = 1;
  s.seqlen_q = s.seqlen_k = 130;
  s.heads_q = s.heads_kv = 1;
  s.options.causal = causal;
  Problem pr = make_problem(s);
  for (int c = 0; c < s.head_dim; ++c) {
    pr.q.set({0, 0, 0, c}, std::numeric_limits<float>::infinity());
    for (int j = 0; j < s.seqlen_k; ++j)
      pr.k.set({0, j, 0, c}, -std::fabs(pr.k.get({0, j, 0, c})) - 0.01f);
  }
  SCOPED_TRACE(s.describe() + ", +Inf in the whole row of q at s 0, every k entry negative");
  GpuProblem gpu(pr);
  ASSERT_TRUE(gpu.forward(nullptr, overrides).ok());
  gpu.download_forward(&pr);
  EXPECT_TRUE(std::isnan(pr.lse.get({0, 0, 0})));
  for (int c = 0; c < s.head_dim; ++c)
    ASSERT_TRUE(std::isnan(pr.o.get({0, 0, 0, c}))) << "O[0][" << c << "]";
  expect_forward_matches_nonfinite(pr);
}

TEST_P(GpuNonfiniteExamples, AllVisibleScoresMinusInfinityGiveNanCausal) {
  FLARE_SKIP_WITHOUT_CUDA();
  expect_minus_infinity_row_is_nan(true, path());
}

TEST_P(GpuNonfiniteExamples, AllVisibleScoresMinusInfinityGiveNanUnmasked) {
  FLARE_SKIP_WITHOUT_CUDA();
  expect_minus_infinity_row_is_nan(false, path());
}

INSTANTIATE_TEST_SUITE_P(Paths, GpuNonfiniteExamples, ::testing::Values(80, 0),
                         [](const ::testing::TestParamInfo<int>& param) {
                           return std::string(param.param == 80 ? "Sm80" : "DeviceChoice");
                         });

}  // namespace
}  // namespace flare::test
