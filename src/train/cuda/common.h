// common.h — what every CUDA operator of the trainer shares on the host side: the bf16 element
// type of weights and activations, and the conversion of a CUDA error into a Status.
//
// The operators follow one contract (DESIGN.md "API conventions"): raw device pointers with their
// dimensions in, a cudaStream_t to run on, a Status out. Launchers validate every size first and
// launch nothing when they reject a call; they never synchronise the device, so the only errors
// they can report are launch errors (cudaGetLastError), never a fault of the kernel itself.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "flare/status.h"

namespace flare::train::cuda {

using bf16 = __nv_bfloat16;

// The Status of the last launch on this thread: ok, or device_error naming `what` and CUDA's text.
Status launch_status(const char* what);
// A CUDA runtime result as a Status (ok, out_of_memory for allocation failures, else device_error).
Status cuda_status(cudaError_t err, const char* what);

}  // namespace flare::train::cuda
