// backward.cpp — flare::cuda::backward: the FlashAttention-2 backward on CUDA tensors.
//
// Three stream-ordered launches over one scratch allocation, and a fourth under masks:
//   preprocess  D = rowsum(dO∘O) (fp32); zero the fp32 dQ accumulator      (bwd_prepost.cu)
//   main        per (key block, kv head, batch): dK, dV written; dQ added    (sm80/bwd_kernel.cuh;
//               on Hopper sm90/bwd_kernel.cuh for the problems it takes)
//   convert     dq = scale · accumulator, rounded to the dtype              (bwd_prepost.cu)
//   fixup       non-finite dq, dk, dv rows recomputed exactly; returns at   (bwd_prepost.cu)
//               once unless a kernel above found one; only under masked pairs
// The scratch comes from cudaMallocAsync and goes back with cudaFreeAsync on the caller's stream,
// so nothing here waits for the device.
//
// Runtime values become template arguments in exactly one place, the switch below. The compiled
// (dtype, head-dim bucket) variants are listed once, in src/cuda/kernels.cmake, which writes them
// to flare/cuda_bwd_variants.inc; a head_dim runs in the smallest bucket that holds it (64, 128,
// 256) with the columns past it zero-filled. Anything else is answered kUnsupported by name.
//
// Deterministic mode trades parallelism for a fixed summation order. sm80: the key blocks of a
// (batch, kv head) are cut into runs, one CTA per run with its own dQ slice, the number of runs
// chosen to give about two CTAs per SM (as FlashAttention-2's deterministic backward does). sm90:
// one CTA per key block as always, the key blocks adding into a query block's dQ rows in turn
// (counters in the workspace: sm90/bwd_kernel.cuh), in slices where the turns would wait long.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "core/backends.h"
#include "cuda/device_probe.h"
#include "cuda/dispatch.h"
#include "cuda/sm80/bwd_launch.h"
#include "cuda/sm80/bwd_tiles.h"
#include "cuda/sm80/tile_order.h"
#include "cuda/sm90/bwd_launch.h"
#include "cuda/sm90/bwd_tiles.h"
#include "cuda/variant_key.h"

