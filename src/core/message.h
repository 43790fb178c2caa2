// message.h — how the library builds the messages of its Status errors: arguments streamed into
// one string ("k: heads = 3 must divide q's heads = 8"), and the invalid-argument status that
// carries one. Shared by every layer that validates (core, dist).
#pragma once

#include <sstream>
#include <string>

#include "flare/status.h"

namespace flare {

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

}  // namespace flare
