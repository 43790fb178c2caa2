// bwd_launch.h — the host-side face of the sm90 backward main kernel, one per compiled (dtype,
// head-dim bucket). Defined in bwd_kernel.cuh and instantiated in generated units
// (src/cuda/kernels.cmake); the preprocess and convert kernels around it are sm80's.
#pragma once

#include <cuda_runtime_api.h>

#include "core/params.h"
#include "cuda/sm80/bwd_launch.h"
#include "flare/status.h"

namespace flare::cuda::sm90 {

// dK, dV written and dQ added into w.dq_accum (one slice) for a problem backward_supported()
// accepts; checks the launch, never synchronises.
template <DType kDType, int kHeadDim>
Status launch_backward_main(const AttentionParams& p, const sm80::BwdWorkspace& w,
                            cudaStream_t stream);

}  // namespace flare::cuda::sm90
