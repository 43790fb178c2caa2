// device.cpp — the CPU device, the device choice, and the shared input generator (device.h).
//
// Peak memory on the CPU is the process's peak resident set size (VmHWM, the number getrusage
// reports as ru_maxrss). Unlike getrusage's, the kernel lets a process reset this high-water mark
// (writing "5" to /proc/self/clear_refs), so each benchmark case reports its own peak rather than
// the largest case so far. It includes everything resident: the program, the library and the
// tensors.
#include <sched.h>
#include <sys/mman.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>

#include "args.h"
#include "core/numeric.h"
#include "device.h"

namespace flare::cli {
namespace {

int cpu_count() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

std::string cpu_model_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) != 0) continue;
    const size_t colon = line.find(':');
    if (colon == std::string::npos) break;
    const size_t start = line.find_first_not_of(" \t", colon + 1);
    return start == std::string::npos ? "unknown CPU" : line.substr(start);
  }
  return "unknown CPU";
}

int64_t peak_rss_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;  // "N kB"
  }
  struct rusage usage;
  getrusage(RUSAGE_SELF, &usage);
  return int64_t{usage.ru_maxrss} * 1024;  // kilobytes on Linux
}

class CpuDevice final : public Device {
 public:
  DeviceType type() const override { return DeviceType::kCPU; }
  int index() const override { return 0; }
  std::string card() const override {
    return cpu_model_name() + " (" + std::to_string(cpu_count()) + " cores)";
  }
  std::vector<std::pair<std::string, std::string>> software() const override { return {}; }
  Stream stream() const override { return nullptr; }

  // Tensors are mapped straight from the kernel rather than taken from malloc: munmap gives the
  // pages back at once, where malloc would keep freed tensors resident and the next case's peak
  // RSS would include them.
  void* allocate(std::size_t bytes, const char* what) override {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
      throw RunError(std::string("out of host memory allocating ") + what + " (" +
                     std::to_string(bytes) + " bytes)");
    sizes_.emplace_back(p, bytes);
    return p;
  }
  void release(void* ptr) override {
    for (auto it = sizes_.begin(); it != sizes_.end(); ++it) {
      if (it->first != ptr) continue;
      munmap(ptr, it->second);
      sizes_.erase(it);
      return;
    }
  }

  void fill_random(void* dst, DType dtype, int64_t n, uint64_t seed) override {
    for (int64_t i = 0; i < n; ++i)
      store_from_float(dst, i, dtype, random_value(seed, static_cast<uint64_t>(i)));
  }
  void poison(void* dst, std::size_t bytes) override { std::memset(dst, 0xFF, bytes); }
  void download(void* host_dst, const void* src, std::size_t bytes) override {
    std::memcpy(host_dst, src, bytes);
  }
  void upload(void* dst, const void* host_src, std::size_t bytes) override {
    std::memcpy(dst, host_src, bytes);
  }

  std::vector<double> time_ms(int warmup, int iters, const std::function<Status()>& fn) override {
    for (int i = 0; i < warmup; ++i) throw_if_error(fn());
    std::vector<double> ms;
    for (int i = 0; i < iters; ++i) {
      const auto start = std::chrono::steady_clock::now();
      const Status s = fn();
      const auto stop = std::chrono::steady_clock::now();
      throw_if_error(s);
      ms.push_back(std::chrono::duration<double, std::milli>(stop - start).count());
    }
    return ms;
  }

  void reset_peak_memory() override {
    // Best effort: where /proc is read-only the peak stays the process's lifetime peak.
    std::ofstream("/proc/self/clear_refs") << "5";
  }
  int64_t peak_memory_bytes() override { return peak_rss_bytes(); }
  const char* memory_kind() const override { return "process peak RSS"; }

 private:
  std::vector<std::pair<void*, std::size_t>> sizes_;  // live mappings, for munmap
};

}  // namespace

float random_value(uint64_t seed, uint64_t i) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + i + 0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  const float u = static_cast<float>(z >> 40) * (1.0f / 16777216.0f);  // [0, 1), 24 bits
  return (2.0f * u - 1.0f) * 1.7320508f;                                // variance 1
}

std::unique_ptr<Device> make_cpu_device() { return std::make_unique<CpuDevice>(); }

#ifndef FLARE_WITH_CUDA
std::unique_ptr<Device> make_cuda_device(std::string* reason) {
  *reason = "this flare build has no CUDA (configure with -DFLARE_CUDA=ON on a machine with nvcc)";
  return nullptr;
}
#endif

std::unique_ptr<Device> choose_device(const std::string& choice, std::string* fallback) {
  if (choice == "cpu") return make_cpu_device();
  std::string reason;
  std::unique_ptr<Device> gpu = make_cuda_device(&reason);
  if (gpu != nullptr) return gpu;
  if (choice == "cuda") throw RunError("--device cuda: " + reason);
  *fallback = reason;
  return make_cpu_device();
}

}  // namespace flare::cli
