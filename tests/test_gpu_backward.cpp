// test_gpu_backward.cpp — the CUDA backward against the float64 CPU reference.
//
// Each case builds a problem on the host (fresh seeded random inputs, seed printed on failure),
// takes O and LSE from the float64 reference forward, copies everything to the device, poisons
// dq/dk/dv with NaN, runs flare's CUDA backward and checks dQ, dK and dV under the tolerance rule
// of docs/architecture.md (max|gpu − ref| ≤ 2·max|naive − ref| + floor, naive = the reference in
// the dtype's precision).
// The list of compiled variants comes from the table that instantiates them
// (flare/cuda_bwd_variants.inc); every variant runs with its full bucket width and with head dims
// that leave part of the bucket zero-filled. The feature cases cover each dispatch branch of the
// kernel: masks, softcap, ALiBi, dropout, GQA, varlen with empty sequences, rows that see no key,
// unaligned strides (the scalar-copy path), the fewer-buffer fallback an A100 runs at d=256
// (forced through cuda/dispatch.h's overrides), and deterministic mode, whose two runs must agree bit for bit.
// The problems the sm90 (Hopper) main kernel takes run through it and, forced, through sm80.
// Gradients within fp32 rounding of zero get the derived bound of
// test_util.h's expect_gradients_match.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "cuda/dispatch.h"
#include "cuda/sm80/bwd_tiles.h"
#include "gpu_bwd_util.h"
#include "problem_cases.h"
#include "test_util.h"

