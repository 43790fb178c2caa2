// init.cpp — counter-based normal initialisation (see init.h).
#include "train/loop/init.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/philox.h"

namespace flare::train {
namespace {

// The normal draws of elements 2k and 2k+1 (pair k): one Philox call gives two 53-bit uniforms,
// and Box-Muller turns them into two normals, the cosine half for the even element and the sine
// half for the odd one.
struct NormalPair {
  double even, odd;
};
NormalPair standard_normal_pair(uint64_t seed, uint64_t pair) {
  const Philox4 ctr = {static_cast<uint32_t>(pair), static_cast<uint32_t>(pair >> 32), 0x1417u, 0u};
  const Philox4 r = philox4x32_10(ctr, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  // u1 in (0, 1] so the log is finite.
  const double u1 = (static_cast<double>((uint64_t{r.x} << 21) ^ r.y) + 1.0) / 9007199254740992.0;
  const double u2 = static_cast<double>((uint64_t{r.z} << 21) ^ r.w) / 9007199254740992.0;
  const double radius = std::sqrt(-2.0 * std::log(std::min(u1, 1.0)));
  const double angle = 2.0 * std::numbers::pi * u2;
  return {radius * std::cos(angle), radius * std::sin(angle)};
}

// w[0, numel) = init_std × the normals of flat elements [offset, offset + numel): one Philox call
// and one logarithm per pair, a parameter that starts or ends inside a pair taking its half.
void fill_normal(uint64_t seed, int64_t offset, int64_t numel, double init_std, float* w) {
  const int64_t first_pair = offset >> 1, end_pair = (offset + numel + 1) >> 1;
#pragma omp parallel for schedule(static)
  for (int64_t k = first_pair; k < end_pair; ++k) {
    const NormalPair n = standard_normal_pair(seed, static_cast<uint64_t>(k));
    const int64_t even = 2 * k - offset;  // index in w of the pair's even element
    if (even >= 0) w[even] = static_cast<float>(init_std * n.even);
    if (even + 1 < numel) w[even + 1] = static_cast<float>(init_std * n.odd);
  }
}

}  // namespace

void init_parameters(const ParameterLayout& layout, uint64_t seed, float* master) {
  // The alignment gaps (the elements no parameter covers; params are in buffer order) are zero.
  int64_t covered = 0;
  for (const ParamSpec& p : layout.params) {
    if (p.offset > covered) std::fill(master + covered, master + p.offset, 0.0f);
    covered = std::max(covered, p.offset + p.numel);
  }
  if (layout.total > covered) std::fill(master + covered, master + layout.total, 0.0f);

  for (const ParamSpec& p : layout.params) {
    float* w = master + p.offset;
    if (p.init_std > 0) {
      fill_normal(seed, p.offset, p.numel, p.init_std, w);
    } else {
      const float value = p.init_ones ? 1.0f : 0.0f;
#pragma omp parallel for schedule(static)
      for (int64_t j = 0; j < p.numel; ++j) w[j] = value;
    }
  }
}

}  // namespace flare::train
