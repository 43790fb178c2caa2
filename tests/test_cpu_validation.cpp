// test_cpu_validation.cpp — every argument rule of attention_forward / attention_backward, one
// test per rule.
//
// Each rejection test builds a valid problem with make_problem(), breaks exactly one thing, and
// checks three promises of the API: the status code, a message that starts with the offending
// argument's name and states the rule, and that nothing was written — every output (o, lse, dq,
// dk, dv) is filled with a sentinel byte pattern before the call and compared byte for byte after.
// Rules that concern the forward's arguments are checked through both passes, since the backward
// validates them too. Tensors that claim to live on a CUDA device keep their host pointers, so
// every such call is one that validation rejects (or, in a build without CUDA, one the stub
// answers kUnsupported): no kernel ever sees them.
//
// The positive tests inspect AttentionParams from make_forward_params / make_backward_params: the
// fields a backend relies on (strides, totals, lse layout, head grouping, scale, window).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numbers>
#include <string>
#include <vector>

#include "test_util.h"

namespace flare::test {
namespace {

constexpr unsigned char kSentinel = 0xA5;

ProblemSpec small_spec() {
  ProblemSpec s;
  s.batch = 2;
  s.seqlen_q = 5;
  s.seqlen_k = 7;
  s.heads_q = 4;
  s.heads_kv = 2;
  s.head_dim = 8;
  s.seed = test_seed();
  return s;
}

ProblemSpec varlen_spec() {
  ProblemSpec s = small_spec();
  s.varlen_q = {3, 0, 4};
  s.varlen_k = {2, 5, 1};
  return s;
}

std::vector<HostTensor*> outputs(Problem& pr) { return {&pr.o, &pr.lse, &pr.dq, &pr.dk, &pr.dv}; }
const char* const kOutputNames[] = {"o", "lse", "dq", "dk", "dv"};

void fill_sentinel(Problem& pr) {
  for (HostTensor* t : outputs(pr)) std::fill(t->bytes.begin(), t->bytes.end(), kSentinel);
}

::testing::AssertionResult outputs_untouched(Problem& pr) {
  const std::vector<HostTensor*> outs = outputs(pr);
  for (size_t i = 0; i < outs.size(); ++i) {
    const std::vector<unsigned char>& b = outs[i]->bytes;
    const auto it =
        std::find_if(b.begin(), b.end(), [](unsigned char c) { return c != kSentinel; });
    if (it != b.end())
      return ::testing::AssertionFailure() << kOutputNames[i] << " was written at byte "
                                           << (it - b.begin()) << " of a rejected call";
  }
  return ::testing::AssertionSuccess();
}

// The tensor of `pr` called `name` as the entry points see it (cu_seqlens and alibi views live in
// pr.varlen / pr.options, which hold copies of the HostTensor views).
TensorView& view(Problem& pr, const std::string& name) {
  if (name == "q") return pr.q.view;
  if (name == "k") return pr.k.view;
  if (name == "v") return pr.v.view;
  if (name == "o") return pr.o.view;
  if (name == "lse") return pr.lse.view;
  if (name == "dout") return pr.dout.view;
  if (name == "dq") return pr.dq.view;
  if (name == "dk") return pr.dk.view;
  if (name == "dv") return pr.dv.view;
  if (name == "cu_seqlens_q") return pr.varlen.cu_seqlens_q;
  if (name == "cu_seqlens_k") return pr.varlen.cu_seqlens_k;
  if (name == "alibi_slopes") return pr.options.alibi_slopes;
  ADD_FAILURE() << "no tensor named " << name;
  return pr.q.view;
}

// Every tensor argument of the backward; the first five are also the forward's.
const std::vector<std::string> kForwardTensors = {"q", "k", "v", "o", "lse"};
const std::vector<std::string> kBackwardOnlyTensors = {"dout", "dq", "dk", "dv"};
std::vector<std::string> all_tensors() {
  std::vector<std::string> all = kForwardTensors;
  all.insert(all.end(), kBackwardOnlyTensors.begin(), kBackwardOnlyTensors.end());
  return all;
}
bool backward_only(const std::string& name) {
  return std::find(kBackwardOnlyTensors.begin(), kBackwardOnlyTensors.end(), name) !=
         kBackwardOnlyTensors.end();
}

Status run_forward(const Problem& pr) {
  return attention_forward(pr.q.view, pr.k.view, pr.v.view, pr.o.view, pr.lse.view, pr.options,
                           pr.varlen);
}
Status run_backward(const Problem& pr) {
  return attention_backward(pr.dout.view, pr.q.view, pr.k.view, pr.v.view, pr.o.view, pr.lse.view,
                            pr.dq.view, pr.dk.view, pr.dv.view, pr.options, pr.varlen);
}

enum class Passes { kBoth, kBackwardOnly };

void expect_status(const Status& s, StatusCode code, const std::string& arg,
                   const std::vector<std::string>& rule) {
  EXPECT_EQ(s.code(), code) << s.to_string();
  EXPECT_EQ(s.message().rfind(arg, 0), 0u)
      << "message does not start with '" << arg << "': " << s.message();
  for (const std::string& r : rule)
    EXPECT_NE(s.message().find(r), std::string::npos)
        << "message lacks '" << r << "': " << s.message();
}

// Runs the pass(es) on `pr` and expects each to be rejected with `code`, a message that starts
// with `arg` and contains every fragment of `rule`, and no output written.
void expect_rejected(Problem& pr, const std::string& arg, const std::vector<std::string>& rule,
                     Passes passes = Passes::kBoth,
                     StatusCode code = StatusCode::kInvalidArgument) {
  if (passes == Passes::kBoth) {
    SCOPED_TRACE("forward");
    fill_sentinel(pr);
    expect_status(run_forward(pr), code, arg, rule);
    EXPECT_TRUE(outputs_untouched(pr));
  }
  SCOPED_TRACE("backward");
  fill_sentinel(pr);
  expect_status(run_backward(pr), code, arg, rule);
  EXPECT_TRUE(outputs_untouched(pr));
}

Passes passes_for(const std::string& name) {
  return backward_only(name) ? Passes::kBackwardOnly : Passes::kBoth;
}

void set_device(Problem& pr, DeviceType device, int index) {
  for (const std::string& n : all_tensors()) {
    view(pr, n).device = device;
    view(pr, n).device_index = index;
  }
  for (TensorView* t :
       {&pr.varlen.cu_seqlens_q, &pr.varlen.cu_seqlens_k, &pr.options.alibi_slopes}) {
    t->device = device;
    t->device_index = index;
  }
}

int32_t* cu_data(Problem& pr, const std::string& name) {
  return static_cast<int32_t*>(view(pr, name).data);
}

// ---- positive ---------------------------------------------------------------------------------

TEST(Validation, ValidCallSucceedsAndWritesEveryOutput) {
  for (Backend backend : {Backend::kReference, Backend::kAuto}) {
    for (const ProblemSpec& spec : {small_spec(), varlen_spec()}) {
      SCOPED_TRACE(spec.describe() + " backend=" + std::to_string(static_cast<int>(backend)));
      Problem pr = make_problem(spec);
      pr.options.backend = backend;
      fill_sentinel(pr);
      Status s = run_forward(pr);
      ASSERT_TRUE(s.ok()) << s.to_string();
      s = run_backward(pr);
      ASSERT_TRUE(s.ok()) << s.to_string();
      // A random result that equals the sentinel element exactly would mean a missed write.
      const std::vector<HostTensor*> outs = outputs(pr);
      for (size_t i = 0; i < outs.size(); ++i) {
        const size_t es = dtype_size(outs[i]->view.dtype);
        const std::vector<unsigned char>& b = outs[i]->bytes;
        for (size_t e = 0; e + es <= b.size(); e += es) {
          const bool sentinel = std::all_of(b.begin() + static_cast<std::ptrdiff_t>(e),
                                            b.begin() + static_cast<std::ptrdiff_t>(e + es),
                                            [](unsigned char c) { return c == kSentinel; });
          ASSERT_FALSE(sentinel) << kOutputNames[i] << " element " << e / es << " not written";
        }
      }
    }
  }
}

TEST(Validation, DefaultScaleIsInverseSqrtHeadDim) {
  for (int d : {1, 40, 59, 256}) {
    ProblemSpec spec = small_spec();
    spec.head_dim = d;
    const Problem pr = make_problem(spec);
    const AttentionParams p = pr.forward_params();
    EXPECT_EQ(p.scale, static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)))) << "d=" << d;
    EXPECT_FLOAT_EQ(p.scale_log2, p.scale * std::numbers::log2e_v<float>) << "d=" << d;
  }
  ProblemSpec spec = small_spec();
  spec.options.softmax_scale = 0.3f;
  EXPECT_EQ(make_problem(spec).forward_params().scale, 0.3f);
}

