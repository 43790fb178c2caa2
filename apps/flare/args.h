// args.h — the flare program's two kinds of failure and its command-line parser.
//
// The CLI is not library code: it prints, and it reports failures by throwing one of the two
// errors below up to main(), which prints the one-line message and turns it into the exit status
// (2 for a bad command line, 1 for a failed run or check).
//
// Each subcommand declares its flags with a target and a range; parse() fills the targets and
// rejects anything else — unknown flags, missing or non-numeric values, values out of range,
// stray arguments — with a message that names the flag. Values are written `--s 1024` or
// `--s=1024`; a flag given twice keeps the last value.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "flare/status.h"

namespace flare::cli {

// The command line is wrong: exit status 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The command line was fine but the run failed (allocation, device, library status): exit 1.
struct RunError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The library answered StatusCode::kUnsupported: a valid request this build or device does not
// serve (yet), such as a pass whose kernels are not written. The benchmark skips such a pass and
// the demo leaves it out; anywhere else it is a RunError like any other.
struct UnsupportedError : RunError {
  using RunError::RunError;
};

// Turns a failed library call into the matching error.
inline void throw_if_error(const Status& s) {
  if (s.code() == StatusCode::kUnsupported) throw UnsupportedError(s.to_string());
  if (!s.ok()) throw RunError(s.to_string());
}

class ArgParser {
 public:
  explicit ArgParser(std::string command) : command_(std::move(command)) {}

  // An integer flag; unset stays std::nullopt so callers can tell "given" from a default.
  void add_int(const char* flag, std::optional<int64_t>* target, int64_t min, int64_t max);
  // A real-number flag in [min, max].
  void add_number(const char* flag, std::optional<double>* target, double min, double max);
  // A flag whose value must be one of `choices`.
  void add_choice(const char* flag, std::optional<std::string>* target,
                  std::vector<std::string> choices);
  // A flag with a free-form value (a file name, a commit id).
  void add_string(const char* flag, std::optional<std::string>* target);
  // A flag without a value; *target becomes true when present.
  void add_switch(const char* flag, bool* target);

  // Parses argv[first, argc). Returns false when -h/--help was given (nothing else is checked
  // then); throws UsageError on anything it cannot accept.
  bool parse(int argc, char** argv, int first);

  // A UsageError prefixed with the command name, for rules that involve several flags.
  UsageError error(const std::string& message) const;

 private:
  enum class Kind { kInt, kNumber, kChoice, kString, kSwitch };
  struct Flag {
    std::string name;
    Kind kind = Kind::kInt;
    std::optional<int64_t>* int_target = nullptr;
    std::optional<double>* number_target = nullptr;
    std::optional<std::string>* string_target = nullptr;
    bool* switch_target = nullptr;
    int64_t min = 0, max = 0;
    double number_min = 0, number_max = 0;
    std::vector<std::string> choices;
  };
  void assign(const Flag& flag, const std::string& value) const;

  std::string command_;
  std::vector<Flag> flags_;
};

}  // namespace flare::cli
