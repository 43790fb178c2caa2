// flags.h — flare-train's command-line flags: `--name value` or `--name=value`, each declared
// once with its target, so an unknown flag, a missing value, a value that is not a number or is
// out of range is a UsageError naming the flag. A flag given twice keeps the last value.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace flare::train_cli {

// A bad command line: exit status 2, nothing written.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class Flags {
 public:
  void add_int(const char* name, std::optional<int64_t>* target, int64_t min, int64_t max,
               const char* help);
  // Finite doubles in [min, max].
  void add_double(const char* name, std::optional<double>* target, double min, double max,
                  const char* help);
  void add_string(const char* name, std::optional<std::string>* target, const char* help);
  void add_switch(const char* name, bool* target, const char* help);

  // Parses argv[first, argc). Returns false when --help or -h was given.
  bool parse(int argc, char** argv, int first);
  // One line per flag: "  --name VALUE   help".
  std::string help() const;

 private:
  enum class Kind { kInt, kDouble, kString, kSwitch };
  struct Flag {
    std::string name;
    Kind kind;
    void* target;
    double min, max;
    std::string help;
  };
  void assign(const Flag& flag, const std::string& value) const;
  std::vector<Flag> flags_;
};

}  // namespace flare::train_cli