TEST(Validation, CausalSetsWindowRightZero) {
  ProblemSpec spec = small_spec();
  spec.options.causal = true;
  AttentionParams p = make_problem(spec).forward_params();
  EXPECT_TRUE(p.causal);
  EXPECT_EQ(p.window_left, -1);
  EXPECT_EQ(p.window_right, 0);
  spec.options.window_left = 3;
  spec.options.window_right = 9;  // causal overrides the right edge
  p = make_problem(spec).forward_params();
  EXPECT_EQ(p.window_left, 3);
  EXPECT_EQ(p.window_right, 0);
  spec.options.causal = false;
  p = make_problem(spec).forward_params();
  EXPECT_EQ(p.window_left, 3);
  EXPECT_EQ(p.window_right, 9);
}

TEST(Validation, FixedLengthParamsFollowTheViews) {
  ProblemSpec spec = small_spec();
  spec.pad = 3;  // non-contiguous rows
  spec.heads_q = 8;
  spec.heads_kv = 2;
  spec.options.dropout_p = 0.25f;
  spec.options.dropout_seed = 11;
  spec.options.dropout_offset = 13;
  const Problem pr = make_problem(spec);
  const AttentionParams p = pr.backward_params();
  EXPECT_EQ(p.batch, 2);
  EXPECT_EQ(p.seqlen_q, 5);
  EXPECT_EQ(p.seqlen_k, 7);
  EXPECT_EQ(p.heads_q, 8);
  EXPECT_EQ(p.heads_kv, 2);
  EXPECT_EQ(p.head_group, 4);
  EXPECT_EQ(p.head_dim, 8);
  EXPECT_EQ(p.total_q, 10);
  EXPECT_EQ(p.total_k, 14);
  EXPECT_FALSE(p.is_varlen());
  struct {
    const HostTensor& t;
    int64_t b, r, h;
  } rows[] = {{pr.q, p.q_batch_stride, p.q_row_stride, p.q_head_stride},
              {pr.k, p.k_batch_stride, p.k_row_stride, p.k_head_stride},
              {pr.v, p.v_batch_stride, p.v_row_stride, p.v_head_stride},
              {pr.o, p.o_batch_stride, p.o_row_stride, p.o_head_stride},
              {pr.dout, p.do_batch_stride, p.do_row_stride, p.do_head_stride},
              {pr.dq, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride},
              {pr.dk, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride},
              {pr.dv, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride}};
  for (const auto& row : rows) {
    EXPECT_EQ(row.b, row.t.view.stride[0]);
    EXPECT_EQ(row.r, row.t.view.stride[1]);
    EXPECT_EQ(row.h, row.t.view.stride[2]);
  }
  EXPECT_EQ(p.q_head_stride, 8 + 3);  // the padding really is in the strides
  EXPECT_EQ(p.lse_batch_stride, 8 * 5);
  EXPECT_EQ(p.lse_head_stride, 5);
  EXPECT_EQ(p.q, pr.q.view.data);
  EXPECT_EQ(p.o, pr.o.view.data);
  EXPECT_EQ(p.lse, pr.lse.view.data);
  EXPECT_EQ(p.dout, pr.dout.view.data);
  EXPECT_EQ(p.dq, pr.dq.view.data);
  EXPECT_EQ(p.dk, pr.dk.view.data);
  EXPECT_EQ(p.dv, pr.dv.view.data);
  EXPECT_EQ(p.dtype, DType::kFloat32);
  EXPECT_EQ(p.device, DeviceType::kCPU);
  EXPECT_EQ(p.dropout_p, 0.25f);
  EXPECT_EQ(p.dropout_scale, 1.0f / 0.75f);
  EXPECT_EQ(p.seed, 11u);
  EXPECT_EQ(p.offset, 13u);
  EXPECT_EQ(p.alibi_slopes, nullptr);
}

