// fwd_fixup.h — the host-side face of the forward's non-finite fixup kernel (fwd_fixup.cu).
// Including this costs no device code.
#pragma once

#include <cuda_runtime_api.h>

#include "core/params.h"
#include "flare/status.h"

namespace flare::cuda {

// After a forward kernel (sm80 or sm90) under a window: every row whose LSE came out non-finite
// and that sees a key — a row whose O the kernel found ±Inf/NaN, marked with LSE = NaN, or one
// left with LSE = −inf although it sees keys — is recomputed exactly from the inputs
// (cuda/nonfinite_fixup.cuh). Checks the launch, never synchronises.
Status launch_forward_fixup(const AttentionParams& p, cudaStream_t stream);

}  // namespace flare::cuda
