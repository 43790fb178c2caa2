// bwd_tiles.h — tiles of the sm90 (Hopper) backward main kernel and which problems it takes.
//
// Host code without CUDA. One row per head-dim bucket: kBlockM queries per step, kBlockN keys per
// CTA (two consumer warpgroups of 64 keys each; a producer warpgroup issues the loads), and the
// Q/dO pipeline depth. A consumer thread holds dK and dV (d/2 fp32 registers each), Sᵀ and dPᵀ
// (kBlockM/2 each) and a 64×64 dQ tile (32), under the 240 setmaxnreg gives it.
//   d 64:  128 queries × 128 keys: dK/dV 32 + 32, Sᵀ/dPᵀ 64 + 64.
//   d 128:  64 queries × 128 keys: dK/dV 64 + 64, Sᵀ/dPᵀ 32 + 32.
//   d 256:  64 queries × 64 keys, the head dim split between the warpgroups (bwd_kernel.cuh):
//           dK/dV 64 + 64 (128 columns each), Sᵀ/dPᵀ 16 + 16 (32 queries), dQ 64; 225 KiB of
//           shared memory.
#pragma once

#include <cstdint>

#include "core/params.h"
#include "cuda/sm90/layout_check.h"

namespace flare::cuda::sm90 {

struct Bwd90Tile {
  int head_dim;  // bucket
  int block_m;
  int block_n;
  int stages;  // Q/dO buffers
};

inline constexpr Bwd90Tile kBwd90Tiles[] = {
    {64, 128, 128, 2},
    {128, 64, 128, 2},
    {256, 64, 64, 2},
};

constexpr Bwd90Tile bwd90_tile(int bucket) {
  for (const Bwd90Tile& t : kBwd90Tiles)
    if (t.head_dim == bucket) return t;
  return {0, 0, 0, 0};
}

// The sm90 backward bucket of a head_dim, else 0. d 65-96 runs zero-filled in the 128 bucket:
// 1.11-1.33x sm80's 96 bucket on an H200 (d 80 1.19-1.33x; sm90/notes.md), and d 129-160 in the
// 256 bucket: d 160 1.02-1.07x sm80's 192 bucket on an H200, where d 192 ran 0.93-0.97x, so
// d 161-192 stays on sm80.
constexpr int bwd90_bucket(int head_dim) {
  if (head_dim > 32 && head_dim <= 64) return 64;
  if (head_dim > 64 && head_dim <= 128) return 128;
  if (head_dim > 128 && head_dim <= 160) return 256;
  if (head_dim > 192 && head_dim <= 256) return 256;
  return 0;
}

// Whether the sm90 backward main kernel takes a problem (before asking the device): fixed-length
// batches with any causal or sliding-window mask or block mask, GQA/MQA, seqlen_q != seqlen_k, and
// packed variable-length batches without a block mask (rows of all sequences in one map, up to
// 2^31), softcap, ALiBi, dropout and the deterministic mode (without a block mask: the turns
// of bwd_kernel.cuh count every key block between a query block's first and last). TMA needs
// 16-byte aligned q, k, v, dout and strides in whole 16-byte units; dK and dV are written in
// 16-byte chunks.
inline bool backward_supported(const AttentionParams& p) {
  if (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16) return false;
  if (bwd90_bucket(p.head_dim) == 0 || p.head_dim % 8 != 0) return false;
  if (p.deterministic && p.block_mask != nullptr) return false;
  if (!packed_batch_fits(p)) return false;
  if (p.batch > 65535 || p.seqlen_q <= 0 || p.seqlen_k <= 0) return false;
  if (int64_t{p.heads_q} * p.total_q >= (int64_t{1} << 31)) return false;  // TMA row coordinates
  if (!aligned16(p.q) || !aligned16(p.k) || !aligned16(p.v) || !aligned16(p.dout) ||
      !aligned16(p.dk) || !aligned16(p.dv))
    return false;
  const TmaRows r = tma_rows(p);
  return strides_fit_tma({{p.q_row_stride, r.q},
                          {p.q_head_stride, p.heads_q},
                          {p.q_batch_stride, r.batch},
                          {p.k_row_stride, r.k},
                          {p.k_head_stride, p.heads_kv},
                          {p.k_batch_stride, r.batch},
                          {p.v_row_stride, r.k},
                          {p.v_head_stride, p.heads_kv},
                          {p.v_batch_stride, r.batch},
                          {p.do_row_stride, r.q},
                          {p.do_head_stride, p.heads_q},
                          {p.do_batch_stride, r.batch},
                          {p.dk_row_stride, r.k},
                          {p.dk_head_stride, p.heads_kv},
                          {p.dk_batch_stride, r.batch},
                          {p.dv_row_stride, r.k},
                          {p.dv_head_stride, p.heads_kv},
                          {p.dv_batch_stride, r.batch}});
}

}  // namespace flare::cuda::sm90