TEST(Validation, VarlenParamsComeFromCuSeqlens) {
  const Problem pr = make_problem(varlen_spec());  // q lengths {3, 0, 4}, k lengths {2, 5, 1}
  const AttentionParams p = pr.backward_params();
  EXPECT_TRUE(p.is_varlen());
  EXPECT_EQ(p.batch, 3);
  EXPECT_EQ(p.seqlen_q, 4);  // max_seqlen_q
  EXPECT_EQ(p.seqlen_k, 5);
  EXPECT_EQ(p.total_q, 7);
  EXPECT_EQ(p.total_k, 8);
  EXPECT_EQ(p.head_group, 2);
  EXPECT_EQ(p.cu_seqlens_q, pr.cu_q.view.data);
  EXPECT_EQ(p.cu_seqlens_k, pr.cu_k.view.data);
  EXPECT_EQ(p.q_batch_stride, 0);
  EXPECT_EQ(p.k_batch_stride, 0);
  EXPECT_EQ(p.o_batch_stride, 0);
  EXPECT_EQ(p.dv_batch_stride, 0);
  EXPECT_EQ(p.q_row_stride, 4 * 8);
  EXPECT_EQ(p.q_head_stride, 8);
  EXPECT_EQ(p.k_row_stride, 2 * 8);
  EXPECT_EQ(p.lse_batch_stride, 0);
  EXPECT_EQ(p.lse_head_stride, 7);  // lse is (heads_q, total_q)
  const SequenceInfo s2 = sequence_info(p, 2);
  EXPECT_EQ(s2.q_row0, 3);
  EXPECT_EQ(s2.k_row0, 7);
  EXPECT_EQ(s2.len_q, 4);
  EXPECT_EQ(s2.len_k, 1);
}

TEST(Validation, AlibiBatchStrideFollowsItsShape) {
  ProblemSpec spec = small_spec();
  spec.alibi = true;
  AttentionParams p = make_problem(spec).forward_params();
  EXPECT_NE(p.alibi_slopes, nullptr);
  EXPECT_EQ(p.alibi_batch_stride, 0);
  spec.alibi_per_batch = true;
  const Problem pr = make_problem(spec);
  p = pr.forward_params();
  EXPECT_EQ(p.alibi_slopes, pr.alibi.view.data);
  EXPECT_EQ(p.alibi_batch_stride, spec.heads_q);
}

TEST(Validation, PermutedOutputLayoutIsAccepted) {
  // o stored as (b, h, s, d) in memory: strides differ from q's but no element overlaps another.
  Problem pr = make_problem(small_spec());
  TensorView& o = pr.o.view;
  o.stride[3] = 1;
  o.stride[1] = o.shape[3];
  o.stride[2] = o.shape[1] * o.shape[3];
  o.stride[0] = o.shape[2] * o.shape[1] * o.shape[3];
  const AttentionParams p = pr.forward_params();
  EXPECT_EQ(p.o_row_stride, 8);
  EXPECT_EQ(p.o_head_stride, 5 * 8);
}

TEST(Validation, BroadcastDoutIsAccepted) {
  // dout is only read, so a broadcast view (stride 0 over rows) is a valid input.
  Problem pr = make_problem(small_spec());
  pr.dout.view.stride[1] = 0;
  EXPECT_EQ(pr.backward_params().do_row_stride, 0);
}

TEST(Validation, EmptyTensorsMayHaveNullData) {
  ProblemSpec spec = small_spec();
  spec.seqlen_k = 0;  // every query row sees no key
  Problem pr = make_problem(spec);
  for (const char* n : {"k", "v", "dk", "dv"}) view(pr, n).data = nullptr;
  EXPECT_EQ(pr.backward_params().seqlen_k, 0);
  spec = small_spec();
  spec.batch = 0;
  pr = make_problem(spec);
  for (const std::string& n : all_tensors()) view(pr, n).data = nullptr;
  EXPECT_EQ(pr.backward_params().batch, 0);
}

