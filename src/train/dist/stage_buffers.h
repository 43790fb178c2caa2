// stage_buffers.h — which buffer holds each backward stage's gradients when no rank keeps the
// whole gradient (ZeRO-2, dp_cuda.h): the bookkeeping alone, in host code, so that it is tested
// without a device. The buffers themselves, their zeroing and the events that make reuse safe are
// the caller's.
//
// Stage s < last (the head and final norm, then each layer) uses ring slot s mod kGradientRing;
// the last stage (the embeddings, which a tied head writes at stage 0) has a buffer of its own,
// live for the whole backward. A backward goes begin() (the last stage and stage 0 live), then
// activate(s + 1) after each stage s: activating a stage retires the one kGradientRing stages
// before it, whose slot it takes.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "train/core/train_config.h"
#include "train/dist/dp_plan.h"

namespace flare::train::dp {

// Ring slots of sharded gradients (train_config.h).
inline constexpr int kGradientRing = kGradientStagesHeld;

class StageBuffers {
 public:
  // plan: its stage ranges (outlives this object); ring: kGradientRing buffers of at least
  // longest_ring_stage(plan) floats; last: one of stage_size(last stage) floats.
  void init(const DpPlan& plan, const std::array<float*, kGradientRing>& ring, float* last);

  int64_t last_stage() const { return static_cast<int64_t>(live_.size()) - 1; }
  // The ring slot of `stage` (< last_stage()).
  static int slot_of(int64_t stage) { return static_cast<int>(stage % kGradientRing); }
  // Every stage retired; the last stage's buffer live. Returns it.
  float* begin();
  // `stage` (< last_stage()) takes its slot, retiring the stage that held it. Returns the buffer.
  float* activate(int64_t stage);
  // The buffer of `stage` while it is live, else null.
  float* buffer(int64_t stage) const { return live_[static_cast<size_t>(stage)]; }
  // The address of flat gradient element `offset` in its stage's buffer; null when that stage is
  // not live or the offset lies outside the layout.
  float* at(int64_t offset) const;

 private:
  const DpPlan* plan_ = nullptr;
  std::array<float*, kGradientRing> ring_{};
  float* last_ = nullptr;
  std::vector<float*> live_;  // per stage
};

// The longest stage that goes through the ring (every stage but the last), in elements.
int64_t longest_ring_stage(const DpPlan& plan);

}  // namespace flare::train::dp
