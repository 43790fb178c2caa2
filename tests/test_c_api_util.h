// test_c_api_util.h — what the tests of the extern "C" API share (test_cpu_c_api*.cpp): C views of
// C++ tensors, options and varlen arguments, and the sentinel byte that shows whether a
// rejected call wrote an output.
#pragma once

#include <algorithm>
#include <cstdint>

#include "flare/attention.h"
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

// The C structs of a C++ call, written field by field here (not by the library's converters, so
// a converter that drops a field fails a test that compares the C and C++ calls' bytes).
inline flare_attention_options to_c(const AttentionOptions& o) {
  flare_attention_options c = flare_default_options();
  c.softmax_scale = o.softmax_scale;
  c.causal = o.causal;
  c.window_left = o.window_left;
  c.window_right = o.window_right;
  c.softcap = o.softcap;
  c.alibi_slopes = to_c(o.alibi_slopes);
  c.dropout_p = o.dropout_p;
  c.dropout_seed = o.dropout_seed;
  c.dropout_offset = o.dropout_offset;
  c.deterministic = o.deterministic;
  c.backend = static_cast<int32_t>(o.backend);
  return c;
}

inline flare_varlen to_c(const VarlenArgs& v) {
  flare_varlen c{};
  c.cu_seqlens_q = to_c(v.cu_seqlens_q);
  c.cu_seqlens_k = to_c(v.cu_seqlens_k);
  c.max_seqlen_q = v.max_seqlen_q;
  c.max_seqlen_k = v.max_seqlen_k;
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