TEST(Validation, RejectedCallLeavesParamsUntouched) {
  Problem pr = make_problem(small_spec());
  AttentionParams p;
  p.batch = 12345;
  pr.k.view.shape[2] = 3;
  EXPECT_FALSE(make_forward_params(pr.q.view, pr.k.view, pr.v.view, pr.o.view, pr.lse.view,
                                   pr.options, pr.varlen, &p)
                   .ok());
  EXPECT_EQ(p.batch, 12345);
  pr = make_problem(small_spec());
  pr.dv.view.dtype = DType::kFloat16;  // forward checks pass, a backward-only check fails
  EXPECT_FALSE(make_backward_params(pr.dout.view, pr.q.view, pr.k.view, pr.v.view, pr.o.view,
                                    pr.lse.view, pr.dq.view, pr.dk.view, pr.dv.view, pr.options,
                                    pr.varlen, &p)
                   .ok());
  EXPECT_EQ(p.batch, 12345);
  EXPECT_EQ(p.q, nullptr);
}

TEST(Validation, CudaTensorsWithoutCudaBuildAreUnsupported) {
  if (cuda_built())
    GTEST_SKIP() << "this build has CUDA kernels; host pointers cannot pose as CUDA";
  Problem pr = make_problem(small_spec());
  set_device(pr, DeviceType::kCUDA, 0);
  expect_rejected(pr, "q", {"CUDA"}, Passes::kBoth, StatusCode::kUnsupported);
}

// ---- tensor presence and layout -----------------------------------------------------------------

TEST(Validation, MissingTensor) {
  for (const std::string& n : all_tensors()) {
    SCOPED_TRACE(n);
    Problem pr = make_problem(small_spec());
    view(pr, n) = TensorView{};
    expect_rejected(pr, n, {"tensor is required"}, passes_for(n));
  }
}

TEST(Validation, NullData) {
  for (const std::string& n : all_tensors()) {
    SCOPED_TRACE(n);
    Problem pr = make_problem(small_spec());
    view(pr, n).data = nullptr;
    expect_rejected(pr, n, {"data pointer is null"}, passes_for(n));
  }
}

TEST(Validation, WrongRank) {
  for (const std::string& n : all_tensors()) {
    SCOPED_TRACE(n);
    Problem pr = make_problem(small_spec());
    view(pr, n).ndim -= 1;
    expect_rejected(pr, n, {"expected", "dimensions", "got"}, passes_for(n));
  }
}

TEST(Validation, FixedLengthLayoutWithCuSeqlens) {
  // cu_seqlens make the batch packed; a 4-D q is then the wrong layout.
  Problem pr = make_problem(small_spec());
  Problem packed = make_problem(varlen_spec());
  pr.varlen = packed.varlen;
  expect_rejected(pr, "q", {"expected 3 dimensions", "varlen", "got 4"});
}

TEST(Validation, NegativeShape) {
  Problem pr = make_problem(small_spec());
  pr.q.view.shape[1] = -5;
  expect_rejected(pr, "q", {"shape[1] = -5 is negative"});
}

TEST(Validation, NegativeStride) {
  for (const std::string& n : all_tensors()) {
    SCOPED_TRACE(n);
    Problem pr = make_problem(small_spec());
    view(pr, n).stride[0] = -1;
    expect_rejected(pr, n, {"stride[0] = -1 is negative"}, passes_for(n));
  }
}

TEST(Validation, NonUnitLastStride) {
  for (const std::string& n : all_tensors()) {
    if (n == "lse") continue;  // lse has its own contiguity rule
    SCOPED_TRACE(n);
    Problem pr = make_problem(small_spec());
    view(pr, n).stride[3] = 2;
    expect_rejected(pr, n, {"last (head_dim) stride must be 1, got 2"}, passes_for(n));
  }
}

TEST(Validation, OffsetsOverflowInt64) {
  Problem pr = make_problem(small_spec());
  // Batch 1 starts just below 2^63; its later rows lie beyond.
  pr.k.view.stride[0] = std::numeric_limits<int64_t>::max() - 5;
  expect_rejected(pr, "k", {"beyond int64"});
}

TEST(Validation, MisalignedData) {
  Problem pr = make_problem(small_spec());
  pr.v.view.data = pr.v.bytes.data() + 2;
  expect_rejected(pr, "v", {"not aligned", "4-byte"});
}

TEST(Validation, UnknownDtype) {
  for (const std::string& n : all_tensors()) {
    SCOPED_TRACE(n);
    Problem pr = make_problem(small_spec());
    view(pr, n).dtype = static_cast<DType>(9);
    expect_rejected(pr, n, {"dtype unknown (9)"}, passes_for(n));
  }
}

TEST(Validation, IntegerDtypeForAttentionTensor) {
  Problem pr = make_problem(small_spec());
  for (const char* n : {"q", "k", "v", "o"}) view(pr, n).dtype = DType::kInt32;
  expect_rejected(pr, "q", {"int32", "not one of float32, float16, bfloat16"});
}

TEST(Validation, DtypeMismatch) {
  for (const std::string& n : all_tensors()) {
    if (n == "q" || n == "lse") continue;
    SCOPED_TRACE(n);
    Problem pr = make_problem(small_spec());
    view(pr, n).dtype = DType::kBFloat16;
    expect_rejected(pr, n, {"dtype bfloat16 differs from q's dtype float32"}, passes_for(n));
  }
}

