// dist_internal.h — small helpers shared by the files of src/dist: message formatting and the
// status every communicator returns once it has failed.
#pragma once

#include <sstream>
#include <string>

#include "flare/status.h"

namespace flare::dist {

template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream s;
  (s << ... << args);
  return s.str();
}

template <typename... Args>
Status invalid(const Args&... args) {
  return Status::invalid_argument(cat(args...));
}

// A timeout or dead peer: kDeviceError is the code a failed NCCL operation gets too, so callers
// test for one code whichever communicator they hold.
template <typename... Args>
Status comm_failure(const Args&... args) {
  return Status::device_error(cat(args...));
}

}  // namespace flare::dist
