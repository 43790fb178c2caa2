// test_gpu_forward.cpp — the CUDA forward kernels against the float64 CPU reference.
//
// Every compiled (dtype, head-dim bucket) variant — the list comes from the same generated table
// that instantiates the kernels — is run at the bucket's own head_dim and at the smallest head_dim
// it serves, with ragged sequence lengths, causal and not. Then every runtime branch of the kernel:
// causal with s_q != s_k both ways (rows that see no key), sliding windows, GQA/MQA, varlen with
// empty sequences, softcap, ALiBi, dropout, padded (16-byte aligned) and odd (unaligned) strides,
// odd head dims, seqlen 1 and 1025, inputs of magnitude 1e3; buckets with a short-walk tile run
// both tiles, forced, under each mask; the problems the sm90 (Hopper) kernel takes run through it
// and, forced, through sm80. Each check follows the tolerance rule of docs/architecture.md
// (test_util.h: within_tolerance against the reference computed in the same low precision).
// Outputs are poisoned with NaN on the device first, so an unwritten element fails. Without a
// CUDA device every test skips, saying so.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "cuda/sm80/fwd_tiles.h"
#include "cuda/dispatch.h"
#include "cuda/sm90/fwd_tiles.h"
#include "gpu_util.h"
#include "problem_cases.h"
#include "test_util.h"

