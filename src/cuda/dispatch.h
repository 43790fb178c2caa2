// dispatch.h — what a caller of the CUDA dispatch (cuda_backend.cpp: forward, backward.cpp:
// backward) may fix instead of letting it choose, and what it reports back.
//
// The dispatch picks a kernel family (sm90 where the device runs it and the problem is in its set,
// else sm80) and, inside a family, tiles, buffering and grid sizes from the problem and the
// device. The library always lets it choose (core/backends.h's forward and backward pass no
// overrides); the GPU tests pass overrides to reach the paths their device would not take, and
// read the record to check which family ran. Both travel as arguments, so no call's choice
// depends on another's.
#pragma once

#include "core/params.h"
#include "flare/attention.h"
#include "flare/status.h"

namespace flare::cuda {

// Choices fixed by the caller; 0 leaves each to the dispatch.
struct DispatchOverrides {
  // 80: the sm80 kernels of both passes, also where the sm90 kernels would run (an H100 takes
  // them for the problems sm90/fwd_tiles.h and sm90/bwd_tiles.h accept).
  int arch = 0;
  // The sm80 forward's tile in buckets that have a short-walk tile (sm80/fwd_tiles.h), under
  // every mask: 1 the primary tile, 2 the short-walk tile.
  int forward_tiles = 0;
  // The sm90 forward's persistent kernel (sm90/fwd_kernel.cuh) on every call of the buckets that
  // have it, its grid capped at this many CTAs (one per SM otherwise), so that small problems
  // make each CTA walk many tiles.
  int forward_ctas = 0;
  // The sm80 backward main kernel's Q/dO buffers (BwdTile::stages or ::min_stages), where the
  // bucket offers that count and the device's shared memory holds it. An H100 picks two buffers
  // at d 256, so the one-buffer kernel an A100 runs is reached through this.
  int backward_stages = 0;

  bool operator==(const DispatchOverrides&) const = default;
};

enum class KernelFamily { kNone, kSm80, kSm90 };

// The kernel family each pass's dispatch chose for its main kernel, written by every call given
// the record; kNone where the call ended before choosing (a problem it refused).
struct DispatchRecord {
  KernelFamily forward = KernelFamily::kNone;
  KernelFamily backward = KernelFamily::kNone;
};

// core/backends.h's forward and backward with `overrides`; where `record` is not null, its
// field of the pass says which kernel family ran.
Status forward(const AttentionParams& p, Stream stream, const DispatchOverrides& overrides,
               DispatchRecord* record);
Status backward(const AttentionParams& p, Stream stream, const DispatchOverrides& overrides,
                DispatchRecord* record);

// Whether the current device runs the sm90 kernels: an sm_90 device and sm_90a code in the build.
// The one probe both passes' dispatch asks (cached per device, cuda/device_probe.h).
bool runs_sm90_kernels();

}  // namespace flare::cuda
