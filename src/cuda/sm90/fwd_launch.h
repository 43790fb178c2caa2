// fwd_launch.h — the host-side face of the sm90 forward kernels, one per compiled (dtype, head-dim
// bucket). Defined in fwd_kernel.cuh and instantiated in generated units (src/cuda/kernels.cmake).
#pragma once

#include <cuda_runtime_api.h>

#include "core/params.h"
#include "cuda/dispatch.h"
#include "flare/status.h"

namespace flare::cuda::sm90 {

// Whether the current device runs this variant's sm_90a code: an sm_90 device and a binary built
// with sm_90a in CMAKE_CUDA_ARCHITECTURES. Asked through runs_sm90_kernels() (cuda/dispatch.h),
// the one probe of both passes.
template <DType kDType, int kHeadDim>
bool forward_runs_on_device();

// Enqueues the forward on `stream` (a problem forward_supported() accepts, on a device that runs
// the kernel; with overrides.forward_ctas, one it accepts with force_persistent); checks the
// launch, never synchronises.
template <DType kDType, int kHeadDim>
Status launch_forward(const AttentionParams& p, const DispatchOverrides& overrides,
                      cudaStream_t stream);

}  // namespace flare::cuda::sm90
