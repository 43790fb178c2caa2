// element_type.cuh — the CUDA element type of a 16-bit DType, for every kernel family.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "flare/tensor.h"

namespace flare::cuda {

template <DType kDType>
using ElementOf = std::conditional_t<kDType == DType::kFloat16, __half, __nv_bfloat16>;

}  // namespace flare::cuda
