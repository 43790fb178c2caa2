// loss_sum.cu — the sum of the classifier's per-token losses on the device (gpu_model.h), so the
// step's loss is read by the host once per step instead of once per micro-batch.
//
// One block: thread t adds elements t, t + 1024, … in double, then a tree in shared memory adds
// the 1024 partial sums in a fixed order. A micro-batch has at most a few tens of thousands of
// tokens, so one block reads them in a few microseconds and the order never depends on timing.
#include "train/cuda/common.h"
#include "train/model/gpu_model.h"

#include "core/message.h"

namespace flare::train::cuda {
namespace {

constexpr int kThreads = 1024;

__global__ void loss_sum_kernel(const float* __restrict__ losses, int64_t n, double* sum) {
  __shared__ double partial[kThreads];
  double s = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) s += static_cast<double>(losses[i]);
  partial[threadIdx.x] = s;
  __syncthreads();
  for (int width = kThreads / 2; width > 0; width /= 2) {
    if (static_cast<int>(threadIdx.x) < width) partial[threadIdx.x] += partial[threadIdx.x + width];
    __syncthreads();
  }
  if (threadIdx.x == 0) *sum += partial[0];
}

}  // namespace

Status loss_sum(const float* losses, int64_t n, double* sum, cudaStream_t stream) {
  if (n < 1) return invalid("loss_sum: n = ", n, " must be >= 1");
  if (losses == nullptr || sum == nullptr) return invalid("loss_sum: losses and sum must not be null");
  loss_sum_kernel<<<1, kThreads, 0, stream>>>(losses, n, sum);
  return launch_status(kCudaContext, "loss_sum");
}

}  // namespace flare::train::cuda
