// args.cpp — see args.h.
#include "args.h"

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>

namespace flare::cli {
namespace {

// A bound as a person would write it: 0, 1e+06, 0.5.
std::string number_text(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

}  // namespace

void ArgParser::add_int(const char* flag, std::optional<int64_t>* target, int64_t min,
                        int64_t max) {
  Flag f;
  f.name = flag;
  f.kind = Kind::kInt;
  f.int_target = target;
  f.min = min;
  f.max = max;
  flags_.push_back(std::move(f));
}

void ArgParser::add_number(const char* flag, std::optional<double>* target, double min,
                           double max) {
  Flag f;
  f.name = flag;
  f.kind = Kind::kNumber;
  f.number_target = target;
  f.number_min = min;
  f.number_max = max;
  flags_.push_back(std::move(f));
}

void ArgParser::add_choice(const char* flag, std::optional<std::string>* target,
                           std::vector<std::string> choices) {
  Flag f;
  f.name = flag;
  f.kind = Kind::kChoice;
  f.string_target = target;
  f.choices = std::move(choices);
  flags_.push_back(std::move(f));
}

void ArgParser::add_string(const char* flag, std::optional<std::string>* target) {
  Flag f;
  f.name = flag;
  f.kind = Kind::kString;
  f.string_target = target;
  flags_.push_back(std::move(f));
}

void ArgParser::add_switch(const char* flag, bool* target) {
  Flag f;
  f.name = flag;
  f.kind = Kind::kSwitch;
  f.switch_target = target;
  flags_.push_back(std::move(f));
}

UsageError ArgParser::error(const std::string& message) const {
  return UsageError("flare " + command_ + ": " + message);
}

void ArgParser::assign(const Flag& flag, const std::string& value) const {
  switch (flag.kind) {
    case Kind::kInt: {
      // strtoll skips leading blanks and stops at junk; demand a number and nothing else.
      char* end = nullptr;
      errno = 0;
      const long long x = std::strtoll(value.c_str(), &end, 10);
      const bool starts_ok =
          !value.empty() && (std::isdigit(static_cast<unsigned char>(value[0])) ||
                             value[0] == '-' || value[0] == '+');
      const bool numeric = starts_ok && *end == '\0' && errno == 0;
      if (!numeric || x < flag.min || x > flag.max)
        throw error(flag.name + ": expected an integer in [" + std::to_string(flag.min) + ", " +
                    std::to_string(flag.max) + "], got '" + value + "'");
      *flag.int_target = x;
      return;
    }
    case Kind::kNumber: {
      // strtod accepts "inf", "nan" and hex; demand a plain decimal number and nothing else.
      char* end = nullptr;
      errno = 0;
      const double x = std::strtod(value.c_str(), &end);
      const bool plain =
          !value.empty() && value.find_first_not_of("0123456789.eE+-") == std::string::npos;
      if (!plain || *end != '\0' || errno != 0 || !(x >= flag.number_min && x <= flag.number_max))
        throw error(flag.name + ": expected a number in [" + number_text(flag.number_min) + ", " +
                    number_text(flag.number_max) + "], got '" + value + "'");
      *flag.number_target = x;
      return;
    }
    case Kind::kChoice: {
      std::string list;
      for (const std::string& c : flag.choices) {
        if (c == value) {
          *flag.string_target = value;
          return;
        }
        list += (list.empty() ? "" : "|") + c;
      }
      throw error(flag.name + ": expected one of " + list + ", got '" + value + "'");
    }
    case Kind::kString:
      if (value.empty()) throw error(flag.name + ": value must not be empty");
      *flag.string_target = value;
      return;
    case Kind::kSwitch:
      throw error(flag.name + " takes no value, got '" + value + "'");
  }
}

bool ArgParser::parse(int argc, char** argv, int first) {
  for (int i = first; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") return false;
  }
  for (int i = first; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--", 0) != 0) throw error("unexpected argument '" + arg + "'");
    const size_t eq = arg.find('=');
    const std::string name = arg.substr(0, eq);
    const Flag* flag = nullptr;
    for (const Flag& f : flags_) {
      if (f.name == name) flag = &f;
    }
    if (flag == nullptr)
      throw error("unknown flag '" + name + "' (see: flare help " + command_ + ")");
    if (flag->kind == Kind::kSwitch && eq == std::string::npos) {
      *flag->switch_target = true;
      continue;
    }
    if (eq != std::string::npos) {
      assign(*flag, arg.substr(eq + 1));
    } else {
      if (i + 1 >= argc) throw error(name + ": missing value");
      assign(*flag, argv[++i]);
    }
  }
  return true;
}

}  // namespace flare::cli
