/* flare/c_api.h — the C ABI mirror of flare/attention.h and flare/dist.h, for bindings (Python
 * over DLPack, …).
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

/* uint8 is for block masks (flare_block_mask); attention's tensors are floating point;
 * float8_e4m3 is for the q, k and v of flare_attention_forward_fp8. */
enum flare_dtype {
  FLARE_FLOAT32 = 0,
  FLARE_FLOAT16 = 1,
  FLARE_BFLOAT16 = 2,
  FLARE_INT32 = 3,
  FLARE_UINT8 = 4,
  FLARE_FLOAT8_E4M3 = 5
};
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

/* FP8 inputs, forward only: the C mirror of flare::attention_forward_fp8 (flare/attention.h
 * states the semantics). q, k, v float8_e4m3; o float32, float16 or bfloat16; each descale
 * float32 (batch | 1, heads | 1, blocks | 1) or undefined (1). descale may be NULL (every factor
 * 1). CUDA tensors give FLARE_UNSUPPORTED (no FP8 kernel yet). */
typedef struct flare_fp8_descale {
  flare_tensor q_descale;
  flare_tensor k_descale;
  flare_tensor v_descale;
  int32_t block_rows; /* rows per block where a descale has blocks > 1 */
} flare_fp8_descale;

int flare_attention_forward_fp8(const flare_tensor* q, const flare_tensor* k,
                                const flare_tensor* v, const flare_tensor* o,
                                const flare_tensor* lse, const flare_fp8_descale* descale,
                                const flare_attention_options* options,
                                const flare_varlen* varlen, void* stream);

/* ---- context parallelism: the C mirror of flare/dist.h ---------------------------------------
 * One sequence split across ranks; docs/context-parallel.md describes the algorithm and launch.
 * Handles are opaque. A handle belongs to one rank and is used by one thread at a time; every
 * rank issues the same collective calls in the same order. Every operation of a communicator is
 * bounded by its timeout: a dead or missing peer gives FLARE_DEVICE_ERROR naming it, never a
 * hang, and leaves the communicator unusable. timeout_ms = 0 takes the default (5 minutes).
 * The NCCL entry points return FLARE_UNSUPPORTED in builds without CUDA and NCCL. */
typedef struct flare_comm flare_comm;
typedef struct flare_cp flare_cp;

enum flare_cp_strategy { FLARE_CP_RING = 0, FLARE_CP_ZIGZAG = 1, FLARE_CP_ALL_TO_ALL = 2 };

/* NCCL's unique id: rank 0 makes it (flare_nccl_unique_id), every rank needs the same bytes. */
typedef struct flare_nccl_id {
  unsigned char bytes[128];
} flare_nccl_id;

typedef struct flare_comm_info {
  int32_t rank;
  int32_t size;
  int32_t device;        /* enum flare_device: where its buffers live */
  int32_t device_index;
  int32_t timeout_ms;
  const char* kind;      /* "in-process" or "nccl"; static storage */
} flare_comm_info;

/* Where this process sits in a launch: torchrun-style variables (RANK, WORLD_SIZE, LOCAL_RANK,
 * MASTER_ADDR, MASTER_PORT), else Open MPI's (OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK). */
typedef struct flare_launch_info {
  int32_t rank;
  int32_t size;
  int32_t local_rank;
  int32_t master_port;
  char master_addr[256];
  char source[16];       /* "torchrun" or "mpirun" */
} flare_launch_info;

/* A run of consecutive global rows held by one rank; a shard is one or two of them (zigzag). */
typedef struct flare_sequence_chunk {
  int64_t global_begin;
  int64_t local_begin;
  int64_t length;
} flare_sequence_chunk;

typedef struct flare_sequence_shard {
  int32_t count;
  flare_sequence_chunk chunk[2];
  int64_t length;        /* local rows */
} flare_sequence_shard;

/* What every rank agrees on (self-attention over one global sequence of seqlen rows). */
typedef struct flare_cp_config {
  int32_t strategy;      /* enum flare_cp_strategy */
  int32_t batch;
  int64_t seqlen;
  int32_t heads_q;
  int32_t heads_kv;
  int32_t head_dim;
  int32_t dtype;         /* enum flare_dtype */
  flare_attention_options attention;
  /* A packed variable-length batch: the global pack's cu_seqlens, host int32, num_cu_seqlens =
   * batch + 1 entries (copied at create). NULL and 0: one fixed-length batch. With them, a rank's
   * local tensors hold its rows of every sequence (flare_shard_varlen's layout): q-like
   * (local rows, heads, d), lse (heads_q, local rows); batch and seqlen are 0 or the pack's. */
  const int32_t* cu_seqlens;
  int32_t num_cu_seqlens;
} flare_cp_config;

/* Sums over the calls since the last flare_cp_take_timing (times on CUDA devices only). */
typedef struct flare_cp_timing {
  int32_t calls;
  int32_t exchanges;
  int64_t bytes_sent;
  double comm_ms;
  double compute_ms;
} flare_cp_timing;

