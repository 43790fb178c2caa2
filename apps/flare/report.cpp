// report.cpp — see report.h.
#include "report.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <sstream>

#include "args.h"

namespace flare::cli {
namespace {

std::string trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ')) s.pop_back();
  return s;
}

// Where a result file is written before it is renamed to `path`: in the same directory, so the
// rename replaces `path` in one step, and named after this process so concurrent runs writing the
// same path do not share it.
std::string partial_path(const std::string& path) {
  return path + ".partial-" + std::to_string(getpid());
}

}  // namespace

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

// JSON has no NaN or infinity; a time that is not finite would be a bug, so write null.
std::string json_number(double x) {
  if (!std::isfinite(x)) return "null";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", x);
  return buf;
}

std::string iso_date_utc() {
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &utc);
  return buf;
}

std::string source_commit(const std::optional<std::string>& flag) {
  if (flag) return *flag;
  if (const char* env = std::getenv("FLARE_COMMIT"); env != nullptr && *env != '\0') return env;
  const std::string cmd =
      std::string("git -C '") + FLARE_SOURCE_DIR + "' rev-parse --short HEAD 2>/dev/null";
  if (FILE* pipe = popen(cmd.c_str(), "r")) {
    char buf[64] = {0};
    const bool got = std::fgets(buf, sizeof buf, pipe) != nullptr;
    const int rc = pclose(pipe);
    if (got && rc == 0 && buf[0] != '\0') return trim(buf);
  }
  return "unknown";
}

std::vector<std::pair<std::string, std::string>> software_versions(
    const std::vector<std::pair<std::string, std::string>>& device_software) {
#if defined(__clang__)
  const std::string compiler = "Clang " __clang_version__;
#else
  const std::string compiler = "GCC " __VERSION__;
#endif
  std::vector<std::pair<std::string, std::string>> v = {{"flare", version()},
                                                        {"compiler", compiler}};
  v.insert(v.end(), device_software.begin(), device_software.end());
  return v;
}

std::string result_file_problem(const std::string& path) {
  struct stat st {};
  if (stat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) return "it is a directory";
    if (access(path.c_str(), W_OK) != 0) return std::strerror(errno);
  }
  // The only sure test of a directory (permissions, a read-only or full file system) is to
  // create a file in it, as the final write will.
  const std::string probe = partial_path(path);
  std::FILE* f = std::fopen(probe.c_str(), "w");
  if (f == nullptr) return std::strerror(errno);
  std::fclose(f);
  std::remove(probe.c_str());
  return "";
}

void write_result_file(const std::string& path, const ResultFile& file) {
  std::ostringstream j;
  j << "{\n  \"card\": " << json_string(file.card) << ",\n  \"date\": " << json_string(file.date)
    << ",\n  \"commit\": " << json_string(file.commit) << ",\n  \"software\": {";
  for (size_t i = 0; i < file.software.size(); ++i)
    j << (i ? ", " : "") << json_string(file.software[i].first) << ": "
      << json_string(file.software[i].second);
  j << "},\n  \"rows\": [";
  for (size_t i = 0; i < file.rows.size(); ++i) {
    const ResultRow& r = file.rows[i];
    const Shape& s = r.shape;
    j << (i ? "," : "") << "\n    {\"impl\": \"flare\", \"pass\": \"" << pass_name(r.pass)
      << "\", \"dtype\": \"" << short_dtype_name(s.dtype) << "\", \"b\": " << s.b
      << ", \"s_q\": " << s.s_q << ", \"s_k\": " << s.s_k << ", \"h\": " << s.h
      << ", \"h_kv\": " << s.h_kv << ", \"d\": " << s.d
      << ", \"causal\": " << (s.causal ? "true" : "false");
    // Only packed and modified rows carry these fields, so other files stay as they were.
    if (s.varlen) j << ", \"varlen\": true";
    if (s.softcap > 0.0f) j << ", \"softcap\": " << json_number(s.softcap);
    if (s.alibi) j << ", \"alibi\": true";
    if (s.dropout_p > 0.0f) j << ", \"dropout\": " << json_number(s.dropout_p);
    if (s.deterministic) j << ", \"deterministic\": true";
    j << ", \"ms\": " << json_number(r.ms) << ", \"tflops\": " << json_number(r.tflops)
      << ", \"peak_mem_bytes\": " << r.peak_mem_bytes << "}";
  }
  j << "\n  ]\n}\n";
  write_file_whole(path, j.str());
}

void write_file_whole(const std::string& path, const std::string& text) {
  const std::string partial = partial_path(path);
  int error = 0;
  // errno of the failed step (a short fwrite need not set one).
  const auto failed = [] { return errno != 0 ? errno : EIO; };
  errno = 0;
  std::FILE* f = std::fopen(partial.c_str(), "w");
  if (f == nullptr) error = failed();
  if (error == 0 && std::fwrite(text.data(), 1, text.size(), f) != text.size()) error = failed();
  if (f != nullptr && std::fclose(f) != 0 && error == 0) error = failed();
  if (error == 0 && std::rename(partial.c_str(), path.c_str()) != 0) error = failed();
  if (error != 0) {
    std::remove(partial.c_str());
    throw RunError("--json: cannot write '" + path + "': " + std::strerror(error));
  }
}

}  // namespace flare::cli
