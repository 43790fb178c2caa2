// flare/tensor.h — non-owning tensor views.
//
// flare never allocates or owns user tensors: callers pass views (pointer, dtype, device, shape,
// strides in elements). The logical layout follows FlashAttention: (batch, seqlen, heads, dim)
// for fixed-length batches, (total_tokens, heads, dim) for packed variable-length batches. Any
// strides are accepted as long as the last (head_dim) stride is 1.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>

namespace flare {

// kFloat8E4M3 (OCP FP8 E4M3: 1 sign, 4 exponent, 3 mantissa bits, ±448, NaN 0x7f/0xff, no Inf):
// the inputs of attention_forward_fp8 only.
enum class DType : int {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  kInt32 = 3,
  kUInt8 = 4,
  kFloat8E4M3 = 5
};
enum class DeviceType : int { kCPU = 0, kCUDA = 1 };

const char* dtype_name(DType dtype);
std::size_t dtype_size(DType dtype);

inline constexpr int kMaxDims = 4;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  DeviceType device = DeviceType::kCPU;
  int device_index = 0;  // CUDA ordinal; ignored for CPU
  int ndim = 0;
  int64_t shape[kMaxDims] = {0, 0, 0, 0};
  int64_t stride[kMaxDims] = {0, 0, 0, 0};  // in elements

  bool defined() const { return ndim > 0 || data != nullptr; }
  int64_t numel() const;
  bool is_contiguous() const;

  // A dense row-major view of `shape`.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               DeviceType device = DeviceType::kCPU, int device_index = 0);
  static TensorView strided(void* data, DType dtype, std::initializer_list<int64_t> shape,
                            std::initializer_list<int64_t> stride,
                            DeviceType device = DeviceType::kCPU, int device_index = 0);
};

}  // namespace flare
