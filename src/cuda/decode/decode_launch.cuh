// decode_launch.cuh — launch<dtype> (decode_launch.h) over the kernels of decode_kernel.cuh;
// included by the one translation unit per dtype that instantiates it.
#pragma once

#include <string>

#include "cuda/decode/decode_kernel.cuh"
#include "cuda/decode/decode_launch.h"
#include "cuda/device_probe.h"
#include "cuda/element_type.cuh"

namespace flare::cuda::decode {

template <typename T, int kHeadDim>
Status launch_bucket(const DecodeParams& p, cudaStream_t stream) {
  const auto kernel = decode_kernel<T, kHeadDim>;
  constexpr int smem = Tile<kHeadDim>::template smem_bytes<T>();
  FLARE_RETURN_IF_ERROR(allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem));
  const dim3 grid(static_cast<unsigned>(p.batch * p.heads_kv), static_cast<unsigned>(p.num_splits),
                  static_cast<unsigned>(row_tiles(p)));
  kernel<<<grid, 128, smem, stream>>>(p);
  FLARE_RETURN_IF_ERROR(launch_status(kErrorContext, "attention"));
  if (p.num_splits > 1) {
    // Programmatic dependent launch: the merge is scheduled while the attention runs and waits
    // for it in the kernel (griddepcontrol.wait), so its launch latency leaves the critical path.
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(static_cast<unsigned>(p.seqlen_q), static_cast<unsigned>(p.heads_q),
                          static_cast<unsigned>(p.batch));
    config.blockDim = dim3(128);
    config.stream = stream;
    cudaLaunchAttribute early{};
    early.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    early.val.programmaticStreamSerializationAllowed = 1;
    config.attrs = &early;
    config.numAttrs = 1;
    FLARE_RETURN_IF_ERROR(cuda_status(kErrorContext, "split merge launch",
                                      cudaLaunchKernelEx(&config, merge_kernel<T, kHeadDim>, p)));
  }
  return {};
}

template <DType kDType>
Status launch(const DecodeParams& p, cudaStream_t stream) {
  using T = ElementOf<kDType>;
  if (p.seqlen_new > 0 && p.batch > 0) {
    append_kernel<T><<<p.batch, 128, 0, stream>>>(p);
    FLARE_RETURN_IF_ERROR(launch_status(kErrorContext, "append"));
  }
  if (p.batch == 0 || p.seqlen_q == 0 || p.heads_q == 0) return {};
  switch (head_dim_bucket(p.head_dim)) {
    case 64:
      return launch_bucket<T, 64>(p, stream);
    case 128:
      return launch_bucket<T, 128>(p, stream);
    case 256:
      return launch_bucket<T, 256>(p, stream);
    default:
      return Status::unsupported("q: head_dim " + std::to_string(p.head_dim) +
                                 " exceeds 256, the largest the CUDA decoding kernels take");
  }
}

}  // namespace flare::cuda::decode
