// test_c_api_util.h — what the tests of the extern "C" API share (test_cpu_c_api*.cpp): C views of
// C++ tensors, options and varlen arguments, a test problem's call as C structs, and the sentinel
// byte that shows whether a rejected call wrote an output.
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

// Every argument of a C attention call, held as C structs so a test can break any one of them.
struct CCall {
  flare_tensor q, k, v, o, lse, dout, dq, dk, dv;
  flare_attention_options options;
  flare_varlen varlen;
  bool is_varlen;

  explicit CCall(const Problem& pr)
      : q(to_c(pr.q.view)),
        k(to_c(pr.k.view)),
        v(to_c(pr.v.view)),
        o(to_c(pr.o.view)),
        lse(to_c(pr.lse.view)),
        dout(to_c(pr.dout.view)),
        dq(to_c(pr.dq.view)),
        dk(to_c(pr.dk.view)),
        dv(to_c(pr.dv.view)),
        options(to_c(pr.options)),
        varlen(to_c(pr.varlen)),
        is_varlen(pr.is_varlen()) {}

  // The varlen argument as the C API takes it: null for a fixed-length call.
  const flare_varlen* varlen_arg() const { return is_varlen ? &varlen : nullptr; }

  int forward() const {
    return flare_attention_forward(&q, &k, &v, &o, &lse, &options, varlen_arg(), nullptr);
  }
  int backward() const {
    return flare_attention_backward(&dout, &q, &k, &v, &o, &lse, &dq, &dk, &dv, &options,
                                    varlen_arg(), nullptr);
  }
};

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