TEST(Validation, UnknownDeviceType) {
  Problem pr = make_problem(small_spec());
  pr.q.view.device = static_cast<DeviceType>(7);
  expect_rejected(pr, "q", {"device type 7 is neither cpu nor cuda"});
}

TEST(Validation, NegativeCudaDeviceIndex) {
  Problem pr = make_problem(small_spec());
  set_device(pr, DeviceType::kCUDA, -1);
  expect_rejected(pr, "q", {"CUDA device index -1 is negative"});
}

TEST(Validation, MixedDeviceTypes) {
  for (const std::string& n : all_tensors()) {
    if (n == "q") continue;
    SCOPED_TRACE(n);
    Problem pr = make_problem(small_spec());
    view(pr, n).device = DeviceType::kCUDA;
    expect_rejected(pr, n, {"on cuda:0 but q is on cpu:0", "share one device"}, passes_for(n));
  }
}

TEST(Validation, MixedCudaDeviceIndices) {
  for (const std::string& n : all_tensors()) {
    if (n == "q") continue;
    SCOPED_TRACE(n);
    Problem pr = make_problem(small_spec());
    set_device(pr, DeviceType::kCUDA, 0);
    view(pr, n).device_index = 1;
    expect_rejected(pr, n, {"on cuda:1 but q is on cuda:0"}, passes_for(n));
  }
}

TEST(Validation, CpuDeviceIndexIsIgnored) {
  Problem pr = make_problem(small_spec());
  pr.k.view.device_index = 3;
  pr.forward_params();
}

// ---- shapes -------------------------------------------------------------------------------------

TEST(Validation, ShapeMismatch) {
  // Each tensor that must match another gets one more row than its reference.
  const std::vector<std::pair<std::string, std::string>> pairs = {
      {"v", "k's shape"},  {"o", "q's shape"},  {"dout", "q's shape"},
      {"dq", "q's shape"}, {"dk", "k's shape"}, {"dv", "v's shape"}};
  for (const auto& [n, ref] : pairs) {
    SCOPED_TRACE(n);
    Problem pr = make_problem(small_spec());
    view(pr, n).shape[1] -= 1;
    expect_rejected(pr, n, {"must equal " + ref}, passes_for(n));
  }
}

TEST(Validation, BatchMismatch) {
  Problem pr = make_problem(small_spec());
  pr.k.view.shape[0] = 1;
  pr.v.view.shape[0] = 1;
  expect_rejected(pr, "k", {"batch = 1 must equal q's batch = 2"});
}

TEST(Validation, HeadDimZero) {
  ProblemSpec spec = small_spec();
  spec.head_dim = 0;
  Problem pr = make_problem(spec);
  expect_rejected(pr, "q", {"head_dim = 0 must be in [1, 256]"});
}

TEST(Validation, HeadDimAbove256) {
  ProblemSpec spec = small_spec();
  spec.head_dim = 257;
  Problem pr = make_problem(spec);
  expect_rejected(pr, "q", {"head_dim = 257 must be in [1, 256]"});
}

TEST(Validation, HeadDimMismatch) {
  Problem pr = make_problem(small_spec());
  pr.k.view.shape[3] = 4;
  pr.v.view.shape[3] = 4;
  expect_rejected(pr, "k", {"head_dim = 4 must equal q's head_dim = 8"});
}

TEST(Validation, HeadsNotMultipleOfKvHeads) {
  ProblemSpec spec = small_spec();
  spec.heads_q = 4;
  spec.heads_kv = 3;
  Problem pr = make_problem(spec);
  expect_rejected(pr, "k", {"heads = 3 must divide q's heads = 4"});
}

TEST(Validation, ZeroHeads) {
  Problem pr = make_problem(small_spec());
  pr.k.view.shape[2] = 0;
  pr.v.view.shape[2] = 0;
  expect_rejected(pr, "k", {"heads = 0 must be >= 1"});
}

TEST(Validation, TooManyHeads) {
  // Only the shapes change; the call is rejected before any element is addressed.
  Problem pr = make_problem(small_spec());
  pr.q.view.shape[2] = 65536;
  pr.k.view.shape[2] = 1;
  pr.v.view.shape[2] = 1;
  expect_rejected(pr, "q", {"heads = 65536 exceeds the maximum 65535"});
}

TEST(Validation, SeqlenTooLong) {
  Problem pr = make_problem(small_spec());
  for (const char* n : {"q", "o", "dout", "dq"}) {
    TensorView& t = view(pr, n);  // a consistent dense layout of the longer sequence
    t.shape[1] = (int64_t{1} << 30) + 1;
    t.stride[0] = t.shape[1] * t.stride[1];
  }
  expect_rejected(pr, "q", {"seqlen = 1073741825 exceeds the maximum"});
}

// ---- lse ----------------------------------------------------------------------------------------

TEST(Validation, LseWrongDtype) {
  Problem pr = make_problem(small_spec());
  pr.lse.view.dtype = DType::kFloat16;
  expect_rejected(pr, "lse", {"dtype must be float32, got float16"});
}

TEST(Validation, LseWrongShape) {
  Problem pr = make_problem(small_spec());
  pr.lse.view.shape[2] = 4;
  expect_rejected(pr, "lse", {"shape (2, 4, 4) must be (batch, heads_q, seqlen_q) = (2, 4, 5)"});
  Problem packed = make_problem(varlen_spec());
  packed.lse.view.shape[1] = 6;
  expect_rejected(packed, "lse", {"shape (4, 6) must be (heads_q, total_q) = (4, 7)"});
}

