// init.h — the initial weights of a run, a pure function of (layout, seed).
//
// Every matrix and embedding is drawn from normal(0, init_std) as its ParamSpec says, norm
// weights start at 1 and biases at 0; the alignment gaps stay 0. Each element's draw depends only
// on (seed, its offset in the flat buffer): Philox 4x32-10 (core/philox.h) gives two uniforms per
// pair of elements and Box-Muller turns them into two normals, so the same seed gives the same
// weights whatever the backend, thread count or order of filling, and a resumed run never needs
// to replay the initialisation.
#pragma once

#include <cstdint>

#include "train/core/model_config.h"

namespace flare::train {

// master: layout.total floats, written.
void init_parameters(const ParameterLayout& layout, uint64_t seed, float* master);

}  // namespace flare::train
