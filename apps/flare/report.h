// report.h — the facts a benchmark result carries, and the result file they are written to
// (docs/architecture.md, "Result files").
//
// A result file is {"card", "date", "commit", "software", "rows": [...]}, one row per (case,
// pass), in the schema shared by every file under bench/results/ so that runs of flare and of its
// peers can be compared and plotted side by side.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "workload.h"

namespace flare::cli {

struct ResultRow {
  Pass pass = Pass::kForward;
  Shape shape;
  double ms = 0;                // median over the timed iterations
  double tflops = 0;            // attention_flops / time, in TFLOP/s
  int64_t peak_mem_bytes = 0;
};

struct ResultFile {
  std::string card;
  std::string date;    // ISO-8601, UTC
  std::string commit;  // short hash or "unknown"
  std::vector<std::pair<std::string, std::string>> software;
  std::vector<ResultRow> rows;
};

// Now, as 2026-01-31T12:34:56Z.
std::string iso_date_utc();
// The commit measured: `flag` if given, else $FLARE_COMMIT, else `git rev-parse --short HEAD` in
// the source tree this program was built from, else "unknown".
std::string source_commit(const std::optional<std::string>& flag);
// flare's version and the compiler, followed by the device's entries.
std::vector<std::pair<std::string, std::string>> software_versions(
    const std::vector<std::pair<std::string, std::string>>& device_software);
// Why a result file could not be written at `path`, or "" when it can: its directory must take a
// new file (one is created there and removed again) and `path` must not be a directory or a
// file this process may not replace. For checking --json before anything runs.
std::string result_file_problem(const std::string& path);
// Writes the file whole or not at all (write_file_whole). Throws RunError if it cannot.
void write_result_file(const std::string& path, const ResultFile& file);

// Writes `text` into a new file beside `path`, renamed over it once complete, so no reader ever
// sees a truncated result. Throws RunError (naming --json and the path) if it cannot.
void write_file_whole(const std::string& path, const std::string& text);
// A JSON string literal of s (quotes and control characters escaped).
std::string json_string(const std::string& s);
// A JSON number, or null where x is not finite (JSON has no NaN or infinity).
std::string json_number(double x);

}  // namespace flare::cli