namespace flare::test {
namespace {

struct Variant {
  DType dtype;
  int bucket;
};

const std::vector<Variant>& compiled_variants() {
  static const std::vector<Variant> variants = {
#define FLARE_CUDA_FWD_VARIANT(DT, HD) {DType::DT, HD},
#include "flare/cuda_fwd_variants.inc"
#undef FLARE_CUDA_FWD_VARIANT
  };
  return variants;
}

// Smallest head_dim a bucket serves: one past the next smaller bucket of the same dtype.
int smallest_head_dim(const Variant& v) {
  int below = 0;
  for (const Variant& w : compiled_variants())
    if (w.dtype == v.dtype && w.bucket < v.bucket && w.bucket > below) below = w.bucket;
  return below + 1;
}

// The CUDA forward of `spec` (with `overrides`, telling `record` which kernels ran) against the
// reference.
void check_forward(const ProblemSpec& spec, const cuda::DispatchOverrides& overrides = {},
                   cuda::DispatchRecord* record = nullptr) {
  SCOPED_TRACE(spec.describe());
  Problem pr = make_problem(spec);
  GpuProblem gpu(pr);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  const Status s = gpu.forward(nullptr, overrides, record);
  ASSERT_TRUE(s.ok()) << s.to_string();
  gpu.download_forward(&pr);
  expect_forward_matches(pr);
}

// Two sequences of 197 tokens and two heads, seeded from this run's seed and `salt`.
ProblemSpec base_spec(DType dtype, int head_dim, uint64_t salt) {
  return problem_cases::with_seed(problem_cases::fixed(2, 197, 197, 2, 2, head_dim, dtype),
                                  test_seed() + salt);
}

// `s` as a 150×210 problem with every score modifier and dropout on, under a causal window.
ProblemSpec with_every_modifier(ProblemSpec s) {
  s.seqlen_q = 150;
  s.seqlen_k = 210;
  s.alibi = true;
  s.options.softcap = 10.0f;
  s.options.window_left = 70;
  s.options.causal = true;
  s.options.dropout_p = 0.1f;
  s.options.dropout_seed = 42 + test_seed();
  return s;
}

// `s` as a causal seqlen_q × seqlen_k problem (seqlen_q > seqlen_k: the first rows see no key).
ProblemSpec causal_shape(ProblemSpec s, int seqlen_q, int seqlen_k) {
  s.seqlen_q = seqlen_q;
  s.seqlen_k = seqlen_k;
  s.options.causal = true;
  return s;
}

// `s` as a seqlen_q × seqlen_k problem with 4 query heads on 2 kv heads under a (left, right)
// sliding window.
ProblemSpec window_gqa(ProblemSpec s, int seqlen_q, int seqlen_k, int left, int right) {
  s.seqlen_q = seqlen_q;
  s.seqlen_k = seqlen_k;
  s.heads_q = 4;
  s.heads_kv = 2;
  s.options.window_left = left;
  s.options.window_right = right;
  return s;
}

std::string variant_name(const ::testing::TestParamInfo<Variant>& info) {
  return std::string(info.param.dtype == DType::kFloat16 ? "fp16" : "bf16") + "_d" +
         std::to_string(info.param.bucket);
}

// ---- every compiled variant ------------------------------------------------------------------

class GpuForwardVariant : public ::testing::TestWithParam<Variant> {};

TEST_P(GpuForwardVariant, BucketHeadDim) {
  FLARE_SKIP_WITHOUT_CUDA();
  const Variant v = GetParam();
  for (bool causal : {false, true}) {
    ProblemSpec s = base_spec(v.dtype, v.bucket, 1);
    s.options.causal = causal;
    check_forward(s);
  }
}

TEST_P(GpuForwardVariant, SmallestHeadDimRaggedLengths) {
  FLARE_SKIP_WITHOUT_CUDA();
  const Variant v = GetParam();
  for (bool causal : {false, true}) {
    ProblemSpec s = base_spec(v.dtype, smallest_head_dim(v), 2);
    s.seqlen_q = 97;
    s.seqlen_k = 300;
    s.options.causal = causal;
    check_forward(s);
  }
}

INSTANTIATE_TEST_SUITE_P(Compiled, GpuForwardVariant, ::testing::ValuesIn(compiled_variants()),
                         variant_name);

// ---- every runtime branch, in both dtypes ----------------------------------------------------

class GpuForwardFeature : public ::testing::TestWithParam<DType> {
 protected:
  ProblemSpec spec(int head_dim, uint64_t salt) const { return base_spec(GetParam(), head_dim, salt); }
};

TEST_P(GpuForwardFeature, CausalQueriesFewerThanKeys) {
  FLARE_SKIP_WITHOUT_CUDA();
  ProblemSpec s = spec(64, 10);
  s.seqlen_q = 97;
  s.seqlen_k = 1025;
  s.options.causal = true;
  check_forward(s);
}

TEST_P(GpuForwardFeature, CausalQueriesMoreThanKeysMasksWholeRows) {
  FLARE_SKIP_WITHOUT_CUDA();
  ProblemSpec s = spec(128, 11);
  s.seqlen_q = 300;  // bottom-right aligned: the first 203 rows see no key
  s.seqlen_k = 97;
  s.options.causal = true;
  check_forward(s);
}

TEST_P(GpuForwardFeature, SlidingWindows) {
  FLARE_SKIP_WITHOUT_CUDA();
  constexpr int kWidest = std::numeric_limits<int>::max();  // bounds' sums pass 32 bits
  const int windows[][2] = {{32, 16}, {64, -1}, {-1, 8}, {0, 0}, {200, 0}, {kWidest, 0},
                            {kWidest, kWidest}};
  for (const auto& w : windows) {
    ProblemSpec s = spec(128, 12);
    s.seqlen_q = 300;
    s.seqlen_k = 333;
    s.options.window_left = w[0];
    s.options.window_right = w[1];
    check_forward(s);
  }
}

// The grouped CTA order (src/cuda/sm80/tile_order.h) under causal and windowed masks, with 15
// (batch, head) pairs: groups of 8, the last one smaller. d 128 and 256 take the grouped kernel.
TEST_P(GpuForwardFeature, GroupedOrderUnevenLastGroup) {
  FLARE_SKIP_WITHOUT_CUDA();
  for (int d : {128, 256})
    for (bool window : {false, true}) {
      ProblemSpec s = spec(d, 40);
      s.batch = 3;
      s.heads_q = 5;
      s.heads_kv = 5;
      s.seqlen_q = 300;
      s.seqlen_k = 330;
      if (window) {
        s.options.window_left = 70;
        s.options.window_right = 5;
      } else {
        s.options.causal = true;
      }
      check_forward(s);
    }
}

TEST_P(GpuForwardFeature, GroupedQueryAttention) {
  FLARE_SKIP_WITHOUT_CUDA();
  const int heads[][2] = {{8, 1}, {8, 2}};
  for (const auto& hh : heads) {
    ProblemSpec s = spec(64, 13);
    s.heads_q = hh[0];
    s.heads_kv = hh[1];
    s.options.causal = true;
    check_forward(s);
  }
}

TEST_P(GpuForwardFeature, VarlenWithEmptySequences) {
  FLARE_SKIP_WITHOUT_CUDA();
  for (bool causal : {false, true}) {
    ProblemSpec s = spec(64, 14);
    s.varlen_q = {0, 97, 1, 300, 5, 130};
    s.varlen_k = {7, 120, 0, 301, 0, 129};
    s.options.causal = causal;
    check_forward(s);
  }
}

TEST_P(GpuForwardFeature, Softcap) {
  FLARE_SKIP_WITHOUT_CUDA();
  ProblemSpec s = spec(64, 15);
  s.magnitude = 4.0f;  // large enough for the cap to bend the scores
  s.options.softcap = 5.0f;
  s.options.causal = true;
  check_forward(s);
}

TEST_P(GpuForwardFeature, Alibi) {
  FLARE_SKIP_WITHOUT_CUDA();
  for (bool per_batch : {false, true}) {
    ProblemSpec s = spec(96, 16);
    s.seqlen_q = 150;
    s.seqlen_k = 260;
    s.alibi = true;
    s.alibi_per_batch = per_batch;
    s.options.causal = per_batch;
    check_forward(s);
  }
}

TEST_P(GpuForwardFeature, SoftcapAndAlibiTogether) {
  FLARE_SKIP_WITHOUT_CUDA();
  ProblemSpec s = spec(128, 17);
  s.alibi = true;
  s.options.softcap = 20.0f;
  s.options.window_left = 50;
  check_forward(s);
}

// Each tile shape (32-row warps at N=64 and N=32, 16-row warps) with every score modifier on.
TEST_P(GpuForwardFeature, AllModifiersInEveryTileShape) {
  FLARE_SKIP_WITHOUT_CUDA();
  for (int d : {64, 128, 256}) check_forward(with_every_modifier(spec(d, 23)));
}

TEST_P(GpuForwardFeature, DropoutMatchesTheCpuMask) {
  FLARE_SKIP_WITHOUT_CUDA();
  for (bool causal : {false, true}) {
    ProblemSpec s = spec(64, 18);
    s.options.dropout_p = 0.17f;
    s.options.dropout_seed = 0x1234567890abcdefull + test_seed();
    s.options.dropout_offset = 0x100000003ull;
    s.options.causal = causal;
    check_forward(s);
  }
}

TEST_P(GpuForwardFeature, PaddedStridesAlignedAndOdd) {
  FLARE_SKIP_WITHOUT_CUDA();
  for (int64_t pad : {8, 3}) {
    ProblemSpec s = spec(64, 19);
    s.pad = pad;  // 8: rows stay 16-byte aligned (cp.async path); 3: the scalar-load path
    s.options.causal = true;
    check_forward(s);
  }
}

TEST_P(GpuForwardFeature, OddHeadDims) {
  FLARE_SKIP_WITHOUT_CUDA();
  for (int d : {40, 59, 80, 111, 256}) {
    ProblemSpec s = spec(d, 20);
    s.seqlen_q = 97;
    s.seqlen_k = 130;
    s.options.causal = d % 2 == 1;
    check_forward(s);
  }
}

TEST_P(GpuForwardFeature, SequenceLengthOneAndLong) {
  FLARE_SKIP_WITHOUT_CUDA();
  const int lens[][2] = {{1, 1}, {1, 1025}, {1025, 1}, {1025, 1025}};
  for (const auto& l : lens) {
    for (bool causal : {false, true}) {
      ProblemSpec s = spec(128, 21);
      s.batch = 1;
      s.seqlen_q = l[0];
      s.seqlen_k = l[1];
      s.options.causal = causal;
      check_forward(s);
    }
  }
}

TEST_P(GpuForwardFeature, LargeMagnitudeInputs) {
  FLARE_SKIP_WITHOUT_CUDA();
  for (bool causal : {false, true}) {
    ProblemSpec s = spec(64, 22);
    s.magnitude = 1e3f;
    s.options.causal = causal;
    check_forward(s);
  }
}

// ---- both tiles of buckets that have a short-walk tile (sm80/fwd_tiles.h) --------------------

// One tile choice forced (DispatchOverrides::forward_tiles): 1 the primary tile, 2 the short-walk
// one.
cuda::DispatchOverrides tiles_forced(int choice) {
  cuda::DispatchOverrides o;
  o.forward_tiles = choice;
  return o;
}

// The automatic choice sends causal and windowed problems with short key walks (every other test
// here) to the short-walk tile and the rest to the primary one; each runs every mask here.
TEST(GpuForwardTiles, BothTilesOfEveryBucketThatHasTwo) {
  FLARE_SKIP_WITHOUT_CUDA();
  int tested = 0;
  for (const Variant& v : compiled_variants()) {
    if (!cuda::sm80::has_short_fwd_tile(v.bucket)) continue;
    for (int choice : {1, 2}) {
      const cuda::DispatchOverrides force = tiles_forced(choice);
      SCOPED_TRACE(std::string(choice == 1 ? "primary" : "short-walk") + " tile");
      for (int d : {v.bucket, smallest_head_dim(v)})
        for (bool causal : {false, true}) {
          ProblemSpec s = base_spec(v.dtype, d, 40);
          s.seqlen_q = 97 + d % 7;
          s.seqlen_k = 300;
          s.options.causal = causal;
          check_forward(s, force);
        }
      check_forward(causal_shape(base_spec(v.dtype, v.bucket, 41), 300, 97), force);
      check_forward(window_gqa(base_spec(v.dtype, v.bucket, 42), 290, 310, 70, 5), force);
      ProblemSpec varlen = base_spec(v.dtype, v.bucket, 43);
      varlen.varlen_q = {0, 97, 1, 300, 5, 130};
      varlen.varlen_k = {7, 120, 0, 301, 0, 129};
      varlen.options.causal = true;
      check_forward(varlen, force);
      check_forward(with_every_modifier(base_spec(v.dtype, v.bucket, 44)), force);
      ProblemSpec odd = base_spec(v.dtype, v.bucket - 3, 45);  // unaligned rows, odd head_dim
      odd.pad = 3;
      odd.options.causal = true;
      check_forward(odd, force);
      ProblemSpec large = base_spec(v.dtype, v.bucket, 46);
      large.magnitude = 1e3f;
      large.seqlen_q = large.seqlen_k = 1025;
      large.batch = 1;
      large.options.causal = true;
      check_forward(large, force);
    }
    ++tested;
  }
  EXPECT_GT(tested, 0) << "no compiled bucket has a short-walk tile";
}


// ---- the sm90 (Hopper) forward -----------------------------------------------------------------

// The problems the sm90 forward takes (sm90/fwd_tiles.h: fixed-length batches, any mask, GQA,
// 16-byte aligned strides, softcap, ALiBi and dropout), one named test per (compiled sm90
// variant, test head dim, shape): gpu_util.h's Sm90SuiteCase.
//
// The shapes, by name: 197×197 (ragged last blocks), causal with fewer and with more queries than
// keys (203 rows see no key), a window under GQA, MQA with padded rows, one token, 1025 tokens
// of magnitude 1e3 (causal at the bucket's own head dim), and 200 queries over 2500 keys (past the
// persistent kernel's lengths: the one-CTA kernel's tile, sm90/fwd_tiles.h); then both score
// modifiers (softcap 5 on magnitude-3 scores, so that the cap bites, and ALiBi slopes per sequence
// and head) on a window under GQA with s_q > s_k, and causal over 200 × 2500 (each kernel); then
// dropout on the same window, and with both modifiers on the causal 200 × 2500.
const char* const kSm90Shapes[] = {"s197",          "causal_97x300",  "causal_300x97",
                                   "window_gqa",    "mqa_padded",     "one_token",
                                   "large_1025",    "causal_200x2500", "mods_window_gqa",
                                   "mods_causal_200x2500", "dropout_window_gqa",
                                   "dropout_mods_causal_200x2500"};

ProblemSpec sm90_problem(const Sm90SuiteCase& c) {
  const ProblemSpec base = base_spec(c.dtype, c.head_dim, 60 + static_cast<uint64_t>(c.shape));
  switch (c.shape) {
    case 1: return causal_shape(base, 97, 300);
    case 2: return causal_shape(base, 300, 97);
    case 3: return window_gqa(base, 290, 310, 70, 5);
    case 4: {
      ProblemSpec mqa = base;
      mqa.heads_q = 3;
      mqa.heads_kv = 1;
      mqa.pad = 16;
      mqa.options.causal = true;
      return mqa;
    }
    case 5: {
      ProblemSpec one = base;
      one.seqlen_q = one.seqlen_k = 1;
      return one;
    }
    case 6: {
      ProblemSpec large = base;
      large.magnitude = 1e3f;
      large.seqlen_q = large.seqlen_k = 1025;
      large.batch = 1;
      large.options.causal = c.head_dim == c.bucket;
      return large;
    }
    case 7: return causal_shape(base, 200, 2500);
    case 8: return problem_cases::with_score_mods(window_gqa(base, 310, 290, 40, 9));
    case 9: return problem_cases::with_score_mods(causal_shape(base, 200, 2500));
    case 10: return problem_cases::dropout(window_gqa(base, 310, 290, 40, 9), 0.3f);
    case 11:
      return problem_cases::dropout(problem_cases::with_score_mods(causal_shape(base, 200, 2500)),
                                    0.2f);
    default: return base;
  }
}

// The compiled sm90 forward variants (dtype, bucket): the generated table that instantiates the
// kernels.
std::vector<std::pair<DType, int>> sm90_forward_variants() {
  return {
#define FLARE_CUDA_FWD90_VARIANT(DT, HD) {DType::DT, HD},
#include "flare/cuda_fwd90_variants.inc"
#undef FLARE_CUDA_FWD90_VARIANT
  };
}

// Their buckets, each once, in the table's order; with `persistent`, those whose bucket has a
// persistent-kernel row (sm90/fwd_tiles.h).
std::vector<int> sm90_forward_buckets(bool persistent = false) {
  std::vector<int> buckets;
  for (const auto& [dtype, bucket] : sm90_forward_variants())
    if (std::find(buckets.begin(), buckets.end(), bucket) == buckets.end() &&
        (!persistent || cuda::sm90::fwd90_tile(bucket, true).head_dim != 0))
      buckets.push_back(bucket);
  return buckets;
}

std::vector<Sm90SuiteCase> every_sm90_case() {
  return sm90_suite_cases(sm90_forward_variants(), sm90_forward_test_head_dims, kSm90Shapes);
}

class GpuForwardSm90Cases : public GpuTestWithParam<Sm90SuiteCase> {};

// Through the automatic choice and forced to sm80 (gpu_util.h: check_sm90_and_forced_sm80).
TEST_P(GpuForwardSm90Cases, AutomaticAndForcedSm80AgainstTheReference) {
  check_sm90_and_forced_sm80(sm90_problem(GetParam()), check_forward,
                             &cuda::DispatchRecord::forward);
}

INSTANTIATE_TEST_SUITE_P(EveryVariant, GpuForwardSm90Cases,
                         ::testing::ValuesIn(every_sm90_case()), sm90_suite_case_name);

// A few ragged shapes through the sm90 kernels of every bucket, as the automatic choice runs them
// (one past the persistent kernel's lengths) and with the persistent kernel's grid capped at two
// CTAs (each walking several tiles through its Q buffers): the compute-sanitizer subset of
// scripts/gpu-check.sh (memcheck and racecheck over the TMA, mbarrier and wgmma paths).
TEST(GpuForwardSm90, RaggedShapesSmall) {
  FLARE_SKIP_WITHOUT_CUDA();
  for (int ctas : {0, 2}) {
    const cuda::DispatchOverrides cap = forward_ctas_capped(ctas);
    for (int d : sm90_forward_buckets()) {
      ProblemSpec one = base_spec(DType::kBFloat16, d, 80);
      one.batch = 1;
      check_forward(causal_shape(one, 97, 300), cap);
      check_forward(window_gqa(one, 130, 140, 40, 3), cap);
      if (ctas == 0) check_forward(causal_shape(one, 200, 2500));  // the one-CTA kernel
    }
  }
}

// The persistent kernel (sm90/fwd_kernel.cuh; the buckets that have it, fwd_tiles.h) with its grid
// capped at 1, 3 and 7 CTAs, so that each walks many tiles through its two Q buffers and the K/V
// ring (one CTA draws every tile from the counter; several draw them in an order that differs run
// to run): causal masks whose tiles differ in work, rows that see no key, a window, GQA and ragged
// lengths, against the reference. Lengths past the automatic choice's limit run it too.
TEST(GpuForwardSm90, PersistentCtasWalkManyTiles) {
  FLARE_SKIP_WITHOUT_CUDA();
  for (int ctas : {1, 3, 7}) {
    const cuda::DispatchOverrides cap = forward_ctas_capped(ctas);
    for (int d : sm90_forward_buckets(true)) {
      SCOPED_TRACE("ctas " + std::to_string(ctas) + ", d " + std::to_string(d));
      ProblemSpec causal = causal_shape(base_spec(DType::kBFloat16, d, 90), 333, 333);
      causal.heads_q = causal.heads_kv = 3;
      check_forward(causal, cap);
      check_forward(causal_shape(base_spec(DType::kFloat16, d, 91), 97, 300), cap);
      check_forward(causal_shape(base_spec(DType::kBFloat16, d, 92), 300, 97),  // rows see no key
                    cap);
      check_forward(window_gqa(base_spec(DType::kBFloat16, d, 93), 410, 390, 60, 0), cap);
      ProblemSpec plain = base_spec(DType::kFloat16, d, 94);
      plain.batch = 3;
      check_forward(plain, cap);
    }
  }
}

// Packed variable-length batches on the persistent kernel (fwd_tiles.h), every bucket that has
// one, at its width and its narrowest head dim, through the automatic choice and forced to sm80:
// empty sequences on either side, one-row sequences, rows that see no key, a window with GQA,
// 40 sequences (the tile walk reads cu_seqlens 32 at a time) and a sequence past the automatic
// choice's 2048 keys beside short ones, the window again with softcap and ALiBi; then with the
// grid capped at 2 CTAs, each walking many tiles. Key tiles run on into the next sequence's rows,
// which the mask must keep out.
TEST(GpuForwardSm90, PackedBatchesEveryPersistentBucket) {
  FLARE_SKIP_WITHOUT_CUDA();
  std::vector<int> many_q, many_k;
  for (int i = 0; i < 40; ++i) {
    many_q.push_back(1 + (i * 37) % 150);
    many_k.push_back((i * 53) % 170);
  }
  for (const auto& [dtype, bucket] : sm90_forward_variants()) {
    if (cuda::sm90::fwd90_tile(bucket, true).head_dim == 0) continue;
    const int narrowest = cuda::sm90::fwd90_bucket(bucket - 8) == bucket ? bucket - 8 : bucket;
    for (int d : {bucket, narrowest}) {
      SCOPED_TRACE("d " + std::to_string(d));
      auto packed = [&](std::vector<int> q, std::vector<int> k, uint64_t seed) {
        ProblemSpec s = base_spec(dtype, d, seed);
        s.varlen_q = std::move(q);
        s.varlen_k = std::move(k);
        return s;
      };
      for (bool causal : {false, true}) {
        ProblemSpec s = packed({0, 97, 1, 300, 5, 130}, {7, 120, 0, 301, 0, 129}, 95);
        s.options.causal = causal;
        check_sm90_and_forced_sm80(s, check_forward, &cuda::DispatchRecord::forward);
      }
      ProblemSpec window = packed({130, 64, 200}, {140, 64, 190}, 96);
      window.heads_q = 4;
      window.heads_kv = 2;
      window.options.window_left = 40;
      window.options.window_right = 3;
      check_sm90_and_forced_sm80(window, check_forward, &cuda::DispatchRecord::forward);
      // Softcap and ALiBi slopes per (sequence, head): each tile takes its own sequence's slope.
      check_sm90_and_forced_sm80(problem_cases::with_score_mods(window), check_forward,
                                 &cuda::DispatchRecord::forward);
      // Dropout: each tile draws its own sequence's rows of the mask.
      check_sm90_and_forced_sm80(problem_cases::dropout(window, 0.25f), check_forward,
                                 &cuda::DispatchRecord::forward);
      ProblemSpec many = packed(many_q, many_k, 97);
      many.options.causal = true;
      check_sm90_and_forced_sm80(many, check_forward, &cuda::DispatchRecord::forward);
      ProblemSpec long_one = packed({70, 300, 1}, {80, 2200, 3}, 98);
      long_one.options.causal = true;
      check_sm90_and_forced_sm80(long_one, check_forward, &cuda::DispatchRecord::forward);
      const cuda::DispatchOverrides cap = forward_ctas_capped(2);
      check_forward(many, cap);
      check_forward(packed({0, 97, 1, 300, 5, 130}, {7, 120, 0, 301, 0, 129}, 99), cap);
    }
  }
}

// The persistent kernel's tile counter is its stream's, and the kernel leaves it at 0
// (sm90/tile_counter.h): launches whose tile counts differ alternate between the default stream
// and two others, two run at once on different streams, and a launch captured into a CUDA graph
// (which carries a counter of its own) replays twice with eager launches on its stream between.
// A counter left dirty or shared would skip or repeat tiles, which the reference sees.
TEST(GpuForwardSm90, PersistentTileCounterPerStreamAndReset) {
  FLARE_SKIP_WITHOUT_CUDA();
  const cuda::DispatchOverrides cap = forward_ctas_capped(3);
  std::vector<ProblemSpec> specs;
  for (int d : {64, 128}) {
    ProblemSpec causal = causal_shape(base_spec(DType::kBFloat16, d, 95), 333, 333);
    causal.heads_q = causal.heads_kv = 3;
    specs.push_back(causal);
    specs.push_back(base_spec(DType::kFloat16, d, 96));
    specs.push_back(causal_shape(base_spec(DType::kBFloat16, d, 97), 97, 300));
  }
  auto check = [](Problem* pr, const GpuProblem& gpu) {
    gpu.download_forward(pr);
    expect_forward_matches(*pr);
  };
  cudaStream_t s1 = nullptr, s2 = nullptr;
  ASSERT_EQ(cudaStreamCreate(&s1), cudaSuccess);
  ASSERT_EQ(cudaStreamCreate(&s2), cudaSuccess);
  const Stream streams[] = {nullptr, s1, s2};

  for (int round = 0; round < 2; ++round) {
    for (size_t i = 0; i < specs.size(); ++i) {
      SCOPED_TRACE("one at a time, round " + std::to_string(round) + ", " + specs[i].describe());
      Problem pr = make_problem(specs[i]);
      GpuProblem gpu(pr);
      const Status s = gpu.forward(streams[(i + round) % 3], cap);
      ASSERT_TRUE(s.ok()) << s.to_string();
      check(&pr, gpu);
    }
  }

  {
    SCOPED_TRACE("two streams at once");
    Problem a = make_problem(specs[0]), b = make_problem(specs[4]);
    GpuProblem ga(a), gb(b);
    for (const GpuProblem* g : {&ga, &gb}) {
      g->o.poison();
      g->lse.poison();
    }
    const Status sa = ga.enqueue_forward(s1, cap);
    const Status sb = gb.enqueue_forward(s2, cap);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_TRUE(sa.ok() && sb.ok()) << sa.to_string() << " " << sb.to_string();
    check(&a, ga);
    check(&b, gb);
  }

  {
    SCOPED_TRACE("captured into a graph");
    Problem pr = make_problem(specs[2]);
    GpuProblem gpu(pr);
    ASSERT_EQ(cudaStreamBeginCapture(s1, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    const Status s = gpu.enqueue_forward(s1, cap);
    cudaGraph_t graph = nullptr;
    ASSERT_EQ(cudaStreamEndCapture(s1, &graph), cudaSuccess);
    ASSERT_TRUE(s.ok()) << s.to_string();
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    for (int replay = 0; replay < 2; ++replay) {
      gpu.o.poison();
      gpu.lse.poison();
      ASSERT_EQ(cudaGraphLaunch(exec, s1), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(s1), cudaSuccess);
      check(&pr, gpu);
      Problem between = make_problem(specs[replay]);
      GpuProblem eager(between);
      ASSERT_TRUE(eager.forward(s1, cap).ok());
      check(&between, eager);
    }
    EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
    EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  }
  EXPECT_EQ(cudaStreamDestroy(s1), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(s2), cudaSuccess);
}

// Problems outside sm90's set run the sm80 kernels on every device (packed batches: at d 193-256,
// whose bucket has no persistent kernel).
TEST(GpuForwardSm90, FeaturesOutsideItsSetRunSm80) {
  FLARE_SKIP_WITHOUT_CUDA();
  ProblemSpec varlen = base_spec(DType::kBFloat16, 256, 71);
  varlen.varlen_q = {0, 97, 1, 300};
  varlen.varlen_k = {7, 120, 0, 301};
  cuda::DispatchRecord ran;
  check_forward(varlen, {}, &ran);
  EXPECT_NE(ran.forward, cuda::KernelFamily::kSm90);
  ProblemSpec odd = base_spec(DType::kBFloat16, 125, 72);  // unaligned rows
  odd.pad = 3;
  check_forward(odd, {}, &ran);
  EXPECT_NE(ran.forward, cuda::KernelFamily::kSm90);
}

std::string dtype_param_name(const ::testing::TestParamInfo<DType>& param) {
  return param.param == DType::kFloat16 ? "fp16" : "bf16";
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GpuForwardFeature,
                         ::testing::Values(DType::kFloat16, DType::kBFloat16), dtype_param_name);

// ---- what the CUDA forward refuses ------------------------------------------------------------

TEST(GpuForward, Float32IsUnsupportedAndWritesNothing) {
  FLARE_SKIP_WITHOUT_CUDA();
  Problem pr = make_problem(base_spec(DType::kFloat32, 64, 30));
  GpuProblem gpu(pr);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  const Status s = gpu.forward();
  EXPECT_EQ(s.code(), StatusCode::kUnsupported) << s.to_string();
  EXPECT_NE(s.message().find("float16 or bfloat16"), std::string::npos) << s.message();
  gpu.download_forward(&pr);
  for (double x : pr.read_o()) ASSERT_TRUE(std::isnan(x)) << "o was written";
}

TEST(GpuForward, ReportsItsBuild) {
  EXPECT_TRUE(cuda_built());  // compiled into every CUDA build, GPU or not
}

}  // namespace
}  // namespace flare::test
