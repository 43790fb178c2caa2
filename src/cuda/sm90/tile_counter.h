// tile_counter.h — the persistent forward's tile counter: one per stream, left at zero by the
// kernel itself.
//
// The persistent kernel's CTAs draw query tiles from a counter in device memory that must read 0
// when the kernel starts (sm90/fwd_kernel.cuh). Allocating and zeroing one per call
// (cudaMallocAsync, cudaMemsetAsync, cudaFreeAsync) costs three runtime calls on the host for
// every forward, and the host must stay ahead of the GPU (bench/host_overhead.py). Instead each
// stream gets one counter, zeroed once in stream order when first used, and the kernel leaves it
// at 0 when it ends: every CTA's last draw comes back empty, and the last CTA to make it resets
// the counter. Launches on one stream run one after another, so they take turns with its counter;
// launches on different streams have different counters.
//
// A stream that is being captured into a CUDA graph gets none: a graph may be replayed on any
// stream, beside that stream's own launches, so a captured launch allocates a counter of its own
// (the capture records the allocation, the zeroing and the free as graph nodes).
//
// The counters live as long as the process (four ints per stream ever used; a stream's id is never
// reused), and a cudaDeviceReset would invalidate them.
#pragma once

#include <cuda_runtime_api.h>

#include "flare/status.h"

namespace flare::cuda::sm90 {

// The counter's ints: {next ticket, CTAs whose producer is done} for the tile walk, and {CTAs
// whose consumers are done, a row needs recomputing} for the rows the last CTA recomputes
// (sm90/fwd_kernel.cuh). The last CTA of each pair resets it.
inline constexpr int kTileCounterInts = 4;

// The tile counter of `stream` on the current device, kTileCounterInts ints, all 0 between
// launches; nullptr when the stream is capturing a graph.
Status stream_tile_counter(cudaStream_t stream, int** counter);

}  // namespace flare::cuda::sm90
