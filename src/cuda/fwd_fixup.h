// fwd_fixup.h — the host-side face of the forward's non-finite fixup kernel (fwd_fixup.cu).
// Including this costs no device code.
#pragma once

#include <cuda_runtime_api.h>

#include "core/params.h"
#include "flare/status.h"

namespace flare::cuda {

// Whether a forward tile's P·V product may multiply, by P = 0, the V of a key the row cannot
// see: under a window (a masked key of the row's own sequence), or in a packed batch (the sm90
// kernel's key tiles run on into the next sequence's rows). Where that V is ±Inf/NaN the row
// comes out non-finite, so the kernels mark such rows (FinishedRow, nonfinite_fixup.cuh) and the
// fixup kernel runs after them. Elsewhere keys past a sequence end are zero-filled.
FLARE_HD bool rows_may_meet_hidden_keys(const AttentionParams& p) {
  return p.has_window() || p.is_varlen();
}

// Whether the sm90 forward kernel recomputes its marked rows itself (sm90/fwd_kernel.cuh: the
// one-CTA kernel after its tile, the persistent kernel's last CTA after every tile), so that no
// fixup kernel follows it: dense calls without dropout. With dropout the recompute's code spills
// the kernel's registers, and under a block mask rows in tiles no CTA ran need the fixup
// kernel's pass over every row.
FLARE_HD bool sm90_forward_fixes_rows_itself(const AttentionParams& p) {
  return p.dropout_p == 0.0f && p.block_mask == nullptr;
}

// After a forward kernel (sm80 or sm90) under a window or on a packed batch: every row whose LSE
// came out non-finite and that sees a key — a row whose O the kernel found ±Inf/NaN, marked with
// LSE = NaN, or one left with LSE = −inf although it sees keys — is recomputed exactly from the
// inputs (cuda/nonfinite_fixup.cuh). Checks the launch, never synchronises.
Status launch_forward_fixup(const AttentionParams& p, cudaStream_t stream);

}  // namespace flare::cuda
