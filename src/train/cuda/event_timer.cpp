// event_timer.cpp — the event pool and span sums of event_timer.h.
#include "train/cuda/event_timer.h"

#include "train/cuda/common.h"

namespace flare::train::cuda {

EventTimer::~EventTimer() {
  for (cudaEvent_t e : pool_) cudaEventDestroy(e);
}

void EventTimer::reset() {
  used_ = 0;
  spans_.clear();
}

Status EventTimer::record(cudaStream_t stream, cudaEvent_t* event) {
  if (used_ == pool_.size()) {
    cudaEvent_t e = nullptr;
    FLARE_RETURN_IF_ERROR(
        cuda_status(kCudaContext, "EventTimer: cudaEventCreate", cudaEventCreate(&e)));
    pool_.push_back(e);
  }
  *event = pool_[used_++];
  return cuda_status(kCudaContext, "EventTimer: cudaEventRecord", cudaEventRecord(*event, stream));
}

void EventTimer::span(Kind kind, cudaEvent_t begin, cudaEvent_t end) { spans_.push_back({kind, begin, end}); }

Status EventTimer::read(Totals* totals) const {
  totals->fill(0.0);
  for (const Span& s : spans_) {
    float ms = 0.0f;
    FLARE_RETURN_IF_ERROR(cuda_status(kCudaContext, "EventTimer: elapsed time",
                                      cudaEventElapsedTime(&ms, s.begin, s.end)));
    (*totals)[s.kind] += static_cast<double>(ms);
  }
  return Status::ok_status();
}

}  // namespace flare::train::cuda
