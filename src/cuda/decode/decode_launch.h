// decode_launch.h — the host side of the CUDA KV-cache decoding kernels (decode_kernel.cuh): the
// launches (the grid's shape: decode_grid.h), one instantiation per dtype
// (decode_fp16.cu, decode_bf16.cu).
#pragma once

#include <cuda_runtime_api.h>

#include "cuda/decode/decode_grid.h"
#include "cuda/decode/decode_params.h"
#include "flare/status.h"

namespace flare::cuda::decode {

// What the decoding's CUDA errors name as their operation (cuda_status, device_probe.h).
inline constexpr char kErrorContext[] = "KV-cache decoding";

// Appends k_new / v_new (when p.seqlen_new > 0), then runs the attention and, when
// p.num_splits > 1, the merge (p.partial_o / p.partial_lse must then be allocated). The current
// device is the tensors'; nothing synchronises.
template <DType kDType>
Status launch(const DecodeParams& p, cudaStream_t stream);

}  // namespace flare::cuda::decode
