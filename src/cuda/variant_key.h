// variant_key.h — the key of a compiled (dtype, head-dim bucket) kernel variant, for the dispatch
// switches over the lists in flare/cuda_*_variants.inc (forward and backward alike).
#pragma once

#include "flare/tensor.h"

namespace flare::cuda {

constexpr int variant_key(DType dtype, int bucket) {
  return static_cast<int>(dtype) * 1024 + bucket;
}

}  // namespace flare::cuda
