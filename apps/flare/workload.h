// workload.h — one attention problem allocated on a device, ready to run forward and backward.
//
// A Workload owns the nine tensors of a fixed-length problem in FlashAttention's layout, fills the
// inputs (q, k, v, dout) with seeded random values and poisons the outputs, and calls the public
// entry points exactly as a user would: flare::attention_forward / attention_backward with views
// on the device and the device's stream.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "device.h"
#include "flare/attention.h"

namespace flare::cli {

// Sizes and options of one problem: q, o, dout, dq (b, s_q, h, d); k, v, dk, dv (b, s_k, h_kv, d);
// lse fp32 (b, h, s_q).
struct Shape {
  int b = 1;
  int s_q = 1;
  int s_k = 1;
  int h = 1;
  int h_kv = 1;
  int d = 64;
  DType dtype = DType::kFloat32;
  bool causal = false;

  int64_t q_numel() const { return int64_t{b} * s_q * h * d; }
  int64_t k_numel() const { return int64_t{b} * s_k * h_kv * d; }
  int64_t lse_numel() const { return int64_t{b} * h * s_q; }
  // "b=2 s=1024 h=8 d=64 causal fp32"; s as s_q/s_k and h as h/h_kv when they differ.
  std::string describe() const;
};

enum class Pass { kForward, kBackward, kForwardBackward };
const char* pass_name(Pass pass);  // "fwd", "bwd", "fwdbwd"

// FLOPs as FlashAttention's benchmarks count them: the forward is two matrix products,
// 4·b·s_q·s_k·h·d, halved when causal; the backward is 2.5× the forward (five products where the
// forward has two); forward+backward 3.5×.
double attention_flops(const Shape& shape, Pass pass);

// Names used on the command line and in result files: fp32, fp16, bf16.
const char* short_dtype_name(DType dtype);
DType parse_dtype(const std::string& name);  // one of the names above

// The middle of the sorted times (mean of the two middle ones for an even count).
double median(std::vector<double> v);

// Views of the nine tensors of a problem, on one device.
struct Tensors {
  TensorView q, k, v, o, lse, dout, dq, dk, dv;
};

// Host copies of a problem's tensors (views into owned bytes).
struct HostTensors {
  std::vector<std::vector<unsigned char>> storage;
  Tensors views;
};

class Workload {
 public:
  // Allocates and fills; throws RunError when memory runs out.
  Workload(Device& device, const Shape& shape, uint64_t seed);
  ~Workload();
  Workload(const Workload&) = delete;
  Workload& operator=(const Workload&) = delete;

  Status forward() const;
  Status backward() const;  // needs o and lse from a forward
  void poison_outputs();
  HostTensors to_host() const;

  const Shape& shape() const { return shape_; }
  const AttentionOptions& options() const { return options_; }

 private:
  TensorView make(DType dtype, std::initializer_list<int64_t> shape, const char* what);

  Device& device_;
  Shape shape_;
  AttentionOptions options_;
  Tensors t_;
  std::vector<void*> buffers_;
};

}  // namespace flare::cli
