// decode_launch.h — the host side of the CUDA KV-cache decoding kernels (decode_kernel.cuh): the
// tile facts the launcher sizes its grid with, and the launches, one instantiation per dtype
// (decode_fp16.cu, decode_bf16.cu).
#pragma once

#include <cuda_runtime_api.h>

#include "cuda/decode/decode_params.h"
#include "flare/status.h"

namespace flare::cuda::decode {

// Head-dim buckets of the kernels: head_dim is zero-padded up to the bucket. 0: none fits.
constexpr int head_dim_bucket(int head_dim) {
  return head_dim <= 64 ? 64 : head_dim <= 128 ? 128 : head_dim <= 256 ? 256 : 0;
}
// Keys in one block a warp handles: 4 KiB of fp16/bf16 per K or V block (16 keys at least, one
// mma k-step of P·V), so that three CTAs fit on an SM up to head dim 128 (decode_kernel.cuh).
constexpr int keys_per_block(int bucket) { return 2048 / bucket > 16 ? 2048 / bucket : 16; }
// CTAs of the attention kernel one SM holds (shared memory and registers).
constexpr int ctas_per_sm(int bucket) { return bucket <= 128 ? 3 : 1; }
constexpr int kRowsPerTile = 16;  // packed query rows per CTA
constexpr int kMaxSplits = 128;
// What the decoding's CUDA errors name as their operation (cuda_status, device_probe.h).
inline constexpr char kErrorContext[] = "KV-cache decoding";

// Appends k_new / v_new (when p.seqlen_new > 0), then runs the attention and, when
// p.num_splits > 1, the merge (p.partial_o / p.partial_lse must then be allocated). The current
// device is the tensors'; nothing synchronises.
template <DType kDType>
Status launch(const DecodeParams& p, cudaStream_t stream);

}  // namespace flare::cuda::decode
