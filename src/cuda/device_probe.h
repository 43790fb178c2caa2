// device_probe.h — what the dispatch asks the CUDA runtime about a device and a kernel, asked once
// per (device, kernel) and cached.
//
// The dispatch runs on every forward and backward, on the host, while the GPU runs earlier work;
// a training step needs the host to stay ahead. Attribute queries (SM count, shared memory, the
// PTX version a kernel was built for, whether its sm_90a code runs) and cudaFuncSetAttribute are
// driver round trips whose answers cannot change while the process lives, so each is made once.
// The caches are process-wide, one per device ordinal (then kernel), each under its device's lock.
//
// cuda_status turns what the runtime returns into a Status, in one shape for all of flare's CUDA
// code (attention, context parallelism, training): the operation, the call that failed, the
// runtime's words; launch_status does the same for the kernel launch just issued.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <utility>

#include "flare/status.h"

namespace flare::cuda {

// A CUDA runtime result as a Status: ok for cudaSuccess; cudaErrorMemoryAllocation is
// out_of_memory (the caller can free memory or make the call smaller and retry), any other error
// device_error. The message reads "<context>: <what>: <the runtime's description>": `context`
// names the operation ("backward"), `what` the runtime call or the launch that failed. A view, so
// that a call that succeeds copies no name (the trainer checks several calls per step).
inline Status cuda_status(const char* context, std::string_view what, cudaError_t err) {
  if (err == cudaSuccess) return {};
  std::string message =
      std::string(context) + ": " + std::string(what) + ": " + cudaGetErrorString(err);
  return err == cudaErrorMemoryAllocation ? Status::out_of_memory(std::move(message))
                                          : Status::device_error(std::move(message));
}

// The Status of the kernel launch this thread issued last (cudaGetLastError), as cuda_status words
// it: "<context>: <what> launch: <the runtime's description>". `what` names the kernel, as a
// string or as a callable returning one; a callable is called only when the launch failed, so a
// launcher that runs on every call builds no message while its launches succeed.
template <typename What>
inline Status launch_status(const char* context, const What& what) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return {};
  if constexpr (std::is_invocable_v<const What&>)
    return cuda_status(context, std::string(what()) + " launch", err);
  else
    return cuda_status(context, std::string(what) + " launch", err);
}

struct DeviceFacts {
  int ordinal = 0;
  int sms = 0;         // streaming multiprocessors
  int smem_optin = 0;  // shared memory one block may opt into, bytes
  int major = 0, minor = 0;
};

namespace probe_detail {

struct KernelFacts {
  int ptx_version = 0;     // cudaFuncAttributes::ptxVersion of the code this device runs
  int binary_version = 0;  // cudaFuncAttributes::binaryVersion
  int smem_set = -1;       // dynamic shared memory already allowed with cudaFuncSetAttribute
};

// One device's cached facts, under a lock of that device's own. Never one lock for the process:
// a probe can load a kernel's module, and the driver may wait for the device's running work to
// do it. The ranks of a context-parallel group can be threads of one process, each on its own
// device, and that work can be a collective waiting for the peer's half; a process-wide lock held
// through the probe kept the peer from issuing it (a deadlock, 2 of 4 runs of the dist GPU suite
// on 2 GPUs). A thread now waits only for threads probing its own device.
struct DeviceProbes {
  std::mutex mutex;
  bool known = false;  // facts filled in
  DeviceFacts facts;
  std::unordered_map<const void*, KernelFacts> kernels;
};

// `device`'s probes, made on first use. The registry's lock is held for the lookup alone, around
// no CUDA call.
inline DeviceProbes& probes(int device) {
  static std::mutex registry_mutex;
  static std::unordered_map<int, std::unique_ptr<DeviceProbes>> registry;
  std::lock_guard<std::mutex> lock(registry_mutex);
  std::unique_ptr<DeviceProbes>& p = registry[device];
  if (!p) p = std::make_unique<DeviceProbes>();
  return *p;
}

// The context of the probes' errors.
inline constexpr char kContext[] = "CUDA device";

// The cached facts of `kernel` on the device `d` belongs to (the current device), probing on
// first use. Called with d.mutex held.
inline Status kernel_facts(DeviceProbes& d, const void* kernel, KernelFacts** out) {
  auto it = d.kernels.find(kernel);
  if (it == d.kernels.end()) {
    cudaFuncAttributes attr{};
    FLARE_RETURN_IF_ERROR(
        cuda_status(kContext, "cudaFuncGetAttributes", cudaFuncGetAttributes(&attr, kernel)));
    it = d.kernels.emplace(kernel, KernelFacts{attr.ptxVersion, attr.binaryVersion}).first;
  }
  *out = &it->second;
  return {};
}

inline Status current_device(int* device) {
  return cuda_status(kContext, "cudaGetDevice", cudaGetDevice(device));
}

}  // namespace probe_detail

