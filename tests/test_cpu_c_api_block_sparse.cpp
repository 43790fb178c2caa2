// test_cpu_c_api_block_sparse.cpp — the C mirror of block-sparse attention (flare/c_api.h,
// "block-sparse attention"): forward and backward through the C ABI must write exactly the bytes
// the C++ entry points write on the same inputs, for every option and mask form; a rejected call
// must come back as a code plus a message naming the argument, with no output written; the
// pattern helpers must write the C++ helpers' masks into the caller's buffer, or nothing.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "flare/block_sparse.h"
#include "flare/c_api.h"
#include "problem_cases.h"
#include "test_c_api_util.h"
#include "test_util.h"

extern "C" int flare_c_block_sparse(void* q, void* k, void* v, void* o, void* lse, void* dout,
                                    void* dq, void* dk, void* dv, void* mask,
                                    const int64_t* q_shape, const int64_t* k_shape,
                                    const int64_t* mask_shape, int32_t block_m, int32_t block_n,
                                    int32_t causal);

namespace flare::test {
namespace {

using namespace problem_cases;  // fixed, with_run_seed, fill_mask, random_mask, ...

static_assert(FLARE_UINT8 == static_cast<int>(DType::kUInt8));

flare_block_mask c_mask(const BlockMask& m) { return {to_c(m.mask), m.block_m, m.block_n}; }

// The spec's full random mask, drawn from its seed.
HostTensor mask_for(const ProblemSpec& spec, int bm, int bn, DType dtype, double density) {
  return random_mask(spec, bm, bn, density, spec.seed + 17, dtype);
}

// A C call of block-sparse attention: the dense call's arguments (test_c_api_util.h) and a mask.
struct CSparseCall : CCall {
  flare_block_mask mask;

  CSparseCall(const Problem& pr, const BlockMask& m) : CCall(pr), mask(c_mask(m)) {}

