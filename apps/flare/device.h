// device.h — where the CLI's tensors live and how it times calls: one interface, two machines.
//
// The demo and the benchmark are written once against Device. The CPU device (device.cpp) uses
// host memory and steady_clock; the CUDA device (cuda_device.cpp, compiled only when the build
// has CUDA) uses cudaMalloc, a stream of its own and CUDA events. Inputs are generated on the host
// by a counter-based generator and copied, so filling device memory needs no kernel of the CLI's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "flare/attention.h"

namespace flare::cli {

class Device {
 public:
  virtual ~Device() = default;

  virtual DeviceType type() const = 0;
  virtual int index() const = 0;  // CUDA ordinal; 0 on the CPU
  // The machine, for reports: "AMD EPYC 7B13 (2 cores)" or "NVIDIA H100 80GB HBM3".
  virtual std::string card() const = 0;
  // Versions of the software under the measurement, for result files (name, value).
  virtual std::vector<std::pair<std::string, std::string>> software() const = 0;
  virtual Stream stream() const = 0;

  // Throws RunError (naming `what` and the size) when the memory is not there.
  virtual void* allocate(std::size_t bytes, const char* what) = 0;
  virtual void release(void* ptr) = 0;
  // n elements of `dtype`, uniform with unit variance, element i a pure function of (seed, i).
  virtual void fill_random(void* dst, DType dtype, int64_t n, uint64_t seed) = 0;
  // Every byte 0xFF: NaN in fp32, fp16 and bf16, so an output element never written shows.
  virtual void poison(void* dst, std::size_t bytes) = 0;
  // Waits for the stream, then copies device memory to the host.
  virtual void download(void* host_dst, const void* src, std::size_t bytes) = 0;
  // Copies host memory to the device and waits for the copy (small tables such as cu_seqlens).
  virtual void upload(void* dst, const void* host_src, std::size_t bytes) = 0;

  // Runs fn `warmup` times untimed, then `iters` times timed one by one; returns the times in
  // milliseconds. A call that returns a non-OK status ends it with throw_if_error (args.h).
  virtual std::vector<double> time_ms(int warmup, int iters,
                                      const std::function<Status()>& fn) = 0;

  // Peak memory since the last reset: the process's peak resident set on the CPU, the device
  // memory in use on a GPU. memory_kind() says which, for the printout.
  virtual void reset_peak_memory() = 0;
  virtual int64_t peak_memory_bytes() = 0;
  virtual const char* memory_kind() const = 0;
};

std::unique_ptr<Device> make_cpu_device();
// A device on the first GPU, or nullptr with *reason saying why there is none usable (no CUDA in
// this build, no kernels in the library, no GPU, a driver error).
std::unique_ptr<Device> make_cuda_device(std::string* reason);

// --device auto|cpu|cuda: auto takes the GPU when one is usable, else the CPU and sets
// *fallback to the reason. An explicit "cuda" without a usable GPU is a RunError with the reason.
std::unique_ptr<Device> choose_device(const std::string& choice, std::string* fallback);

// Element i of the random inputs: splitmix64 of (seed, i) mapped to [-√3, √3) (unit variance).
// Shared by both devices so a problem's inputs do not depend on where it runs.
float random_value(uint64_t seed, uint64_t i);

}  // namespace flare::cli
