// dist_internal.h — small helpers shared by the files of src/dist: the status every communicator
// returns once it has failed (message formatting is core/message.h's).
#pragma once

#include "core/message.h"
#include "flare/status.h"

namespace flare::dist {

// A timeout or dead peer: kDeviceError is the code a failed NCCL operation gets too, so callers
// test for one code whichever communicator they hold.
template <typename... Args>
Status comm_failure(const Args&... args) {
  return Status::device_error(cat(args...));
}

}  // namespace flare::dist
