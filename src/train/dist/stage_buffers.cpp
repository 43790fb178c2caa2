// stage_buffers.cpp — the stage-to-buffer bookkeeping of stage_buffers.h.
#include "train/dist/stage_buffers.h"

#include <algorithm>

namespace flare::train::dp {

int64_t longest_ring_stage(const DpPlan& plan) {
  int64_t longest = 0;
  for (size_t s = 0; s + 1 < plan.stage_begin.size(); ++s) {
    longest = std::max(longest, plan.stage_size(static_cast<int64_t>(s)));
  }
  return longest;
}

void StageBuffers::init(const DpPlan& plan, const std::array<float*, kGradientRing>& ring, float* last) {
  plan_ = &plan;
  ring_ = ring;
  last_ = last;
  live_.assign(plan.stage_begin.size(), nullptr);
}

float* StageBuffers::begin() {
  std::fill(live_.begin(), live_.end(), nullptr);
  live_.back() = last_;
  return last_;
}

float* StageBuffers::activate(int64_t stage) {
  if (stage >= kGradientRing) live_[static_cast<size_t>(stage - kGradientRing)] = nullptr;
  float* buffer = ring_[static_cast<size_t>(slot_of(stage))];
  live_[static_cast<size_t>(stage)] = buffer;
  return buffer;
}

float* StageBuffers::at(int64_t offset) const {
  // Stages run down the flat buffer: the first stage whose range begins at or below `offset`.
  const std::vector<int64_t>& begin = plan_->stage_begin;
  const auto first = std::partition_point(begin.begin(), begin.end(), [offset](int64_t b) { return b > offset; });
  if (first == begin.end()) return nullptr;
  const auto stage = static_cast<size_t>(first - begin.begin());
  if (offset >= plan_->stage_end[stage] || live_[stage] == nullptr) return nullptr;
  return live_[stage] + (offset - begin[stage]);
}

}  // namespace flare::train::dp
