// schedule.cpp — linear warm-up, then cosine decay to min_lr (see schedule.h for the boundaries).
#include "train/core/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace flare::train {

double learning_rate(const TrainConfig& t, int64_t step) {
  if (step < t.warmup) {
    return t.lr * static_cast<double>(step + 1) / static_cast<double>(t.warmup);
  }
  // Steps warmup … steps − 1 span the cosine; a run without decay steps stays at the peak.
  const int64_t decay_steps = t.steps - 1 - t.warmup;
  if (decay_steps <= 0) return step < t.steps ? t.lr : t.min_lr;
  const double progress =
      std::min(1.0, static_cast<double>(step - t.warmup) / static_cast<double>(decay_steps));
  const double cosine = 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
  return t.min_lr + cosine * (t.lr - t.min_lr);
}

}  // namespace flare::train
