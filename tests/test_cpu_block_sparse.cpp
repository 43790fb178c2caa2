// test_cpu_block_sparse.cpp — block-sparse attention (flare/block_sparse.h) on the CPU.
//
// The CPU backend (src/cpu/block_sparse_flash.cpp) is checked against the float64 reference,
// which reads the same mask, under the tolerance rule of docs/architecture.md, forward and
// backward, on poisoned outputs: random masks at several densities and block shapes that do not
// divide the lengths, the fixed patterns, combined with causal / window / GQA / softcap / ALiBi /
// dropout, broadcast and strided masks, varlen. Then: rows that see no key, the skip of masked
// blocks (NaN planted in them never arrives; a counter of tiles computed equals the blocks on),
// the pattern helpers, and every rejected argument with nothing written.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/block_sparse_backends.h"
#include "flare/block_sparse.h"
#include "problem_cases.h"
#include "test_util.h"

namespace flare::test {
namespace {

using namespace problem_cases;  // fixed, fill_mask, random_mask, block_sparse_forward, ...

// Runs forward and backward through the public API and checks all outputs against the
// references of the same (masked) problem.
void check_case(const ProblemSpec& spec, const HostTensor& mask, int bm, int bn) {
  SCOPED_TRACE(spec.describe() + " block " + std::to_string(bm) + "x" + std::to_string(bn));
  Problem pr = make_problem(spec);
  const BlockMask m{mask.view, bm, bn};
  Status s = block_sparse_forward(pr, m);
  ASSERT_TRUE(s.ok()) << s.to_string();
  AttentionParams fp;
  s = make_block_sparse_forward_params(pr.q.view, pr.k.view, pr.v.view, pr.o.view, pr.lse.view, m,
                                       pr.options, pr.varlen, &fp);
  ASSERT_TRUE(s.ok()) << s.to_string();
  expect_forward_matches(pr, cpu::reference_forward(fp, cpu::RefPrecision::kFloat64),
                         cpu::reference_forward(fp, cpu::RefPrecision::kLowPrecision));
  s = block_sparse_backward(pr, m);
  ASSERT_TRUE(s.ok()) << s.to_string();
  AttentionParams bp;
  s = make_block_sparse_backward_params(pr.dout.view, pr.q.view, pr.k.view, pr.v.view, pr.o.view,
                                        pr.lse.view, pr.dq.view, pr.dk.view, pr.dv.view, m,
                                        pr.options, pr.varlen, &bp);
  ASSERT_TRUE(s.ok()) << s.to_string();
  expect_gradients_match(pr, bp, cpu::reference_backward(bp, cpu::RefPrecision::kFloat64),
                         naive_backward(bp));
}

// A per-(batch, head) random mask of the spec's shape at `density`.
void check_random(ProblemSpec spec, int bm, int bn, double density, DType mask_dtype = DType::kUInt8) {
  spec.seed ^= test_seed();
  const HostTensor mask = random_mask(spec, bm, bn, density, spec.seed * 31 + 7, mask_dtype);
  check_case(spec, mask, bm, bn);
}

// ---- against the reference ----------------------------------------------------------------------

TEST(CpuBlockSparse, RandomMasksAtSeveralDensities) {
  for (double density : {1.0, 0.5, 0.25, 0.1}) {
    SCOPED_TRACE("density " + std::to_string(density));
    check_random(fixed(2, 97, 130, 4, 4, 40), 16, 32, density);
    check_random(fixed(1, 130, 97, 2, 2, 64, DType::kBFloat16), 32, 16, density);
    check_random(fixed(1, 70, 70, 2, 2, 32, DType::kFloat16), 7, 9, density, DType::kInt32);
  }
}

TEST(CpuBlockSparse, CombinedWithCausalWindowGqaAndScoreModifiers) {
  ProblemSpec causal = fixed(2, 97, 150, 8, 2, 48);  // GQA 4:1, bottom-right causal
  causal.options.causal = true;
  check_random(causal, 16, 16, 0.6);
  ProblemSpec window = fixed(1, 120, 120, 4, 1, 32, DType::kBFloat16);  // MQA
  window.options.window_left = 20;
  window.options.window_right = 5;
  check_random(window, 8, 12, 0.5);
  ProblemSpec mods = fixed(1, 80, 64, 4, 2, 40);
  mods.options.softcap = 5.0f;
  mods.alibi = true;
  mods.options.dropout_p = 0.2f;
  mods.options.dropout_seed = 99;
  check_random(mods, 16, 16, 0.5);
}

TEST(CpuBlockSparse, BlockSizesThatDoNotDivideAndExtremes) {
  check_random(fixed(1, 33, 45, 2, 2, 16), 1, 1, 0.3);        // one element per block
  check_random(fixed(1, 33, 45, 2, 2, 16), 1000, 1000, 1.0);  // one block bigger than it all
  check_random(fixed(1, 1, 77, 2, 2, 16), 64, 10, 0.5);       // a single query row
  check_random(fixed(1, 65, 65, 1, 1, 24), 64, 64, 0.75);     // a ragged last block of 1
}

TEST(CpuBlockSparse, BroadcastAndStridedMasks) {
  const ProblemSpec spec = fixed(2, 64, 96, 4, 2, 32);
  const int bm = 16, bn = 16, rows = 4, cols = 6;
  std::mt19937_64 rng(test_seed());
  const std::vector<std::pair<int, int>> shapes = {{1, 1}, {2, 1}, {1, 4}, {2, 4}};
  for (const auto& [mb, mh] : shapes) {
    SCOPED_TRACE("mask (" + std::to_string(mb) + ", " + std::to_string(mh) + ", ...)");
    const HostTensor mask =
        fill_mask(mb, mh, rows, cols, DType::kUInt8, false, random_blocks(0.5, rng()));
    check_case(spec, mask, bm, bn);
  }
  // A strided view: the even columns of a buffer twice as wide (its odd columns the opposite).
  const HostTensor strided =
      fill_mask(2, 4, rows, cols, DType::kUInt8, true,
                [](int, int h, int r, int c) { return (c + r + h) % 3 != 0; });
  check_case(spec, strided, bm, bn);
}

TEST(CpuBlockSparse, VarlenWithRaggedAndEmptySequences) {
  ProblemSpec spec;
  spec.heads_q = 4;
  spec.heads_kv = 2;
  spec.head_dim = 32;
  spec.varlen_q = {37, 0, 64, 5};
  spec.varlen_k = {50, 12, 33, 0};
  check_random(spec, 16, 8, 0.5);
  spec.options.causal = true;
  check_random(spec, 8, 16, 0.7);
}

TEST(CpuBlockSparse, FixedPatterns) {
  const ProblemSpec spec = fixed(1, 256, 256, 2, 2, 32);
  const int bm = 32, bn = 32, n = 8;
  std::vector<uint8_t> lg, bf;
  ASSERT_TRUE(local_global_block_mask(n, n, 3, 1, &lg).ok());
  ASSERT_TRUE(butterfly_block_mask(n, n, &bf).ok());
  for (auto* m : {&lg, &bf}) {
    HostTensor t = HostTensor::make(DType::kUInt8, {1, 1, n, n});
    std::memcpy(t.bytes.data(), m->data(), m->size());
    check_case(spec, t, bm, bn);
  }
}

// ---- rows that see no key ------------------------------------------------------------------------

TEST(CpuBlockSparse, RowsThatSeeNoKeyGetZeroOutputAndMinusInfLse) {
  ProblemSpec spec = fixed(1, 40, 40, 2, 2, 16);
  spec.seed ^= test_seed();
  // Row block 1 (rows 10..19) of head 0 is off everywhere; head 1 sees all.
  const HostTensor mask = fill_mask(1, 2, 4, 4, DType::kUInt8, false,
                                    [](int, int h, int r, int) { return h == 1 || r != 1; });
  check_case(spec, mask, 10, 10);
  Problem pr = make_problem(spec);
  const BlockMask m{mask.view, 10, 10};
  ASSERT_TRUE(block_sparse_forward(pr, m).ok());
  ASSERT_TRUE(block_sparse_backward(pr, m).ok());
  for (int i = 10; i < 20; ++i) {
    EXPECT_EQ(pr.lse.get({0, 0, i}), -std::numeric_limits<float>::infinity()) << "row " << i;
    EXPECT_TRUE(std::isfinite(pr.lse.get({0, 1, i}))) << "row " << i;
    for (int c = 0; c < 16; ++c) {
      EXPECT_EQ(pr.o.get({0, i, 0, c}), 0.0f) << "row " << i;
      EXPECT_EQ(pr.dq.get({0, i, 0, c}), 0.0f) << "row " << i;
    }
  }
}

// ---- masked blocks are skipped -------------------------------------------------------------------

TEST(CpuBlockSparse, NanInAMaskedBlockNeverReachesAnOutput) {
  ProblemSpec spec = fixed(1, 64, 64, 2, 1, 16);
  spec.seed ^= test_seed();
  // Key block 2 (keys 32..47) is off for every row and head.
  const HostTensor mask =
      fill_mask(1, 1, 4, 4, DType::kUInt8, false, [](int, int, int, int c) { return c != 2; });
  Problem pr = make_problem(spec);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int j = 32; j < 48; ++j)
    for (int c = 0; c < 16; ++c) {
      pr.k.set({0, j, 0, c}, nan);
      pr.v.set({0, j, 0, c}, nan);
    }
  const BlockMask m{mask.view, 16, 16};
  ASSERT_TRUE(block_sparse_forward(pr, m).ok());
  ASSERT_TRUE(block_sparse_backward(pr, m).ok());
  for (double x : pr.read_o()) ASSERT_TRUE(std::isfinite(x));
  for (double x : pr.read_lse()) ASSERT_TRUE(std::isfinite(x));
  for (double x : pr.read_dq()) ASSERT_TRUE(std::isfinite(x));
  for (int j = 0; j < 64; ++j)
    for (int c = 0; c < 16; ++c) {
      const bool masked = j >= 32 && j < 48;
      const float dk = pr.dk.get({0, j, 0, c}), dv = pr.dv.get({0, j, 0, c});
      if (masked) {
        EXPECT_EQ(dk, 0.0f) << "key " << j;
        EXPECT_EQ(dv, 0.0f) << "key " << j;
      } else {
        EXPECT_TRUE(std::isfinite(dk) && std::isfinite(dv)) << "key " << j;
      }
    }
  // And the finite entries are the reference's (which never reads the masked block either).
  AttentionParams fp;
  ASSERT_TRUE(make_block_sparse_forward_params(pr.q.view, pr.k.view, pr.v.view, pr.o.view,
                                               pr.lse.view, m, {}, {}, &fp)
                  .ok());
  expect_forward_matches(pr, cpu::reference_forward(fp, cpu::RefPrecision::kFloat64),
                         cpu::reference_forward(fp, cpu::RefPrecision::kLowPrecision));
}

TEST(CpuBlockSparse, TilesComputedEqualBlocksOn) {
  ProblemSpec spec = fixed(2, 100, 90, 4, 2, 16);
  spec.seed ^= test_seed();
  const int bm = 16, bn = 32;
  const int64_t rows = ceil_div(100, bm), cols = ceil_div(90, bn);
  const HostTensor mask =
      fill_mask(2, 4, rows, cols, DType::kUInt8, false, random_blocks(0.3, spec.seed + 1));
  int64_t on = 0;
  for (int64_t i = 0; i < mask.view.numel(); ++i) on += mask.bytes[static_cast<size_t>(i)] != 0;
  Problem pr = make_problem(spec);
  const BlockMask m{mask.view, bm, bn};
  // The flash backend's entry points, which count the tiles they compute.
  AttentionParams fp, bp;
  ASSERT_TRUE(make_block_sparse_forward_params(pr.q.view, pr.k.view, pr.v.view, pr.o.view,
                                               pr.lse.view, m, pr.options, pr.varlen, &fp)
                  .ok());
  int64_t tiles = -1;
  ASSERT_TRUE(cpu::block_sparse_flash_forward(fp, &tiles).ok());
  EXPECT_EQ(tiles, on);
  ASSERT_TRUE(make_block_sparse_backward_params(pr.dout.view, pr.q.view, pr.k.view, pr.v.view,
                                                pr.o.view, pr.lse.view, pr.dq.view, pr.dk.view,
                                                pr.dv.view, m, pr.options, pr.varlen, &bp)
                  .ok());
  ASSERT_TRUE(cpu::block_sparse_flash_backward(bp, &tiles).ok());
  EXPECT_EQ(tiles, 2 * on) << "the backward visits each block on once for dK/dV and once for dQ";
  // With a causal mask, blocks above the diagonal are skipped too, though on in the mask.
  const HostTensor all = fill_mask(1, 1, rows, cols, DType::kUInt8, false, every_block);
  AttentionOptions causal;
  causal.causal = true;
  ASSERT_TRUE(make_block_sparse_forward_params(pr.q.view, pr.k.view, pr.v.view, pr.o.view,
                                               pr.lse.view, {all.view, bm, bn}, causal, {}, &fp)
                  .ok());
  ASSERT_TRUE(cpu::block_sparse_flash_forward(fp, &tiles).ok());
  int64_t reachable = 0;  // blocks with a key j ≤ i + (90 − 100) for some row i of the block
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      reachable += c * bn <= std::min<int64_t>(100, (r + 1) * bm) - 1 - 10;
  EXPECT_EQ(tiles, 2 * 4 * reachable);
}

// ---- pattern helpers -----------------------------------------------------------------------------

std::string rows_of(const std::vector<uint8_t>& m, int cols) {
  std::string s;
  for (size_t i = 0; i < m.size(); ++i) {
    s += m[i] ? '1' : '.';
    if ((i + 1) % static_cast<size_t>(cols) == 0) s += '/';
  }
  return s;
}

TEST(CpuBlockSparsePatterns, LocalGlobal) {
  std::vector<uint8_t> m;
  ASSERT_TRUE(local_global_block_mask(5, 5, 3, 1, &m).ok());
  EXPECT_EQ(rows_of(m, 5), "11111/111../1111./1.111/1..11/");
  ASSERT_TRUE(local_global_block_mask(4, 4, 1, 0, &m).ok());
  EXPECT_EQ(rows_of(m, 4), "1.../.1../..1./...1/");
  ASSERT_TRUE(local_global_block_mask(4, 4, 2, 0, &m).ok());  // the diagonal and its left
  EXPECT_EQ(rows_of(m, 4), "1.../11../.11./..11/");
  ASSERT_TRUE(local_global_block_mask(2, 5, 0, 2, &m).ok());  // global only, rectangular
  EXPECT_EQ(rows_of(m, 5), "11111/11111/");
  ASSERT_TRUE(local_global_block_mask(3, 2, 0, 0, &m).ok());
  EXPECT_EQ(rows_of(m, 2), "../../../");
  ASSERT_TRUE(local_global_block_mask(0, 3, 1, 1, &m).ok());
  EXPECT_TRUE(m.empty());
}

TEST(CpuBlockSparsePatterns, Butterfly) {
  std::vector<uint8_t> m;
  ASSERT_TRUE(butterfly_block_mask(8, 8, &m).ok());
  EXPECT_EQ(rows_of(m, 8),
            "111.1.../11.1.1../1.11..1./.111...1/1...111./.1..11.1/..1.1.11/...1.111/");
  for (int r = 0; r < 8; ++r) {
    int on = 0;
    for (int c = 0; c < 8; ++c) {
      on += m[r * 8 + c];
      EXPECT_EQ(m[r * 8 + c], m[c * 8 + r]) << "symmetric";
    }
    EXPECT_EQ(on, 4) << "log2(8) + 1 blocks in row " << r;
  }
  ASSERT_TRUE(butterfly_block_mask(2, 3, &m).ok());
  EXPECT_EQ(rows_of(m, 3), "111/11./");
}

TEST(CpuBlockSparsePatterns, BadArgumentsAreNamedAndLeaveTheOutputAlone) {
  std::vector<uint8_t> m = {42};
  Status s = local_global_block_mask(-1, 4, 1, 0, &m);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("row_blocks"), std::string::npos) << s.message();
  s = local_global_block_mask(4, -2, 1, 0, &m);
  EXPECT_NE(s.message().find("col_blocks"), std::string::npos) << s.message();
  s = local_global_block_mask(4, 4, -1, 0, &m);
  EXPECT_NE(s.message().find("band"), std::string::npos) << s.message();
  s = local_global_block_mask(4, 4, 1, -1, &m);
  EXPECT_NE(s.message().find("global"), std::string::npos) << s.message();
  s = butterfly_block_mask(1 << 20, 1 << 20, &m);
  EXPECT_NE(s.message().find("2^31"), std::string::npos) << s.message();
  EXPECT_EQ(m, std::vector<uint8_t>{42});
  s = butterfly_block_mask(2, 2, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
}

// ---- rejected calls ------------------------------------------------------------------------------

// Forward and backward both reject `m`, with a message containing `needle`, writing nothing.
void expect_rejected(Problem& pr, const BlockMask& m, const std::string& needle,
                     StatusCode code = StatusCode::kInvalidArgument) {
  SCOPED_TRACE(needle);
  Status s = block_sparse_forward(pr, m);
  EXPECT_EQ(s.code(), code) << s.to_string();
  EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
  EXPECT_TRUE(all_nan(pr.o) && all_nan(pr.lse)) << "a rejected forward wrote an output";
  s = block_sparse_backward(pr, m);
  EXPECT_EQ(s.code(), code) << s.to_string();
  EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
  EXPECT_TRUE(all_nan(pr.dq) && all_nan(pr.dk) && all_nan(pr.dv))
      << "a rejected backward wrote a gradient";
}

TEST(CpuBlockSparseValidation, BadMasksAreNamedAndNothingIsWritten) {
  Problem pr = make_problem(fixed(2, 40, 50, 4, 2, 16));
  const HostTensor good =
      fill_mask(2, 4, 3, 4, DType::kUInt8, false, every_block);  // blocks 16 × 16
  expect_rejected(pr, {TensorView{}, 16, 16}, "mask: tensor is required");
  HostTensor rank3 = HostTensor::make(DType::kUInt8, {4, 3, 4});
  expect_rejected(pr, {rank3.view, 16, 16}, "mask: expected 4 dimensions");
  const HostTensor fp = fill_mask(2, 4, 3, 4, DType::kFloat32, false, every_block);
  expect_rejected(pr, {fp.view, 16, 16}, "mask: dtype must be uint8 or int32, got float32");
  expect_rejected(pr, {good.view, 0, 16}, "block_m: must be >= 1, got 0");
  expect_rejected(pr, {good.view, 16, -3}, "block_n: must be >= 1, got -3");
  expect_rejected(pr, {good.view, 8, 16}, "ceil(seqlen_q / block_m) = ceil(40 / 8) = 5");
  expect_rejected(pr, {good.view, 16, 8}, "ceil(seqlen_k / block_n) = ceil(50 / 8) = 7");
  const HostTensor batch3 = fill_mask(3, 4, 3, 4, DType::kUInt8, false, every_block);
  expect_rejected(pr, {batch3.view, 16, 16}, "batch = 2 or 1");
  const HostTensor heads2 =
      fill_mask(2, 2, 3, 4, DType::kUInt8, false, every_block);  // h_kv, not h_q
  expect_rejected(pr, {heads2.view, 16, 16}, "heads_q = 4 or 1");
  HostTensor negative = good;
  negative.view.data = negative.bytes.data();
  negative.view.stride[3] = -1;
  expect_rejected(pr, {negative.view, 16, 16}, "mask: stride[3] = -1 is negative");
  HostTensor null_data = good;
  null_data.view.data = nullptr;
  expect_rejected(pr, {null_data.view, 16, 16}, "mask: data pointer is null");
  HostTensor on_gpu = good;
  on_gpu.view.data = on_gpu.bytes.data();
  on_gpu.view.device = DeviceType::kCUDA;
  expect_rejected(pr, {on_gpu.view, 16, 16}, "mask: must be on q's device");
  // A mask living inside an output: the output is written while the mask is read.
  TensorView in_o = good.view;
  in_o.data = pr.o.bytes.data();
  in_o.dtype = DType::kUInt8;
  Status s = block_sparse_attention_forward(pr.q.view, pr.k.view, pr.v.view, pr.o.view,
                                            pr.lse.view, {in_o, 16, 16});
  EXPECT_NE(s.message().find("o: shares memory with the input mask"), std::string::npos)
      << s.message();
  // The dense arguments are still checked first, by the same code as attention_forward.
  HostTensor bad_lse = HostTensor::make(DType::kFloat32, {2, 4, 41});
  bad_lse.poison();
  s = block_sparse_attention_forward(pr.q.view, pr.k.view, pr.v.view, pr.o.view, bad_lse.view,
                                     {good.view, 16, 16});
  EXPECT_NE(s.message().find("lse: shape"), std::string::npos) << s.message();
  EXPECT_TRUE(all_nan(pr.o));
}

TEST(CpuBlockSparseValidation, CudaTensorsNeedWholeTileBlocks) {
  Problem pr = make_problem(fixed(1, 16, 16, 1, 1, 16));
  HostTensor mask = fill_mask(1, 1, 1, 1, DType::kUInt8, false, every_block);
  // Views that claim the GPU: validation reads no CUDA memory, and 16-row blocks are refused
  // (the CUDA kernels skip whole tiles: multiples of 128) before any backend runs, so host
  // pointers are safe here.
  for (HostTensor* t : {&pr.q, &pr.k, &pr.v, &pr.o, &pr.lse, &pr.dout, &pr.dq, &pr.dk, &pr.dv, &mask})
    t->view.device = DeviceType::kCUDA;
  expect_rejected(pr, {mask.view, 16, 16}, "block_m: the CUDA kernels take mask blocks of a "
                  "multiple of 128", StatusCode::kUnsupported);
}

}  // namespace
}  // namespace flare::test
