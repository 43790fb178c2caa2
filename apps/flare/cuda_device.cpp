// cuda_device.cpp — the CUDA device of the flare CLI (device.h); built only with CUDA.
//
// Plain runtime API, no kernels: tensors come from cudaMalloc, inputs are generated on the host in
// chunks and copied, outputs are poisoned with cudaMemset, and every flare call goes to a stream
// of our own. Timing records a CUDA event before each call and one after the last, so a call's
// time is the gap between consecutive events on the device; calls queue back to back, so host
// overhead shows only where a call is shorter than its launch.
//
// Peak memory is what the device really had in use for the problem: the larger of
//   - our buffers plus the high-water mark of the default memory pool (where the library's
//     stream-ordered allocations, cudaMallocAsync, come from; freed memory is not counted), and
//   - the growth of cudaMemGetInfo's used memory, sampled when a timed run of calls ends, over
//     what was in use besides our buffers at the reset (catches cudaMalloc'd memory the library
//     keeps).
// Other processes on the same GPU disturb the second figure. Inputs and outputs are copied on our
// stream (non-blocking, so it never waits on the legacy default stream) and waited for.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <vector>

#include "args.h"
#include "core/numeric.h"
#include "device.h"

namespace flare::cli {
namespace {

void check_cuda(cudaError_t err, const std::string& what) {
  if (err != cudaSuccess) throw RunError(what + ": " + cudaGetErrorString(err));
}

std::string version_string(int v) {  // 12040 → "12.4"
  return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10);
}

class CudaDevice final : public Device {
 public:
  explicit CudaDevice(int ordinal) : ordinal_(ordinal) {
    check_cuda(cudaSetDevice(ordinal_), "cudaSetDevice");
    check_cuda(cudaGetDeviceProperties(&prop_, ordinal_), "cudaGetDeviceProperties");
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  }
  ~CudaDevice() override { cudaStreamDestroy(stream_); }

  DeviceType type() const override { return DeviceType::kCUDA; }
  int index() const override { return ordinal_; }
  std::string card() const override { return prop_.name; }
  std::vector<std::pair<std::string, std::string>> software() const override {
    int runtime = 0, driver = 0;
    cudaRuntimeGetVersion(&runtime);
    cudaDriverGetVersion(&driver);
    return {{"cuda_runtime", version_string(runtime)},
            {"cuda_driver", version_string(driver)},
            {"compute_capability", std::to_string(prop_.major) + "." + std::to_string(prop_.minor)}};
  }
  Stream stream() const override { return stream_; }

  void* allocate(std::size_t bytes, const char* what) override {
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, bytes);
    if (err != cudaSuccess) {
      cudaGetLastError();  // reset the last-error state so later checks are not blamed
      throw RunError(std::string("cudaMalloc of ") + what + " (" + std::to_string(bytes) +
                     " bytes): " + cudaGetErrorString(err));
    }
    allocated_ += bytes;
    sizes_.emplace_back(p, bytes);
    return p;
  }
  void release(void* ptr) override {
    for (auto it = sizes_.begin(); it != sizes_.end(); ++it) {
      if (it->first != ptr) continue;
      allocated_ -= it->second;
      sizes_.erase(it);
      break;
    }
    cudaFree(ptr);
  }

