// test_gpu_block_sparse.cpp — block-sparse attention (flare/block_sparse.h) on CUDA tensors
// against the float64 CPU reference, which reads the same mask.
//
// The CUDA kernels skip whole tiles, so they take mask blocks of multiples of 128 (anything finer
// is kUnsupported, named, nothing written) and every feature of dense attention under them. Each
// case builds a problem on the host (fresh seeded inputs, seed printed on failure) and its mask,
// computes the references once (float64 and the naive kernel in the inputs' precision, for the
// tolerance rule of docs/architecture.md: test_util.h), then runs the device backward on the
// reference's O and LSE and the device forward, on NaN-poisoned outputs, through the automatic
// kernel choice and, where that took an sm90 kernel, through the sm80 kernels forced. Families, one
// parameterised test each, so a failure names its case:
//   RandomMasks  densities 100 to 5 %, block shapes 128×128, 256×128, 128×256, lengths that are
//                and are not multiples of 128, up to 32×32 blocks per head (s 4k)
//   Features     causal both ways, sliding windows, softcap, ALiBi, dropout (the CPU's Philox
//                mask), GQA/MQA (the mask is per query head), varlen with empty sequences (blocks
//                count from each sequence's start), head dims 32..256, padded and unaligned
//                strides, int32 masks, masks broadcast over batch and/or heads, strided masks,
//                deterministic backward (two runs agree bit for bit)
//   Patterns     local_global_block_mask and butterfly_block_mask at 8×8 and 16×16 blocks
//   Unseen       rows whose every block is off (O = 0 and dQ = 0 exactly, LSE = −inf) and keys
//                nobody's block reaches (dK = dV = 0 exactly); NaN and ±Inf planted in the K/V
//                of those key blocks and the Q/dO of those rows never reach an output
//   AllOn        a mask with every block on equals the dense call bit for bit wherever both take
//                the same kernel (the backward in deterministic mode: elsewhere dQ's atomic sums
//                vary run to run)
//   BlockSizes   block_m / block_n not multiples of 128: kUnsupported, named, nothing written
// and, as plain tests, float32 and a mask on the host refused by name, and a few small ragged
// shapes through every mask-walking kernel for compute-sanitizer (scripts/gpu-check.sh).
// Without a CUDA device every test skips, saying so.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <future>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "core/backends.h"
#include "core/block_sparse_backends.h"
#include "cuda/dispatch.h"
#include "cuda/sm90/bwd_tiles.h"
#include "cuda/sm90/fwd_tiles.h"
#include "flare/block_sparse.h"
#include "gpu_util.h"
#include "problem_cases.h"
#include "test_util.h"

namespace flare::test {
namespace {

using namespace problem_cases;  // fixed, varlen, causal, window, fill_mask, random_blocks, ...

// ---- masks ---------------------------------------------------------------------------------------

enum class Pattern { kRandom, kLocalGlobal, kButterfly };

// What a case's mask is: its block sizes, its entries, and how it is laid out.
struct MaskSpec {
  int block_m = 128;
  int block_n = 128;
  Pattern pattern = Pattern::kRandom;
  double density = 0.5;    // kRandom: each block on with this probability
  bool per_batch = true;   // false: extent 1, shared by every sequence
  bool per_head = true;    // false: extent 1, shared by every query head
  DType dtype = DType::kUInt8;
  bool strided = false;
};

// The entries of a fixed pattern (the same for every sequence and head).
BlockOn pattern_blocks(Pattern pattern, int64_t rows, int64_t cols) {
  std::vector<uint8_t> m;
  const Status s = pattern == Pattern::kLocalGlobal ? local_global_block_mask(rows, cols, 3, 1, &m)
                                                    : butterfly_block_mask(rows, cols, &m);
  EXPECT_TRUE(s.ok()) << s.to_string();
  return [m, cols](int, int, int r, int c) {
    return m.empty() ? false : m[static_cast<size_t>(r * cols + c)] != 0;
  };
}

HostTensor make_mask(const ProblemSpec& spec, const MaskSpec& m, uint64_t seed) {
  const int64_t rows = ceil_div(max_len_q(spec), m.block_m);
  const int64_t cols = ceil_div(max_len_k(spec), m.block_n);
  const BlockOn on = m.pattern == Pattern::kRandom ? random_blocks(m.density, seed)
                                                   : pattern_blocks(m.pattern, rows, cols);
  return fill_mask(m.per_batch ? batch_of(spec) : 1, m.per_head ? spec.heads_q : 1, rows, cols,
                   m.dtype, m.strided, on);
}

// ---- device copies of a block-sparse problem ----------------------------------------------------

// Every tensor of a forward and a backward call on the device. The backward reads `fwd.o` and
// `fwd.lse` (uploaded from the host problem: the reference forward, or whatever a test wrote
// there); the forward writes `out_o` and `out_lse`, so running it never changes the backward's
// inputs. A call given DispatchOverrides or a DispatchRecord goes to the CUDA dispatch directly
// (gpu_util.h), with params filled as the public entry point fills them.
struct GpuSparseProblem {
  GpuProblem fwd;  // q, k, v, o, lse, cu_seqlens, alibi, options, varlen
  GpuTensor out_o, out_lse, dout, dq, dk, dv, mask_dev;
  BlockMask mask;

  GpuSparseProblem(const Problem& pr, const HostTensor& host_mask, int block_m, int block_n)
      : fwd(pr) {
    out_o.upload(pr.o);
    out_lse.upload(pr.lse);
    dout.upload(pr.dout);
    dq.upload(pr.dq);
    dk.upload(pr.dk);
    dv.upload(pr.dv);
    mask_dev.upload(host_mask);
    mask = {mask_dev.view(), block_m, block_n};
  }

  // Poisons out_o and out_lse, runs the block-sparse forward (`dense`: attention_forward on the
  // same tensors; with `overrides`, telling `record` which kernels ran) and waits for the device.
  Status forward(bool dense = false, const cuda::DispatchOverrides& overrides = {},
                 cuda::DispatchRecord* record = nullptr) {
    out_o.poison();
    out_lse.poison();
    Status s;
    if (record == nullptr && overrides == cuda::DispatchOverrides{}) {
      s = dense ? attention_forward(fwd.q.view(), fwd.k.view(), fwd.v.view(), out_o.view(),
                                    out_lse.view(), fwd.options, fwd.varlen)
                : block_sparse_attention_forward(fwd.q.view(), fwd.k.view(), fwd.v.view(),
                                                 out_o.view(), out_lse.view(), mask, fwd.options,
                                                 fwd.varlen);
    } else {
      AttentionParams p;
      s = dense ? make_forward_params(fwd.q.view(), fwd.k.view(), fwd.v.view(), out_o.view(),
                                      out_lse.view(), fwd.options, fwd.varlen, &p)
                : make_block_sparse_forward_params(fwd.q.view(), fwd.k.view(), fwd.v.view(),
                                                   out_o.view(), out_lse.view(), mask,
                                                   fwd.options, fwd.varlen, &p);
      if (s.ok()) s = cuda::forward(p, nullptr, overrides, record);
    }
    synchronize();
    return s;
  }

