// bwd_launch.h — the host-side face of the sm80 backward: the workspace the three kernels share
// and their launchers. The main kernel's launcher is defined in bwd_kernel.cuh and instantiated
// once per (dtype, head-dim bucket) in a generated translation unit (src/cuda/kernels.cmake);
// the preprocess and convert kernels live in bwd_prepost.cu. Including this costs no device code.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/params.h"
#include "flare/status.h"

namespace flare::cuda::sm80 {

// Indices of BwdWorkspace::nonfinite.
inline constexpr int kNonfiniteDq = 0, kNonfiniteDkDv = 1;

// Stream-ordered scratch of one backward call (allocated by src/cuda/backward.cpp), plus the
// launch-shape decisions the three kernels must agree on. Trivially copyable: passed by value.
struct BwdWorkspace {
  // fp32 dQ accumulator, (splits, heads_q, total_q, bucket): row r of head h of split s at
  // ((s·heads_q + h)·total_q + r)·bucket, where r is the packed row (b·seqlen_q + i, or
  // cu_seqlens_q[b] + i). Columns past head_dim stay zero.
  float* dq_accum = nullptr;
  // D_i = rowsum(dO∘O), (heads_q, total_q), fp32.
  float* dsum = nullptr;
  // Two flags, zeroed by the preprocess kernel and set to 1 where an output element comes out
  // ±Inf/NaN: [kNonfiniteDq] by the convert kernels, [kNonfiniteDkDv] by the main kernels. The
  // fixup kernel does its work only where one is set.
  int* nonfinite = nullptr;
  // Elements between split slices of dq_accum: 0 when every CTA adds into one slice with
  // atomics (the default), the slice size in deterministic mode, where CTA x owns slice x.
  int64_t dq_split_stride = 0;
  int num_splits = 1;         // slices the convert kernel sums, in order
  // Key blocks per dQ slice (> 1 only if deterministic): sm80, a run one CTA walks; sm90, one
  // CTA each.
  int kv_blocks_per_cta = 1;
  // The sm90 kernel's deterministic mode: one counter per (dQ slice, query head, query block),
  // zeroed per call, of the dQ tile adds done into that block (sm90/bwd_kernel.cuh);
  // dq_turn_stride counters per query head. Null otherwise. A slice is kv_blocks_per_cta
  // consecutive key blocks, one CTA each, taking turns in descending key order where set
  // (causal and right-windowed masks), else ascending.
  int* dq_turns = nullptr;
  int64_t dq_turn_stride = 0;
  bool dq_turns_descending = false;
  int bucket = 0;             // head-dim bucket: the accumulator's row length
  int stages = 0;             // Q/dO buffers of the main kernel (BwdTile::stages or min_stages)
  bool vec = false;           // q, k, v, dout rows 16-byte aligned and head_dim % 8 == 0
  bool pair_store = false;    // dk, dv element pairs (even columns) 4-byte aligned
  bool store16 = false;       // dk, dv rows 16-byte aligned and head_dim % 8 == 0
  int tile_group = 1;         // the main grid's CTA order (sm80/tile_order.cuh)
};

// The main kernel: dK, dV (written) and dQ (added into dq_accum). Checks the launch, never
// synchronises.
template <DType kDType, int kHeadDim>
Status launch_backward_main(const AttentionParams& p, const BwdWorkspace& w, int key_blocks,
                            cudaStream_t stream);

// D = rowsum(dO∘O) into w.dsum; zeroes every slice of w.dq_accum.
Status launch_backward_preprocess(const AttentionParams& p, const BwdWorkspace& w,
                                  cudaStream_t stream);
// dq = scale · Σ_s dq_accum[s], rounded to the dtype, written with dq's strides.
Status launch_backward_convert(const AttentionParams& p, const BwdWorkspace& w,
                               cudaStream_t stream);

// After convert: where w.nonfinite has a flag set, every dq row (kNonfiniteDq) or dk/dv row
// (kNonfiniteDkDv) holding ±Inf/NaN is recomputed exactly from the inputs
// (cuda/nonfinite_fixup.cuh), so a masked pair's 0·Inf in the main kernel's products cannot reach
// it; otherwise its CTAs return at once. `ctas` sizes the grid (its warps stride over the rows).
Status launch_backward_fixup(const AttentionParams& p, const BwdWorkspace& w, int ctas,
                             cudaStream_t stream);

}  // namespace flare::cuda::sm80