namespace flare {
namespace cuda {
namespace {

// The sm90 backward's compiled buckets, and every kBwd90Tiles row among them.
constexpr int kBwd90Compiled[] = {
#define FLARE_CUDA_BWD90_VARIANT(DT, HD) HD,
#include "flare/cuda_bwd90_variants.inc"
#undef FLARE_CUDA_BWD90_VARIANT
};
static_assert(every_tile_compiled(sm90::kBwd90Tiles, kBwd90Compiled),
              "a kBwd90Tiles row has no compiled unit: list its bucket in kernels.cmake's "
              "FLARE_CUDA_BWD90_HEAD_DIMS");

Status launch_main(const AttentionParams& p, const sm80::BwdWorkspace& w, int key_blocks,
                   cudaStream_t stream) {
  switch (variant_key(p.dtype, w.bucket)) {
#define FLARE_CUDA_BWD_VARIANT(DT, HD) \
  case variant_key(DType::DT, HD):     \
    return sm80::launch_backward_main<DType::DT, HD>(p, w, key_blocks, stream);
#include "flare/cuda_bwd_variants.inc"
#undef FLARE_CUDA_BWD_VARIANT
    default:
      return Status::unsupported("q: no CUDA backward kernel for dtype " +
                                 std::string(dtype_name(p.dtype)) + ", head_dim " +
                                 std::to_string(p.head_dim));
  }
}

// Whether the sm90 main kernel runs p: a problem it takes (sm90/bwd_tiles.h), in a compiled
// variant, on a device that runs its sm_90a code; never with overrides.arch 80. Asked before the
// workspace is sized: the dQ accumulator's rows are the bucket of the main kernel that runs, and
// sm90's bucket can be wider than sm80's (d 80: 128, not 96).
bool sm90_runs(const AttentionParams& p, const DispatchOverrides& overrides) {
  if (overrides.arch == 80 || !sm90::backward_supported(p)) return false;
  switch (variant_key(p.dtype, sm90::bwd90_bucket(p.head_dim))) {
#define FLARE_CUDA_BWD90_VARIANT(DT, HD) case variant_key(DType::DT, HD):
#include "flare/cuda_bwd90_variants.inc"
#undef FLARE_CUDA_BWD90_VARIANT
      return runs_sm90_kernels();
    default:
      return false;
  }
}

// The sm90 main kernel of w.bucket; only after sm90_runs(p).
Status launch_main_sm90(const AttentionParams& p, const sm80::BwdWorkspace& w,
                        cudaStream_t stream) {
  switch (variant_key(p.dtype, w.bucket)) {
#define FLARE_CUDA_BWD90_VARIANT(DT, HD) \
  case variant_key(DType::DT, HD):       \
    return sm90::launch_backward_main<DType::DT, HD>(p, w, stream);
#include "flare/cuda_bwd90_variants.inc"
#undef FLARE_CUDA_BWD90_VARIANT
    default:
      return Status::internal("backward: no sm90 kernel for bucket " + std::to_string(w.bucket));
  }
}

bool aligned(const void* ptr, uintptr_t bytes) {
  return (reinterpret_cast<uintptr_t>(ptr) & (bytes - 1)) == 0;
}

// Whether a tile of the main kernels can hold a masked pair: a causal or windowed mask, varlen, or
// a ragged last query or key block. Only then can a product multiply a masked pair's P = 0 or
// dS = 0 into an infinite operand (or form its dS from an infinite dP) and make a gradient NaN
// that the reference has finite (cuda/nonfinite_fixup.cuh), and only then is the fixup kernel
// launched. Every block of both kernel families divides kBlocksDivide.
constexpr int kBlocksDivide = 128;
constexpr bool blocks_divide(int n) {
  for (const sm80::BwdTile& t : sm80::kBwdTiles)
    if (n % t.block_m != 0 || n % t.block_n != 0) return false;
  for (const sm90::Bwd90Tile& t : sm90::kBwd90Tiles)
    if (n % t.block_m != 0 || n % t.block_n != 0) return false;
  return true;
}
static_assert(blocks_divide(kBlocksDivide), "a backward tile does not divide kBlocksDivide");

bool has_masked_pairs(const AttentionParams& p) {
  return p.has_window() || p.is_varlen() || p.seqlen_q % kBlocksDivide != 0 ||
         p.seqlen_k % kBlocksDivide != 0;
}

// Everything after the device is current: workspace, the launches, the free. `*family` is the
// main kernel's family, once chosen.
Status run_backward(const AttentionParams& p, const DispatchOverrides& overrides,
                    KernelFamily* family, cudaStream_t stream) {
  DeviceFacts device;
  if (const Status s = current_device_facts(&device); !s.ok())
    return Status::device_error("backward: " + s.message());
  const int sms = device.sms, smem_optin = device.smem_optin;

  sm80::BwdWorkspace w;
  w.bucket = sm80::bwd_head_dim_bucket(p.head_dim);
  const sm80::BwdTile tile = sm80::bwd_tile(w.bucket);
  if (w.bucket == 0)
    return Status::unsupported("q: no CUDA backward kernel for head_dim " +
                               std::to_string(p.head_dim));
  // Double-buffered Q/dO where the device's shared memory allows, else the tile's fallback.
  w.stages =
      sm80::bwd_smem_bytes(w.bucket, tile.stages) <= smem_optin ? tile.stages : tile.min_stages;
  const int forced = overrides.backward_stages;
  if ((forced == tile.stages || forced == tile.min_stages) &&
      sm80::bwd_smem_bytes(w.bucket, forced) <= smem_optin)
    w.stages = forced;
  // Block-sparse problems run the two-buffer steps, the ones that walk a block mask
  // (sm80/bwd_kernel.cuh).
  if (p.block_mask != nullptr) w.stages = 2;
  if (sm80::bwd_smem_bytes(w.bucket, w.stages) > smem_optin)
    return Status::unsupported(
        "q: the CUDA backward for head_dim " + std::to_string(p.head_dim) + " needs " +
        std::to_string(sm80::bwd_smem_bytes(w.bucket, w.stages)) +
        " bytes of shared memory per block; this device allows " + std::to_string(smem_optin));
  const int64_t strides = p.q_batch_stride | p.q_row_stride | p.q_head_stride | p.k_batch_stride |
                          p.k_row_stride | p.k_head_stride | p.v_batch_stride | p.v_row_stride |
                          p.v_head_stride | p.do_batch_stride | p.do_row_stride | p.do_head_stride;
  // 16-byte copies need whole chunks per row and 16-byte-aligned rows.
  w.vec = p.head_dim % 8 == 0 && strides % 8 == 0 && aligned(p.q, 16) && aligned(p.k, 16) &&
          aligned(p.v, 16) && aligned(p.dout, 16);
  const int64_t out_strides = p.dk_batch_stride | p.dk_row_stride | p.dk_head_stride |
                              p.dv_batch_stride | p.dv_row_stride | p.dv_head_stride;
  w.pair_store = out_strides % 2 == 0 && aligned(p.dk, 4) && aligned(p.dv, 4);
  w.store16 = p.head_dim % 8 == 0 && out_strides % 8 == 0 && aligned(p.dk, 16) && aligned(p.dv, 16);

  const bool sm90 = sm90_runs(p, overrides);
  if (sm90) w.bucket = sm90::bwd90_bucket(p.head_dim);
  *family = sm90 ? KernelFamily::kSm90 : KernelFamily::kSm80;

  const int key_blocks = (p.seqlen_k + tile.block_n - 1) / tile.block_n;
  int64_t turns = 0;  // sm90's dQ turn counters
  if (p.deterministic && key_blocks > 0 && p.batch > 0) {
    // dQ slices, summed in order by the convert kernel: sm80, one per run of key blocks (about
    // two CTAs per SM, as FlashAttention-2's deterministic backward does). sm90's key blocks take
    // turns in each slice; causal and right-windowed masks walk a key block's query blocks from
    // its diagonal, so the turns go in descending key order, each key block's turn at a query
    // block coming while the one above it is steps ahead, and one slice does. Other masks start
    // every key block at the same query block, and in ascending turns the n-th key block of a
    // slice starts n steps late: there the runs are also kept to about a quarter of a CTA's
    // steps, at most 4 slices for that (each slice is another fp32 copy of dQ).
    const sm90::Bwd90Tile tile90 = sm90 ? sm90::bwd90_tile(w.bucket) : sm90::Bwd90Tile{};
    const int n_blocks = sm90 ? (p.seqlen_k + tile90.block_n - 1) / tile90.block_n : key_blocks;
    const int64_t units = static_cast<int64_t>(p.batch) * p.heads_kv;
    const int64_t rows_per_slice = int64_t{p.heads_q} * p.total_q;
    w.dq_turns_descending = sm90 && p.window_right >= 0;
    int64_t runs = std::clamp<int64_t>((2 * sms + units - 1) / units, 1, n_blocks);
    if (w.dq_turns_descending) {
      runs = 1;
    } else if (sm90) {
      const int64_t cta_steps =
          std::max<int64_t>(1, int64_t{(p.seqlen_q + tile90.block_m - 1) / tile90.block_m} *
                                   p.head_group);
      const int64_t short_runs = (4 * int64_t{n_blocks} + cta_steps - 1) / cta_steps;
      runs = std::clamp<int64_t>(std::max(runs, std::min<int64_t>(short_runs, 4)), 1, n_blocks);
    }
    if (sm90) {
      // Turn counters per slice and query head: one per query block of at least 64 rows, plus
      // one per sequence (the kernel's indexing). The kernel indexes them, and the slices' rows
      // in the accumulator's tensor map, in 32 bits.
      w.dq_turn_stride = p.total_q / 64 + 1 + p.batch;
      const int64_t per_slice = std::max(rows_per_slice, int64_t{p.heads_q} * w.dq_turn_stride);
      runs = std::max<int64_t>(1, std::min(runs, ((int64_t{1} << 31) - 1) / per_slice));
    }
    w.kv_blocks_per_cta = static_cast<int>((n_blocks + runs - 1) / runs);
    w.num_splits = (n_blocks + w.kv_blocks_per_cta - 1) / w.kv_blocks_per_cta;
    w.dq_split_stride = rows_per_slice * w.bucket;
    if (sm90) turns = int64_t{w.num_splits} * p.heads_q * w.dq_turn_stride;
  }

  // Grouped CTA order under causal or windowed masks: a kv head's CTAs reread its query heads'
  // Q and dO (2 bytes each) and add into their fp32 dQ rows.
  w.tile_group = sm80::tile_group(p.has_window(), int64_t{8} * p.seqlen_q * w.bucket * p.head_group,
                                  (key_blocks + w.kv_blocks_per_cta - 1) / w.kv_blocks_per_cta,
                                  static_cast<int64_t>(p.heads_kv) * p.batch);

  const int64_t rows = static_cast<int64_t>(p.heads_q) * p.total_q;
  const size_t dsum_bytes = static_cast<size_t>(rows) * sizeof(float);
  const size_t accum_bytes = static_cast<size_t>(rows) * w.bucket * w.num_splits * sizeof(float);
  void* scratch = nullptr;
  if (rows > 0) {
    const size_t turn_bytes = static_cast<size_t>(turns) * sizeof(int);
    FLARE_RETURN_IF_ERROR(cuda_status(
        "backward", "cudaMallocAsync of the workspace",
        cudaMallocAsync(&scratch, dsum_bytes + accum_bytes + 2 * sizeof(int) + turn_bytes, stream)));
    // The accumulator first: its rows are read as float4 and must stay 16-byte aligned.
    w.dq_accum = static_cast<float*>(scratch);
    w.dsum = w.dq_accum + static_cast<size_t>(rows) * w.bucket * w.num_splits;
    w.nonfinite = reinterpret_cast<int*>(w.dsum + rows);
    if (turns > 0) {
      w.dq_turns = w.nonfinite + 2;
      if (const Status s = cuda_status("backward", "cudaMemsetAsync of the dQ turn counters",
                                       cudaMemsetAsync(w.dq_turns, 0, turn_bytes, stream));
          !s.ok()) {
        (void)cudaFreeAsync(scratch, stream);
        return s;
      }
    }
  }

  Status status = sm80::launch_backward_preprocess(p, w, stream);
  if (status.ok() && key_blocks > 0 && p.batch > 0) {
    status = sm90 ? launch_main_sm90(p, w, stream) : launch_main(p, w, key_blocks, stream);
  }
  if (status.ok()) status = sm80::launch_backward_convert(p, w, stream);
  if (status.ok() && rows > 0 && has_masked_pairs(p))
    status = sm80::launch_backward_fixup(p, w, 2 * sms, stream);
  if (scratch != nullptr) {
    const Status freed = cuda_status("backward", "cudaFreeAsync", cudaFreeAsync(scratch, stream));
    if (status.ok()) status = freed;
  }
  return status;
}

}  // namespace

Status backward(const AttentionParams& p, Stream stream) {
  return backward(p, stream, DispatchOverrides{}, nullptr);
}

Status backward(const AttentionParams& p, Stream stream, const DispatchOverrides& overrides,
                DispatchRecord* record) {
  KernelFamily family = KernelFamily::kNone;
  if (record != nullptr) record->backward = family;
  if (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16)
    return Status::unsupported(
        "q: the CUDA backward takes float16 or bfloat16 tensors (as FlashAttention does), got " +
        std::string(dtype_name(p.dtype)) + "; convert the inputs, or use CPU tensors");
  const Status status = on_device(p.device_index, [&] {
    return run_backward(p, overrides, &family, static_cast<cudaStream_t>(stream));
  });
  if (record != nullptr) record->backward = family;
  return status;
}

}  // namespace cuda
}  // namespace flare
