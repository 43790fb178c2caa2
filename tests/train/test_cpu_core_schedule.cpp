// The learning-rate schedule (src/train/core/schedule.h) at its boundaries.
#include "train/core/schedule.h"

#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

namespace flare::train {
namespace {

TrainConfig run(int64_t steps, int64_t warmup) {
  TrainConfig t;
  t.steps = steps;
  t.warmup = warmup;
  t.lr = 1e-3;
  t.min_lr = 1e-4;
  return t;
}

TEST(Schedule, WarmupIsLinearFromLrOverWarmup) {
  const TrainConfig t = run(100, 10);
  EXPECT_DOUBLE_EQ(learning_rate(t, 0), 1e-4);  // lr · 1/10: the first step is never wasted
  EXPECT_DOUBLE_EQ(learning_rate(t, 4), 5e-4);
  EXPECT_DOUBLE_EQ(learning_rate(t, 9), 1e-3);  // the last warm-up step reaches the peak
}

TEST(Schedule, CosineFromPeakToMinLrAtTheLastStep) {
  const TrainConfig t = run(100, 10);
  EXPECT_DOUBLE_EQ(learning_rate(t, 10), 1e-3);   // cosine starts at the peak
  EXPECT_NEAR(learning_rate(t, 99), 1e-4, 1e-18);  // and ends at min_lr on the last step
  EXPECT_DOUBLE_EQ(learning_rate(t, 100), 1e-4);  // later steps stay there
  EXPECT_DOUBLE_EQ(learning_rate(t, 1000), 1e-4);
  // Half way through the 89 decay steps the cosine is half way between peak and floor.
  const double mid = 10 + 89.0 / 2;
  const double expected = 1e-4 + 0.5 * (1 + std::cos(std::numbers::pi * (mid - 10) / 89)) * 9e-4;
  EXPECT_NEAR(learning_rate(t, 54), expected, 1e-5);
  // Monotone after warm-up.
  for (int64_t s = 11; s < 100; ++s) EXPECT_LE(learning_rate(t, s), learning_rate(t, s - 1));
}

TEST(Schedule, NoWarmup) {
  const TrainConfig t = run(11, 0);
  EXPECT_DOUBLE_EQ(learning_rate(t, 0), 1e-3);
  EXPECT_NEAR(learning_rate(t, 5), 5.5e-4, 1e-15);  // the cosine's midpoint
  EXPECT_NEAR(learning_rate(t, 10), 1e-4, 1e-18);
}

TEST(Schedule, WarmupCoversTheRun) {
  const TrainConfig t = run(10, 10);
  EXPECT_DOUBLE_EQ(learning_rate(t, 9), 1e-3);
  EXPECT_DOUBLE_EQ(learning_rate(t, 10), 1e-4);
  const TrainConfig u = run(10, 9);  // one step left after warm-up: no cosine to follow
  EXPECT_DOUBLE_EQ(learning_rate(u, 9), 1e-3);
  const TrainConfig one = run(1, 0);
  EXPECT_DOUBLE_EQ(learning_rate(one, 0), 1e-3);
}

}  // namespace
}  // namespace flare::train
