// params.h — the one contract between the API layer and every backend.
//
// src/core/attention.cpp validates the public arguments and fills an AttentionParams; backends
// (CPU reference, CPU flash, CUDA kernels) see nothing else: raw pointers, 64-bit element strides,
// dimensions and precomputed constants. The struct is trivially copyable so it can be passed to a
// CUDA kernel by value.
#pragma once

#include <cstdint>

#include "core/host_device.h"
#include "flare/tensor.h"

namespace flare {

struct AttentionParams {
  // ---- tensors (element strides; the head_dim stride is always 1) -------------------------
  const void* q = nullptr;  // (b, s_q, h_q, d) or packed (total_q, h_q, d)
  const void* k = nullptr;  // (b, s_k, h_kv, d) or packed (total_k, h_kv, d)
  const void* v = nullptr;
  void* o = nullptr;        // like q
  float* lse = nullptr;     // (b, h_q, s_q) or packed (h_q, total_q); contiguous
  // backward only
  const void* dout = nullptr;  // like q
  void* dq = nullptr;          // like q
  void* dk = nullptr;          // like k
  void* dv = nullptr;          // like v

  // Per tensor: batch stride (0 when packed: rows are offset by cu_seqlens), row (token) stride
  // and head stride.
  int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  int64_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  int64_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;
  int64_t o_batch_stride = 0, o_row_stride = 0, o_head_stride = 0;
  int64_t do_batch_stride = 0, do_row_stride = 0, do_head_stride = 0;
  int64_t dq_batch_stride = 0, dq_row_stride = 0, dq_head_stride = 0;
  int64_t dk_batch_stride = 0, dk_row_stride = 0, dk_head_stride = 0;
  int64_t dv_batch_stride = 0, dv_row_stride = 0, dv_head_stride = 0;
  // lse element (b, h, i) is at b·lse_batch_stride + h·lse_head_stride + row_offset + i.
  int64_t lse_batch_stride = 0, lse_head_stride = 0;

  DType dtype = DType::kFloat32;  // of q, k, v, o, dout, dq, dk, dv
  DeviceType device = DeviceType::kCPU;
  int device_index = 0;

  // ---- dimensions ---------------------------------------------------------------------------
  int batch = 0;
  int heads_q = 0;
  int heads_kv = 0;
  int head_group = 1;   // heads_q / heads_kv
  int head_dim = 0;
  int seqlen_q = 0;     // fixed length: every sequence; varlen: max_seqlen_q
  int seqlen_k = 0;
  int64_t total_q = 0;  // batch·seqlen_q, or the packed token count
  int64_t total_k = 0;
  const int32_t* cu_seqlens_q = nullptr;  // null for fixed length; same device as q
  const int32_t* cu_seqlens_k = nullptr;

  // ---- score modifiers ----------------------------------------------------------------------
  float scale = 0.0f;        // softmax scale
  float scale_log2 = 0.0f;   // scale · log2(e), for exp2-based kernels
  bool causal = false;       // informational: the window below already encodes it
  int window_left = -1;      // −1 unbounded; causal ⇒ window_right = 0
  int window_right = -1;
  float softcap = 0.0f;      // 0 = off
  const float* alibi_slopes = nullptr;  // null = off; slope(b, h) = alibi[b·stride + h]
  int64_t alibi_batch_stride = 0;       // 0 when slopes are (h_q)

  // ---- dropout --------------------------------------------------------------------------------
  float dropout_p = 0.0f;
  float dropout_scale = 1.0f;  // 1 / (1 − p)
  uint64_t seed = 0;
  uint64_t offset = 0;

  bool deterministic = false;

  // ---- block sparsity (flare/block_sparse.h; core/block_mask.h reads it) ----------------------
  // Null = dense. Otherwise element (b, h, i / block_m, j / block_n) of the mask, nonzero or not,
  // says whether row i and key j of sequence b, query head h may meet (the window still applies).
  const void* block_mask = nullptr;  // uint8 or int32; same device as q
  bool block_mask_int32 = false;     // false: uint8
  int block_m = 0;                   // query rows per mask block
  int block_n = 0;                   // keys per mask block
  int block_rows = 0;                // ceil(seqlen_q / block_m): the mask's row blocks
  int block_cols = 0;                // ceil(seqlen_k / block_n)
  // Element strides; 0 on a dimension the mask broadcasts (extent 1).
  int64_t mask_batch_stride = 0, mask_head_stride = 0, mask_row_stride = 0, mask_col_stride = 0;

  FLARE_HD bool is_varlen() const { return cu_seqlens_q != nullptr; }
  FLARE_HD bool has_window() const { return window_left >= 0 || window_right >= 0; }
  // Softcap or ALiBi: the scores are modified (core/score_mod.h) before the softmax.
  FLARE_HD bool has_score_mods() const { return softcap > 0.0f || alibi_slopes != nullptr; }
};

// Where one sequence of the batch lives: row offsets into the packed token dimension (0 for fixed
// length, where the batch stride does the work) and its lengths.
struct SequenceInfo {
  int64_t q_row0 = 0;
  int64_t k_row0 = 0;
  int len_q = 0;
  int len_k = 0;
};

// Host-side when cu_seqlens live on the host; CUDA kernels call it with device pointers.
FLARE_HD SequenceInfo sequence_info(const AttentionParams& p, int b) {
  SequenceInfo s;
  if (p.cu_seqlens_q != nullptr) {
    s.q_row0 = p.cu_seqlens_q[b];
    s.k_row0 = p.cu_seqlens_k[b];
    s.len_q = p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b];
    s.len_k = p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b];
  } else {
    s.len_q = p.seqlen_q;
    s.len_k = p.seqlen_k;
  }
  return s;
}

// Sequence b's first query row in the packed row space of per-row workspaces (b·seqlen_q + i for
// padded batches, cu_seqlens_q[b] + i for varlen), given its sequence_info.
FLARE_HD int64_t packed_q_row0(const AttentionParams& p, int b, const SequenceInfo& s) {
  return p.cu_seqlens_q != nullptr ? s.q_row0 : static_cast<int64_t>(b) * p.seqlen_q;
}

}  // namespace flare
