// adamw.h — the optimizer step on the GPU: the global gradient L2 norm with its clip scale, and
// AdamW over the flat fp32 master weights, kept as two halves: the bf16 weights the model reads
// and the low 16 bits (core/split_master.h), so no separate fp32 copy exists.
//
// Gradients are fp32. A bf16 gradient (llm.c's choice) halves their memory, but micro-batch
// accumulation in bf16 loses the small contributions (8 bits of mantissa), and the CPU reference
// (cpu/ops.h, core/adamw.h) accumulates in fp32, so fp32 gradients keep the GPU comparable to it
// element by element. The cost: 4 bytes per parameter instead of 2, 10.6 GB instead of 5.3 GB for
// GPT-3 2.7B (beside 2 bytes of bf16 weights, 2 of the master's low halves and 8 of fp32 m and v:
// 14 → 16 bytes per parameter); ZeRO sharding of the gradients is where that comes back.
//
// The element formulas are core/adamw.h's, operation for operation (torch.optim.AdamW): fp32
// arithmetic, bias corrections and the decay factor computed in double on the host and rounded
// to fp32, eps outside the sqrt, decay only on tensors whose ParamSpec says weight_decay, bf16
// weights rounded to nearest even. The clip scale is read from device memory (written there by
// gradient_norm), so clipping needs no host wait.
//
// Both kernels walk a table of chunks (at most 64 Ki elements, each inside one tensor, carrying
// its weight-decay flag), built once from the ParameterLayout; the alignment gaps between tensors
// are never touched. The norm sums squares in double, per chunk in a fixed order and then over the
// chunks in table order: the same bits every run, and equal to core's gradient_norm (also double)
// to fp32 precision.
#pragma once

#include <cstdint>
#include <vector>

#include "train/core/adamw.h"
#include "train/core/model_config.h"
#include "train/cuda/common.h"

namespace flare::train::cuda {

// One piece of one tensor of the flat buffer: elements [begin, end).
struct TensorChunk {
  int64_t begin = 0;
  int64_t end = 0;
  int32_t weight_decay = 0;  // 1: the tensor decays
  int32_t reserved = 0;
};

// The chunk table on the device, built from a layout (a setup call: it allocates and copies).
class DeviceChunkTable {
 public:
  static constexpr int64_t kChunkElements = int64_t{1} << 16;

  DeviceChunkTable() = default;
  ~DeviceChunkTable();
  DeviceChunkTable(const DeviceChunkTable&) = delete;
  DeviceChunkTable& operator=(const DeviceChunkTable&) = delete;

  Status init(const ParameterLayout& layout);
  const TensorChunk* chunks() const { return chunks_; }
  int64_t count() const { return count_; }

 private:
  TensorChunk* chunks_ = nullptr;
  int64_t count_ = 0;
};

// The host side of the table, in order (exposed for tests).
std::vector<TensorChunk> tensor_chunks(const ParameterLayout& layout, int64_t chunk_elements);

int64_t gradient_norm_scratch_bytes(const DeviceChunkTable& table);

// norm_and_scale (2 fp32, device) written: [0] = ‖grads‖₂, [1] = min(1, max_norm / (norm + 1e-6)),
// or 1 when max_norm is 0 (clipping off), as core's clip_scale.
Status gradient_norm(const DeviceChunkTable& table, GradientIn grads, double max_norm,
                     float* norm_and_scale, void* scratch, cudaStream_t stream);

// The two halves of gradient_norm for a gradient spread over ranks (data parallel, ZeRO shards):
// each rank writes the sum of squares of its part (*sum_of_squares, device, double; the same
// chunk order and bits as gradient_norm's), the ranks exchange them, and every rank turns the
// `count` sums (sums[0], sums[stride], …: one per rank) into the norm and clip scale by adding them
// in index order, so every rank holds the same bits. With one sum, norm_from_sums gives
// gradient_norm's result exactly.
Status gradient_sum_of_squares(const DeviceChunkTable& table, GradientIn grads,
                               double* sum_of_squares, void* scratch, cudaStream_t stream);
Status norm_from_sums(const double* sums, int64_t count, int64_t stride, double max_norm,
                      float* norm_and_scale, cudaStream_t stream);

// One AdamW step. The gradient scale is step.grad_scale × *grad_scale_device (e.g. &norm_and_scale[1]
// of gradient_norm), or step.grad_scale alone when grad_scale_device is null. The fp32 master is
// (weights, low), its two halves (core/split_master.h: the bf16 weight the model reads and the low
// 16 bits); both are updated, and m and v.
Status adamw_update(const DeviceChunkTable& table, const AdamWStep& step,
                    const float* grad_scale_device, GradientIn grads, bf16* weights, uint16_t* low,
                    float* m, float* v, cudaStream_t stream);

}  // namespace flare::train::cuda
