// test_cpu_c_api.cpp — the extern "C" API: it must compute exactly what the C++ API computes,
// report a rejected call as a status code plus a per-thread message naming the argument, and
// write nothing when it rejects. c_api_from_c.c, compiled as C, drives one forward from C.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "flare/c_api.h"
#include "test_c_api_util.h"
#include "test_util.h"

extern "C" int flare_c_forward(void* q, void* k, void* v, void* o, void* lse,
                               const int64_t* q_shape, const int64_t* k_shape, int32_t causal,
                               int32_t backend);

namespace flare::test {
namespace {

using test::to_c;  // test_c_api_util.h's, for tensors, options and varlen arguments

// The C enums are the C++ enums by value; bindings rely on it.
static_assert(FLARE_OK == static_cast<int>(StatusCode::kOk));
static_assert(FLARE_INVALID_ARGUMENT == static_cast<int>(StatusCode::kInvalidArgument));
static_assert(FLARE_UNSUPPORTED == static_cast<int>(StatusCode::kUnsupported));
static_assert(FLARE_DEVICE_ERROR == static_cast<int>(StatusCode::kDeviceError));
static_assert(FLARE_OUT_OF_MEMORY == static_cast<int>(StatusCode::kOutOfMemory));
static_assert(FLARE_INTERNAL == static_cast<int>(StatusCode::kInternal));
static_assert(FLARE_FLOAT32 == static_cast<int>(DType::kFloat32));
static_assert(FLARE_FLOAT16 == static_cast<int>(DType::kFloat16));
static_assert(FLARE_BFLOAT16 == static_cast<int>(DType::kBFloat16));
static_assert(FLARE_INT32 == static_cast<int>(DType::kInt32));
static_assert(FLARE_CPU == static_cast<int>(DeviceType::kCPU));
static_assert(FLARE_CUDA == static_cast<int>(DeviceType::kCUDA));
static_assert(FLARE_BACKEND_AUTO == static_cast<int>(Backend::kAuto));
static_assert(FLARE_BACKEND_REFERENCE == static_cast<int>(Backend::kReference));
static_assert(FLARE_BACKEND_FLASH == static_cast<int>(Backend::kFlash));
static_assert(kMaxDims == 4, "flare_tensor holds 4 dimensions");

std::vector<const HostTensor*> outputs(const Problem& pr) {
  return {&pr.o, &pr.lse, &pr.dq, &pr.dk, &pr.dv};
}
const char* const kOutputNames[] = {"o", "lse", "dq", "dk", "dv"};

void fill_sentinel(Problem& pr) {
  for (HostTensor* t : {&pr.o, &pr.lse, &pr.dq, &pr.dk, &pr.dv}) fill_with_sentinel(t);
}

::testing::AssertionResult outputs_untouched(const Problem& pr) {
  const std::vector<const HostTensor*> outs = outputs(pr);
  for (size_t i = 0; i < outs.size(); ++i) {
    if (!holds_only_sentinel(*outs[i]))
      return ::testing::AssertionFailure() << kOutputNames[i] << " was written by a rejected call";
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult same_outputs(const Problem& a, const Problem& b) {
  const std::vector<const HostTensor*> oa = outputs(a), ob = outputs(b);
  for (size_t i = 0; i < oa.size(); ++i) {
    if (oa[i]->bytes != ob[i]->bytes)
      return ::testing::AssertionFailure() << kOutputNames[i] << " differs between C and C++ API";
  }
  return ::testing::AssertionSuccess();
}

void expect_last_error(const std::string& arg, const std::string& rule) {
  const std::string msg = flare_last_error();
  EXPECT_EQ(msg.rfind(arg + ":", 0), 0u) << msg;
  EXPECT_NE(msg.find(rule), std::string::npos) << msg;
}

std::vector<ProblemSpec> specs() {
  std::vector<ProblemSpec> out;
  ProblemSpec s;
  s.batch = 2;
  s.seqlen_q = 9;
  s.seqlen_k = 13;
  s.heads_q = 4;
  s.heads_kv = 2;
  s.head_dim = 24;
  s.seed = test_seed();
  s.options.causal = true;
  s.options.softcap = 5.0f;
  out.push_back(s);
  ProblemSpec h = s;  // fp16, padded rows, per-batch ALiBi, sliding window
  h.dtype = DType::kFloat16;
  h.pad = 5;
  h.alibi = true;
  h.alibi_per_batch = true;
  h.options.causal = false;
  h.options.softcap = 0.0f;
  h.options.window_left = 4;
  h.options.window_right = 2;
  h.options.softmax_scale = 0.3f;
  out.push_back(h);
  ProblemSpec p = s;  // varlen with an empty sequence, ALiBi per head
  p.varlen_q = {4, 0, 7};
  p.varlen_k = {6, 3, 0};
  p.alibi = true;
  out.push_back(p);
  return out;
}

TEST(CApi, ForwardBackwardMatchCppApiByteForByte) {
  for (Backend backend : {Backend::kReference, Backend::kAuto}) {
    for (ProblemSpec spec : specs()) {
      spec.options.backend = backend;
      SCOPED_TRACE(spec.describe() + " backend=" + std::to_string(static_cast<int>(backend)));
      Problem cpp = make_problem(spec);
      Problem c = make_problem(spec);  // same seed: same inputs, same poisoned outputs
      Status s = attention_forward(cpp.q.view, cpp.k.view, cpp.v.view, cpp.o.view, cpp.lse.view,
                                   cpp.options, cpp.varlen);
      ASSERT_TRUE(s.ok()) << s.to_string();
      s = attention_backward(cpp.dout.view, cpp.q.view, cpp.k.view, cpp.v.view, cpp.o.view,
                             cpp.lse.view, cpp.dq.view, cpp.dk.view, cpp.dv.view, cpp.options,
                             cpp.varlen);
      ASSERT_TRUE(s.ok()) << s.to_string();
      const CCall call(c);
      ASSERT_EQ(call.forward(), FLARE_OK) << flare_last_error();
      ASSERT_EQ(call.backward(), FLARE_OK) << flare_last_error();
      EXPECT_TRUE(same_outputs(cpp, c));
    }
  }
}

TEST(CApi, NullOptionsAndVarlenMeanDefaults) {
  ProblemSpec spec = specs()[0];
  spec.options = AttentionOptions{};
  Problem cpp = make_problem(spec);
  Problem c = make_problem(spec);
  ASSERT_TRUE(attention_forward(cpp.q.view, cpp.k.view, cpp.v.view, cpp.o.view, cpp.lse.view).ok());
  ASSERT_TRUE(attention_backward(cpp.dout.view, cpp.q.view, cpp.k.view, cpp.v.view, cpp.o.view,
                                 cpp.lse.view, cpp.dq.view, cpp.dk.view, cpp.dv.view)
                  .ok());
  const CCall call(c);
  ASSERT_EQ(flare_attention_forward(&call.q, &call.k, &call.v, &call.o, &call.lse, nullptr, nullptr,
                                    nullptr),
            FLARE_OK)
      << flare_last_error();
  ASSERT_EQ(flare_attention_backward(&call.dout, &call.q, &call.k, &call.v, &call.o, &call.lse,
                                     &call.dq, &call.dk, &call.dv, nullptr, nullptr, nullptr),
            FLARE_OK)
      << flare_last_error();
  EXPECT_TRUE(same_outputs(cpp, c));
}

TEST(CApi, DefaultOptionsMatchCpp) {
  const flare_attention_options c = flare_default_options();
  const AttentionOptions cpp;
  EXPECT_EQ(c.window_left, -1);
  EXPECT_EQ(c.window_right, -1);
  EXPECT_EQ(c.window_left, cpp.window_left);
  EXPECT_EQ(c.window_right, cpp.window_right);
  EXPECT_EQ(c.softmax_scale, cpp.softmax_scale);
  EXPECT_EQ(c.causal, 0);
  EXPECT_EQ(c.softcap, cpp.softcap);
  EXPECT_EQ(c.alibi_slopes.data, nullptr);
  EXPECT_EQ(c.alibi_slopes.ndim, 0);
  EXPECT_EQ(c.dropout_p, cpp.dropout_p);
  EXPECT_EQ(c.dropout_seed, cpp.dropout_seed);
  EXPECT_EQ(c.dropout_offset, cpp.dropout_offset);
  EXPECT_EQ(c.deterministic, 0);
  EXPECT_EQ(c.backend, FLARE_BACKEND_AUTO);
}

TEST(CApi, RejectedCallReportsCodeArgumentAndWritesNothing) {
  ProblemSpec spec = specs()[0];
  spec.heads_kv = 3;
  Problem pr = make_problem(spec);
  fill_sentinel(pr);
  const CCall call(pr);
  EXPECT_EQ(call.forward(), FLARE_INVALID_ARGUMENT);
  expect_last_error("k", "must divide q's heads = 4");
  EXPECT_EQ(call.backward(), FLARE_INVALID_ARGUMENT);
  expect_last_error("k", "must divide q's heads = 4");
  EXPECT_TRUE(outputs_untouched(pr));

  Problem good = make_problem(specs()[0]);
  fill_sentinel(good);
  CCall bad_dv(good);
  bad_dv.dv.dtype = FLARE_BFLOAT16;
  EXPECT_EQ(bad_dv.backward(), FLARE_INVALID_ARGUMENT);
  expect_last_error("dv", "dtype bfloat16 differs from q's dtype float32");
  EXPECT_TRUE(outputs_untouched(good));
}

TEST(CApi, AliasedOutputsRejected) {
  // The fuzzed cases: dq sharing dk's memory, dv sharing dout's, lse placed inside o. Each is
  // refused by name and nothing is written.
  Problem pr = make_problem(specs()[0]);
  fill_sentinel(pr);
  CCall dq_dk(pr);
  dq_dk.dk.data = dq_dk.dq.data;
  EXPECT_EQ(dq_dk.backward(), FLARE_INVALID_ARGUMENT);
  expect_last_error("dk", "shares memory with dq");
  CCall dv_dout(pr);
  dv_dout.dv.data = dv_dout.dout.data;
  EXPECT_EQ(dv_dout.backward(), FLARE_INVALID_ARGUMENT);
  expect_last_error("dv", "shares memory with the input dout");
  CCall lse_in_o(pr);
  lse_in_o.lse.data = lse_in_o.o.data;
  EXPECT_EQ(lse_in_o.forward(), FLARE_INVALID_ARGUMENT);
  expect_last_error("lse", "shares memory with o");
  EXPECT_TRUE(outputs_untouched(pr));
}

TEST(CApi, NdimOutOfRangeRejected) {
  Problem pr = make_problem(specs()[2]);  // varlen with ALiBi: every tensor argument is present
  fill_sentinel(pr);
  const std::vector<std::pair<std::string, flare_tensor CCall::*>> tensors = {
      {"dout", &CCall::dout}, {"q", &CCall::q},   {"k", &CCall::k},
      {"v", &CCall::v},       {"o", &CCall::o},   {"lse", &CCall::lse},
      {"dq", &CCall::dq},     {"dk", &CCall::dk}, {"dv", &CCall::dv}};
  for (int ndim : {5, 64, -1}) {
    for (const auto& [name, member] : tensors) {
      SCOPED_TRACE(name + " ndim=" + std::to_string(ndim));
      CCall call(pr);
      (call.*member).ndim = ndim;
      const std::string rule = "ndim = " + std::to_string(ndim) + " must be in [0, 4]";
      if (name != "dout" && name != "dq" && name != "dk" && name != "dv") {
        EXPECT_EQ(call.forward(), FLARE_INVALID_ARGUMENT);
        expect_last_error(name, rule);
      }
      EXPECT_EQ(call.backward(), FLARE_INVALID_ARGUMENT);
      expect_last_error(name, rule);
    }
    SCOPED_TRACE("ndim=" + std::to_string(ndim));
    CCall call(pr);
    call.options.alibi_slopes.ndim = ndim;
    EXPECT_EQ(call.forward(), FLARE_INVALID_ARGUMENT);
    expect_last_error("alibi_slopes", "must be in [0, 4]");
    call = CCall(pr);
    call.varlen.cu_seqlens_q.ndim = ndim;
    EXPECT_EQ(call.forward(), FLARE_INVALID_ARGUMENT);
    expect_last_error("cu_seqlens_q", "must be in [0, 4]");
    call = CCall(pr);
    call.varlen.cu_seqlens_k.ndim = ndim;
    EXPECT_EQ(call.backward(), FLARE_INVALID_ARGUMENT);
    expect_last_error("cu_seqlens_k", "must be in [0, 4]");
  }
  EXPECT_TRUE(outputs_untouched(pr));
}

TEST(CApi, NullTensorPointerIsAMissingTensor) {
  Problem pr = make_problem(specs()[0]);
  fill_sentinel(pr);
  const CCall call(pr);
  EXPECT_EQ(flare_attention_forward(nullptr, &call.k, &call.v, &call.o, &call.lse, &call.options,
                                    nullptr, nullptr),
            FLARE_INVALID_ARGUMENT);
  expect_last_error("q", "tensor is required");
  EXPECT_EQ(flare_attention_backward(&call.dout, &call.q, &call.k, &call.v, &call.o, &call.lse,
                                     &call.dq, nullptr, &call.dv, &call.options, nullptr, nullptr),
            FLARE_INVALID_ARGUMENT);
  expect_last_error("dk", "tensor is required");
  EXPECT_TRUE(outputs_untouched(pr));
}

TEST(CApi, InvalidEnumValuesRejected) {
  Problem pr = make_problem(specs()[0]);
  fill_sentinel(pr);
  CCall call(pr);
  call.q.dtype = 9;
  EXPECT_EQ(call.forward(), FLARE_INVALID_ARGUMENT);
  expect_last_error("q", "dtype unknown (9)");
  call = CCall(pr);
  call.lse.device = 3;
  EXPECT_EQ(call.forward(), FLARE_INVALID_ARGUMENT);
  expect_last_error("lse", "device type 3 is neither cpu nor cuda");
  call = CCall(pr);
  call.options.backend = 5;
  EXPECT_EQ(call.forward(), FLARE_INVALID_ARGUMENT);
  expect_last_error("backend", "unknown value 5");
  EXPECT_TRUE(outputs_untouched(pr));
}

TEST(CApi, CudaTensorsWithoutCudaBuildAreUnsupported) {
  if (flare_cuda_built())
    GTEST_SKIP() << "this build has CUDA kernels; host pointers cannot pose as CUDA";
  Problem pr = make_problem(specs()[0]);
  fill_sentinel(pr);
  CCall call(pr);
  for (flare_tensor* t : {&call.q, &call.k, &call.v, &call.o, &call.lse}) t->device = FLARE_CUDA;
  EXPECT_EQ(call.forward(), FLARE_UNSUPPORTED);
  expect_last_error("q", "CUDA");
  EXPECT_TRUE(outputs_untouched(pr));
}

TEST(CApi, LastErrorIsPerThread) {
  Problem pr = make_problem(specs()[0]);
  CCall bad(pr);
  bad.options.dropout_p = 2.0f;
  ASSERT_EQ(bad.forward(), FLARE_INVALID_ARGUMENT);
  std::string other_before, other_after;
  std::thread([&] {
    other_before = flare_last_error();
    CCall worse(pr);
    worse.options.softcap = -1.0f;
    EXPECT_EQ(worse.forward(), FLARE_INVALID_ARGUMENT);
    other_after = flare_last_error();
  }).join();
  EXPECT_EQ(other_before, "");
  EXPECT_EQ(other_after.rfind("softcap:", 0), 0u) << other_after;
  expect_last_error("dropout_p", "must be in [0, 1)");
}

TEST(CApi, VersionAndBuildInfo) {
  ASSERT_NE(flare_version(), nullptr);
  EXPECT_GT(std::strlen(flare_version()), 0u);
  EXPECT_STREQ(flare_version(), version());
  EXPECT_EQ(flare_cuda_built() != 0, cuda_built());
}

TEST(CApi, HeaderCompilesAsC) {
  // flare_c_forward lives in a C translation unit; it must agree with the C++ API bit for bit and
  // report a rejection the same way.
  ProblemSpec spec = specs()[0];
  spec.options = AttentionOptions{};
  spec.options.causal = true;
  Problem cpp = make_problem(spec);
  Problem c = make_problem(spec);
  ASSERT_TRUE(
      attention_forward(cpp.q.view, cpp.k.view, cpp.v.view, cpp.o.view, cpp.lse.view, cpp.options)
          .ok());
  const int64_t q_shape[4] = {spec.batch, spec.seqlen_q, spec.heads_q, spec.head_dim};
  int64_t k_shape[4] = {spec.batch, spec.seqlen_k, spec.heads_kv, spec.head_dim};
  ASSERT_EQ(flare_c_forward(c.q.view.data, c.k.view.data, c.v.view.data, c.o.view.data,
                            c.lse.view.data, q_shape, k_shape, 1, FLARE_BACKEND_AUTO),
            FLARE_OK)
      << flare_last_error();
  EXPECT_EQ(c.o.bytes, cpp.o.bytes);
  EXPECT_EQ(c.lse.bytes, cpp.lse.bytes);

  fill_sentinel(c);
  k_shape[3] = spec.head_dim / 2;
  EXPECT_EQ(flare_c_forward(c.q.view.data, c.k.view.data, c.v.view.data, c.o.view.data,
                            c.lse.view.data, q_shape, k_shape, 1, FLARE_BACKEND_AUTO),
            FLARE_INVALID_ARGUMENT);
  expect_last_error("k", "head_dim = 12 must equal q's head_dim = 24");
  EXPECT_TRUE(outputs_untouched(c));
}

}  // namespace
}  // namespace flare::test
