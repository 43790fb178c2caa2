// tile_counter.cpp — one tile counter per (device, stream); see tile_counter.h.
#include "tile_counter.h"

#include <map>
#include <mutex>
#include <utility>

#include "../device_probe.h"

namespace flare::cuda::sm90 {
namespace {

constexpr const char* kContext = "forward";

}  // namespace

Status stream_tile_counter(cudaStream_t stream, int** counter) {
  *counter = nullptr;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  FLARE_RETURN_IF_ERROR(
      cuda_status(kContext, "cudaStreamIsCapturing", cudaStreamIsCapturing(stream, &capture)));
  if (capture != cudaStreamCaptureStatusNone) return {};
  int device = 0;
  FLARE_RETURN_IF_ERROR(cuda_status(kContext, "cudaGetDevice", cudaGetDevice(&device)));
  unsigned long long id = 0;
  FLARE_RETURN_IF_ERROR(cuda_status(kContext, "cudaStreamGetId", cudaStreamGetId(stream, &id)));

  // The lock guards the map alone and is never held around a CUDA call (device_probe.h says why:
  // the ranks of one process must not wait on each other's devices).
  static std::mutex mutex;
  static std::map<std::pair<int, unsigned long long>, int*> counters;
  const std::pair<int, unsigned long long> key{device, id};
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (const auto it = counters.find(key); it != counters.end()) {
      *counter = it->second;
      return {};
    }
  }
  void* p = nullptr;
  FLARE_RETURN_IF_ERROR(cuda_status(kContext, "cudaMallocAsync of the stream's tile counter",
                                    cudaMallocAsync(&p, kTileCounterInts * sizeof(int), stream)));
  if (const Status s = cuda_status(kContext, "cudaMemsetAsync of the stream's tile counter",
                                   cudaMemsetAsync(p, 0, kTileCounterInts * sizeof(int), stream));
      !s.ok()) {
    (void)cudaFreeAsync(p, stream);
    return s;
  }
  std::lock_guard<std::mutex> lock(mutex);
  const auto [it, made] = counters.emplace(key, static_cast<int*>(p));
  if (!made) (void)cudaFreeAsync(p, stream);  // another thread on this stream made one first
  *counter = it->second;
  return {};
}

}  // namespace flare::cuda::sm90
