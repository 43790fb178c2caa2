// status.cpp — names for status codes and tensor helpers shared by every backend.
#include "flare/status.h"

#include "flare/tensor.h"

namespace flare {

const char* status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "ok";
    case StatusCode::kInvalidArgument: return "invalid_argument";
    case StatusCode::kUnsupported: return "unsupported";
    case StatusCode::kDeviceError: return "device_error";
    case StatusCode::kOutOfMemory: return "out_of_memory";
    case StatusCode::kInternal: return "internal";
  }
  return "unknown";
}

std::string Status::to_string() const {
  if (ok()) return "ok";
  return std::string(status_code_name(code_)) + ": " + message_;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kInt32: return "int32";
    case DType::kUInt8: return "uint8";
    case DType::kFloat8E4M3: return "float8_e4m3";
  }
  return "unknown";
}

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
    case DType::kUInt8:
    case DType::kFloat8E4M3: return 1;
    default: return 4;
  }
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return ndim > 0 ? n : 0;
}

bool TensorView::is_contiguous() const {
  int64_t expected = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    if (shape[i] > 1 && stride[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                                  DeviceType device, int device_index) {
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.device_index = device_index;
  t.ndim = static_cast<int>(shape.size());
  int i = 0;
  for (int64_t s : shape) t.shape[i++] = s;
  int64_t st = 1;
  for (int j = t.ndim - 1; j >= 0; --j) {
    t.stride[j] = st;
    st *= t.shape[j];
  }
  return t;
}

TensorView TensorView::strided(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               std::initializer_list<int64_t> stride, DeviceType device,
                               int device_index) {
  TensorView t = contiguous(data, dtype, shape, device, device_index);
  int i = 0;
  for (int64_t s : stride) t.stride[i++] = s;
  return t;
}

}  // namespace flare