TEST(Validation, LseNotContiguous) {
  Problem pr = make_problem(small_spec());
  pr.lse.view.stride[1] = 7;  // rows of 5 spaced 7 apart (heads * 7 <= batch stride: no overlap)
  pr.lse.view.stride[0] = 4 * 7;
  expect_rejected(pr, "lse", {"must be contiguous", "(28, 7, 1)"});
}

// ---- outputs ------------------------------------------------------------------------------------

TEST(Validation, OutputOverlapsItself) {
  for (const char* n : {"o", "dq", "dk", "dv"}) {
    SCOPED_TRACE(n);
    Problem pr = make_problem(small_spec());
    view(pr, n).stride[1] = 0;  // every row of a sequence aliases row 0
    expect_rejected(pr, n, {"share memory", "must not overlap"}, passes_for(n));
  }
  Problem pr = make_problem(small_spec());
  pr.o.view.stride[2] = 4;  // heads of 8 elements placed 4 apart: interleaved
  expect_rejected(pr, "o", {"must not overlap"});
}

// Outputs that share memory with another argument would be read after being written (or written
// twice); each such call is refused, naming the output and what it overlaps.
TEST(Validation, OutputAliasesAnotherOutput) {
  Problem pr = make_problem(small_spec());
  pr.dk.view.data = pr.dq.view.data;  // dk's bytes are dq's first bytes (dq is larger)
  expect_rejected(pr, "dk", {"shares memory with dq", "must not overlap"}, Passes::kBackwardOnly);
  pr = make_problem(small_spec());
  // lse placed inside o (o holds 2·5·4·8 bf16-or-fp32 elements, lse 2·4·5 floats).
  pr.lse.view.data = static_cast<unsigned char*>(pr.o.view.data) + 16;
  expect_rejected(pr, "lse", {"shares memory with o"});
}

TEST(Validation, OutputAliasesAnInput) {
  for (const char* out : {"o", "dq", "dk", "dv"}) {
    for (const char* in : {"q", "k", "v", "dout"}) {
      if (std::string(out) == "o" && std::string(in) == "dout") continue;  // dout: backward only
      SCOPED_TRACE(std::string(out) + " over " + in);
      Problem pr = make_problem(small_spec());
      // Same shape (q-like or k-like) is needed for the output to be valid on its own.
      const bool q_like = std::string(out) == "o" || std::string(out) == "dq";
      const bool in_q_like = std::string(in) == "q" || std::string(in) == "dout";
      if (q_like != in_q_like) continue;
      view(pr, out).data = view(pr, in).data;
      expect_rejected(pr, out, {"shares memory with the input " + std::string(in)},
                      passes_for(out));
    }
  }
}

TEST(Validation, InterleavedGradientViewsOfOnePackedBufferAreAccepted) {
  // dq, dk, dv as the three slices of one packed (b, s, 3, h, d) gradient: their byte ranges
  // interleave, their elements never meet. Likewise q, k, v read from a packed qkv.
  ProblemSpec spec = small_spec();
  spec.seqlen_k = spec.seqlen_q;
  spec.heads_kv = spec.heads_q;
  Problem pr = make_problem(spec);
  const int64_t b = spec.batch, s = spec.seqlen_q, h = spec.heads_q, d = spec.head_dim;
  const size_t es = dtype_size(pr.q.view.dtype);
  std::vector<unsigned char> packed(static_cast<size_t>(b * s * 3 * h * d) * es);
  for (int i = 0; i < 3; ++i) {
    TensorView& g = view(pr, i == 0 ? "dq" : i == 1 ? "dk" : "dv");
    g.data = packed.data() + static_cast<size_t>(i * h * d) * es;
    g.stride[0] = s * 3 * h * d;
    g.stride[1] = 3 * h * d;
    g.stride[2] = d;
    g.stride[3] = 1;
  }
  EXPECT_TRUE(run_backward(pr).ok());
  // One head further on, dk's first head is dq's second: a shared element.
  pr.dk.view.data = packed.data() + static_cast<size_t>(d) * es;
  expect_rejected(pr, "dk", {"shares memory with dq"}, Passes::kBackwardOnly);
}

TEST(Validation, GqaGradientViewsOfOnePackedBufferAreAccepted) {
  // Under GQA a model's fused (b, s, h_q + 2·h_kv, d) gradient holds dq (h_q heads), dk and dv
  // (h_kv heads each): views of different shapes on one lattice, interleaved, never meeting.
  ProblemSpec spec = small_spec();
  spec.seqlen_k = spec.seqlen_q;
  ASSERT_GT(spec.heads_q, spec.heads_kv);
  Problem pr = make_problem(spec);
  const int64_t b = spec.batch, s = spec.seqlen_q, hq = spec.heads_q, hkv = spec.heads_kv,
                d = spec.head_dim, heads = hq + 2 * hkv;
  const size_t es = dtype_size(pr.q.view.dtype);
  std::vector<unsigned char> packed(static_cast<size_t>(b * s * heads * d) * es);
  auto place = [&](const char* name, int64_t first_head) {
    TensorView& g = view(pr, name);
    g.data = packed.data() + static_cast<size_t>(first_head * d) * es;
    g.stride[0] = s * heads * d;
    g.stride[1] = heads * d;
    g.stride[2] = d;
    g.stride[3] = 1;
  };
  place("dq", 0);
  place("dk", hq);
  place("dv", hq + hkv);
  EXPECT_TRUE(run_backward(pr).ok()) << run_backward(pr).to_string();
  // dk one head earlier starts inside dq's last head; dv one head earlier ends inside dk.
  place("dk", hq - 1);
  expect_rejected(pr, "dk", {"shares memory with dq"}, Passes::kBackwardOnly);
  place("dk", hq);
  place("dv", hq + hkv - 1);
  expect_rejected(pr, "dv", {"shares memory with dk"}, Passes::kBackwardOnly);
}

