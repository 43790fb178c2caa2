// flare/status.h — the error type every public entry point returns.
//
// A Status is a code plus a message that names the offending argument and the rule it broke
// ("q: head_dim 300 exceeds the maximum 256"). Library code never throws, exits or prints:
// it returns a Status, and on any non-OK status no output has been written.
#pragma once

#include <string>
#include <utility>

namespace flare {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,  // the caller broke a documented rule
  kUnsupported = 2,      // valid request this build or device cannot serve
  kDeviceError = 3,      // a CUDA/driver call failed
  kOutOfMemory = 4,      // an allocation failed
  kInternal = 5,         // a bug in flare
};

const char* status_code_name(StatusCode code);

class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok_status() { return {}; }
  static Status invalid_argument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
  static Status unsupported(std::string m) { return {StatusCode::kUnsupported, std::move(m)}; }
  static Status device_error(std::string m) { return {StatusCode::kDeviceError, std::move(m)}; }
  static Status out_of_memory(std::string m) { return {StatusCode::kOutOfMemory, std::move(m)}; }
  static Status internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "invalid_argument: q: ..." — for logs and exceptions in bindings.
  std::string to_string() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

}  // namespace flare

// Propagate a non-OK Status from an expression to the caller.
#define FLARE_RETURN_IF_ERROR(expr)            \
  do {                                         \
    ::flare::Status flare_status_ = (expr);    \
    if (!flare_status_.ok()) return flare_status_; \
  } while (0)
