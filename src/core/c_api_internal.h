// c_api_internal.h — what the extern "C" files share (c_api.cpp for attention.h, c_api_dist.cpp
// for dist.h, c_api_kvcache.cpp for kvcache.h, c_api_block_sparse.cpp for block_sparse.h): C
// structs to flare types, and the guard that turns a Status or an exception into a code plus the
// thread's last-error message, so nothing crosses the ABI as an exception.
#pragma once

#include <initializer_list>
#include <new>

#include "flare/attention.h"
#include "flare/c_api.h"
#include "flare/status.h"

namespace flare::c_api {

// A flare_tensor's ndim indexes fixed arrays of kMaxDims, so it is checked (by rank_error) before
// the tensor is converted.
TensorView to_view(const flare_tensor* t);
AttentionOptions to_options(const flare_attention_options* o);
// NULL → a fixed-length batch.
VarlenArgs to_varlen(const flare_varlen* v);

// Records `message` as this thread's last error and returns `code`; an allocation failure while
// recording leaves the message empty, the code still reaches the caller.
int fail(int code, const char* message);

template <typename F>
int guarded(F&& f) {
  try {
    const Status s = f();
    return s.ok() ? FLARE_OK : fail(static_cast<int>(s.code()), s.message().c_str());
  } catch (const std::bad_alloc&) {
    return fail(FLARE_OUT_OF_MEMORY, "host allocation failed");
  } catch (...) {
    return fail(FLARE_INTERNAL, "unexpected exception inside flare");
  }
}

// Each tensor argument with its name, so a bad rank is reported against the argument it belongs to.
struct NamedTensor {
  const char* name;
  const flare_tensor* tensor;
};

// The first tensor (then alibi_slopes of `options`, then cu_seqlens of `varlen`; both may be
// null) whose ndim is outside [0, kMaxDims], as kInvalidArgument naming it.
Status rank_error(std::initializer_list<NamedTensor> tensors,
                  const flare_attention_options* options, const flare_varlen* varlen);

}  // namespace flare::c_api
