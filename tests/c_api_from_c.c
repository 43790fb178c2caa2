/* c_api_from_c.c — a caller of the C API written in C99, so that flare/c_api.h is proven to be a
 * valid C header (a C++-only construct in it would fail this compile). test_cpu_c_api calls
 * flare_c_forward and checks its results against the C++ API. */
#include <stddef.h>
#include <stdint.h>

#include "flare/c_api.h"

/* A dense row-major float32 CPU tensor of `ndim` dimensions. */
static flare_tensor dense_f32(void* data, int32_t ndim, const int64_t* shape) {
  flare_tensor t;
  int64_t stride = 1;
  int i;
  t.data = data;
  t.dtype = FLARE_FLOAT32;
  t.device = FLARE_CPU;
  t.device_index = 0;
  t.ndim = ndim;
  for (i = 0; i < 4; ++i) {
    t.shape[i] = 0;
    t.stride[i] = 0;
  }
  for (i = ndim - 1; i >= 0; --i) {
    t.shape[i] = shape[i];
    t.stride[i] = stride;
    stride *= shape[i];
  }
  return t;
}

/* Fixed-length float32 forward on dense buffers: q and o (b, s_q, h_q, d), k and v
 * (b, s_k, h_kv, d), lse (b, h_q, s_q); default options but for `causal` and `backend`.
 * Returns the status code. */
int flare_c_forward(void* q, void* k, void* v, void* o, void* lse, const int64_t* q_shape,
                    const int64_t* k_shape, int32_t causal, int32_t backend) {
  const int64_t lse_shape[3] = {q_shape[0], q_shape[2], q_shape[1]};
  const flare_tensor tq = dense_f32(q, 4, q_shape);
  const flare_tensor tk = dense_f32(k, 4, k_shape);
  const flare_tensor tv = dense_f32(v, 4, k_shape);
  const flare_tensor to = dense_f32(o, 4, q_shape);
  const flare_tensor tlse = dense_f32(lse, 3, lse_shape);
  flare_attention_options options = flare_default_options();
  options.causal = causal;
  options.backend = backend;
  return flare_attention_forward(&tq, &tk, &tv, &to, &tlse, &options, NULL, NULL);
}
