// common.h — what every CUDA operator of the trainer shares on the host side: the bf16 element
// type of weights and activations, and how a CUDA error becomes a Status: flare's one conversion
// (cuda/device_probe.h), under the trainer's context.
//
// The operators follow one contract (docs/architecture.md, "API conventions"): raw device pointers
// with their dimensions in, a cudaStream_t to run on, a Status out. Launchers validate every size
// first and launch nothing when they reject a call; they never synchronise the device, so the only
// errors they can report are launch errors (cudaGetLastError), never a fault of the kernel itself.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "cuda/device_probe.h"
#include "flare/status.h"

namespace flare::train::cuda {

using bf16 = __nv_bfloat16;

// cuda_status(kCudaContext, what, err) for a runtime call, launch_status(kCudaContext, kernel)
// after a launch: ok, out_of_memory for an allocation that failed, else device_error, each message
// "training: <what>: <CUDA's description>".
using flare::cuda::cuda_status;
using flare::cuda::launch_status;
inline constexpr char kCudaContext[] = "training";

// A parameter gradient an operator writes: fp32, written (=) or added to (+=), or bf16, written
// only (a bf16 sum over micro-batches would round each addend away; TrainConfig::bf16_grads says
// why a run takes bf16). Converts from either pointer, so fp32 callers pass their float* as before.
class GradientOut {
 public:
  GradientOut() = default;
  GradientOut(std::nullptr_t) {}
  GradientOut(float* p) : ptr_(p) {}
  GradientOut(bf16* p) : ptr_(p), bf16_(true) {}

  explicit operator bool() const { return ptr_ != nullptr; }
  bool is_bf16() const { return bf16_; }
  int64_t element_bytes() const { return bf16_ ? 2 : 4; }
  void* data() const { return ptr_; }
  float* f32() const { return bf16_ ? nullptr : static_cast<float*>(ptr_); }
  bf16* b16() const { return bf16_ ? static_cast<bf16*>(ptr_) : nullptr; }
  // The gradient `elements` further on, same type.
  GradientOut operator+(int64_t elements) const {
    GradientOut g = *this;
    g.ptr_ = static_cast<char*>(ptr_) + elements * element_bytes();
    return g;
  }

 private:
  void* ptr_ = nullptr;
  bool bf16_ = false;
};

// The same, read (the optimizer's input).
class GradientIn {
 public:
  GradientIn() = default;
  GradientIn(std::nullptr_t) {}
  GradientIn(const float* p) : ptr_(p) {}
  GradientIn(const bf16* p) : ptr_(p), bf16_(true) {}
  GradientIn(GradientOut g) : ptr_(g.data()), bf16_(g.is_bf16()) {}

  explicit operator bool() const { return ptr_ != nullptr; }
  bool is_bf16() const { return bf16_; }
  const float* f32() const { return bf16_ ? nullptr : static_cast<const float*>(ptr_); }
  const bf16* b16() const { return bf16_ ? static_cast<const bf16*>(ptr_) : nullptr; }

 private:
  const void* ptr_ = nullptr;
  bool bf16_ = false;
};

}  // namespace flare::train::cuda