  void fill_random(void* dst, DType dtype, int64_t n, uint64_t seed) override {
    // Chunks bound the host staging memory; 4M elements is 16 MiB of fp32.
    constexpr int64_t kChunk = int64_t{1} << 22;
    const std::size_t esize = dtype_size(dtype);
    std::vector<unsigned char> host(static_cast<std::size_t>(std::min(n, kChunk)) * esize);
    for (int64_t start = 0; start < n; start += kChunk) {
      const int64_t count = std::min(kChunk, n - start);
      for (int64_t i = 0; i < count; ++i)
        store_from_float(host.data(), i, dtype, random_value(seed, static_cast<uint64_t>(start + i)));
      // On our stream, and waited for, since the next chunk overwrites the staging buffer.
      check_cuda(cudaMemcpyAsync(static_cast<unsigned char*>(dst) + start * esize, host.data(),
                                 static_cast<std::size_t>(count) * esize, cudaMemcpyHostToDevice,
                                 stream_),
                 "cudaMemcpyAsync (inputs)");
      check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    }
  }
  void poison(void* dst, std::size_t bytes) override {
    check_cuda(cudaMemsetAsync(dst, 0xFF, bytes, stream_), "cudaMemsetAsync");
  }
  void download(void* host_dst, const void* src, std::size_t bytes) override {
    check_cuda(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, stream_),
               "cudaMemcpyAsync (outputs)");
    check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (outputs)");
  }
  void upload(void* dst, const void* host_src, std::size_t bytes) override {
    // Waited for, so the caller may free host_src on return.
    check_cuda(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, stream_),
               "cudaMemcpyAsync (upload)");
    check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (upload)");
  }

  std::vector<double> time_ms(int warmup, int iters, const std::function<Status()>& fn) override {
    for (int i = 0; i < warmup; ++i) throw_if_error(fn());
    std::vector<cudaEvent_t> events(static_cast<std::size_t>(iters) + 1);
    for (cudaEvent_t& e : events) check_cuda(cudaEventCreate(&e), "cudaEventCreate");
    std::vector<double> ms;
    try {
      for (int i = 0; i < iters; ++i) {
        check_cuda(cudaEventRecord(events[i], stream_), "cudaEventRecord");
        throw_if_error(fn());
      }
      check_cuda(cudaEventRecord(events[iters], stream_), "cudaEventRecord");
      check_cuda(cudaEventSynchronize(events[iters]), "kernel execution");
      for (int i = 0; i < iters; ++i) {
        float t = 0;
        check_cuda(cudaEventElapsedTime(&t, events[i], events[i + 1]), "cudaEventElapsedTime");
        ms.push_back(t);
      }
      sample_memory();
    } catch (...) {
      for (cudaEvent_t e : events) cudaEventDestroy(e);
      throw;
    }
    for (cudaEvent_t e : events) cudaEventDestroy(e);
    return ms;
  }

  void reset_peak_memory() override {
    check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    cudaMemPool_t pool;
    check_cuda(cudaDeviceGetDefaultMemPool(&pool, ordinal_), "cudaDeviceGetDefaultMemPool");
    uint64_t zero = 0;  // the only value this attribute may be set to
    check_cuda(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero),
               "cudaMemPoolSetAttribute");
    other_used_ = used_bytes() - static_cast<int64_t>(allocated_);
    sampled_peak_ = static_cast<int64_t>(allocated_);
  }
  int64_t peak_memory_bytes() override {
    cudaMemPool_t pool;
    check_cuda(cudaDeviceGetDefaultMemPool(&pool, ordinal_), "cudaDeviceGetDefaultMemPool");
    uint64_t pool_high = 0;
    check_cuda(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &pool_high),
               "cudaMemPoolGetAttribute");
    return std::max(static_cast<int64_t>(allocated_ + pool_high), sampled_peak_);
  }
  const char* memory_kind() const override { return "device memory in use"; }

 private:
  int64_t used_bytes() const {
    std::size_t free = 0, total = 0;
    check_cuda(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
    return static_cast<int64_t>(total - free);
  }
  void sample_memory() { sampled_peak_ = std::max(sampled_peak_, used_bytes() - other_used_); }

  int ordinal_;
  cudaDeviceProp prop_{};
  cudaStream_t stream_ = nullptr;
  std::size_t allocated_ = 0;                            // bytes of our live cudaMalloc buffers
  std::vector<std::pair<void*, std::size_t>> sizes_;     // live buffers and their sizes
  int64_t other_used_ = 0;                               // device memory in use that is not ours
  int64_t sampled_peak_ = 0;
};

}  // namespace

std::unique_ptr<Device> make_cuda_device(std::string* reason) {
  if (!cuda_built()) {
    *reason = "this flare library was built without CUDA kernels";
    return nullptr;
  }
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    *reason = std::string("no usable GPU (") + cudaGetErrorString(err) + ")";
    return nullptr;
  }
  if (count == 0) {
    *reason = "no GPU found";
    return nullptr;
  }
  try {
    return std::make_unique<CudaDevice>(0);
  } catch (const RunError& e) {
    *reason = e.what();
    return nullptr;
  }
}

}  // namespace flare::cli