TEST(Validation, EmptyTensorsMayHaveAnyStrides) {
  // NumPy 2 gives empty arrays all-zero strides; torch gives empty outputs strides that are not
  // contiguous ones. An empty tensor addresses no element, so its strides are not checked.
  for (const char* which : {"seqlen_q", "seqlen_k", "batch"}) {
    SCOPED_TRACE(which);
    ProblemSpec spec = small_spec();
    (std::string(which) == "seqlen_q" ? spec.seqlen_q
     : std::string(which) == "seqlen_k" ? spec.seqlen_k
                                         : spec.batch) = 0;
    Problem pr = make_problem(spec);
    for (const std::string& n : all_tensors()) {
      TensorView& t = view(pr, n);
      if (t.numel() != 0) continue;
      for (int i = 0; i < t.ndim; ++i) t.stride[i] = 0;
    }
    EXPECT_TRUE(run_forward(pr).ok()) << run_forward(pr).to_string();
    EXPECT_TRUE(run_backward(pr).ok()) << run_backward(pr).to_string();
    // The backends see dense strides for them, never the zeros.
    const AttentionParams p = pr.backward_params();
    if (pr.k.view.numel() == 0) {
      EXPECT_EQ(p.k_head_stride, 8);
    }
  }
}

// ---- varlen -------------------------------------------------------------------------------------

TEST(Validation, CuSeqlensKWithoutQ) {
  Problem pr = make_problem(varlen_spec());
  pr.varlen.cu_seqlens_q = TensorView{};
  expect_rejected(pr, "cu_seqlens_q", {"required when cu_seqlens_k is given"});
}

TEST(Validation, CuSeqlensQWithoutK) {
  Problem pr = make_problem(varlen_spec());
  pr.varlen.cu_seqlens_k = TensorView{};
  expect_rejected(pr, "cu_seqlens_k", {"required when cu_seqlens_q is given"});
}

TEST(Validation, CuSeqlensWrongDtype) {
  for (const char* n : {"cu_seqlens_q", "cu_seqlens_k"}) {
    SCOPED_TRACE(n);
    Problem pr = make_problem(varlen_spec());
    view(pr, n).dtype = DType::kFloat32;
    expect_rejected(pr, n, {"dtype must be int32, got float32"});
  }
}

TEST(Validation, CuSeqlensWrongLength) {
  Problem pr = make_problem(varlen_spec());
  pr.varlen.cu_seqlens_k.shape[0] = 3;
  expect_rejected(pr, "cu_seqlens_k", {"length 3 must be batch + 1 = 4"});
  pr = make_problem(varlen_spec());
  pr.varlen.cu_seqlens_q.shape[0] = 0;
  expect_rejected(pr, "cu_seqlens_q", {"length 0 must be batch + 1 >= 1"});
}

TEST(Validation, CuSeqlensWrongRank) {
  for (const char* n : {"cu_seqlens_q", "cu_seqlens_k"}) {
    SCOPED_TRACE(n);
    Problem pr = make_problem(varlen_spec());
    TensorView& cu = view(pr, n);
    cu.ndim = 2;  // (1, batch + 1)
    cu.shape[1] = cu.shape[0];
    cu.stride[1] = 1;
    cu.shape[0] = 1;
    cu.stride[0] = cu.shape[1];
    expect_rejected(pr, n, {"expected 1 dimension", "got 2"});
  }
}

TEST(Validation, CuSeqlensNotContiguous) {
  Problem pr = make_problem(varlen_spec());
  pr.varlen.cu_seqlens_k.stride[0] = 2;  // rejected before the out-of-buffer entries are read
  expect_rejected(pr, "cu_seqlens_k", {"must be contiguous"});
}

TEST(Validation, CuSeqlensNotStartingAtZero) {
  Problem pr = make_problem(varlen_spec());
  cu_data(pr, "cu_seqlens_k")[0] = 1;
  expect_rejected(pr, "cu_seqlens_k", {"[0] must be 0, got 1"});
}

TEST(Validation, CuSeqlensDecreasing) {
  Problem pr = make_problem(varlen_spec());
  int32_t* c = cu_data(pr, "cu_seqlens_q");  // {0, 3, 3, 7}
  c[2] = 2;
  expect_rejected(pr, "cu_seqlens_q", {"must be non-decreasing", "[2] = 2 < [1] = 3"});
}

TEST(Validation, CuSeqlensTotalMismatch) {
  Problem pr = make_problem(varlen_spec());
  cu_data(pr, "cu_seqlens_k")[3] = 7;  // k holds 8 packed tokens
  expect_rejected(pr, "cu_seqlens_k", {"[batch] = 7 must equal the packed token count 8"});
}

TEST(Validation, MaxSeqlenSmallerThanASequence) {
  Problem pr = make_problem(varlen_spec());
  pr.varlen.max_seqlen_k = 4;  // sequence 1 of k has 5 tokens
  expect_rejected(pr, "max_seqlen_k", {"4 is smaller than sequence 1's length 5", "cu_seqlens_k"});
}

