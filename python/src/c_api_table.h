// c_api_table.h — the C ABI entry points the torch operators library (flare_torch_ops.cpp) calls,
// handed over by the extension module (flare_ext.cpp) as one table of function pointers. The
// operators library links against torch and not against flare; the extension links flare and not
// torch. So the process holds one copy of flare (its kernels, probes and per-stream state), and a
// NumPy or JAX user never needs torch.
#pragma once

#include "flare/c_api.h"

struct flare_c_api_table {
  decltype(&flare_default_options) default_options;
  decltype(&flare_attention_forward) forward;
  decltype(&flare_attention_backward) backward;
  decltype(&flare_block_sparse_attention_forward) block_sparse_forward;
  decltype(&flare_block_sparse_attention_backward) block_sparse_backward;
  decltype(&flare_last_error) last_error;
};
