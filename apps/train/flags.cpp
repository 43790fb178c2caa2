// flags.cpp — the parser of flags.h.
#include "flags.h"

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <sstream>

namespace flare::train_cli {

void Flags::add_int(const char* name, std::optional<int64_t>* target, int64_t min, int64_t max,
                    const char* help) {
  flags_.push_back({name, Kind::kInt, target, static_cast<double>(min), static_cast<double>(max), help});
}
void Flags::add_double(const char* name, std::optional<double>* target, double min, double max,
                       const char* help) {
  flags_.push_back({name, Kind::kDouble, target, min, max, help});
}
void Flags::add_string(const char* name, std::optional<std::string>* target, const char* help) {
  flags_.push_back({name, Kind::kString, target, 0, 0, help});
}
void Flags::add_switch(const char* name, bool* target, const char* help) {
  flags_.push_back({name, Kind::kSwitch, target, 0, 0, help});
}

void Flags::assign(const Flag& f, const std::string& value) const {
  const std::string flag = "--" + f.name;
  switch (f.kind) {
    case Kind::kInt: {
      int64_t v = 0;
      const auto [end, err] = std::from_chars(value.data(), value.data() + value.size(), v);
      if (err != std::errc() || end != value.data() + value.size()) {
        throw UsageError(flag + ": '" + value + "' is not an integer");
      }
      if (static_cast<double>(v) < f.min || static_cast<double>(v) > f.max) {
        std::ostringstream s;
        s << flag << ": " << v << " must be in [" << static_cast<int64_t>(f.min) << ", "
          << static_cast<int64_t>(f.max) << "]";
        throw UsageError(s.str());
      }
      *static_cast<std::optional<int64_t>*>(f.target) = v;
      return;
    }
    case Kind::kDouble: {
      char* end = nullptr;
      const double v = value.empty() ? NAN : std::strtod(value.c_str(), &end);
      if (value.empty() || end != value.c_str() + value.size() || !std::isfinite(v)) {
        throw UsageError(flag + ": '" + value + "' is not a finite number");
      }
      if (v < f.min || v > f.max) {
        std::ostringstream s;
        s << flag << ": " << v << " must be in [" << f.min << ", " << f.max << "]";
        throw UsageError(s.str());
      }
      *static_cast<std::optional<double>*>(f.target) = v;
      return;
    }
    case Kind::kString:
      if (value.empty()) throw UsageError(flag + ": needs a non-empty value");
      *static_cast<std::optional<std::string>*>(f.target) = value;
      return;
    case Kind::kSwitch:
      throw UsageError(flag + ": takes no value");
  }
}

bool Flags::parse(int argc, char** argv, int first) {
  for (int i = first; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") return false;
    if (arg.rfind("--", 0) != 0) {
      throw UsageError("unexpected argument '" + arg + "' (flags start with --; see --help)");
    }
    const size_t eq = arg.find('=');
    const std::string name = arg.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
    const Flag* flag = nullptr;
    for (const Flag& f : flags_) {
      if (f.name == name) flag = &f;
    }
    if (!flag) throw UsageError("unknown flag --" + name + " (see --help)");
    if (flag->kind == Kind::kSwitch) {
      if (eq != std::string::npos) throw UsageError("--" + name + ": takes no value");
      *static_cast<bool*>(flag->target) = true;
      continue;
    }
    std::string value;
    if (eq != std::string::npos) {
      value = arg.substr(eq + 1);
    } else {
      if (i + 1 >= argc) throw UsageError("--" + name + ": missing value");
      value = argv[++i];
    }
    assign(*flag, value);
  }
  return true;
}

std::string Flags::help() const {
  std::ostringstream s;
  for (const Flag& f : flags_) {
    std::string left = "  --" + f.name;
    if (f.kind == Kind::kInt) left += " N";
    if (f.kind == Kind::kDouble) left += " X";
    if (f.kind == Kind::kString) left += " VALUE";
    if (left.size() < 26) left.resize(26, ' ');
    s << left << " " << f.help << "\n";
  }
  return s.str();
}

}  // namespace flare::train_cli
