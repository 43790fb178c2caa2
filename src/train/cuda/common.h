// common.h — what every CUDA operator of the trainer shares on the host side: the bf16 element
// type of weights and activations, and how a CUDA error becomes a Status: flare's one conversion
// (cuda/device_probe.h), under the trainer's context.
//
// The operators follow one contract (docs/architecture.md, "API conventions"): raw device pointers
// with their dimensions in, a cudaStream_t to run on, a Status out. Launchers validate every size
// first and launch nothing when they reject a call; they never synchronise the device, so the only
// errors they can report are launch errors (cudaGetLastError), never a fault of the kernel itself.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/device_probe.h"
#include "flare/status.h"

namespace flare::train::cuda {

using bf16 = __nv_bfloat16;

// cuda_status(kCudaContext, what, err) for a runtime call, launch_status(kCudaContext, kernel)
// after a launch: ok, out_of_memory for an allocation that failed, else device_error, each message
// "training: <what>: <CUDA's description>".
using flare::cuda::cuda_status;
using flare::cuda::launch_status;
inline constexpr char kCudaContext[] = "training";

}  // namespace flare::train::cuda
