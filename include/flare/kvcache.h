// flare/kvcache.h — attention of new queries over a KV cache (decoding), with the new keys and
// values appended to the cache in place: flare's counterpart of flash_attn_with_kvcache.
//
// Shapes (FlashAttention conventions; d = head_dim):
//   q                 (b, s_q, h_q, d)
//   k_cache, v_cache  contiguous: (b_cache, s_cache, h_kv, d), sequence i in row cache_batch_idx[i]
//                     (or i) — b_cache ≥ b;
//                     paged: (num_blocks, block_size, h_kv, d) with block_table int32
//                     (b, max_blocks): token t of sequence i lives in block
//                     block_table[i, t / block_size], row t % block_size.
//   cache_seqlens     int32 (b): tokens already in each sequence's cache; or one int for all.
//   k_new, v_new      optional (b, s_new, h_kv, d): written into the cache at positions
//                     cache_seqlens[i] .. cache_seqlens[i] + s_new − 1, then attended to.
//   rotary_cos/sin    optional (s_rot, d_rot / 2), float32 or q's dtype, d_rot even and ≤ d.
//                     Needs k_new. k_new row j is rotated at position cache_seqlens[i] + j; q row
//                     j at cache_seqlens[i] + j when causal or windowed, else at cache_seqlens[i]
//                     (every query at the first new position), as flash_attn does. Interleaved
//                     rotates pairs (2m, 2m+1) (GPT-J); otherwise pairs (m, m + d_rot/2) (GPT-NeoX).
//                     The rotation is computed in fp32 and rounded to the dtype once.
//   o                 (b, s_q, h_q, d) like q;   lse optional, float32 (b, h_q, s_q), contiguous.
// Semantics: attention of q over the first n_i = cache_seqlens[i] + s_new cache positions of each
// sequence, with attention.h's masks aligned to the bottom right: query row j sits at position
// n_i − s_q + j (causal keeps positions ≤ that; windows and ALiBi measure from it). softcap,
// ALiBi, GQA/MQA and the backends are those of attention.h; dropout is not offered (inference).
//
// Rules, each checked before anything is written (a rejected call leaves o, lse and both caches
// untouched): block sizes are any value ≥ 1; the block_table entries a sequence uses
// (its first ceil(n_i / block_size)) lie in [0, num_blocks) — unused entries are not read, so
// padding such as −1 is fine; n_i ≤ the capacity (s_cache, or max_blocks · block_size);
// cache_batch_idx (contiguous caches only) lies in [0, b_cache); a cache row or block that one
// sequence appends to is used by no other sequence of the call; outputs share no byte with any
// other argument, and k_new / v_new none with the caches (checked on byte ranges).
//
// Backends: CPU tensors run on the float64 reference (Backend::kReference) or the CPU flash kernel
// (kAuto, kFlash) over the gathered cache rows; paged and contiguous caches holding the same
// values give bit-identical results. CUDA tensors (float16, bfloat16) run the decoding kernels of
// src/cuda/decode over the cache in place; num_splits (0 = automatic, at most 128) is their
// split-KV count, which the CPU ignores. On CUDA the values of cache_seqlens, block_table and
// cache_batch_idx are checked by the kernels, not the host (that would synchronise): a sequence
// whose values break a rule above gets NaN in its rows of o and lse and nothing appended; the
// rule that appended rows and blocks are private is the caller's to keep there (docs/kvcache.md).
#pragma once

#include "flare/attention.h"
#include "flare/status.h"
#include "flare/tensor.h"

namespace flare {

struct KVCacheArgs {
  TensorView k_cache;          // written in place when k_new is given
  TensorView v_cache;
  TensorView block_table;      // undefined → contiguous cache
  TensorView cache_seqlens;    // int32 (b); undefined → cache_seqlen for every sequence
  int cache_seqlen = 0;
  TensorView cache_batch_idx;  // undefined → sequence i uses cache row i
  TensorView k_new;            // both or neither
  TensorView v_new;
  TensorView rotary_cos;       // both or neither; needs k_new
  TensorView rotary_sin;
  bool rotary_interleaved = false;
  int num_splits = 0;          // ≥ 0; 0 = automatic
};

// Appends k_new / v_new to the cache (if given), then writes o and, if defined, lse.
Status attention_with_kvcache(const TensorView& q, const KVCacheArgs& cache, const TensorView& o,
                              const TensorView& lse, const AttentionOptions& options = {},
                              Stream stream = nullptr);

}  // namespace flare