int flare_nccl_built(void);
int flare_nccl_unique_id(flare_nccl_id* id);

/* `size` in-process communicators of one group (threads of this process, host memory): comms is
 * an array of `size` handles, comms[r] being rank r's, each destroyed on its own. */
int flare_comm_create_in_process_group(int32_t size, int32_t timeout_ms, flare_comm** comms);
/* An NCCL communicator on CUDA device `device`, rank `rank` of `size` (collective). */
int flare_comm_create_nccl(const flare_nccl_id* id, int32_t rank, int32_t size, int32_t device,
                           int32_t timeout_ms, flare_comm** comm);
/* The launcher's path: reads the environment, shares rank 0's NCCL id over TCP
 * (MASTER_ADDR:MASTER_PORT) and creates the communicator on device LOCAL_RANK. info may be NULL. */
int flare_comm_create_nccl_from_env(int32_t timeout_ms, flare_comm** comm,
                                    flare_launch_info* info);
/* Wraps a caller's ncclComm_t. With take_ownership it is destroyed with the handle; either way a
 * timeout aborts it (docs/context-parallel.md). */
int flare_comm_adopt_nccl(void* nccl_comm, int32_t take_ownership, int32_t timeout_ms,
                          flare_comm** comm);
/* NULL is ignored. Destroy every flare_cp made on a communicator first. */
void flare_comm_destroy(flare_comm* comm);
int flare_comm_get_info(const flare_comm* comm, flare_comm_info* info);
/* Host-blocking: every rank has arrived and this rank's earlier operations have completed. */
int flare_comm_barrier(flare_comm* comm);
/* FLARE_OK, or the error that made the communicator unusable. */
int flare_comm_health(flare_comm* comm);
int flare_launch_info_from_env(flare_launch_info* info);

/* Which global rows rank `rank` of `size` holds, in local order. */
int flare_get_sequence_shard(int32_t strategy, int64_t seqlen, int32_t size, int32_t rank,
                             flare_sequence_shard* shard);
/* Copies rank `rank`'s rows of `full` into `local` (shard) or back (unshard); seq_dim 1 for
 * (b, s, h, d) tensors, 2 for lse (b, h, s). CPU tensors of one dtype. */
int flare_shard_sequence(const flare_tensor* full, int32_t seq_dim, int32_t strategy,
                         int32_t size, int32_t rank, const flare_tensor* local);
int flare_unshard_sequence(const flare_tensor* local, int32_t seq_dim, int32_t strategy,
                           int32_t size, int32_t rank, const flare_tensor* full);

/* Copies rank `rank`'s rows of a packed tensor `full` (global pack cu_seqlens, num_cu_seqlens
 * entries) into `local` (shard) or back (unshard): every sequence cut across the ranks on its
 * own, in `strategy`'s layout. seq_dim 0 for (total, h, d) tensors, 1 for lse (h, total). CPU
 * tensors of one dtype. */
int flare_shard_varlen(const flare_tensor* full, int32_t seq_dim, int32_t strategy,
                       const int32_t* cu_seqlens, int32_t num_cu_seqlens, int32_t size,
                       int32_t rank, const flare_tensor* local);
int flare_unshard_varlen(const flare_tensor* local, int32_t seq_dim, int32_t strategy,
                         const int32_t* cu_seqlens, int32_t num_cu_seqlens, int32_t size,
                         int32_t rank, const flare_tensor* full);

/* Zigzag, bfloat16, default attention options, sizes 0 (to be filled in). */
flare_cp_config flare_default_cp_config(void);
/* Collective: every rank of `comm` calls it with the same config (checked across ranks). comm
 * must outlive the plan. */
int flare_cp_create(flare_comm* comm, const flare_cp_config* config, flare_cp** cp);
void flare_cp_destroy(flare_cp* cp);
/* This rank's rows: local tensors hold shard->length of them, in that order. */
int flare_cp_get_shard(const flare_cp* cp, flare_sequence_shard* shard);
/* Collective. Local tensors: q, o, dout, dq (b, s_local, h_q, d); k, v, dk, dv
 * (b, s_local, h_kv, d); lse (b, h_q, s_local) float32. stream: cudaStream_t or NULL. */
int flare_cp_forward(flare_cp* cp, const flare_tensor* q, const flare_tensor* k,
                     const flare_tensor* v, const flare_tensor* o, const flare_tensor* lse,
                     void* stream);
int flare_cp_backward(flare_cp* cp, const flare_tensor* dout, const flare_tensor* q,
                      const flare_tensor* k, const flare_tensor* v, const flare_tensor* o,
                      const flare_tensor* lse, const flare_tensor* dq, const flare_tensor* dk,
                      const flare_tensor* dv, void* stream);
int flare_cp_set_timing(flare_cp* cp, int32_t on);
int flare_cp_take_timing(flare_cp* cp, flare_cp_timing* timing);

/* Message of the last failed call on this thread ("" if none). Valid until the next call. */
const char* flare_last_error(void);
const char* flare_version(void);
int flare_cuda_built(void);