  // Poisons dq, dk, dv, runs the block-sparse backward (`dense`: attention_backward; with
  // `overrides`, telling `record` which kernels ran) and waits.
  Status backward(bool dense = false, const cuda::DispatchOverrides& overrides = {},
                  cuda::DispatchRecord* record = nullptr) {
    dq.poison();
    dk.poison();
    dv.poison();
    Status s;
    if (record == nullptr && overrides == cuda::DispatchOverrides{}) {
      s = dense ? attention_backward(dout.view(), fwd.q.view(), fwd.k.view(), fwd.v.view(),
                                     fwd.o.view(), fwd.lse.view(), dq.view(), dk.view(),
                                     dv.view(), fwd.options, fwd.varlen)
                : block_sparse_attention_backward(dout.view(), fwd.q.view(), fwd.k.view(),
                                                  fwd.v.view(), fwd.o.view(), fwd.lse.view(),
                                                  dq.view(), dk.view(), dv.view(), mask,
                                                  fwd.options, fwd.varlen);
    } else {
      AttentionParams p;
      s = dense ? make_backward_params(dout.view(), fwd.q.view(), fwd.k.view(), fwd.v.view(),
                                       fwd.o.view(), fwd.lse.view(), dq.view(), dk.view(),
                                       dv.view(), fwd.options, fwd.varlen, &p)
                : make_block_sparse_backward_params(dout.view(), fwd.q.view(), fwd.k.view(),
                                                    fwd.v.view(), fwd.o.view(), fwd.lse.view(),
                                                    dq.view(), dk.view(), dv.view(), mask,
                                                    fwd.options, fwd.varlen, &p);
      if (s.ok()) s = cuda::backward(p, nullptr, overrides, record);
    }
    synchronize();
    return s;
  }

  void download_forward(Problem* pr) const {
    out_o.download(&pr->o);
    out_lse.download(&pr->lse);
  }
  void download_backward(Problem* pr) const {
    dq.download(&pr->dq);
    dk.download(&pr->dk);
    dv.download(&pr->dv);
  }

 private:
  static void synchronize() {
    const cudaError_t err = cudaDeviceSynchronize();
    EXPECT_EQ(err, cudaSuccess) << cudaGetErrorString(err);
  }
};

// ---- the references ------------------------------------------------------------------------------

// The float64 reference and the naive low-precision kernel of both passes of one problem. The
// host problem's O and LSE receive the float64 forward (the backward's inputs, on the device and in
// the naive backward alike, as in the dense backward tests).
struct References {
  AttentionParams fp, bp;
  cpu::RefForward f, f_naive;
  cpu::RefBackward b;
  NaiveBackward b_naive;
};

// The host references take most of this binary's time; given the stored forward the other three
// are independent, so they run on three threads.
::testing::AssertionResult compute_references(Problem* pr, const BlockMask& host_mask,
                                              References* r) {
  Status s = make_block_sparse_forward_params(pr->q.view, pr->k.view, pr->v.view, pr->o.view,
                                              pr->lse.view, host_mask, pr->options, pr->varlen,
                                              &r->fp);
  if (!s.ok()) return ::testing::AssertionFailure() << "forward params: " << s.to_string();
  r->f = cpu::reference_forward(r->fp, cpu::RefPrecision::kFloat64);
  cpu::store_forward(r->fp, r->f);
  s = make_block_sparse_backward_params(pr->dout.view, pr->q.view, pr->k.view, pr->v.view,
                                        pr->o.view, pr->lse.view, pr->dq.view, pr->dk.view,
                                        pr->dv.view, host_mask, pr->options, pr->varlen, &r->bp);
  if (!s.ok()) return ::testing::AssertionFailure() << "backward params: " << s.to_string();
  auto f_naive = std::async(std::launch::async, [&] {
    return cpu::reference_forward(r->fp, cpu::RefPrecision::kLowPrecision);
  });
  auto b = std::async(std::launch::async, [&] {
    return cpu::reference_backward(r->bp, cpu::RefPrecision::kFloat64);
  });
  r->b_naive = naive_backward(r->bp);
  r->f_naive = f_naive.get();
  r->b = b.get();
  return ::testing::AssertionSuccess();
}

// ---- running and checking one case ---------------------------------------------------------------

using ExtraCheck = std::function<void(const Problem& pr, const References& r)>;

// The raw bytes of a device run's gradients, padding included.
struct GradientBytes {
  std::vector<unsigned char> dq, dk, dv;
};
GradientBytes gradient_bytes(const Problem& pr) { return {pr.dq.bytes, pr.dk.bytes, pr.dv.bytes}; }

// One kernel family's run of both passes with `overrides`: the backward (twice, compared bit for
// bit, in deterministic mode), then the forward, each checked; `extra` sees the outputs of both.
// `record` is left telling which kernels the last calls ran.
void run_and_check(GpuSparseProblem& dev, Problem& pr, const References& r,
                   const ExtraCheck& extra, const cuda::DispatchOverrides& overrides,
                   cuda::DispatchRecord* record) {
  Status s = dev.backward(false, overrides, record);
  ASSERT_TRUE(s.ok()) << s.to_string();
  dev.download_backward(&pr);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  // The non-finite variant of the gradient check (test_util.h) is expect_gradients_match exactly
  // for finite inputs; with NaN/Inf planted where no visible pair reads them (Unseen) it takes
  // its fp32 noise bound from the finite inputs rather than from an infinite max|V|.
  expect_gradients_match_nonfinite(pr, r.bp, r.b, r.b_naive);
  if (pr.options.deterministic) {
    const GradientBytes first = gradient_bytes(pr);
    s = dev.backward(false, overrides, record);
    ASSERT_TRUE(s.ok()) << s.to_string();
    dev.download_backward(&pr);
    const GradientBytes second = gradient_bytes(pr);
    EXPECT_TRUE(first.dq == second.dq) << "deterministic backward: dq differs between two runs";
    EXPECT_TRUE(first.dk == second.dk) << "deterministic backward: dk differs between two runs";
    EXPECT_TRUE(first.dv == second.dv) << "deterministic backward: dv differs between two runs";
  }
  s = dev.forward(false, overrides, record);
  ASSERT_TRUE(s.ok()) << s.to_string();
  dev.download_forward(&pr);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  expect_forward_matches(pr, r.f, r.f_naive);
  if (extra) extra(pr, r);
}

// Forward and backward of `spec` under `host_mask` on the device against the references, through
// the automatic kernel choice (or the one `overrides` makes) and, where that took an sm90 kernel,
// again with sm80 forced. `prepare` may change the host inputs (planting values) before anything
// is computed.
void check_case(const ProblemSpec& spec, const HostTensor& host_mask, int block_m, int block_n,
                const std::function<void(Problem*)>& prepare = {}, const ExtraCheck& extra = {},
                const cuda::DispatchOverrides& overrides = {}) {
  SCOPED_TRACE(spec.describe() + " blocks " + std::to_string(block_m) + "x" +
               std::to_string(block_n));
  Problem pr = make_problem(spec);
  if (prepare) prepare(&pr);
  References r;
  ASSERT_TRUE(compute_references(&pr, {host_mask.view, block_m, block_n}, &r));
  GpuSparseProblem dev(pr, host_mask, block_m, block_n);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());

