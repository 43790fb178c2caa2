// schedule.h — the learning rate of each optimizer step: linear warm-up, then a cosine down to
// min_lr.
//
// Steps count from 0. During warm-up (step < warmup) the rate climbs linearly and never starts at
// zero: lr · (step + 1) / warmup, so step warmup − 1 already runs at the peak lr (a first step at
// lr 0 would be wasted work). From step = warmup the rate follows half a cosine from lr down to
// min_lr, reached exactly at the last step, steps − 1; any later step stays at min_lr. (When
// warm-up leaves a single step, steps − 1, there is no cosine to follow: it runs at the peak.)
#pragma once

#include <cstdint>

#include "train/core/train_config.h"

namespace flare::train {

// The learning rate of `step` (0-based) for a valid TrainConfig (lr, min_lr, warmup, steps).
double learning_rate(const TrainConfig& train, int64_t step);

}  // namespace flare::train
