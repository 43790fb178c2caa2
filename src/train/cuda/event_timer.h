// event_timer.h — the per-step profile of the CUDA backend from CUDA events: spans between two
// events (on one stream or two), summed by kind, read once the step has completed.
//
// Events come from a pool that grows on first use and is reused step after step (reset() at the
// start of each), so a step creates no event after the first. Reading happens after the host has
// already waited for the step's last event (the per-step read-back), so the profile adds no wait;
// each span costs one cudaEventElapsedTime call.
//
// A span whose begin event sits before a cudaStreamWaitEvent and whose end event after it, on the
// same stream, measures how long that stream waited: that is how exposed communication is timed.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <vector>

#include "flare/status.h"

namespace flare::train::cuda {

class EventTimer {
 public:
  enum Kind : int {
    kForward = 0,   // the micro-batches' forwards (compute stream)
    kBackward,      // their backwards (compute stream)
    kComm,          // collectives on the communication stream, each run of them between waits
    kCommExposed,   // the compute stream waiting for the communication stream
    kOptimizer,     // gradient norm, clip and AdamW (compute stream)
    kKinds
  };
  using Totals = std::array<double, kKinds>;  // milliseconds per kind

  EventTimer() = default;
  ~EventTimer();
  EventTimer(const EventTimer&) = delete;
  EventTimer& operator=(const EventTimer&) = delete;

  // A new step: spans forgotten, the pool's events reused from the first.
  void reset();
  // Records the pool's next event on `stream` (creating it on first use) into *event.
  Status record(cudaStream_t stream, cudaEvent_t* event);
  // Counts the time from `begin` to `end` (both recorded since reset()) under `kind`.
  void span(Kind kind, cudaEvent_t begin, cudaEvent_t end);
  // The sums of the spans since reset(); every event must have completed (the caller has waited
  // for the step).
  Status read(Totals* totals) const;

 private:
  struct Span {
    Kind kind;
    cudaEvent_t begin, end;
  };
  std::vector<cudaEvent_t> pool_;
  size_t used_ = 0;
  std::vector<Span> spans_;
};

}  // namespace flare::train::cuda