  // On an sm_90 device built with sm_90a code, the automatic choice must take the sm90 kernel of
  // every problem its predicate accepts, block mask and all (sm90/fwd_tiles.h, sm90/bwd_tiles.h:
  // fixed-length batches without dropout or score modifiers, in a bucket that takes masks).
  const bool sm90 = cuda::runs_sm90_kernels();
  // Without overrides, first as users call it: the public entry points (which keep no record).
  if (overrides == cuda::DispatchOverrides{}) {
    run_and_check(dev, pr, r, extra, overrides, nullptr);
    if (::testing::Test::HasFatalFailure()) return;
  }
  cuda::DispatchRecord ran;
  run_and_check(dev, pr, r, extra, overrides, &ran);
  if (::testing::Test::HasFatalFailure()) return;
  const bool fwd_sm90 = ran.forward == cuda::KernelFamily::kSm90;
  const bool bwd_sm90 = ran.backward == cuda::KernelFamily::kSm90;
  if (sm90) {
    EXPECT_EQ(fwd_sm90, cuda::sm90::forward_supported(r.fp, overrides.forward_ctas > 0))
        << "the forward's automatic choice of kernel family disagrees with sm90/fwd_tiles.h";
    EXPECT_EQ(bwd_sm90, cuda::sm90::backward_supported(r.bp))
        << "the backward's automatic choice of kernel family disagrees with sm90/bwd_tiles.h";
  }
  if (!fwd_sm90 && !bwd_sm90) return;
  SCOPED_TRACE("forced to sm80");
  cuda::DispatchOverrides sm80 = overrides;
  sm80.arch = 80;
  cuda::DispatchRecord forced;
  run_and_check(dev, pr, r, extra, sm80, &forced);
  EXPECT_NE(forced.forward, cuda::KernelFamily::kSm90);
  EXPECT_NE(forced.backward, cuda::KernelFamily::kSm90);
}

// ---- cases ---------------------------------------------------------------------------------------

struct Case {
  std::string name;  // the test's name: letters, digits and underscores
  ProblemSpec spec;  // seed: set from the run's seed and the name
  MaskSpec mask;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

std::string case_name(const ::testing::TestParamInfo<Case>& info) { return info.param.name; }

// The case's spec with this run's seed (FLARE_TEST_SEED replays it), distinct per case.
ProblemSpec seeded(const Case& c) {
  ProblemSpec s = c.spec;
  s.seed = test_seed() ^ std::hash<std::string>{}(c.name);
  return s;
}

// The case under its mask (a random one drawn from the seed after the spec's), with `overrides`.
void check_case(const Case& c, const cuda::DispatchOverrides& overrides = {}) {
  const ProblemSpec spec = seeded(c);
  check_case(spec, make_mask(spec, c.mask, spec.seed + 1), c.mask.block_m, c.mask.block_n, {}, {},
             overrides);
}

MaskSpec blocks(int block_m, int block_n, double density) {
  MaskSpec m;
  m.block_m = block_m;
  m.block_n = block_n;
  m.density = density;
  return m;
}

// A softcap over scores large enough for the cap to bend them.
ProblemSpec capped(ProblemSpec s, float cap) { return magnitude(softcap(s, cap), 4.0f); }
// Dropout keyed by this run's seed, at an offset past 2^32 (the high word of the counter in use).
ProblemSpec keyed_dropout(ProblemSpec s, float p) {
  s = dropout(s, p);
  s.options.dropout_seed = 0x1234567890abcdefull ^ test_seed();
  s.options.dropout_offset = 0x100000003ull;
  return s;
}
MaskSpec broadcast(MaskSpec m, bool per_batch, bool per_head) {
  m.per_batch = per_batch;
  m.per_head = per_head;
  return m;
}

constexpr DType kF16 = DType::kFloat16;
constexpr DType kBF16 = DType::kBFloat16;

// ---- random masks --------------------------------------------------------------------------------

class GpuBlockSparseRandomMasks : public GpuTestWithParam<Case> {};

TEST_P(GpuBlockSparseRandomMasks, AgainstTheReference) { check_case(GetParam()); }

// s 1024: 8 blocks of 128 per row and per column, so the forward's key walk and the backward's
// query walk each pass several off blocks in a row; s 4096: 32. Lengths 1000, 300, 129 leave a
// ragged last block (of 104, 44 and 1 rows or keys).
const Case kRandomCases[] = {
    {"d128_s1024_128x128_all", fixed(1, 1024, 1024, 1, 1, 128, kBF16), blocks(128, 128, 1.0)},
    {"d128_s1024_128x128_50", fixed(1, 1024, 1024, 2, 2, 128, kBF16), blocks(128, 128, 0.5)},
    {"d128_s1024_128x128_25", fixed(1, 1024, 1024, 2, 2, 128, kF16), blocks(128, 128, 0.25)},
    {"d128_s1024_128x128_10", fixed(1, 1024, 1024, 4, 4, 128, kBF16), blocks(128, 128, 0.1)},
    {"d128_s1024_256x128_50", fixed(1, 1024, 1024, 2, 2, 128, kBF16), blocks(256, 128, 0.5)},
    {"d128_s1024_128x256_50", fixed(1, 1024, 1024, 2, 2, 128, kF16), blocks(128, 256, 0.5)},
    {"d128_s1024_256x256_40", fixed(1, 1024, 1024, 2, 2, 128, kF16), blocks(256, 256, 0.4)},
    {"d64_s1024_128x128_40", fixed(1, 1024, 1024, 4, 2, 64, kBF16), blocks(128, 128, 0.4)},
    {"d256_s1024_128x256_40", fixed(1, 1024, 1024, 2, 2, 256, kF16), blocks(128, 256, 0.4)},
    {"d128_s1000_128x128_50", fixed(2, 1000, 1000, 1, 1, 128, kBF16), blocks(128, 128, 0.5)},
    {"d128_sq300_sk129_128x128_60", fixed(2, 300, 129, 2, 2, 128, kF16), blocks(128, 128, 0.6)},
    {"d128_sq129_sk1000_128x256_50", fixed(1, 129, 1000, 2, 2, 128, kBF16), blocks(128, 256, 0.5)},
    {"d64_sq1000_sk300_256x128_50", fixed(2, 1000, 300, 2, 1, 64, kF16), blocks(256, 128, 0.5)},
    {"d128_s4096_128x128_5", fixed(1, 4096, 4096, 1, 1, 128, kBF16), blocks(128, 128, 0.05)},
    {"d128_s4096_256x128_causal_15", causal(fixed(1, 4096, 4096, 1, 1, 128, kF16)),
     blocks(256, 128, 0.15)},
    {"d64_s4096_128x256_10", fixed(1, 4096, 4096, 1, 1, 64, kBF16), blocks(128, 256, 0.1)},
};

INSTANTIATE_TEST_SUITE_P(Cases, GpuBlockSparseRandomMasks, ::testing::ValuesIn(kRandomCases),
                         case_name);

// ---- every feature of dense attention under a block mask -----------------------------------------

class GpuBlockSparseFeatures : public GpuTestWithParam<Case> {};

TEST_P(GpuBlockSparseFeatures, AgainstTheReference) { check_case(GetParam()); }

MaskSpec int32_mask(MaskSpec m) {
  m.dtype = DType::kInt32;
  return m;
}
MaskSpec strided_mask(MaskSpec m) {
  m.strided = true;
  return m;
}

// Varlen lengths: empty query and key sequences, lengths of 1 block and of several, ragged ends.
const std::vector<int> kLensQ = {0, 700, 129, 300, 5, 384};
const std::vector<int> kLensK = {7, 600, 0, 300, 260, 384};

const Case kFeatureCases[] = {
    // Causal, bottom-right aligned: s_q < s_k, and s_q > s_k (the first 700 rows see no key).
    {"causal_sq300_sk1000_gqa4to2_d128", causal(fixed(1, 300, 1000, 4, 2, 128, kBF16)),
     blocks(128, 128, 0.5)},
    {"causal_sq1000_sk300_d128", causal(fixed(1, 1000, 300, 2, 2, 128, kF16)),
     blocks(128, 128, 0.6)},
    {"causal_s1024_d64", causal(fixed(1, 1024, 1024, 2, 2, 64, kF16)), blocks(128, 128, 0.5)},
    {"causal_s1024_d256_128x256", causal(fixed(1, 1024, 1024, 1, 1, 256, kBF16)),
     blocks(128, 256, 0.5)},
    // Sliding windows.
    {"window_200_50_s1024_d128", window(fixed(1, 1024, 1024, 2, 2, 128, kBF16), 200, 50),
     blocks(128, 128, 0.6)},
    {"window_left_unbounded_right_100_sq700_sk900_d128",
     window(fixed(1, 700, 900, 2, 2, 128, kF16), -1, 100), blocks(256, 128, 0.5)},
    {"window_0_0_s513_d128", window(fixed(1, 513, 513, 2, 2, 128, kBF16), 0, 0),
     blocks(128, 128, 0.7)},
    {"window_causal_300_s1024_d64", window(causal(fixed(1, 1024, 1024, 2, 2, 64, kBF16)), 300, 0),
     blocks(128, 128, 0.6)},
    // Score modifiers and dropout: the sm80 kernels.
    {"softcap_s512_d128", capped(fixed(1, 512, 512, 2, 2, 128, kBF16), 5.0f),
     blocks(128, 128, 0.5)},
    {"alibi_per_batch_sq400_sk600_d96", alibi(fixed(2, 400, 600, 2, 2, 96, kF16), true),
     blocks(128, 128, 0.5)},
    {"alibi_causal_gqa_s700_d128", alibi(causal(fixed(1, 700, 700, 4, 2, 128, kBF16))),
     blocks(128, 128, 0.5)},
    {"dropout_causal_s640_d128", keyed_dropout(causal(fixed(1, 640, 640, 2, 2, 128, kBF16)), 0.17f),
     blocks(128, 128, 0.5)},
    {"dropout_gqa_sq600_sk900_d64", keyed_dropout(fixed(1, 600, 900, 4, 2, 64, kF16), 0.2f),
     blocks(128, 256, 0.5)},
    {"every_modifier_gqa_sq700_sk800_d80",
     keyed_dropout(alibi(capped(window(fixed(1, 700, 800, 4, 2, 80, kBF16), 300, 50), 8.0f)),
                   0.1f),
     blocks(128, 128, 0.6)},
    // GQA / MQA: the mask is per query head, so heads sharing K/V see different blocks.
    {"mqa_8to1_causal_s512_d128", causal(fixed(1, 512, 512, 8, 1, 128, kF16)),
     blocks(128, 128, 0.5)},
    {"gqa_4to1_sq384_sk512_d256", fixed(1, 384, 512, 4, 1, 256, kBF16), blocks(128, 128, 0.5)},
    // Varlen: blocks count from each sequence's start.
    {"varlen_gqa_d128", varlen(kLensQ, kLensK, 2, 1, 128, kBF16), blocks(128, 128, 0.5)},
    {"varlen_causal_d128_256x128", causal(varlen(kLensQ, kLensK, 2, 2, 128, kF16)),
     blocks(256, 128, 0.6)},
    {"varlen_causal_dropout_alibi_d64",
     keyed_dropout(alibi(causal(varlen(kLensQ, kLensK, 4, 2, 64, kBF16)), true), 0.15f),
     blocks(128, 128, 0.5)},
    // Head dims: every bucket of both kernel families, widths inside them, odd ones.
    {"head_dim_32", fixed(1, 384, 520, 2, 2, 32, kBF16), blocks(128, 128, 0.6)},
    {"head_dim_40", fixed(1, 384, 520, 2, 2, 40, kF16), blocks(128, 128, 0.6)},
    {"head_dim_59", fixed(1, 384, 520, 2, 2, 59, kBF16), blocks(128, 128, 0.6)},
    {"head_dim_64", fixed(1, 384, 520, 2, 2, 64, kF16), blocks(128, 128, 0.6)},
    {"head_dim_80", fixed(1, 384, 520, 2, 2, 80, kBF16), blocks(128, 128, 0.6)},
    {"head_dim_96", fixed(1, 384, 520, 2, 2, 96, kF16), blocks(128, 128, 0.6)},
    {"head_dim_111", fixed(1, 384, 520, 2, 2, 111, kBF16), blocks(128, 128, 0.6)},
    {"head_dim_128", fixed(1, 384, 520, 2, 2, 128, kF16), blocks(128, 128, 0.6)},
    {"head_dim_160", fixed(1, 384, 520, 2, 2, 160, kBF16), blocks(128, 128, 0.6)},
    {"head_dim_192", fixed(1, 384, 520, 2, 2, 192, kF16), blocks(128, 128, 0.6)},
    {"head_dim_256", fixed(1, 384, 520, 2, 2, 256, kBF16), blocks(128, 128, 0.6)},
    // Strided inputs: rows 16-byte aligned (pad 8: the sm90 and vector paths), and not (pad 3).
    {"padded_aligned_d128", padded(causal(fixed(2, 520, 520, 2, 2, 128, kBF16)), 8),
     blocks(128, 128, 0.5)},
    {"padded_unaligned_d64", padded(fixed(2, 520, 520, 2, 1, 64, kF16), 3), blocks(128, 128, 0.5)},
    // Mask layouts.
    {"int32_mask_s1024_d128", fixed(1, 1024, 1024, 2, 2, 128, kBF16),
     int32_mask(blocks(128, 128, 0.3))},
    {"int32_mask_varlen_d64", varlen(kLensQ, kLensK, 2, 2, 64, kF16),
     int32_mask(blocks(128, 128, 0.5))},
    {"mask_shared_by_all", fixed(2, 512, 640, 2, 1, 128, kBF16),
     broadcast(blocks(128, 128, 0.5), false, false)},
    {"mask_per_batch_shared_by_heads", fixed(2, 512, 640, 2, 1, 128, kF16),
     broadcast(blocks(128, 128, 0.5), true, false)},
    {"mask_per_head_shared_by_batch", fixed(2, 512, 640, 2, 1, 64, kBF16),
     broadcast(blocks(128, 128, 0.5), false, true)},
    {"mask_strided_columns", fixed(2, 512, 640, 2, 1, 128, kF16),
     strided_mask(blocks(128, 128, 0.5))},
    {"mask_strided_varlen", causal(varlen(kLensQ, kLensK, 2, 1, 128, kBF16)),
     strided_mask(blocks(128, 128, 0.6))},
    // Deterministic backward: bit for bit the same twice (and against the reference).
    {"deterministic_gqa_dropout_causal_d128",
     deterministic(keyed_dropout(causal(fixed(1, 640, 640, 4, 2, 128, kBF16)), 0.1f)),
     blocks(128, 128, 0.5)},
    {"deterministic_d64_256x128", deterministic(fixed(2, 300, 1000, 2, 2, 64, kF16)),
     blocks(256, 128, 0.5)},
};

INSTANTIATE_TEST_SUITE_P(Cases, GpuBlockSparseFeatures, ::testing::ValuesIn(kFeatureCases),
                         case_name);

// ---- the fixed patterns ---------------------------------------------------------------------------

class GpuBlockSparsePatterns : public GpuTestWithParam<Case> {};

TEST_P(GpuBlockSparsePatterns, AgainstTheReference) { check_case(GetParam()); }

// The FlashAttention paper's patterns, written once and shared by every sequence and head.
MaskSpec pattern(Pattern p) {
  MaskSpec m = broadcast(blocks(128, 128, 0.0), false, false);
  m.pattern = p;
  return m;
}

const Case kPatternCases[] = {
    {"local_global_s1024_d128", fixed(1, 1024, 1024, 2, 2, 128, kBF16),
     pattern(Pattern::kLocalGlobal)},
    {"local_global_causal_s2048_d64", causal(fixed(1, 2048, 2048, 2, 1, 64, kF16)),
     pattern(Pattern::kLocalGlobal)},
    {"butterfly_s1024_d128", fixed(1, 1024, 1024, 2, 2, 128, kF16), pattern(Pattern::kButterfly)},
    {"butterfly_s2048_d128", fixed(1, 2048, 2048, 1, 1, 128, kBF16), pattern(Pattern::kButterfly)},
};

INSTANTIATE_TEST_SUITE_P(Cases, GpuBlockSparsePatterns, ::testing::ValuesIn(kPatternCases),
                         case_name);

// ---- rows that see no key, keys nobody sees, and what is planted in them -------------------------

// A random mask with one row block off for every query head (row block h mod rows) and one column
// block off for every query head of a kv group (column block 2g + 1 mod cols, so different groups
// lose different keys): those rows see no key, and no row sees those keys.
struct Unseen {
  int rows, cols, group;
  int off_row(int h) const { return h % rows; }
  int off_col(int kv_head) const { return (2 * kv_head + 1) % cols; }
};

Unseen unseen_of(const ProblemSpec& spec, const MaskSpec& m) {
  return {static_cast<int>(ceil_div(max_len_q(spec), m.block_m)),
          static_cast<int>(ceil_div(max_len_k(spec), m.block_n)), spec.heads_q / spec.heads_kv};
}

HostTensor unseen_mask(const ProblemSpec& spec, const MaskSpec& m, const Unseen& u, uint64_t seed) {
  const BlockOn random = random_blocks(m.density, seed);
  return fill_mask(batch_of(spec), spec.heads_q, u.rows, u.cols, m.dtype, m.strided,
                   [&](int b, int h, int r, int c) {
                     const bool on = random(b, h, r, c);
                     return on && r != u.off_row(h) && c != u.off_col(h / u.group);
                   });
}

// First row and length of sequence b along q (is_q) or k.
struct SeqRows {
  int64_t row0;
  int len;
};
SeqRows seq_rows(const Problem& pr, int b, bool is_q) {
  if (!pr.is_varlen())
    return {0, is_q ? pr.spec.seqlen_q : pr.spec.seqlen_k};
  const auto* cu = reinterpret_cast<const int32_t*>((is_q ? pr.cu_q : pr.cu_k).bytes.data());
  return {cu[b], cu[b + 1] - cu[b]};
}

// Calls f(index) for every element of rows [begin, end) of sequence b, head `head`, of a q-shaped
// (is_q) or k-shaped tensor: (b, s, h, d), or packed (total, h, d) for varlen.
template <typename F>
void for_rows(const Problem& pr, bool is_q, int b, int head, int begin, int end, F f) {
  const SeqRows s = seq_rows(pr, b, is_q);
  for (int64_t i = begin; i < std::min(end, s.len); ++i)
    for (int64_t c = 0; c < pr.spec.head_dim; ++c) {
      if (pr.is_varlen())
        f({s.row0 + i, int64_t{head}, c});
      else
        f({int64_t{b}, i, int64_t{head}, c});
    }
}

using Index = std::initializer_list<int64_t>;

// Writes `k_value` / `v_value` into the K/V rows of every kv head's off key block and `q_value`
// into the Q and dO rows of every query head's off row block.
void plant(Problem* pr, const MaskSpec& m, const Unseen& u, float k_value, float v_value,
           float q_value) {
  const ProblemSpec& spec = pr->spec;
  for (int b = 0; b < batch_of(spec); ++b) {
    for (int g = 0; g < spec.heads_kv; ++g) {
      const int j0 = u.off_col(g) * m.block_n;
      for_rows(*pr, false, b, g, j0, j0 + m.block_n, [&](Index at) {
        pr->k.set(at, k_value);
        pr->v.set(at, v_value);
      });
    }
    for (int h = 0; h < spec.heads_q; ++h) {
      const int i0 = u.off_row(h) * m.block_m;
      for_rows(*pr, true, b, h, i0, i0 + m.block_m, [&](Index at) {
        pr->q.set(at, q_value);
        pr->dout.set(at, q_value);
      });
    }
  }
}

// Elements that must be exactly 0: how many were checked, how many were not 0, and the first.
struct ZeroTally {
  explicit ZeroTally(const char* name) : what(name) {}
  const char* what;
  int64_t checked = 0, nonzero = 0;
  std::string first;

