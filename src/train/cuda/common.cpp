// common.cpp — CUDA errors as Status values (common.h).
#include "train/cuda/common.h"

#include "core/message.h"

namespace flare::train::cuda {

Status cuda_status(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::ok_status();
  if (err == cudaErrorMemoryAllocation)
    return Status::out_of_memory(cat(what, ": ", cudaGetErrorString(err)));
  return Status::device_error(cat(what, ": ", cudaGetErrorName(err), ": ", cudaGetErrorString(err)));
}

Status launch_status(const char* what) { return cuda_status(cudaGetLastError(), what); }

}  // namespace flare::train::cuda