namespace flare::test {
namespace {

using problem_cases::causal;
using problem_cases::deterministic;
using problem_cases::dropout;
using problem_cases::fixed;
using problem_cases::window;
using problem_cases::with_run_seed;
using problem_cases::with_score_mods;

class GpuBackward : public ::testing::Test {
 protected:
  void SetUp() override { FLARE_SKIP_WITHOUT_CUDA(); }
};

// Runs the CUDA backward on `spec` (with `overrides`, telling `record` which kernels ran) and
// checks the three gradients; returns the gradients' bytes (dq, dk, dv, padding included) for the
// determinism check.
std::vector<std::vector<unsigned char>> check_backward(
    const ProblemSpec& spec, const cuda::DispatchOverrides& overrides = {},
    cuda::DispatchRecord* record = nullptr) {
  SCOPED_TRACE(spec.describe());
  Problem pr = make_problem(spec);
  GpuBackwardProblem dev(&pr);
  if (::testing::Test::HasFatalFailure()) return {};
  const Status s = dev.backward(nullptr, overrides, record);
  EXPECT_TRUE(s.ok()) << s.to_string();
  if (!s.ok()) return {};
  dev.download_backward(&pr);
  if (::testing::Test::HasFatalFailure()) return {};
  const AttentionParams bp = pr.backward_params();
  const cpu::RefBackward ref = cpu::reference_backward(bp, cpu::RefPrecision::kFloat64);
  expect_gradients_match(pr, bp, ref, naive_backward(bp));
  return {pr.dq.bytes, pr.dk.bytes, pr.dv.bytes};
}

// Runs `spec` twice (with `overrides`) and requires the three gradients to agree bit for bit;
// adds the runs that took the sm90 kernel to *sm90_runs where given.
void expect_reproducible(const ProblemSpec& spec, const cuda::DispatchOverrides& overrides = {},
                         int* sm90_runs = nullptr) {
  cuda::DispatchRecord first_run, second_run;
  const auto first = check_backward(spec, overrides, &first_run);
  const auto second = check_backward(spec, overrides, &second_run);
  if (sm90_runs != nullptr)
    for (const cuda::DispatchRecord& run : {first_run, second_run})
      *sm90_runs += run.backward == cuda::KernelFamily::kSm90 ? 1 : 0;
  ASSERT_EQ(first.size(), 3u);
  ASSERT_EQ(second.size(), 3u);
  const char* names[] = {"dq", "dk", "dv"};
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(first[i] == second[i]) << names[i] << " differs";
}

struct Variant {
  DType dtype;
  int bucket;
};

constexpr Variant kVariants[] = {
#define FLARE_CUDA_BWD_VARIANT(DT, HD) {DType::DT, HD},
#include "flare/cuda_bwd_variants.inc"
#undef FLARE_CUDA_BWD_VARIANT
};

constexpr DType kDtypes[] = {DType::kFloat16, DType::kBFloat16};

// Head dims inside a bucket: the full width and widths that leave a zero-filled, ragged tail
// (odd ones also force the scalar copy path, since their rows are not 16-byte aligned).
std::vector<int> head_dims_of(int bucket) {
  switch (bucket) {
    case 32: return {32, 16, 27};
    case 64: return {64, 40, 59};
    case 96: return {96, 72, 90};
    case 128: return {128, 104, 111};
    case 192: return {192, 136, 150};
    case 256: return {256, 200};
    default: return {bucket};
  }
}

// ---- the sm90 (Hopper) backward ----------------------------------------------------------------

// The problems the sm90 backward takes (sm90/bwd_tiles.h: fixed-length and packed batches, any
// mask, GQA, 16-byte aligned strides, softcap, ALiBi, dropout, deterministic mode), one
// named test per (compiled sm90 variant, test head dim, shape): gpu_util.h's Sm90SuiteCase.
//
// The shapes, by name: 197×197 (ragged last blocks), causal with fewer and with more queries than
// keys (203 rows see no key), a window under GQA, MQA with padded rows, one token, 700 tokens
// (causal at head dims that fill their 64-column panels), and packed batches: empty sequences on
// either side, causal and not (query and key tiles run on into the next sequence's rows); a window
// under GQA; 40 sequences beside one of 300 × 700; then both score modifiers
// (problem_cases::with_score_mods) on a window under GQA with more queries than keys, and on a
// causal packed batch (each sequence its own ALiBi slopes); dropout on the window under GQA, and
// with both score modifiers on the causal packed batch; deterministic mode (key blocks adding
// into each query block's dQ in turn) on the window under GQA with more queries than keys, on the
// 41 packed sequences with dropout (both turns in descending key order), and without a mask over
// 64 heads of 11 key blocks (ascending turns in dQ slices of about 3 key blocks: 64 CTAs per
// key block leave about 4 slices for 2 CTAs per SM on 132 SMs).
const char* const kSm90Shapes[] = {"s197",          "causal_97x300",   "causal_300x97",
                                   "window_gqa",    "mqa_padded",      "one_token",
                                   "s700",          "packed",          "packed_causal",
                                   "packed_window", "packed_many",     "mods_window_gqa",
                                   "mods_packed_causal", "dropout_window_gqa",
                                   "dropout_mods_packed_causal", "deterministic_window_gqa",
                                   "deterministic_packed_many_dropout",
                                   "deterministic_many_heads"};

// A packed batch of `s` with these sequence lengths.
ProblemSpec packed(ProblemSpec s, std::vector<int> lengths_q, std::vector<int> lengths_k) {
  s.varlen_q = std::move(lengths_q);
  s.varlen_k = std::move(lengths_k);
  return s;
}

ProblemSpec sm90_problem(const Sm90SuiteCase& c) {
  const int d = c.head_dim;
  const DType dt = c.dtype;
  switch (c.shape) {
    case 1: return causal(with_run_seed(fixed(1, 97, 300, 2, 2, d, dt)));
    case 2: return causal(with_run_seed(fixed(1, 300, 97, 2, 2, d, dt)));
    case 3: return window(with_run_seed(fixed(1, 290, 310, 4, 2, d, dt)), 70, 5);
    case 4: {
      ProblemSpec mqa = causal(with_run_seed(fixed(2, 150, 260, 3, 1, d, dt)));
      mqa.pad = 16;  // padded rows (aligned)
      return mqa;
    }
    case 5: return with_run_seed(fixed(2, 1, 1, 2, 2, d, dt));
    case 6: {
      ProblemSpec longer = with_run_seed(fixed(1, 700, 700, 2, 2, d, dt));
      longer.options.causal = d % 64 == 0;
      return longer;
    }
    case 7:
    case 8: {
      ProblemSpec s = packed(with_run_seed(fixed(0, 0, 0, 4, 2, d, dt)), {37, 0, 130, 5, 64},
                             {50, 20, 0, 130, 64});
      s.options.causal = c.shape == 8;
      return s;
    }
    case 9:
      return window(
          packed(with_run_seed(fixed(0, 0, 0, 4, 2, d, dt)), {130, 64, 200}, {140, 64, 190}), 40,
          3);
    case 10:
    case 16: {
      std::vector<int> q, k;
      for (int i = 0; i < 40; ++i) {
        q.push_back(1 + (i * 37) % 150);
        k.push_back((i * 53) % 170);
      }
      q.push_back(300);
      k.push_back(700);
      const ProblemSpec s = causal(packed(with_run_seed(fixed(0, 0, 0, 2, 2, d, dt)), q, k));
      return c.shape == 16 ? deterministic(dropout(s, 0.1f)) : s;
    }
    case 11: return with_score_mods(window(with_run_seed(fixed(1, 310, 290, 4, 2, d, dt)), 40, 9));
    case 12:
      return with_score_mods(causal(packed(with_run_seed(fixed(0, 0, 0, 4, 2, d, dt)),
                                           {37, 0, 130, 5, 64}, {50, 20, 0, 130, 64})));
    case 13: return dropout(window(with_run_seed(fixed(1, 310, 290, 4, 2, d, dt)), 40, 9), 0.3f);
    case 14:
      return dropout(with_score_mods(causal(packed(with_run_seed(fixed(0, 0, 0, 4, 2, d, dt)),
                                                   {37, 0, 130, 5, 64}, {50, 20, 0, 130, 64}))),
                     0.2f);
    case 15: return deterministic(window(with_run_seed(fixed(1, 310, 290, 4, 2, d, dt)), 40, 9));
    case 17: return deterministic(with_run_seed(fixed(1, 40, 1300, 64, 64, d, dt)));
    default: return with_run_seed(fixed(2, 197, 197, 2, 2, d, dt));
  }
}

std::vector<Sm90SuiteCase> every_sm90_case() {
  return sm90_suite_cases(
      {
#define FLARE_CUDA_BWD90_VARIANT(DT, HD) {DType::DT, HD},
#include "flare/cuda_bwd90_variants.inc"
#undef FLARE_CUDA_BWD90_VARIANT
      },
      sm90_backward_test_head_dims, kSm90Shapes);
}

class GpuBackwardSm90Cases : public GpuTestWithParam<Sm90SuiteCase> {};

// Through the automatic choice and forced to sm80 (gpu_util.h: check_sm90_and_forced_sm80).
TEST_P(GpuBackwardSm90Cases, AutomaticAndForcedSm80AgainstTheReference) {
  check_sm90_and_forced_sm80(sm90_problem(GetParam()), check_backward,
                             &cuda::DispatchRecord::backward);
}

INSTANTIATE_TEST_SUITE_P(EveryVariant, GpuBackwardSm90Cases,
                         ::testing::ValuesIn(every_sm90_case()), sm90_suite_case_name);

// A few ragged shapes through the sm90 main kernel of every bucket: the compute-sanitizer subset
// of scripts/gpu-check.sh.
TEST_F(GpuBackward, Sm90RaggedShapesSmall) {
  for (int d : {64, 80, 128, 256}) {
    ProblemSpec causal = with_run_seed(fixed(1, 150, 200, 4, 2, d, DType::kBFloat16));
    causal.options.causal = true;
    check_backward(causal);
    ProblemSpec window = with_run_seed(fixed(1, 130, 140, 2, 2, d, DType::kFloat16));
    window.options.window_left = 40;
    window.options.window_right = 3;
    check_backward(window);
  }
}

// Problems outside sm90's set run the sm80 backward on every device.
TEST_F(GpuBackward, Sm90LeavesTheRestToSm80) {
  cuda::DispatchRecord ran;
  const ProblemSpec d192 = with_run_seed(fixed(1, 130, 140, 2, 2, 192, DType::kBFloat16));
  check_backward(d192, {}, &ran);  // no sm90 bucket
  EXPECT_NE(ran.backward, cuda::KernelFamily::kSm90);
  ProblemSpec odd = with_run_seed(fixed(1, 130, 140, 2, 2, 59, DType::kFloat16));  // unaligned rows
  check_backward(odd, {}, &ran);
  EXPECT_NE(ran.backward, cuda::KernelFamily::kSm90);
}

TEST_F(GpuBackward, EveryVariantAndHeadDim) {
  for (const Variant& v : kVariants)
    for (int d : head_dims_of(v.bucket))
      for (bool causal : {false, true}) {
        ProblemSpec s = with_run_seed(fixed(2, 97, 130, 2, 2, d, v.dtype));
        s.options.causal = causal;
        check_backward(s);
      }
}

// Buckets whose kernel has a fallback with fewer Q/dO buffers (d=256: one buffer where shared
// memory is short, as on an A100) run that fallback too, on ragged causal GQA and sliding-window
// problems.
TEST_F(GpuBackward, FewerBufferFallback) {
  int tested = 0;
  for (const Variant& v : kVariants) {
    const cuda::sm80::BwdTile tile = cuda::sm80::bwd_tile(v.bucket);
    if (tile.min_stages == tile.stages) continue;
    cuda::DispatchOverrides fewer;
    fewer.backward_stages = tile.min_stages;
    for (int d : head_dims_of(v.bucket)) {
      ProblemSpec s = with_run_seed(fixed(2, 97, 130, 4, 2, d, v.dtype));
      s.options.causal = true;
      check_backward(s, fewer);
      ProblemSpec w = with_run_seed(fixed(1, 200, 150, 2, 2, d, v.dtype));
      w.options.window_left = 40;
      w.options.window_right = 7;
      check_backward(w, fewer);
    }
    ++tested;
  }
  EXPECT_GT(tested, 0) << "no bucket has a fallback: this test checks nothing";
}

TEST_F(GpuBackward, SeqlenOne) {
  for (DType dt : kDtypes) {
    check_backward(with_run_seed(fixed(2, 1, 1, 2, 2, 64, dt)));
    ProblemSpec s = with_run_seed(fixed(1, 1, 97, 2, 1, 128, dt));
    s.options.causal = true;
    check_backward(s);
  }
}

// s_q > s_k under bottom-right causal alignment leaves the first s_q − s_k rows without keys
// (LSE = −inf): their gradients must be exactly 0, never NaN.
TEST_F(GpuBackward, SeqlenMismatchAndFullyMaskedRows) {
  for (DType dt : kDtypes) {
    ProblemSpec s = with_run_seed(fixed(2, 130, 37, 2, 2, 64, dt));
    s.options.causal = true;
    check_backward(s);
    s = with_run_seed(fixed(1, 37, 300, 2, 2, 128, dt));
    s.options.causal = true;
    check_backward(s);
    s = with_run_seed(fixed(1, 300, 37, 2, 2, 128, dt));
    check_backward(s);
  }
}

TEST_F(GpuBackward, LongSequences) {
  ProblemSpec s = with_run_seed(fixed(1, 1025, 1025, 2, 2, 64, DType::kBFloat16));
  s.options.causal = true;
  check_backward(s);
  s = with_run_seed(fixed(1, 1025, 1025, 1, 1, 128, DType::kFloat16));
  check_backward(s);
  s = with_run_seed(fixed(1, 513, 1025, 1, 1, 256, DType::kBFloat16));
  s.options.causal = true;
  check_backward(s);
  // d=192: copies by 192 of the 256 threads (24 chunks per row), GQA 2:1, a ragged last block.
  s = with_run_seed(fixed(1, 700, 700, 2, 1, 192, DType::kBFloat16));
  check_backward(s);
  // d=96: 4-chunk swizzle groups, dQ tiles of 16 queries, causal GQA 2:1 over several key blocks.
  s = with_run_seed(fixed(1, 600, 650, 4, 2, 96, DType::kFloat16));
  s.options.causal = true;
  check_backward(s);
  s = with_run_seed(fixed(1, 1025, 1025, 2, 2, 32, DType::kBFloat16));
  s.options.causal = true;
  check_backward(s);
}

TEST_F(GpuBackward, GroupedQueryHeads) {
  for (DType dt : kDtypes) {
    ProblemSpec s = with_run_seed(fixed(2, 97, 97, 8, 1, 128, dt));
    s.options.causal = true;
    check_backward(s);
    s = with_run_seed(fixed(1, 150, 200, 4, 2, 64, dt));
    check_backward(s);
  }
}

// Windows of every kind, the widest ones included (their bounds' sums pass 32 bits unless capped),
// at d 64 (the sm90 kernel on Hopper) and d 160 (sm80's).
TEST_F(GpuBackward, SlidingWindow) {
  constexpr int kWidest = std::numeric_limits<int>::max();
  const int windows[][2] = {{20, 5}, {-1, 3}, {0, 0}, {40, -1}, {kWidest, 0}, {kWidest, kWidest}};
  for (DType dt : kDtypes)
    for (int d : {64, 160})
      for (const auto& w : windows) {
        ProblemSpec s = with_run_seed(fixed(2, 97, 150, 2, 2, d, dt));
        s.options.window_left = w[0];
        s.options.window_right = w[1];
        check_backward(s);
      }
}

TEST_F(GpuBackward, Softcap) {
  for (DType dt : kDtypes) {
    ProblemSpec s = with_run_seed(fixed(2, 97, 130, 2, 2, 128, dt));
    s.options.softcap = 2.0f;
    s.magnitude = 2.0f;
    check_backward(s);
  }
}

TEST_F(GpuBackward, Alibi) {
  for (DType dt : kDtypes) {
    ProblemSpec s = with_run_seed(fixed(2, 97, 130, 4, 2, 64, dt));
    s.alibi = true;
    s.options.causal = true;
    check_backward(s);
    s.alibi_per_batch = true;
    s.options.causal = false;
    check_backward(s);
  }
}

TEST_F(GpuBackward, Dropout) {
  for (DType dt : kDtypes) {
    ProblemSpec s = with_run_seed(fixed(2, 97, 130, 2, 2, 128, dt));
    s.options.dropout_p = 0.17f;
    s.options.dropout_seed = 0x1234567890abcdefULL;
    s.options.dropout_offset = 7;
    s.options.causal = true;
    check_backward(s);
  }
}

TEST_F(GpuBackward, AllModifiersTogether) {
  for (DType dt : kDtypes) {
    ProblemSpec s = with_run_seed(fixed(2, 150, 97, 4, 2, 80, dt));
    s.options.softcap = 3.0f;
    s.alibi = true;
    s.options.dropout_p = 0.1f;
    s.options.dropout_seed = 99;
    s.options.window_left = 30;
    s.options.window_right = 10;
    check_backward(s);
  }
}

TEST_F(GpuBackward, VarlenWithEmptySequences) {
  for (DType dt : kDtypes)
    for (bool causal : {false, true}) {
      ProblemSpec s = with_run_seed(fixed(0, 0, 0, 4, 2, 64, dt));
      s.varlen_q = {37, 0, 130, 5, 64};
      s.varlen_k = {50, 20, 0, 130, 64};
      s.options.causal = causal;
      check_backward(s);
    }
  ProblemSpec s = with_run_seed(fixed(0, 0, 0, 2, 2, 128, DType::kBFloat16));
  s.varlen_q = {200, 1, 77};
  s.varlen_k = {130, 1, 300};
  s.options.dropout_p = 0.2f;
  s.alibi = true;
  check_backward(s);
}

// Padded rows: pad 8 keeps rows 16-byte aligned (vector copies), pad 3 breaks alignment (scalar
// copies and element-wise gradient stores).
TEST_F(GpuBackward, StridedLayouts) {
  for (int64_t pad : {8, 3}) {
    ProblemSpec s = with_run_seed(fixed(2, 97, 130, 2, 2, 64, DType::kBFloat16));
    s.pad = pad;
    s.options.causal = true;
    check_backward(s);
    s = with_run_seed(fixed(1, 97, 97, 4, 1, 128, DType::kFloat16));
    s.pad = pad;
    check_backward(s);
  }
}

// Scores of several hundred: P is one-hot, dQ and dK vanish (the zero-gradient bound applies) and
// dV must still be exact.
TEST_F(GpuBackward, LargeScores) {
  ProblemSpec s = with_run_seed(fixed(1, 97, 130, 2, 2, 64, DType::kBFloat16));
  s.magnitude = 30.0f;
  check_backward(s);
}

// Inputs of magnitude 1e3 put scores near 1e6, where one fp32 ulp of the stored LSE is 0.06: P
// recomputed from it is off by percents in any backward, the naive one included.
TEST_F(GpuBackward, LargeMagnitudeInputs) {
  ProblemSpec s = with_run_seed(fixed(1, 97, 130, 2, 2, 64, DType::kBFloat16));
  s.magnitude = 1e3f;
  check_backward(s);
}

// Through the automatic choice (sm90 on Hopper) and forced to sm80 (its dQ slices).
TEST_F(GpuBackward, DeterministicIsBitwiseReproducible) {
  for (DType dt : kDtypes) {
    ProblemSpec s = with_run_seed(fixed(2, 300, 1025, 4, 2, 128, dt));
    s.options.deterministic = true;
    s.options.dropout_p = 0.1f;
    s.options.causal = true;
    expect_reproducible(s);
    SCOPED_TRACE("forced to sm80");
    expect_reproducible(s, sm80_forced());
  }
}

// Deterministic mode gives a CTA a run of consecutive key blocks only when there are few
// (batch, kv head) pairs per SM; with b·h_kv = 264 every CTA of an H100 (132 SMs) walks all three
// key blocks of its pair, which the key-block loop's bound and per-block state must survive (no
// other test reaches that loop's second iteration on such a device).
TEST_F(GpuBackward, DeterministicMultiKeyBlockCtas) {
  for (int d : {64, 128}) {
    ProblemSpec s = with_run_seed(fixed(2, 37, 300, 132, 132, d, DType::kBFloat16));
    s.options.deterministic = true;
    s.options.causal = d == 128;
    expect_reproducible(s, sm80_forced());  // the sm80 kernel's runs (sm90: one CTA per key block)
  }
}

// The sm90 kernel's deterministic mode: many key blocks take turns at each query block (s_k 1300:
// 11 blocks of 128 keys; causal and not, GQA, fixed-length and packed, d 64 and 128; 2 × 64 kv heads
// for ascending turns in dQ slices of several key blocks), two runs bitwise equal, through sm90
// where the device runs it.
TEST_F(GpuBackward, Sm90DeterministicIsBitwiseReproducible) {
  int sm90_runs = 0;
  for (int d : {64, 128})
    for (bool is_causal : {false, true}) {
      ProblemSpec s = deterministic(with_run_seed(fixed(1, 700, 1300, 4, 2, d, DType::kBFloat16)));
      s.options.causal = is_causal;
      expect_reproducible(s, {}, &sm90_runs);
    }
  expect_reproducible(deterministic(causal(packed(with_run_seed(fixed(0, 0, 0, 4, 4, 128,
                                                                      DType::kFloat16)),
                                                  {700, 0, 1300, 64}, {900, 30, 1200, 64}))),
                      {}, &sm90_runs);
  expect_reproducible(deterministic(with_run_seed(fixed(2, 200, 1300, 128, 64, 64, DType::kBFloat16))),
                      {}, &sm90_runs);
  if (cuda::runs_sm90_kernels()) {
    EXPECT_EQ(sm90_runs, 12);  // 6 problems, 2 runs each
  }
}

TEST_F(GpuBackward, Float32IsUnsupported) {
  Problem pr = make_problem(with_run_seed(fixed(1, 16, 16, 1, 1, 64, DType::kFloat32)));
  GpuBackwardProblem dev(&pr);
  ASSERT_FALSE(HasFatalFailure());
  const Status s = dev.backward();
  EXPECT_EQ(s.code(), StatusCode::kUnsupported) << s.to_string();
}

}  // namespace
}  // namespace flare::test