  void check(float x, int b, int head, int64_t row) {
    ++checked;
    if (x == 0.0f || nonzero++ > 0) return;
    first = std::string(what) + " = " + std::to_string(x) + " at seq " + std::to_string(b) +
            ", head " + std::to_string(head) + ", row " + std::to_string(row);
  }
  ::testing::AssertionResult all_zero() const {
    if (checked == 0)
      return ::testing::AssertionFailure() << what << ": nothing to check; the case is wrong";
    if (nonzero == 0) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << nonzero << " of " << checked << " elements not 0, "
                                         << "first " << first;
  }
};

// Exactly zero, not merely within tolerance: O and dQ of every row whose reference LSE is −inf
// (it sees no key), dK and dV of every key in an off column block.
void expect_exact_zeros(const Problem& pr, const References& r, const MaskSpec& m,
                        const Unseen& u) {
  const ProblemSpec& spec = pr.spec;
  ZeroTally o{"O of a row that sees no key"}, dq{"dQ of a row that sees no key"};
  ZeroTally dk{"dK of a key nobody sees"}, dv{"dV of a key nobody sees"};
  for (int b = 0; b < batch_of(spec); ++b) {
    const SeqRows sq = seq_rows(pr, b, true);
    const int64_t packed0 = pr.is_varlen() ? sq.row0 : int64_t{b} * spec.seqlen_q;
    for (int h = 0; h < spec.heads_q; ++h)
      for (int i = 0; i < sq.len; ++i) {
        if (r.f.lse[static_cast<size_t>(h * r.fp.total_q + packed0 + i)] !=
            -std::numeric_limits<double>::infinity())
          continue;
        for_rows(pr, true, b, h, i, i + 1, [&](Index at) {
          o.check(pr.o.get(at), b, h, i);
          dq.check(pr.dq.get(at), b, h, i);
        });
      }
    for (int g = 0; g < spec.heads_kv; ++g) {
      const int j0 = u.off_col(g) * m.block_n;
      for_rows(pr, false, b, g, j0, j0 + m.block_n, [&](Index at) {
        const int64_t key = *(at.begin() + (pr.is_varlen() ? 0 : 1));
        dk.check(pr.dk.get(at), b, g, key);
        dv.check(pr.dv.get(at), b, g, key);
      });
    }
  }
  for (const ZeroTally* t : {&o, &dq, &dk, &dv}) EXPECT_TRUE(t->all_zero());
}

class GpuBlockSparseUnseen : public GpuTestWithParam<Case> {
 protected:
  // The case with its off rows and columns; `values` (K, V, Q/dO) planted there when given.
  void run(const float* values) {
    const Case& c = GetParam();
    const ProblemSpec spec = seeded(c);
    const Unseen u = unseen_of(spec, c.mask);
    const HostTensor mask = unseen_mask(spec, c.mask, u, spec.seed + 1);
    std::function<void(Problem*)> prepare;
    if (values != nullptr)
      prepare = [&](Problem* pr) { plant(pr, c.mask, u, values[0], values[1], values[2]); };
    check_case(spec, mask, c.mask.block_m, c.mask.block_n, prepare,
               [&](const Problem& pr, const References& r) { expect_exact_zeros(pr, r, c.mask, u); });
  }
};

TEST_P(GpuBlockSparseUnseen, RowsAndKeysNobodySeesAreExactlyZero) { run(nullptr); }

// The float64 reference never visits a masked pair either, so it is finite here and equal in
// every other value to the problem without the planted values.
TEST_P(GpuBlockSparseUnseen, NanAndInfInOffBlocksNeverArrive) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const float nan_k_inf_v[] = {nan, inf, nan};
  const float inf_k_nan_v[] = {-inf, nan, inf};
  {
    SCOPED_TRACE("K = NaN, V = +Inf, Q = dO = NaN");
    run(nan_k_inf_v);
  }
  SCOPED_TRACE("K = -Inf, V = NaN, Q = dO = +Inf");
  run(inf_k_nan_v);
}

const Case kUnseenCases[] = {
    {"d128_s640", fixed(1, 640, 640, 2, 2, 128, kBF16), blocks(128, 128, 0.7)},
    {"d128_gqa4to2_causal_sq512_sk768", causal(fixed(1, 512, 768, 4, 2, 128, kF16)),
     blocks(128, 128, 0.7)},
    {"d256_window_s520_128x256", window(fixed(1, 520, 520, 2, 1, 256, kBF16), 200, 100),
     blocks(128, 256, 0.8)},
    {"d64_s640_256x128", fixed(2, 640, 640, 2, 2, 64, kF16), blocks(256, 128, 0.7)},
    {"d96_dropout_softcap_s512",
     keyed_dropout(capped(fixed(1, 512, 512, 2, 2, 96, kBF16), 6.0f), 0.1f),
     blocks(128, 128, 0.7)},
    {"varlen_d128", varlen({300, 0, 520, 140}, {400, 50, 520, 0}, 2, 1, 128, kF16),
     blocks(128, 128, 0.7)},
    {"deterministic_d128_s512", deterministic(fixed(1, 512, 512, 2, 2, 128, kBF16)),
     blocks(128, 128, 0.7)},
    {"every_block_off_d128", fixed(1, 300, 300, 2, 2, 128, kBF16), blocks(128, 128, 0.0)},
};

INSTANTIATE_TEST_SUITE_P(Cases, GpuBlockSparseUnseen, ::testing::ValuesIn(kUnseenCases),
                         case_name);

// ---- every block on: the dense call, bit for bit -------------------------------------------------

class GpuBlockSparseAllOn : public GpuTestWithParam<Case> {};

// Both calls' outputs, and whether each took an sm90 kernel.
struct SameKernelRun {
  std::vector<unsigned char> sparse, dense;
  bool sparse_sm90 = false, dense_sm90 = false;
};

// With every block on, the block-sparse call runs the dense call's kernel over every tile (the
// walks find each one on), so where both take the same kernel their bytes agree. On an sm_90
// device the dense d 64 calls take sm90 kernels that do not read masks (sm90/fwd_tiles.h,
// bwd_tiles.h) while the block-sparse ones take sm80's: those pairs are compared with sm80 forced.
TEST_P(GpuBlockSparseAllOn, EqualsDenseBitForBit) {
  const Case& c = GetParam();
  const ProblemSpec spec = seeded(c);
  SCOPED_TRACE(spec.describe());
  Problem pr = make_problem(spec);
  MaskSpec m = c.mask;
  m.density = 1.0;
  const HostTensor mask = make_mask(spec, m, 0);
  GpuSparseProblem dev(pr, mask, m.block_m, m.block_n);
  ASSERT_FALSE(HasFatalFailure());
  // The backward's O and LSE: the dense forward's, in fwd.o / fwd.lse (not the reference's: no
  // reference is needed for a bitwise comparison).
  ASSERT_TRUE(attention_forward(dev.fwd.q.view(), dev.fwd.k.view(), dev.fwd.v.view(),
                                dev.fwd.o.view(), dev.fwd.lse.view(), dev.fwd.options,
                                dev.fwd.varlen)
                  .ok());

  auto forward = [&](bool dense, const cuda::DispatchOverrides& overrides,
                     std::vector<unsigned char>* bytes, bool* sm90) {
    cuda::DispatchRecord ran;
    const Status s = dev.forward(dense, overrides, &ran);
    ASSERT_TRUE(s.ok()) << (dense ? "dense: " : "block-sparse: ") << s.to_string();
    dev.download_forward(&pr);
    *bytes = pr.o.bytes;
    bytes->insert(bytes->end(), pr.lse.bytes.begin(), pr.lse.bytes.end());
    *sm90 = ran.forward == cuda::KernelFamily::kSm90;
  };
  auto backward = [&](bool dense, const cuda::DispatchOverrides& overrides,
                      std::vector<unsigned char>* bytes, bool* sm90) {
    cuda::DispatchRecord ran;
    const Status s = dev.backward(dense, overrides, &ran);
    ASSERT_TRUE(s.ok()) << (dense ? "dense: " : "block-sparse: ") << s.to_string();
    dev.download_backward(&pr);
    *bytes = pr.dq.bytes;
    for (const HostTensor* t : {&pr.dk, &pr.dv})
      bytes->insert(bytes->end(), t->bytes.begin(), t->bytes.end());
    *sm90 = ran.backward == cuda::KernelFamily::kSm90;
  };
  // Runs both calls of one pass (sm80 `forced` or the automatic choice) and compares them where
  // they took the same kernel family; returns whether either took an sm90 kernel.
  auto compare = [&](bool is_forward, bool forced) {
    const char* pass = is_forward ? "forward" : "backward";
    const cuda::DispatchOverrides overrides = forced ? sm80_forced() : cuda::DispatchOverrides{};
    SameKernelRun run;
    if (is_forward) {
      forward(false, overrides, &run.sparse, &run.sparse_sm90);
      forward(true, overrides, &run.dense, &run.dense_sm90);
    } else {
      backward(false, overrides, &run.sparse, &run.sparse_sm90);
      backward(true, overrides, &run.dense, &run.dense_sm90);
    }
    if (HasFatalFailure()) return false;
    if (forced) {
      EXPECT_FALSE(run.sparse_sm90 || run.dense_sm90) << pass << ": sm90 ran, sm80 forced";
    }
    if (run.sparse_sm90 == run.dense_sm90) {
      EXPECT_TRUE(run.sparse == run.dense)
          << pass << (forced ? " (sm80 forced)" : "") << ": the all-on block-sparse call's bytes "
          << "differ from the dense call's";
    }
    return run.sparse_sm90 || run.dense_sm90;
  };

  bool sm90_ran = compare(true, false);
  if (spec.options.deterministic) sm90_ran |= compare(false, false);
  if (HasFatalFailure() || !sm90_ran) return;
  compare(true, true);
  if (spec.options.deterministic) compare(false, true);
}

const Case kAllOnCases[] = {
    {"d128_s2048", fixed(1, 2048, 2048, 4, 4, 128, kBF16), blocks(128, 128, 1.0)},
    {"d128_causal_sq1000_sk1500_gqa", causal(fixed(2, 1000, 1500, 4, 2, 128, kF16)),
     blocks(256, 128, 1.0)},
    {"d256_window_s1030_128x256", window(fixed(1, 1030, 1030, 2, 1, 256, kBF16), 300, 40),
     blocks(128, 256, 1.0)},
    {"d64_causal_s2048", causal(fixed(1, 2048, 2048, 4, 4, 64, kF16)), blocks(128, 128, 1.0)},
    {"d96_softcap_dropout_s1000",
     keyed_dropout(capped(fixed(1, 1000, 1000, 2, 2, 96, kBF16), 5.0f), 0.1f),
     blocks(128, 128, 1.0)},
    {"d40_varlen", varlen(kLensQ, kLensK, 4, 2, 40, kF16), blocks(128, 128, 1.0)},
    {"deterministic_d128_causal_gqa", deterministic(causal(fixed(1, 1024, 1024, 4, 2, 128, kBF16))),
     blocks(128, 128, 1.0)},
    {"deterministic_d64_dropout_varlen",
     deterministic(keyed_dropout(varlen(kLensQ, kLensK, 2, 2, 64, kF16), 0.2f)),
     blocks(128, 256, 1.0)},
    {"deterministic_d256_s700", deterministic(fixed(1, 700, 700, 2, 2, 256, kBF16)),
     blocks(128, 128, 1.0)},
    {"deterministic_d192_alibi_s600", deterministic(alibi(fixed(1, 600, 600, 2, 1, 192, kF16))),
     blocks(128, 128, 1.0)},
};

INSTANTIATE_TEST_SUITE_P(Cases, GpuBlockSparseAllOn, ::testing::ValuesIn(kAllOnCases), case_name);

// ---- a small subset for compute-sanitizer (scripts/gpu-check.sh) ---------------------------------

// Ragged shapes through each kernel that walks a mask: sm90 forward and backward at d 128 and 256,
// the sm80 kernels at d 64 and under varlen.
TEST(GpuBlockSparse, SmallRaggedShapes) {
  FLARE_SKIP_WITHOUT_CUDA();
  const Case cases[] = {
      {"sm90_d128", causal(fixed(1, 200, 300, 4, 2, 128, kBF16)), blocks(128, 128, 0.6)},
      {"sm90_d256", window(fixed(1, 260, 300, 2, 2, 256, kF16), 90, 20), blocks(128, 256, 0.7)},
      {"sm80_d64", fixed(2, 300, 200, 2, 1, 64, kBF16), blocks(256, 128, 0.6)},
      {"sm80_varlen", causal(varlen({130, 0, 200}, {150, 30, 260}, 2, 1, 128, kF16)),
       blocks(128, 128, 0.7)},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    check_case(c);
  }
}

// The sm90 persistent forward (d 128) with its grid capped at 3 CTAs, so that each walks many
// query tiles whose step counts differ (a sparse mask leaves some with none) through its Q
// buffers and K/V ring.
TEST(GpuBlockSparse, PersistentForwardWalksManyTiles) {
  FLARE_SKIP_WITHOUT_CUDA();
  const cuda::DispatchOverrides cap = forward_ctas_capped(3);
  const Case cases[] = {
      {"d128_sparse", fixed(2, 1000, 1000, 2, 2, 128, kBF16), blocks(128, 128, 0.15)},
      {"d128_causal", causal(fixed(1, 1024, 1024, 3, 1, 128, kF16)), blocks(128, 256, 0.5)},
      {"d128_window", window(fixed(1, 700, 650, 2, 2, 128, kBF16), 200, 30),
       blocks(128, 128, 0.5)},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    check_case(c, cap);
  }
}

// ---- what CUDA refuses ---------------------------------------------------------------------------

// Both passes of `dev` answer `code` with a message that starts with `prefix` (the argument it
// names) and contains `rule`, and leave every output as poisoned.
void expect_refused(GpuSparseProblem& dev, Problem& pr, StatusCode code, const std::string& prefix,
                    const std::string& rule) {
  auto expect_message = [&](const Status& s) {
    EXPECT_EQ(s.code(), code) << s.to_string();
    EXPECT_EQ(s.message().rfind(prefix, 0), 0u) << "the message must start with '" << prefix
                                                << "': " << s.message();
    EXPECT_NE(s.message().find(rule), std::string::npos) << s.message();
  };
  expect_message(dev.forward());
  dev.download_forward(&pr);
  EXPECT_TRUE(all_nan(pr.o) && all_nan(pr.lse)) << "a refused forward wrote an output";
  expect_message(dev.backward());
  dev.download_backward(&pr);
  EXPECT_TRUE(all_nan(pr.dq) && all_nan(pr.dk) && all_nan(pr.dv))
      << "a refused backward wrote a gradient";
}

struct BlockSizes {
  int block_m, block_n;
  const char* named;  // the argument the message must name
};

void PrintTo(const BlockSizes& b, std::ostream* os) { *os << b.block_m << "x" << b.block_n; }

class GpuBlockSparseBlockSizes : public GpuTestWithParam<BlockSizes> {};

// A mask of the right shape for the block sizes, so the only rule broken is the CUDA kernels'.
TEST_P(GpuBlockSparseBlockSizes, NotMultiplesOf128AreUnsupportedAndWriteNothing) {
  const BlockSizes bs = GetParam();
  ProblemSpec spec = fixed(1, 300, 260, 2, 2, 64, kBF16);
  spec.seed = test_seed();
  Problem pr = make_problem(spec);
  const HostTensor mask = fill_mask(1, 2, ceil_div(300, bs.block_m), ceil_div(260, bs.block_n),
                                    DType::kUInt8, false, every_block);
  GpuSparseProblem dev(pr, mask, bs.block_m, bs.block_n);
  ASSERT_FALSE(HasFatalFailure());
  expect_refused(dev, pr, StatusCode::kUnsupported, std::string(bs.named) + ":", "multiple of 128");
}

const BlockSizes kBadBlockSizes[] = {
    {64, 128, "block_m"}, {128, 64, "block_n"}, {192, 128, "block_m"}, {128, 200, "block_n"},
    {1, 1, "block_m"},    {100, 256, "block_m"}, {256, 384 + 1, "block_n"},
};

std::string block_sizes_name(const ::testing::TestParamInfo<BlockSizes>& param) {
  return std::to_string(param.param.block_m) + "x" + std::to_string(param.param.block_n);
}

INSTANTIATE_TEST_SUITE_P(Cases, GpuBlockSparseBlockSizes, ::testing::ValuesIn(kBadBlockSizes),
                         block_sizes_name);

TEST(GpuBlockSparse, Float32IsUnsupportedAndWritesNothing) {
  FLARE_SKIP_WITHOUT_CUDA();
  ProblemSpec spec = fixed(1, 256, 256, 2, 2, 64, DType::kFloat32);
  spec.seed = test_seed();
  Problem pr = make_problem(spec);
  const HostTensor mask =
      fill_mask(1, 1, 2, 2, DType::kUInt8, false, every_block);
  GpuSparseProblem dev(pr, mask, 128, 128);
  ASSERT_FALSE(HasFatalFailure());
  expect_refused(dev, pr, StatusCode::kUnsupported, "q:", "float16 or bfloat16");
}

TEST(GpuBlockSparse, AMaskOnTheHostIsRefusedByName) {
  FLARE_SKIP_WITHOUT_CUDA();
  ProblemSpec spec = fixed(1, 256, 256, 2, 2, 64, kBF16);
  spec.seed = test_seed();
  Problem pr = make_problem(spec);
  const HostTensor mask =
      fill_mask(1, 1, 2, 2, DType::kUInt8, false, every_block);
  GpuSparseProblem dev(pr, mask, 128, 128);
  ASSERT_FALSE(HasFatalFailure());
  dev.mask.mask = mask.view;  // the host copy
  expect_refused(dev, pr, StatusCode::kInvalidArgument, "mask:", "must be on q's device");
}

}  // namespace
}  // namespace flare::test
