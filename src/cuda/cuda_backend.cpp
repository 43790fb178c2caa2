// cuda_backend.cpp — flare::cuda::forward, runs_sm90_kernels() and cuda_built(): runtime values
// become template arguments here and nowhere else.
//
// The compiled variants are listed once, in src/cuda/kernels.cmake, which writes them to
// flare/cuda_fwd_variants.inc as FLARE_CUDA_FWD_VARIANT(dtype, head_dim_bucket) lines; the same
// list instantiates the kernels and drives the GPU tests. A head_dim runs in the smallest bucket
// that holds it. Anything outside the table is answered kUnsupported by name, never a fallthrough.
#include <cuda_runtime_api.h>

#include <string>

#include "core/backends.h"
#include "cuda/device_probe.h"
#include "cuda/dispatch.h"
#include "cuda/fwd_fixup.h"
#include "cuda/sm80/fwd_launch.h"
#include "cuda/sm90/fwd_launch.h"
#include "cuda/sm90/fwd_tiles.h"
#include "cuda/variant_key.h"

namespace flare {
namespace cuda {
namespace {

// The sm90 forward's compiled buckets, and every kFwd90Tiles row among them.
constexpr int kFwd90Compiled[] = {
#define FLARE_CUDA_FWD90_VARIANT(DT, HD) HD,
#include "flare/cuda_fwd90_variants.inc"
#undef FLARE_CUDA_FWD90_VARIANT
};
static_assert(every_tile_compiled(sm90::kFwd90Tiles, kFwd90Compiled),
              "a kFwd90Tiles row has no compiled unit: list its bucket in kernels.cmake's "
              "FLARE_CUDA_FWD90_HEAD_DIMS");

// Smallest compiled bucket ≥ head_dim for this dtype, 0 if none.
int forward_bucket(DType dtype, int head_dim) {
  int best = 0;
#define FLARE_CUDA_FWD_VARIANT(DT, HD)                                          \
  if (DType::DT == dtype && head_dim <= (HD) && (best == 0 || (HD) < best)) best = (HD);
#include "flare/cuda_fwd_variants.inc"
#undef FLARE_CUDA_FWD_VARIANT
  return best;
}

// Whether the sm90 kernel of p's bucket runs p on the current device (never with overrides.arch
// 80): a compiled variant, on a device that runs sm90 kernels.
bool sm90_runs(const AttentionParams& p, const DispatchOverrides& overrides) {
  if (overrides.arch == 80 || !sm90::forward_supported(p, overrides.forward_ctas > 0))
    return false;
  switch (variant_key(p.dtype, sm90::fwd90_bucket(p.head_dim))) {
#define FLARE_CUDA_FWD90_VARIANT(DT, HD) case variant_key(DType::DT, HD):
#include "flare/cuda_fwd90_variants.inc"
#undef FLARE_CUDA_FWD90_VARIANT
      return runs_sm90_kernels();
    default:
      return false;
  }
}

// The forward kernel of p: sm90 where it takes p on this device, else sm80 (bucket: the smallest
// compiled one that holds head_dim, 0 if none). `*family` is the one it chose.
Status launch_forward_kernel(const AttentionParams& p, int bucket,
                             const DispatchOverrides& overrides, KernelFamily* family,
                             cudaStream_t s) {
  // Hopper: the sm90 kernel for the problems it takes (sm90/fwd_tiles.h), sm80 for the rest.
  if (sm90_runs(p, overrides)) {
    switch (variant_key(p.dtype, sm90::fwd90_bucket(p.head_dim))) {
#define FLARE_CUDA_FWD90_VARIANT(DT, HD) \
  case variant_key(DType::DT, HD):       \
    *family = KernelFamily::kSm90;       \
    return sm90::launch_forward<DType::DT, HD>(p, overrides, s);
#include "flare/cuda_fwd90_variants.inc"
#undef FLARE_CUDA_FWD90_VARIANT
      default:
        break;
    }
  }
  switch (variant_key(p.dtype, bucket)) {
#define FLARE_CUDA_FWD_VARIANT(DT, HD) \
  case variant_key(DType::DT, HD):     \
    *family = KernelFamily::kSm80;     \
    return sm80::launch_forward<DType::DT, HD>(p, overrides, s);
#include "flare/cuda_fwd_variants.inc"
#undef FLARE_CUDA_FWD_VARIANT
    default:
      return Status::unsupported("q: no CUDA forward kernel for dtype " +
                                 std::string(dtype_name(p.dtype)) + ", head_dim " +
                                 std::to_string(p.head_dim));
  }
}

}  // namespace

// Every sm90 unit is compiled for the same architectures, so one kernel's answer is every sm90
// kernel's; the forward's d 128 kernel asks (a kFwd90Tiles bucket, hence always compiled).
bool runs_sm90_kernels() { return sm90::forward_runs_on_device<DType::kBFloat16, 128>(); }

Status forward(const AttentionParams& p, Stream stream) {
  return forward(p, stream, DispatchOverrides{}, nullptr);
}

Status forward(const AttentionParams& p, Stream stream, const DispatchOverrides& overrides,
               DispatchRecord* record) {
  KernelFamily family = KernelFamily::kNone;
  if (record != nullptr) record->forward = family;
  if (p.dtype == DType::kFloat32)
    return Status::unsupported(
        "q: float32 tensors on CUDA are not supported; the CUDA kernels take float16 or bfloat16 "
        "(as FlashAttention does) — convert the inputs, or use CPU tensors");
  const int bucket = forward_bucket(p.dtype, p.head_dim);
  const auto s = static_cast<cudaStream_t>(stream);
  return on_device(p.device_index, [&]() -> Status {
    Status status = launch_forward_kernel(p, bucket, overrides, &family, s);
    if (record != nullptr) record->forward = family;
    // Under a window or on a packed batch a row's O may have met a hidden key's ±Inf/NaN V in
    // the P·V product (fwd_fixup.h): the rows the kernel marked are recomputed exactly
    // (fwd_fixup.cu), as are the rows a block mask left with LSE = −inf that see a key, unless
    // the sm90 kernel recomputed them itself. Otherwise no tile holds a hidden real key, and the
    // kernels' own results are the reference's.
    const bool fixed_in_kernel =
        family == KernelFamily::kSm90 && sm90_forward_fixes_rows_itself(p);
    if (status.ok() && !fixed_in_kernel &&
        (rows_may_meet_hidden_keys(p) || p.block_mask != nullptr))
      status = launch_forward_fixup(p, s);
    return status;
  });
}

}  // namespace cuda

bool cuda_built() { return true; }

}  // namespace flare
