// decode_params.h — what the CUDA KV-cache decoding kernels read: attention_with_kvcache's
// arguments after the host has checked everything it can (src/core/kvcache.cpp), as raw pointers
// and element strides. Plain data, passed to the kernels by value.
//
// The integer tensors (cache_seqlens, block_table, cache_batch_idx) stay on the device: reading
// them on the host would need a synchronisation. The kernels check their values where they use
// them (decode_kernel.cuh, "sequence checks"); a sequence whose values break a rule gets NaN in
// its o and lse rows and nothing appended, and no kernel touches memory outside the tensors.
#pragma once

#include <cstdint>

#include "flare/tensor.h"

namespace flare::cuda {

struct DecodeParams {
  DType dtype = DType::kBFloat16;
  int batch = 0, seqlen_q = 0, heads_q = 0, heads_kv = 0, head_dim = 0;
  int group = 1;  // heads_q / heads_kv: the query heads that read one kv head

  const void* q = nullptr;  // (b, s_q, h_q, d)
  int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  void* o = nullptr;  // like q
  int64_t o_batch_stride = 0, o_row_stride = 0, o_head_stride = 0;
  float* lse = nullptr;  // (b, h_q, s_q) contiguous, or null

  // Caches: contiguous (b_cache, s_cache, h_kv, d) or paged (num_blocks, block_size, h_kv, d).
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  int64_t k_stride[3] = {0, 0, 0};  // batch-or-block, row, head
  int64_t v_stride[3] = {0, 0, 0};
  const int32_t* block_table = nullptr;  // null: contiguous
  int64_t block_table_stride[2] = {0, 0};
  int block_size = 1, num_blocks = 0;
  const int32_t* cache_batch_idx = nullptr;  // contiguous only; null: sequence i uses row i
  int64_t cache_batch_idx_stride = 0;
  int batch_cache = 0;
  const int32_t* cache_seqlens = nullptr;  // null: cache_seqlen for every sequence
  int64_t cache_seqlens_stride = 0;
  int cache_seqlen = 0;
  int64_t capacity = 0;  // positions one sequence can hold

  const void* k_new = nullptr;  // (b, s_new, h_kv, d), or null
  const void* v_new = nullptr;
  int64_t k_new_stride[3] = {0, 0, 0};  // batch, row, head
  int64_t v_new_stride[3] = {0, 0, 0};
  int seqlen_new = 0;

  const void* rotary_cos = nullptr;  // (s_rot, d_rot / 2), float32 or dtype; null: no rotary
  const void* rotary_sin = nullptr;
  int64_t cos_stride[2] = {0, 0};
  int64_t sin_stride[2] = {0, 0};
  bool rotary_fp32 = true;
  bool rotary_interleaved = false;
  bool rotate_q_per_row = false;  // q row j at cache_seqlens + j (causal / windowed) or + 0
  int rotary_half = 0;             // d_rot / 2
  int64_t seqlen_rotary = 0;

  float scale = 1.0f, softcap = 0.0f;
  float softcap_inverse = 0.0f;  // 1 / softcap (a division in the kernels is a subroutine call)
  const float* alibi_slopes = nullptr;  // slope of (b, h) at b · alibi_batch_stride + h
  int64_t alibi_batch_stride = 0;
  int window_left = -1, window_right = -1;  // causal ⇒ window_right = 0

  // Every pointer above 16-byte aligned and every row 16-byte aligned (strides and head_dim
  // multiples of 8 elements): the kernels then copy 16 bytes at a time, else element by element.
  bool aligned16 = false;

  // Split-KV: each (sequence, kv head, row tile) is cut into num_splits ranges of keys whose
  // partial results (fp32 O and LSE per row) the merge kernel combines. 1: no workspace.
  int num_splits = 1;
  float* partial_o = nullptr;    // (num_splits, b, h_q, s_q, head_dim)
  float* partial_lse = nullptr;  // (num_splits, b, h_q, s_q)
};

}  // namespace flare::cuda
