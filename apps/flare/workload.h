// workload.h — one attention problem allocated on a device, ready to run forward and backward.
//
// A Workload owns the nine tensors of a problem in FlashAttention's layout — fixed length, or the
// batch packed into one variable-length batch with its cu_seqlens — fills the inputs (q, k, v,
// dout) with seeded random values and poisons the outputs, and calls the public entry points
// exactly as a user would: flare::attention_forward / attention_backward with views on the device
// and the device's stream.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "device.h"
#include "flare/attention.h"

namespace flare::cli {

// Sizes and options of one problem: q, o, dout, dq (b, s_q, h, d); k, v, dk, dv (b, s_k, h_kv, d);
// lse fp32 (b, h, s_q). Packed (varlen): q-like (total_q, h, d), k-like (total_k, h_kv, d), lse
// (h, total_q), the b sequences' lengths spread around s_q and s_k (varlen_lengths).
struct Shape {
  int b = 1;
  int s_q = 1;
  int s_k = 1;
  int h = 1;
  int h_kv = 1;
  int d = 64;
  DType dtype = DType::kFloat32;
  bool causal = false;
  bool varlen = false;
  float softcap = 0.0f;  // > 0: scores capped at ±softcap (softcap · tanh(s / softcap))
  bool alibi = false;    // ALiBi with the usual slopes 2^(−8(i+1)/h) per query head i
  float dropout_p = 0.0f;  // > 0: dropout with this drop probability (a fixed seed)
  bool deterministic = false;  // the backward's deterministic mode (a fixed summation order)

  // Each sequence's query / key length: s_q / s_k b times, or varlen_lengths when packed.
  std::vector<int> lengths_q() const;
  std::vector<int> lengths_k() const;
  // Tokens over the whole batch: b·s_q, or the packed lengths' sum.
  int64_t total_q() const;
  int64_t total_k() const;
  int64_t q_numel() const { return total_q() * h * d; }
  int64_t k_numel() const { return total_k() * h_kv * d; }
  int64_t lse_numel() const { return total_q() * h; }
  // "b=2 s=1024 h=8 d=64 causal fp32"; s as s_q/s_k and h as h/h_kv when they differ; " varlen",
  // " softcap=X", " alibi", " dropout=P" and " deterministic" appended where they apply.
  std::string describe() const;
};

// Lengths of b packed sequences spread evenly around s, so that a varlen case mixes short and long
// ones: sequence i gets round(s · (1/4 + 3/2 · i/(b−1))) tokens (at least 1), s/4 to 7s/4 and
// about b·s in all; one sequence gets s.
std::vector<int> varlen_lengths(int b, int s);

enum class Pass { kForward, kBackward, kForwardBackward };
const char* pass_name(Pass pass);  // "fwd", "bwd", "fwdbwd"

// FLOPs as FlashAttention's benchmarks count them: the forward is two matrix products,
// 4·b·s_q·s_k·h·d, halved when causal; the backward is 2.5× the forward (five products where the
// forward has two); forward+backward 3.5×. A packed batch counts each sequence at its own lengths.
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
  // Allocates and fills; throws RunError when memory runs out or a packed batch has more tokens
  // than cu_seqlens' int32 offsets can hold.
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
  VarlenArgs varlen_;  // undefined for a fixed-length problem
  std::vector<void*> buffers_;
};

}  // namespace flare::cli