TEST(Validation, MaxSeqlenNegative) {
  Problem pr = make_problem(varlen_spec());
  pr.varlen.max_seqlen_q = -1;
  expect_rejected(pr, "max_seqlen_q", {"must be >= 0, got -1"});
}

TEST(Validation, MaxSeqlenTooLarge) {
  Problem pr = make_problem(varlen_spec());
  pr.varlen.max_seqlen_q = (1 << 30) + 1;
  expect_rejected(pr, "max_seqlen_q", {"exceeds the maximum 1073741824"});
}

TEST(Validation, CuSeqlensOnAnotherDevice) {
  for (const char* n : {"cu_seqlens_q", "cu_seqlens_k"}) {
    SCOPED_TRACE(n);
    Problem pr = make_problem(varlen_spec());
    view(pr, n).device = DeviceType::kCUDA;
    expect_rejected(pr, n, {"on cuda:0 but q is on cpu:0"});
  }
}

// ---- options ------------------------------------------------------------------------------------

TEST(Validation, DropoutOutsideUnitInterval) {
  for (float p : {-0.1f, 1.0f, 1.5f, std::numeric_limits<float>::quiet_NaN(),
                  std::numeric_limits<float>::infinity()}) {
    SCOPED_TRACE(p);
    Problem pr = make_problem(small_spec());
    pr.options.dropout_p = p;
    expect_rejected(pr, "dropout_p", {"must be in [0, 1)"});
  }
}

TEST(Validation, WindowBelowMinusOne) {
  Problem pr = make_problem(small_spec());
  pr.options.window_left = -2;
  expect_rejected(pr, "window_left", {"must be >= -1", "got -2"});
  pr = make_problem(small_spec());
  pr.options.window_right = -5;
  expect_rejected(pr, "window_right", {"must be >= -1", "got -5"});
}

TEST(Validation, SoftmaxScaleNotFinitePositive) {
  for (float s : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                  -std::numeric_limits<float>::infinity(), -0.5f}) {
    SCOPED_TRACE(s);
    Problem pr = make_problem(small_spec());
    pr.options.softmax_scale = s;
    expect_rejected(pr, "softmax_scale", {"must be finite and > 0"});
  }
}

TEST(Validation, SoftcapNotFiniteNonNegative) {
  for (float c :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(), -1.0f}) {
    SCOPED_TRACE(c);
    Problem pr = make_problem(small_spec());
    pr.options.softcap = c;
    expect_rejected(pr, "softcap", {"must be finite and >= 0"});
  }
}

ProblemSpec alibi_spec() {
  ProblemSpec s = small_spec();
  s.alibi = true;
  return s;
}

TEST(Validation, AlibiWrongDtype) {
  Problem pr = make_problem(alibi_spec());
  pr.options.alibi_slopes.dtype = DType::kFloat16;
  expect_rejected(pr, "alibi_slopes", {"dtype must be float32, got float16"});
}

TEST(Validation, AlibiWrongShape) {
  Problem pr = make_problem(alibi_spec());
  pr.options.alibi_slopes.shape[0] = 3;
  expect_rejected(pr, "alibi_slopes", {"shape (3) must be (heads_q) = (4) or (batch, heads_q)"});
  ProblemSpec spec = alibi_spec();
  spec.alibi_per_batch = true;
  pr = make_problem(spec);
  pr.options.alibi_slopes.shape[0] = 1;
  expect_rejected(pr, "alibi_slopes", {"shape (1, 4) must be", "(batch, heads_q) = (2, 4)"});
}

TEST(Validation, AlibiWrongRank) {
  Problem pr = make_problem(alibi_spec());
  pr.options.alibi_slopes.ndim = 3;
  expect_rejected(pr, "alibi_slopes", {"expected 1 or 2 dimensions", "got 3"});
}

TEST(Validation, AlibiNonUnitStride) {
  Problem pr = make_problem(alibi_spec());
  pr.options.alibi_slopes.stride[0] = 2;
  expect_rejected(pr, "alibi_slopes", {"last stride must be 1, got 2"});
}

TEST(Validation, AlibiNullData) {
  Problem pr = make_problem(alibi_spec());
  pr.options.alibi_slopes.data = nullptr;
  expect_rejected(pr, "alibi_slopes", {"data pointer is null"});
}

TEST(Validation, AlibiOnAnotherDevice) {
  Problem pr = make_problem(alibi_spec());
  set_device(pr, DeviceType::kCUDA, 0);
  pr.options.alibi_slopes.device_index = 2;
  expect_rejected(pr, "alibi_slopes", {"on cuda:2 but q is on cuda:0"});
  pr = make_problem(alibi_spec());
  pr.options.alibi_slopes.device = DeviceType::kCUDA;
  expect_rejected(pr, "alibi_slopes", {"on cuda:0 but q is on cpu:0"});
}

TEST(Validation, UnknownBackend) {
  Problem pr = make_problem(small_spec());
  pr.options.backend = static_cast<Backend>(7);
  expect_rejected(pr, "backend", {"unknown value 7", "auto (0), reference (1) or flash (2)"});
}

TEST(Validation, ReferenceBackendOnCuda) {
  Problem pr = make_problem(small_spec());
  set_device(pr, DeviceType::kCUDA, 0);
  pr.options.backend = Backend::kReference;
  expect_rejected(pr, "backend", {"reference backend runs on CPU tensors only"});
}

}  // namespace
}  // namespace flare::test
