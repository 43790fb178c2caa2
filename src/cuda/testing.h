// testing.h — internal hooks the GPU tests use to reach code paths the test device would not
// choose on its own. Not part of the public API: the library only reads the overrides (forced_*)
// in its dispatch and counts its sm90 launches; the force_* setters are the tests'. All of them
// live in testing.cpp.
#pragma once

namespace flare::cuda::testing {

// Forces the backward main kernel's Q/dO buffering (BwdTile::stages or ::min_stages) wherever
// the head-dim bucket offers that count and the device's shared memory holds it; 0 restores the
// automatic choice. An H100 picks two buffers at d=256, so the one-buffer kernel an A100 runs is
// tested through this. Process-wide; for single-threaded tests.
void force_backward_stages(int stages);
int forced_backward_stages();

// Forces the forward's tile choice for buckets that have a short-walk tile (sm80/fwd_tiles.h): 1
// the primary tile, 2 the short-walk tile, under every mask; 0 restores the automatic choice.
// Process-wide; for single-threaded tests.
void force_forward_tiles(int choice);
int forced_forward_tiles();

// Forces the kernel family of both passes: 80 the sm80 kernels even where the sm90 (Hopper)
// kernels would run (an H100 otherwise takes them for the problems sm90/fwd_tiles.h and
// sm90/bwd_tiles.h accept), 0 the automatic choice. Process-wide; for single-threaded tests.
void force_arch(int arch);
int forced_arch();

// Runs the sm90 forward's persistent kernel (sm90/fwd_kernel.cuh; in the buckets that have it,
// fwd_tiles.h) on every call, its grid capped at `ctas` CTAs (one per SM otherwise), so that small
// test problems make each CTA walk many tiles; 0 restores the automatic choice. Process-wide; for
// single-threaded tests.
void force_forward_ctas(int ctas);
int forced_forward_ctas();

// Whether the current device runs the sm90 kernels (an sm_90 device, sm_90a code in the build),
// and how many forward and backward calls have taken them in this process (the dispatch counts
// each launch).
bool sm90_available();
long sm90_forward_launches();
long sm90_backward_launches();
void count_sm90_forward_launch();
void count_sm90_backward_launch();

}  // namespace flare::cuda::testing
