// fwd_launch.h — the host-side face of the sm80 forward kernels: one launcher per compiled
// (dtype, head-dim bucket) variant. Defined in fwd_kernel.cuh and instantiated once per variant in
// a generated translation unit (src/cuda/kernels.cmake), so including this costs no device code.
#pragma once

#include <cuda_runtime_api.h>

#include "core/params.h"
#include "flare/status.h"

namespace flare::cuda::sm80 {

// Enqueues the forward on `stream`; checks the launch, never synchronises.
template <DType kDType, int kHeadDim>
Status launch_forward(const AttentionParams& p, cudaStream_t stream);

}  // namespace flare::cuda::sm80