// The current device's facts.
inline Status current_device_facts(DeviceFacts* facts) {
  int device = 0;
  FLARE_RETURN_IF_ERROR(probe_detail::current_device(&device));
  probe_detail::DeviceProbes& d = probe_detail::probes(device);
  std::lock_guard<std::mutex> lock(d.mutex);
  if (!d.known) {
    DeviceFacts f;
    f.ordinal = device;
    for (auto [value, attribute] :
         {std::pair{&f.sms, cudaDevAttrMultiProcessorCount},
          std::pair{&f.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin},
          std::pair{&f.major, cudaDevAttrComputeCapabilityMajor},
          std::pair{&f.minor, cudaDevAttrComputeCapabilityMinor}})
      FLARE_RETURN_IF_ERROR(cuda_status(probe_detail::kContext, "cudaDeviceGetAttribute",
                                        cudaDeviceGetAttribute(value, attribute, device)));
    d.facts = f;
    d.known = true;
  }
  *facts = d.facts;
  return {};
}

// The PTX version `kernel`'s code on the current device was compiled from (80 for sm_80 code or
// compute_80 compiled just in time, 90 for sm_90a).
inline Status kernel_ptx_version(const void* kernel, int* version) {
  int device = 0;
  FLARE_RETURN_IF_ERROR(probe_detail::current_device(&device));
  probe_detail::DeviceProbes& d = probe_detail::probes(device);
  std::lock_guard<std::mutex> lock(d.mutex);
  probe_detail::KernelFacts* facts = nullptr;
  FLARE_RETURN_IF_ERROR(probe_detail::kernel_facts(d, kernel, &facts));
  *version = facts->ptx_version;
  return {};
}

// Whether the current device runs `kernel`'s sm_90a code: an sm_90 device and a binary built with
// sm_90a in CMAKE_CUDA_ARCHITECTURES (not sm_80 code run forward, which has no wgmma).
inline bool runs_sm90a_code(const void* kernel) {
  DeviceFacts device;
  if (!current_device_facts(&device).ok() || device.major != 9 || device.minor != 0) return false;
  probe_detail::DeviceProbes& d = probe_detail::probes(device.ordinal);
  std::lock_guard<std::mutex> lock(d.mutex);
  probe_detail::KernelFacts* facts = nullptr;
  if (!probe_detail::kernel_facts(d, kernel, &facts).ok()) return false;
  // Both: compute_80 PTX compiled just in time on this device also reports binary version 90,
  // and the sm90 kernels' bodies are empty outside the sm_90a compilation.
  return facts->binary_version == 90 && facts->ptx_version >= 90;
}

// Lets `kernel` use `bytes` of dynamic shared memory on the current device (once per size).
inline Status allow_dynamic_smem(const void* kernel, int bytes) {
  int device = 0;
  FLARE_RETURN_IF_ERROR(probe_detail::current_device(&device));
  probe_detail::DeviceProbes& d = probe_detail::probes(device);
  std::lock_guard<std::mutex> lock(d.mutex);
  probe_detail::KernelFacts* facts = nullptr;
  FLARE_RETURN_IF_ERROR(probe_detail::kernel_facts(d, kernel, &facts));
  if (facts->smem_set == bytes) return {};
  FLARE_RETURN_IF_ERROR(cuda_status(
      probe_detail::kContext, std::to_string(bytes) + " bytes of dynamic shared memory",
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes)));
  facts->smem_set = bytes;
  return {};
}

// Runs `launch` on the tensors' device, restoring the caller's current device afterwards.
template <typename Launch>
inline Status on_device(int device_index, Launch launch) {
  int current = 0;
  FLARE_RETURN_IF_ERROR(probe_detail::current_device(&current));
  if (current != device_index) {
    FLARE_RETURN_IF_ERROR(cuda_status(probe_detail::kContext,
                                      "cudaSetDevice(" + std::to_string(device_index) + ")",
                                      cudaSetDevice(device_index)));
  }
  const Status status = launch();
  if (current != device_index) cudaSetDevice(current);
  return status;
}

}  // namespace flare::cuda
