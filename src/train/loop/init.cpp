// init.cpp — counter-based normal initialisation (see init.h).
#include "train/loop/init.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/philox.h"

namespace flare::train {
namespace {

// The normal draw of element `index`: elements 2k and 2k+1 share one Philox call and take the
// cosine and sine halves of one Box-Muller pair.
double standard_normal(uint64_t seed, int64_t index) {
  const uint64_t pair = static_cast<uint64_t>(index) >> 1;
  const Philox4 ctr = {static_cast<uint32_t>(pair), static_cast<uint32_t>(pair >> 32), 0x1417u, 0u};
  const Philox4 r = philox4x32_10(ctr, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  // 53-bit uniforms; u1 in (0, 1] so the log is finite.
  const double u1 = (static_cast<double>((uint64_t{r.x} << 21) ^ r.y) + 1.0) / 9007199254740992.0;
  const double u2 = static_cast<double>((uint64_t{r.z} << 21) ^ r.w) / 9007199254740992.0;
  const double radius = std::sqrt(-2.0 * std::log(std::min(u1, 1.0)));
  const double angle = 2.0 * std::numbers::pi * u2;
  return (index & 1) ? radius * std::sin(angle) : radius * std::cos(angle);
}

}  // namespace

void init_parameters(const ParameterLayout& layout, uint64_t seed, float* master) {
  std::fill(master, master + layout.total, 0.0f);
  for (const ParamSpec& p : layout.params) {
    float* w = master + p.offset;
    if (p.init_std > 0) {
#pragma omp parallel for schedule(static)
      for (int64_t j = 0; j < p.numel; ++j) {
        w[j] = static_cast<float>(p.init_std * standard_normal(seed, p.offset + j));
      }
    } else {
      std::fill(w, w + p.numel, p.init_ones ? 1.0f : 0.0f);
    }
  }
}

}  // namespace flare::train
