/* c_api_from_c.c — a caller of the C API written in C99, so that flare/c_api.h is proven to be a
 * valid C header (a C++-only construct in it would fail this compile). test_cpu_c_api calls
 * flare_c_forward, test_cpu_c_api_dist flare_c_cp_rank, test_cpu_c_api_kvcache
 * flare_c_kvcache_decode and test_cpu_c_api_block_sparse flare_c_block_sparse, and each checks
 * the results against the C++ API. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

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

/* One rank of a context-parallel float32 forward and backward, written against the C ABI alone:
 * the plan over `comm` (every rank calls this at once, each with its own handle), then forward and
 * backward on dense buffers of this rank's rows. local_shape is q's (b, s_local, h_q, d); k, v,
 * dk and dv have heads_kv heads. A plan whose shard disagrees with s_local is reported as
 * FLARE_INVALID_ARGUMENT before anything runs. Returns the first failed call's status code. */
int flare_c_cp_rank(flare_comm* comm, int32_t strategy, int32_t causal, int64_t seqlen,
                    const int64_t* local_shape, int32_t heads_kv, void* q, void* k, void* v,
                    void* o, void* lse, void* dout, void* dq, void* dk, void* dv) {
  const int64_t kv_shape[4] = {local_shape[0], local_shape[1], heads_kv, local_shape[3]};
  const int64_t lse_shape[3] = {local_shape[0], local_shape[2], local_shape[1]};
  const flare_tensor tq = dense_f32(q, 4, local_shape), tk = dense_f32(k, 4, kv_shape),
                     tv = dense_f32(v, 4, kv_shape), to = dense_f32(o, 4, local_shape),
                     tl = dense_f32(lse, 3, lse_shape), tdo = dense_f32(dout, 4, local_shape),
                     tdq = dense_f32(dq, 4, local_shape), tdk = dense_f32(dk, 4, kv_shape),
                     tdv = dense_f32(dv, 4, kv_shape);
  flare_cp_config config = flare_default_cp_config();
  flare_sequence_shard shard;
  flare_cp* cp = NULL;
  int code;
  config.strategy = strategy;
  config.batch = (int32_t)local_shape[0];
  config.seqlen = seqlen;
  config.heads_q = (int32_t)local_shape[2];
  config.heads_kv = heads_kv;
  config.head_dim = (int32_t)local_shape[3];
  config.dtype = FLARE_FLOAT32;
  config.attention.causal = causal;
  code = flare_cp_create(comm, &config, &cp);
  if (code != FLARE_OK) return code;
  code = flare_cp_get_shard(cp, &shard);
  if (code == FLARE_OK && shard.length != local_shape[1]) code = FLARE_INVALID_ARGUMENT;
  if (code == FLARE_OK) code = flare_cp_forward(cp, &tq, &tk, &tv, &to, &tl, NULL);
  if (code == FLARE_OK)
    code = flare_cp_backward(cp, &tdo, &tq, &tk, &tv, &to, &tl, &tdq, &tdk, &tdv, NULL);
  flare_cp_destroy(cp);
  return code;
}

/* One decoding step over a paged float32 cache (num_blocks, block_size, h_kv, d), causal, one new
 * token per sequence appended in place: q and o (b, 1, h_q, d), k_new and v_new (b, 1, h_kv, d),
 * block_table int32 (b, max_blocks), cache_seqlens int32 (b), lse (b, h_q, 1). Returns the status
 * code. */
int flare_c_kvcache_decode(void* q, void* k_cache, void* v_cache, void* k_new, void* v_new,
                           void* block_table, void* cache_seqlens, void* o, void* lse,
                           const int64_t* q_shape, const int64_t* cache_shape,
                           int64_t max_blocks) {
  const int64_t new_shape[4] = {q_shape[0], 1, cache_shape[2], cache_shape[3]};
  const int64_t table_shape[2] = {q_shape[0], max_blocks};
  const int64_t lse_shape[3] = {q_shape[0], q_shape[2], 1};
  const flare_tensor tq = dense_f32(q, 4, q_shape), to = dense_f32(o, 4, q_shape),
                     tl = dense_f32(lse, 3, lse_shape);
  flare_attention_options options = flare_default_options();
  flare_kvcache_args args;
  memset(&args, 0, sizeof args);
  args.k_cache = dense_f32(k_cache, 4, cache_shape);
  args.v_cache = dense_f32(v_cache, 4, cache_shape);
  args.k_new = dense_f32(k_new, 4, new_shape);
  args.v_new = dense_f32(v_new, 4, new_shape);
  args.block_table = dense_f32(block_table, 2, table_shape);
  args.block_table.dtype = FLARE_INT32;
  args.cache_seqlens = dense_f32(cache_seqlens, 1, q_shape);
  args.cache_seqlens.dtype = FLARE_INT32;
  options.causal = 1;
  return flare_attention_with_kvcache(&tq, &args, &to, &tl, &options, NULL);
}

/* Block-sparse float32 forward then backward on dense buffers: q, o, dout, dq (b, s_q, h_q, d);
 * k, v, dk, dv (b, s_k, h_kv, d); lse (b, h_q, s_q); a uint8 mask of mask_shape at
 * block_m x block_n; causal as given, other options default. Returns the first failed call's
 * status code. */
int flare_c_block_sparse(void* q, void* k, void* v, void* o, void* lse, void* dout, void* dq,
                         void* dk, void* dv, void* mask, const int64_t* q_shape,
                         const int64_t* k_shape, const int64_t* mask_shape, int32_t block_m,
                         int32_t block_n, int32_t causal) {
  const int64_t lse_shape[3] = {q_shape[0], q_shape[2], q_shape[1]};
  const flare_tensor tq = dense_f32(q, 4, q_shape), tk = dense_f32(k, 4, k_shape),
                     tv = dense_f32(v, 4, k_shape), to = dense_f32(o, 4, q_shape),
                     tl = dense_f32(lse, 3, lse_shape), tdo = dense_f32(dout, 4, q_shape),
                     tdq = dense_f32(dq, 4, q_shape), tdk = dense_f32(dk, 4, k_shape),
                     tdv = dense_f32(dv, 4, k_shape);
  flare_attention_options options = flare_default_options();
  flare_block_mask m;
  int code;
  m.mask = dense_f32(mask, 4, mask_shape);
  m.mask.dtype = FLARE_UINT8;
  m.block_m = block_m;
  m.block_n = block_n;
  options.causal = causal;
  code = flare_block_sparse_attention_forward(&tq, &tk, &tv, &to, &tl, &m, &options, NULL, NULL);
  if (code != FLARE_OK) return code;
  return flare_block_sparse_attention_backward(&tdo, &tq, &tk, &tv, &to, &tl, &tdq, &tdk, &tdv,
                                               &m, &options, NULL, NULL);
}