  int forward(const flare_block_mask* m) const {
    return flare_block_sparse_attention_forward(&q, &k, &v, &o, &lse, m, &options, varlen_arg(),
                                                nullptr);
  }
  int backward(const flare_block_mask* m) const {
    return flare_block_sparse_attention_backward(&dout, &q, &k, &v, &o, &lse, &dq, &dk, &dv, m,
                                                 &options, varlen_arg(), nullptr);
  }
  int forward() const { return forward(&mask); }
  int backward() const { return backward(&mask); }
};

// Forward and backward through both APIs on two copies of the same inputs: equal bytes.
void expect_c_equals_cpp(const ProblemSpec& spec, const TensorView& mask, int bm, int bn) {
  SCOPED_TRACE(spec.describe() + " block " + std::to_string(bm) + "x" + std::to_string(bn));
  Problem via_cpp = make_problem(spec), via_c = make_problem(spec);
  const BlockMask m{mask, bm, bn};
  Status s = block_sparse_forward(via_cpp, m);
  ASSERT_TRUE(s.ok()) << s.to_string();
  s = block_sparse_backward(via_cpp, m);
  ASSERT_TRUE(s.ok()) << s.to_string();
  const CSparseCall c(via_c, m);
  ASSERT_EQ(c.forward(), FLARE_OK) << flare_last_error();
  ASSERT_EQ(c.backward(), FLARE_OK) << flare_last_error();
  EXPECT_EQ(via_c.o.bytes, via_cpp.o.bytes);
  EXPECT_EQ(via_c.lse.bytes, via_cpp.lse.bytes);
  EXPECT_EQ(via_c.dq.bytes, via_cpp.dq.bytes);
  EXPECT_EQ(via_c.dk.bytes, via_cpp.dk.bytes);
  EXPECT_EQ(via_c.dv.bytes, via_cpp.dv.bytes);
}

// The same with the spec's full random mask.
void expect_c_equals_cpp(const ProblemSpec& spec, int bm, int bn, DType mask_dtype,
                         double density) {
  const HostTensor mask = mask_for(spec, bm, bn, mask_dtype, density);
  expect_c_equals_cpp(spec, mask.view, bm, bn);
}

// ---- the same bytes as the C++ API ------------------------------------------------------------

TEST(CApiBlockSparse, FromCEqualsCpp) {
  // The C99 caller (c_api_from_c.c): uint8 mask, float32, causal, bottom-right with s_q < s_k.
  constexpr int64_t b = 2, sq = 37, sk = 50, hq = 4, hkv = 2, d = 16, bm = 8, bn = 16;
  const int64_t q_shape[4] = {b, sq, hq, d}, k_shape[4] = {b, sk, hkv, d};
  const int64_t mask_shape[4] = {b, hq, ceil_div(sq, bm), ceil_div(sk, bn)};
  ProblemSpec spec = with_run_seed(fixed(b, sq, sk, hq, hkv, d));
  spec.options.causal = true;
  Problem via_cpp = make_problem(spec), via_c = make_problem(spec);
  HostTensor mask = fill_mask(mask_shape[0], mask_shape[1], mask_shape[2], mask_shape[3],
                              DType::kUInt8, false, random_blocks(0.5, spec.seed + 1));
  const BlockMask m{mask.view, bm, bn};
  ASSERT_TRUE(block_sparse_forward(via_cpp, m).ok());
  ASSERT_TRUE(block_sparse_backward(via_cpp, m).ok());
  ASSERT_EQ(flare_c_block_sparse(via_c.q.view.data, via_c.k.view.data, via_c.v.view.data,
                                 via_c.o.view.data, via_c.lse.view.data, via_c.dout.view.data,
                                 via_c.dq.view.data, via_c.dk.view.data, via_c.dv.view.data,
                                 mask.view.data, q_shape, k_shape, mask_shape, bm, bn, 1),
            FLARE_OK)
      << flare_last_error();
  EXPECT_EQ(via_c.o.bytes, via_cpp.o.bytes);
  EXPECT_EQ(via_c.lse.bytes, via_cpp.lse.bytes);
  EXPECT_EQ(via_c.dq.bytes, via_cpp.dq.bytes);
  EXPECT_EQ(via_c.dk.bytes, via_cpp.dk.bytes);
  EXPECT_EQ(via_c.dv.bytes, via_cpp.dv.bytes);
}

TEST(CApiBlockSparse, EveryOptionAndBackendGivesTheCppBytes) {
  for (Backend backend : {Backend::kAuto, Backend::kReference}) {
    SCOPED_TRACE(backend == Backend::kAuto ? "auto" : "reference");
    ProblemSpec plain = with_run_seed(fixed(2, 97, 130, 4, 4, 40));
    plain.options.backend = backend;
    expect_c_equals_cpp(plain, 16, 32, DType::kUInt8, 0.5);
    ProblemSpec mods = with_run_seed(fixed(1, 80, 64, 8, 2, 24, DType::kBFloat16));  // GQA 4:1
    mods.options.backend = backend;
    mods.options.causal = true;
    mods.options.softcap = 5.0f;
    mods.options.softmax_scale = 0.3f;
    mods.alibi = true;
    mods.options.dropout_p = 0.2f;
    mods.options.dropout_seed = 99;
    mods.options.dropout_offset = 5;
    expect_c_equals_cpp(mods, 16, 16, DType::kInt32, 0.6);
    ProblemSpec window = with_run_seed(fixed(1, 70, 70, 2, 1, 32, DType::kFloat16));
    window.options.backend = backend;
    window.options.window_left = 20;
    window.options.window_right = 3;
    window.options.deterministic = true;
    expect_c_equals_cpp(window, 7, 9, DType::kUInt8, 0.5);
  }
}

TEST(CApiBlockSparse, VarlenBroadcastAndStridedMasks) {
  const ProblemSpec packed = with_run_seed(varlen({37, 0, 64, 5}, {50, 12, 33, 0}, 4, 2, 16));
  expect_c_equals_cpp(packed, 16, 8, DType::kUInt8, 0.5);
  // Shared over batch and heads: the (1, 1, rows, cols) corner of a full mask.
  const ProblemSpec spec = with_run_seed(fixed(2, 64, 96, 4, 2, 32));
  HostTensor full = mask_for(spec, 16, 16, DType::kUInt8, 0.5);
  TensorView shared = full.view;
  shared.shape[0] = shared.shape[1] = 1;
  expect_c_equals_cpp(spec, shared, 16, 16);
  // Every other column of a mask at 16 × 16 (6 columns) read as the 3 columns of 16 × 32.
  full = mask_for(spec, 16, 16, DType::kInt32, 0.5);
  TensorView strided = full.view;
  strided.shape[3] = 3;
  strided.stride[3] = 2;
  expect_c_equals_cpp(spec, strided, 16, 32);
}

// ---- rejected calls ------------------------------------------------------------------------------

struct Rejection {
  std::string needle;
  int code = FLARE_INVALID_ARGUMENT;
};

// Forward and backward both reject, naming `r.needle`, with every output left as it was.
void expect_rejected(Problem& pr, const CSparseCall& c, const flare_block_mask* m,
                     const Rejection& r) {
  SCOPED_TRACE(r.needle);
  for (HostTensor* out : {&pr.o, &pr.lse, &pr.dq, &pr.dk, &pr.dv}) fill_with_sentinel(out);
  EXPECT_EQ(c.forward(m), r.code) << flare_last_error();
  EXPECT_NE(std::string(flare_last_error()).find(r.needle), std::string::npos)
      << flare_last_error();
  EXPECT_EQ(c.backward(m), r.code) << flare_last_error();
  EXPECT_NE(std::string(flare_last_error()).find(r.needle), std::string::npos)
      << flare_last_error();
  for (const HostTensor* out : {&pr.o, &pr.lse, &pr.dq, &pr.dk, &pr.dv})
    EXPECT_TRUE(holds_only_sentinel(*out)) << "a rejected call wrote an output";
}

TEST(CApiBlockSparseValidation, EveryRejectionIsNamedAndWritesNothing) {
  Problem pr = make_problem(with_run_seed(fixed(2, 40, 50, 4, 2, 16)));
  // Blocks 16 × 16.
  HostTensor good = fill_mask(2, 4, 3, 4, DType::kUInt8, false, random_blocks(0.5, 3));
  const BlockMask m{good.view, 16, 16};
  const CSparseCall c(pr, m);
  const flare_block_mask base = c.mask;
  // The unbroken call runs, so each rejection below is its one change's.
  ASSERT_EQ(c.forward(), FLARE_OK) << flare_last_error();
  ASSERT_EQ(c.backward(), FLARE_OK) << flare_last_error();

  expect_rejected(pr, c, nullptr, {"mask: block mask arguments are required"});
  auto with = [&](const std::function<void(flare_block_mask*)>& change) {
    flare_block_mask bad = base;
    change(&bad);
    return bad;
  };
  flare_block_mask bad = with([](flare_block_mask* b) { b->mask.ndim = 9; });
  expect_rejected(pr, c, &bad, {"mask: ndim = 9 must be in [0, 4]"});
  bad = with([](flare_block_mask* b) { b->mask = flare_tensor{}; });
  expect_rejected(pr, c, &bad, {"mask: tensor is required"});
  bad = with([](flare_block_mask* b) { b->mask.ndim = 3; });
  expect_rejected(pr, c, &bad, {"mask: expected 4 dimensions"});
  bad = with([](flare_block_mask* b) { b->mask.dtype = FLARE_FLOAT32; });
  expect_rejected(pr, c, &bad, {"mask: dtype must be uint8 or int32, got float32"});
  bad = with([](flare_block_mask* b) { b->mask.dtype = 77; });
  expect_rejected(pr, c, &bad, {"mask: dtype"});
  bad = with([](flare_block_mask* b) { b->block_m = 0; });
  expect_rejected(pr, c, &bad, {"block_m: must be >= 1, got 0"});
  bad = with([](flare_block_mask* b) { b->block_n = -3; });
  expect_rejected(pr, c, &bad, {"block_n: must be >= 1, got -3"});
  bad = with([](flare_block_mask* b) { b->block_m = 8; });
  expect_rejected(pr, c, &bad, {"ceil(seqlen_q / block_m) = ceil(40 / 8) = 5"});
  bad = with([](flare_block_mask* b) { b->mask.shape[1] = 2; });
  expect_rejected(pr, c, &bad, {"heads_q = 4 or 1"});
  bad = with([](flare_block_mask* b) { b->mask.stride[3] = -1; });
  expect_rejected(pr, c, &bad, {"mask: stride[3] = -1 is negative"});
  bad = with([](flare_block_mask* b) { b->mask.data = nullptr; });
  expect_rejected(pr, c, &bad, {"mask: data pointer is null"});
  bad = with([](flare_block_mask* b) { b->mask.device = FLARE_CUDA; });
  expect_rejected(pr, c, &bad, {"mask: must be on q's device"});

  // The dense arguments keep the dense checks and names, the C ABI's rank check included.
  CSparseCall dense = c;
  dense.lse.shape[2] = 41;
  expect_rejected(pr, dense, &base, {"lse: shape"});
  dense = c;
  dense.varlen.cu_seqlens_q.ndim = 7;
  dense.is_varlen = true;
  expect_rejected(pr, dense, &base, {"cu_seqlens_q: ndim = 7"});
  dense = c;
  dense.options.alibi_slopes.ndim = -1;
  expect_rejected(pr, dense, &base, {"alibi_slopes: ndim = -1"});

  // CUDA tensors with 16-row blocks: refused by name before any backend runs (no device memory
  // is read); the CUDA kernels take multiples of 128.
  CSparseCall cuda = c;
  for (flare_tensor* t : {&cuda.q, &cuda.k, &cuda.v, &cuda.o, &cuda.lse, &cuda.dout, &cuda.dq,
                          &cuda.dk, &cuda.dv})
    t->device = FLARE_CUDA;
  cuda.mask.mask.device = FLARE_CUDA;
  expect_rejected(pr, cuda, &cuda.mask,
                  {"block_m: the CUDA kernels take mask blocks", FLARE_UNSUPPORTED});
}

TEST(CApiBlockSparseValidation, AMaskInsideAnOutputIsRefused) {
  Problem pr = make_problem(with_run_seed(fixed(1, 16, 16, 1, 1, 16)));
  HostTensor mask = fill_mask(1, 1, 1, 1, DType::kUInt8, false, random_blocks(1.0, 1));
  const CSparseCall c(pr, {mask.view, 16, 16});
  flare_block_mask in_o = c.mask;
  in_o.mask.data = pr.o.bytes.data();
  EXPECT_EQ(c.forward(&in_o), FLARE_INVALID_ARGUMENT);
  EXPECT_NE(std::string(flare_last_error()).find("o: shares memory with the input mask"),
            std::string::npos)
      << flare_last_error();
  flare_block_mask in_dk = c.mask;
  in_dk.mask.data = pr.dk.bytes.data();
  EXPECT_EQ(c.backward(&in_dk), FLARE_INVALID_ARGUMENT);
  EXPECT_NE(std::string(flare_last_error()).find("dk: shares memory with the input mask"),
            std::string::npos)
      << flare_last_error();
}

// ---- pattern helpers -----------------------------------------------------------------------------

TEST(CApiBlockSparsePatterns, WriteTheCppMasks) {
  for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{5, 5}, {3, 7}, {8, 2}}) {
    std::vector<uint8_t> expected, got(static_cast<size_t>(rows * cols) + 1, 42);
    ASSERT_TRUE(local_global_block_mask(rows, cols, 3, 1, &expected).ok());
    ASSERT_EQ(flare_local_global_block_mask(rows, cols, 3, 1, got.data(), rows * cols + 1),
              FLARE_OK)
        << flare_last_error();
    EXPECT_EQ(std::vector<uint8_t>(got.begin(), got.end() - 1), expected);
    EXPECT_EQ(got.back(), 42) << "a byte past the mask was written";
    ASSERT_TRUE(butterfly_block_mask(rows, cols, &expected).ok());
    ASSERT_EQ(flare_butterfly_block_mask(rows, cols, got.data(), rows * cols), FLARE_OK)
        << flare_last_error();
    EXPECT_EQ(std::vector<uint8_t>(got.begin(), got.end() - 1), expected);
  }
  // No blocks: nothing to write, so no buffer is needed.
  EXPECT_EQ(flare_butterfly_block_mask(0, 4, nullptr, 0), FLARE_OK) << flare_last_error();
}

