// variant_key.h — the key of a compiled (dtype, head-dim bucket) kernel variant, for the dispatch
// switches over the lists in flare/cuda_*_variants.inc (forward and backward alike), and the check
// that a tile table and the compiled list agree.
#pragma once

#include <cstddef>

#include "flare/tensor.h"

namespace flare::cuda {

constexpr int variant_key(DType dtype, int bucket) {
  return static_cast<int>(dtype) * 1024 + bucket;
}

// Whether every row of a tile table (rows with a head_dim bucket) has a compiled unit among
// `compiled` (the buckets kernels.cmake instantiated). A unit without a row fails its kernel
// config's static_assert; this catches the other way.
template <typename Tile, std::size_t kRows, std::size_t kUnits>
constexpr bool every_tile_compiled(const Tile (&tiles)[kRows], const int (&compiled)[kUnits]) {
  for (const Tile& t : tiles) {
    bool found = false;
    for (int bucket : compiled) found = found || bucket == t.head_dim;
    if (!found) return false;
  }
  return true;
}

}  // namespace flare::cuda