/* ---- KV-cache decoding: the C mirror of flare/kvcache.h --------------------------------------
 * Attention of q (b, s_q, h_q, d) over a contiguous or paged KV cache, with k_new / v_new
 * appended to the cache in place first; flare/kvcache.h states the shapes and rules. A
 * zero-initialised flare_kvcache_args leaves every optional tensor undefined, cache_seqlen 0,
 * rotary not interleaved and num_splits automatic. Rejected calls write neither o, lse nor the
 * caches. CUDA tensors give FLARE_UNSUPPORTED (no GPU decoding kernels yet). */
typedef struct flare_kvcache_args {
  flare_tensor k_cache;          /* (b_cache, s_cache, h_kv, d), or (num_blocks, block_size, …) */
  flare_tensor v_cache;
  flare_tensor block_table;      /* int32 (b, max_blocks); undefined → contiguous cache */
  flare_tensor cache_seqlens;    /* int32 (b); undefined → cache_seqlen for every sequence */
  int32_t cache_seqlen;
  flare_tensor cache_batch_idx;  /* int32 (b); contiguous caches only */
  flare_tensor k_new;            /* (b, s_new, h_kv, d); both or neither */
  flare_tensor v_new;
  flare_tensor rotary_cos;       /* (s_rot, d_rot / 2); both or neither; needs k_new */
  flare_tensor rotary_sin;
  int32_t rotary_interleaved;
  int32_t num_splits;            /* >= 0; 0 = automatic */
} flare_kvcache_args;

/* lse may be NULL (not returned). stream is a cudaStream_t or NULL. */
int flare_attention_with_kvcache(const flare_tensor* q, const flare_kvcache_args* cache,
                                 const flare_tensor* o, const flare_tensor* lse,
                                 const flare_attention_options* options, void* stream);
/* ---- end of KV-cache decoding ----------------------------------------------------------------- */

/* ---- block-sparse attention: the C mirror of flare/block_sparse.h ------------------------------
 * Attention in which a block mask says which (block_m query rows) x (block_n keys) blocks of the
 * score matrix are computed; an off block is never read. Everything else (shapes, options, varlen,
 * O and LSE) is flare_attention_forward / _backward's. A pair (i, j) is visible iff its block is
 * on AND the options' mask keeps it; a row that sees no key gets O = 0, LSE = -inf, dQ = 0.
 * Rejected calls write no output. CUDA tensors give FLARE_UNSUPPORTED (no GPU kernels yet). */
typedef struct flare_block_mask {
  /* FLARE_UINT8 or FLARE_INT32, nonzero = on, shape (b or 1, h_q or 1, ceil(s_q / block_m),
   * ceil(s_k / block_n)), any strides, on q's device; an extent-1 batch or head dimension
   * broadcasts. Varlen: b sequences, s = max_seqlen, blocks counted from each sequence's start. */
  flare_tensor mask;
  int32_t block_m;  /* query rows per block, >= 1 (the CPU takes any; the GPU will take 128s) */
  int32_t block_n;  /* keys per block, >= 1 */
} flare_block_mask;

/* Writes o and lse. varlen may be NULL (fixed length). stream is a cudaStream_t or NULL. */
int flare_block_sparse_attention_forward(const flare_tensor* q, const flare_tensor* k,
                                         const flare_tensor* v, const flare_tensor* o,
                                         const flare_tensor* lse, const flare_block_mask* mask,
                                         const flare_attention_options* options,
                                         const flare_varlen* varlen, void* stream);

/* With the forward's mask, options, o and lse; writes dq, dk and dv. */
int flare_block_sparse_attention_backward(const flare_tensor* dout, const flare_tensor* q,
                                          const flare_tensor* k, const flare_tensor* v,
                                          const flare_tensor* o, const flare_tensor* lse,
                                          const flare_tensor* dq, const flare_tensor* dk,
                                          const flare_tensor* dv, const flare_block_mask* mask,
                                          const flare_attention_options* options,
                                          const flare_varlen* varlen, void* stream);

/* The fixed patterns of flare/block_sparse.h, written as a row-major (row_blocks, col_blocks)
 * uint8 mask into mask[0 .. row_blocks * col_blocks), which `capacity` bytes must hold (mask may
 * be NULL when there are no blocks). row_blocks, col_blocks >= 0 and at most 2^31 blocks, checked
 * before the buffer. Block (r, c) is on the diagonal when c = r.
 * Local + global: c - r in [-floor(band / 2), ceil(band / 2) - 1], plus the first `global` block
 * rows and columns; band >= 0, global >= 0. Butterfly: r XOR c is 0 or a power of two. */
int flare_local_global_block_mask(int64_t row_blocks, int64_t col_blocks, int64_t band,
                                  int64_t global, uint8_t* mask, int64_t capacity);
int flare_butterfly_block_mask(int64_t row_blocks, int64_t col_blocks, uint8_t* mask,
                               int64_t capacity);
/* ---- end of block-sparse attention ------------------------------------------------------------ */

#ifdef __cplusplus
}
#endif

#endif /* FLARE_C_API_H_ */
