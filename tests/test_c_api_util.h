// test_c_api_util.h — what the tests of the extern "C" API share (test_cpu_c_api.cpp and
// test_cpu_c_api_dist.cpp): C views of C++ tensors, and the sentinel byte that shows whether a
// rejected call wrote an output.
#pragma once

#include <algorithm>
#include <cstdint>

#include "flare/c_api.h"
#include "flare/tensor.h"
#include "test_util.h"

namespace flare::test {

inline flare_tensor to_c(const TensorView& t) {
  flare_tensor c{};
  c.data = t.data;
  c.dtype = static_cast<int32_t>(t.dtype);
  c.device = static_cast<int32_t>(t.device);
  c.device_index = t.device_index;
  c.ndim = t.ndim;
  for (int i = 0; i < kMaxDims; ++i) {
    c.shape[i] = t.shape[i];
    c.stride[i] = t.stride[i];
  }
  return c;
}

// Outputs are filled with this byte before a call that must be rejected, and checked after.
constexpr unsigned char kSentinel = 0xA5;

inline void fill_with_sentinel(HostTensor* t) {
  std::fill(t->bytes.begin(), t->bytes.end(), kSentinel);
}

inline bool holds_only_sentinel(const HostTensor& t) {
  return std::all_of(t.bytes.begin(), t.bytes.end(),
                     [](unsigned char b) { return b == kSentinel; });
}

}  // namespace flare::test