TEST(CApiBlockSparsePatterns, RejectionsAreNamedAndLeaveTheBuffer) {
  std::vector<uint8_t> buf(16, 42);
  const std::vector<uint8_t> before = buf;
  auto expect = [&](int code, const std::string& needle) {
    EXPECT_EQ(code, FLARE_INVALID_ARGUMENT) << needle;
    EXPECT_NE(std::string(flare_last_error()).find(needle), std::string::npos)
        << flare_last_error();
    EXPECT_EQ(buf, before) << needle;
  };
  expect(flare_local_global_block_mask(4, 5, 1, 0, buf.data(), 16),
         "capacity: 16 bytes cannot hold the 20 blocks of the mask");
  expect(flare_butterfly_block_mask(2, 2, buf.data(), -1), "capacity: must be >= 0 bytes, got -1");
  expect(flare_butterfly_block_mask(2, 2, nullptr, 16), "mask: output pointer is null");
  expect(flare_local_global_block_mask(-1, 4, 1, 0, buf.data(), 16), "row_blocks: must be >= 0");
  expect(flare_local_global_block_mask(4, -2, 1, 0, buf.data(), 16), "col_blocks: must be >= 0");
  expect(flare_local_global_block_mask(4, 4, -1, 0, buf.data(), 16), "band: must be >= 0");
  expect(flare_local_global_block_mask(4, 4, 1, -1, buf.data(), 16), "global: must be >= 0");
  const int64_t huge = std::numeric_limits<int64_t>::max() / 2;
  expect(flare_butterfly_block_mask(huge, huge, buf.data(), 16), "exceeds 2^31 blocks");
  // The sizes' rules come before the buffer's: a caller without one still learns what is wrong.
  expect(flare_butterfly_block_mask(1 << 20, 1 << 20, nullptr, 0), "exceeds 2^31 blocks");
  expect(flare_local_global_block_mask(-3, 4, 1, 0, nullptr, 0), "row_blocks: must be >= 0");
}

}  // namespace
}  // namespace flare::test
