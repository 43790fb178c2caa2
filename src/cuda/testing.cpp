// testing.cpp — the one home of testing.h's overrides and launch counts, which the forward's
// dispatch (cuda_backend.cpp, sm80/fwd_launch.h, sm90/fwd_kernel.cuh) and the backward's
// (backward.cpp) read and bump.
#include "cuda/testing.h"

#include <atomic>

namespace flare::cuda::testing {
namespace {
std::atomic<int> backward_stages{0};
std::atomic<int> forward_tiles{0};
std::atomic<int> arch{0};
std::atomic<int> forward_ctas{0};
std::atomic<long> sm90_forwards{0};
std::atomic<long> sm90_backwards{0};
}  // namespace

void force_backward_stages(int stages) { backward_stages.store(stages); }
int forced_backward_stages() { return backward_stages.load(); }
void force_forward_tiles(int choice) { forward_tiles.store(choice); }
int forced_forward_tiles() { return forward_tiles.load(); }
void force_arch(int value) { arch.store(value); }
int forced_arch() { return arch.load(); }
void force_forward_ctas(int ctas) { forward_ctas.store(ctas); }
int forced_forward_ctas() { return forward_ctas.load(); }

void count_sm90_forward_launch() { ++sm90_forwards; }
void count_sm90_backward_launch() { ++sm90_backwards; }
long sm90_forward_launches() { return sm90_forwards.load(); }
long sm90_backward_launches() { return sm90_backwards.load(); }

}  // namespace flare::cuda::testing
