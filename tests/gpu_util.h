// gpu_util.h — device mirrors of test Problems for the CUDA forward tests.
//
// A Problem (test_util.h) owns host tensors with random contents; GpuProblem copies every one of
// them to the device byte for byte, padding included, so the device views keep the host views'
// shapes and strides (and with them the aligned or unaligned layout a test asked for). Outputs are
// poisoned with NaN on the device before each call — all-ones bytes are NaN in fp16, bf16 and
// fp32 — and copied back into the Problem's host tensors afterwards, where read_o()/read_lse()
// and the CPU reference take over. Host-side params keep pointing at host copies.
//
// A call given DispatchOverrides or a DispatchRecord (cuda/dispatch.h) goes to the CUDA dispatch
// directly, with params filled as the public entry point fills them; others go through the public
// entry point.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "cuda/dispatch.h"
#include "test_util.h"

namespace flare::test {

// True when the CUDA runtime reports at least one device.
bool cuda_device_available();

#define FLARE_SKIP_WITHOUT_CUDA()                               \
  do {                                                          \
    if (!::flare::test::cuda_device_available())                \
      GTEST_SKIP() << "no CUDA device";                         \
  } while (0)

// A parameterised test whose every case skips, saying so, without a CUDA device.
template <typename Param>
class GpuTestWithParam : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override { FLARE_SKIP_WITHOUT_CUDA(); }
};

// One device allocation holding a copy of a HostTensor; view() points into it.
class GpuTensor {
 public:
  GpuTensor() = default;
  GpuTensor(const GpuTensor&) = delete;
  GpuTensor& operator=(const GpuTensor&) = delete;
  ~GpuTensor();

  void upload(const HostTensor& h);          // allocate and copy (no-op for an undefined tensor)
  void download(HostTensor* h) const;        // copy every byte back
  void poison() const;                       // fill with NaN
  const TensorView& view() const { return view_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  TensorView view_;
};

// Every tensor of a forward call on the device.
struct GpuProblem {
  GpuTensor q, k, v, o, lse, cu_q, cu_k, alibi;
  AttentionOptions options;
  VarlenArgs varlen;

  explicit GpuProblem(const Problem& pr);
  // Runs attention_forward on `stream` (with `overrides`, telling `record` which kernels ran);
  // does not wait for the device.
  Status enqueue_forward(Stream stream, const cuda::DispatchOverrides& overrides = {},
                         cuda::DispatchRecord* record = nullptr) const;
  // Poisons o and lse, runs enqueue_forward and waits for the device.
  Status forward(Stream stream = nullptr, const cuda::DispatchOverrides& overrides = {},
                 cuda::DispatchRecord* record = nullptr);
  // Copies o and lse back into the problem's host tensors.
  void download_forward(Problem* pr) const;
};

// The sm80 kernels of both passes, also where the device would run sm90's.
inline cuda::DispatchOverrides sm80_forced() {
  cuda::DispatchOverrides o;
  o.arch = 80;
  return o;
}

// The sm90 forward's persistent kernel on every call of its buckets, its grid capped at `ctas`
// CTAs (0: the automatic choice).
inline cuda::DispatchOverrides forward_ctas_capped(int ctas) {
  cuda::DispatchOverrides o;
  o.forward_ctas = ctas;
  return o;
}

// Head dims the sm90 forward tests run in each sm90 bucket (sm90/fwd_tiles.h): the bucket's own
// and the narrowest it takes (40, 72, 88, 104, 136, 200: zero-filled past d by TMA).
inline std::vector<int> sm90_forward_test_head_dims(int bucket) {
  switch (bucket) {
    case 64: return {64, 40};
    case 80: return {80, 72};
    case 96: return {96, 88};
    case 128: return {128, 104};
    case 192: return {192, 136};
    case 256: return {256, 200};
    default: return {bucket};
  }
}

// The backward's (sm90/bwd_tiles.h): its 128 bucket takes d 65-128 (96, 80 and 72 zero-filled)
// and its 256 bucket d 129-160 and 193-256 (160 and 136 zero-filled).
inline std::vector<int> sm90_backward_test_head_dims(int bucket) {
  switch (bucket) {
    case 64: return {64, 40};
    case 128: return {128, 104, 96, 80, 72};
    case 256: return {256, 232, 160, 136};
    default: return {bucket};
  }
}

// ---- the sm90 suites' cases ---------------------------------------------------------------------

// One case of a pass's sm90 suite (test_gpu_forward.cpp, test_gpu_backward.cpp): a compiled sm90
// variant (dtype, bucket: the generated table that instantiates the kernels), one of the bucket's
// test head dims and one of the suite's shapes, each case its own named test.
struct Sm90SuiteCase {
  DType dtype;
  int bucket, head_dim;
  int shape;               // index into the suite's shapes
  const char* shape_name;  // for the test's name
};

inline void PrintTo(const Sm90SuiteCase& c, std::ostream* os) {
  *os << (c.dtype == DType::kFloat16 ? "fp16" : "bf16") << " d " << c.head_dim << " in bucket "
      << c.bucket << ", " << c.shape_name;
}

inline std::string sm90_suite_case_name(const ::testing::TestParamInfo<Sm90SuiteCase>& info) {
  const Sm90SuiteCase& c = info.param;
  return std::string(c.dtype == DType::kFloat16 ? "fp16" : "bf16") + "_d" +
         std::to_string(c.head_dim) + "_in" + std::to_string(c.bucket) + "_" + c.shape_name;
}

// Every (variant, head dim of its bucket, shape).
template <std::size_t kShapes>
std::vector<Sm90SuiteCase> sm90_suite_cases(const std::vector<std::pair<DType, int>>& variants,
                                            std::vector<int> (*head_dims)(int),
                                            const char* const (&shapes)[kShapes]) {
  std::vector<Sm90SuiteCase> cases;
  for (const auto& [dtype, bucket] : variants)
    for (int d : head_dims(bucket))
      for (std::size_t shape = 0; shape < kShapes; ++shape)
        cases.push_back({dtype, bucket, d, static_cast<int>(shape), shapes[shape]});
  return cases;
}

// `check` (a pass's run against the reference, `check(s, overrides, &record)`) once through the
// automatic choice and once forced to sm80. On an sm_90 device built with sm_90a code the
// automatic call must take an sm90 kernel, as the record's field `pass` (&DispatchRecord::forward
// or ::backward) says; elsewhere both runs are sm80 and the test still checks them.
template <typename Check>
void check_sm90_and_forced_sm80(const ProblemSpec& s, Check check,
                                cuda::KernelFamily cuda::DispatchRecord::*pass) {
  const bool sm90 = cuda::runs_sm90_kernels();
  cuda::DispatchRecord automatic;
  check(s, cuda::DispatchOverrides{}, &automatic);
  if (sm90) {
    EXPECT_EQ(automatic.*pass, cuda::KernelFamily::kSm90)
        << s.describe() << ": the automatic choice did not take the sm90 kernel";
  }
  SCOPED_TRACE("forced to sm80");
  cuda::DispatchRecord forced;
  check(s, sm80_forced(), &forced);
  EXPECT_NE(forced.*pass, cuda::KernelFamily::kSm90);
}

}  // namespace flare::test
