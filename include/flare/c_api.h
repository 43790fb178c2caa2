/* flare/c_api.h — the C ABI mirror of flare/attention.h, for bindings (Python over DLPack, …).
 *
 * Every function returns a flare_status_code (0 = OK). On failure, flare_last_error() returns the
 * message of the last failed call on the calling thread; nothing was written to any output.
 * No function throws, exits or prints. */
#ifndef FLARE_C_API_H_
#define FLARE_C_API_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum flare_status_code {
  FLARE_OK = 0,
  FLARE_INVALID_ARGUMENT = 1,
  FLARE_UNSUPPORTED = 2,
  FLARE_DEVICE_ERROR = 3,
  FLARE_OUT_OF_MEMORY = 4,
  FLARE_INTERNAL = 5
};

enum flare_dtype { FLARE_FLOAT32 = 0, FLARE_FLOAT16 = 1, FLARE_BFLOAT16 = 2, FLARE_INT32 = 3 };
enum flare_device { FLARE_CPU = 0, FLARE_CUDA = 1 };
enum flare_backend { FLARE_BACKEND_AUTO = 0, FLARE_BACKEND_REFERENCE = 1, FLARE_BACKEND_FLASH = 2 };

/* A tensor view; ndim = 0 and data = NULL mean "not given". Strides are in elements. */
typedef struct flare_tensor {
  void* data;
  int32_t dtype;        /* enum flare_dtype */
  int32_t device;       /* enum flare_device */
  int32_t device_index;
  int32_t ndim;
  int64_t shape[4];
  int64_t stride[4];
} flare_tensor;

typedef struct flare_attention_options {
  float softmax_scale;  /* 0 → 1/sqrt(head_dim) */
  int32_t causal;
  int32_t window_left;  /* −1 = unbounded */
  int32_t window_right;
  float softcap;        /* 0 = off */
  flare_tensor alibi_slopes;
  float dropout_p;
  uint64_t dropout_seed;
  uint64_t dropout_offset;
  int32_t deterministic;
  int32_t backend;      /* enum flare_backend */
} flare_attention_options;

typedef struct flare_varlen {
  flare_tensor cu_seqlens_q; /* int32 (batch + 1); both undefined for fixed-length batches */
  flare_tensor cu_seqlens_k;
  int32_t max_seqlen_q;
  int32_t max_seqlen_k;
} flare_varlen;

/* Options with the defaults of flare::AttentionOptions. */
flare_attention_options flare_default_options(void);

/* varlen may be NULL (fixed length). stream is a cudaStream_t or NULL. */
int flare_attention_forward(const flare_tensor* q, const flare_tensor* k, const flare_tensor* v,
                            const flare_tensor* o, const flare_tensor* lse,
                            const flare_attention_options* options, const flare_varlen* varlen,
                            void* stream);

int flare_attention_backward(const flare_tensor* dout, const flare_tensor* q,
                             const flare_tensor* k, const flare_tensor* v, const flare_tensor* o,
                             const flare_tensor* lse, const flare_tensor* dq,
                             const flare_tensor* dk, const flare_tensor* dv,
                             const flare_attention_options* options, const flare_varlen* varlen,
                             void* stream);

/* Message of the last failed call on this thread ("" if none). Valid until the next call. */
const char* flare_last_error(void);
const char* flare_version(void);
int flare_cuda_built(void);

#ifdef __cplusplus
}
#endif

#endif /* FLARE_C_API_H_ */
