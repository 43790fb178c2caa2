// row_finish.h — how the CPU backends finish a forward row, in one place: flash.cpp's forward
// and its decoding merge, and block_sparse_flash.cpp's forward. Plain host code: flash.cpp
// includes it before its instruction-set region, so every compiled level shares the one inline
// definition.
#pragma once

#include <cmath>
#include <limits>

namespace flare::cpu {

// A row's output factor (O = factor · Σ_j p_j v_j) and its LSE, from its running max `m` (the
// base its exponentials subtracted, natural-log units) and the sum `l` of those exponentials.
// `numerator` scales O beside 1/l (dropout's 1/(1 − p), else 1). A row that sees no key gets
// O = 0 and LSE = −inf. l = 0 for a row that sees keys only when every visible score is −inf:
// the reference's softmax is then 0/0, NaN, as is a row whose l is NaN (a NaN or +inf score).
struct RowFinish {
  double factor;
  float lse;
};

inline RowFinish finish_row(bool sees_keys, float m, double l, double numerator) {
  if (!sees_keys) return {0.0, -std::numeric_limits<float>::infinity()};
  const double l_row = l > 0.0 ? l : std::numeric_limits<double>::quiet_NaN();
  return {numerator / l_row, static_cast<float>(static_cast<double>(m) + std::log(l_row))};
}

}  // namespace flare::cpu
