// gpu_util.h — device mirrors of test Problems for the CUDA forward tests.
//
// A Problem (test_util.h) owns host tensors with random contents; GpuProblem copies every one of
// them to the device byte for byte, padding included, so the device views keep the host views'
// shapes and strides (and with them the aligned or unaligned layout a test asked for). Outputs are
// poisoned with NaN on the device before each call — all-ones bytes are NaN in fp16, bf16 and
// fp32 — and copied back into the Problem's host tensors afterwards, where read_o()/read_lse()
// and the CPU reference take over. Host-side params keep pointing at host copies.
#pragma once

#include <gtest/gtest.h>

#include <vector>

#include "cuda/testing.h"
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
  // Poisons o and lse, runs attention_forward on `stream` and waits for the device.
  Status forward(Stream stream = nullptr);
  // Copies o and lse back into the problem's host tensors.
  void download_forward(Problem* pr) const;
};

// Forces the kernel family of both passes for the scope (cuda/testing.h): 80 the sm80 kernels.
struct ForceArch {
  explicit ForceArch(int arch) { cuda::testing::force_arch(arch); }
  ~ForceArch() { cuda::testing::force_arch(0); }
  ForceArch(const ForceArch&) = delete;
  ForceArch& operator=(const ForceArch&) = delete;
};

// Runs the sm90 forward's persistent kernel on every call of its buckets, its grid capped at
// `ctas` CTAs, for the scope (cuda/testing.h).
struct ForceForwardCtas {
  explicit ForceForwardCtas(int ctas) { cuda::testing::force_forward_ctas(ctas); }
  ~ForceForwardCtas() { cuda::testing::force_forward_ctas(0); }
  ForceForwardCtas(const ForceForwardCtas&) = delete;
  ForceForwardCtas& operator=(const ForceForwardCtas&) = delete;
};

// Head dims the sm90 forward tests run in each sm90 bucket (sm90/fwd_tiles.h): the bucket's own,
// one 24 below it, and the narrowest the bucket takes besides (80 and 136: zero-filled past d by
// TMA).
inline std::vector<int> sm90_forward_test_head_dims(int bucket) {
  switch (bucket) {
    case 64: return {64, 40};
    case 128: return {128, 104, 80};
    case 256: return {256, 192, 136};
    default: return {bucket};
  }
}

// The backward's (sm90/bwd_tiles.h): its 128 bucket takes d 65-128 (96, 80 and 72 zero-filled)
// and its 256 bucket only d 193-256.
inline std::vector<int> sm90_backward_test_head_dims(int bucket) {
  switch (bucket) {
    case 64: return {64, 40};
    case 128: return {128, 104, 96, 80, 72};
    case 256: return {256, 232};
    default: return {bucket};
  }
}

}  // namespace flare::test
