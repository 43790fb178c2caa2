// main.cpp — the flare program: dispatch to a subcommand, turn its failures into exit statuses.
//
//   flare demo    one checked forward+backward on the best device (demo.cpp)
//   flare bench   the benchmark grid or given sizes, optional JSON results (bench.cpp)
//   flare bench-dist  context-parallel attention across GPUs, one process per GPU launched by
//                 mpirun or torchrun (bench_dist.cpp)
//   flare help    usage
//   flare --version
//
// Standard output is line-buffered, even into a pipe or a file, so that each progress and result
// line shows up as its case finishes rather than when the program exits.
//
// Exit status: 0 success, 1 a run or check failed, 2 the command line was wrong. Every failure
// prints one line to stderr.
#include <cstdio>
#include <exception>
#include <string>

#include "args.h"
#include "commands.h"
#include "flare/attention.h"

namespace {

const char* kUsage = R"(usage: flare <command> [options]

flare is exact attention (FlashAttention-2) for CPUs and NVIDIA GPUs.

commands:
  demo    run forward+backward on the best device present, check it against the
          float64 reference, print time, throughput and peak memory
  bench   time forward/backward over the standard grid or given sizes, print one line
          per case, optionally write JSON results
  bench-dist  time context-parallel attention across GPUs (one process per GPU,
          launched by mpirun or torchrun) against one GPU, optionally write JSON results
  help    this text; `flare help <command>` for a command's options

options:
  --version   print flare's version and whether this build has CUDA kernels

exit status: 0 success, 1 a run or check failed, 2 bad arguments
)";

int help(const std::string& topic) {
  using namespace flare::cli;
  if (topic.empty()) std::fputs(kUsage, stdout);
  else if (topic == "demo") std::fputs(demo_help(), stdout);
  else if (topic == "bench") std::fputs(bench_help(), stdout);
  else if (topic == "bench-dist") std::fputs(bench_dist_help(), stdout);
  else throw UsageError("flare help: unknown command '" + topic +
                        "' (commands: demo, bench, bench-dist)");
  return 0;
}

int dispatch(int argc, char** argv) {
  using namespace flare::cli;
  const std::string command = argc > 1 ? argv[1] : "";
  if (command.empty()) {
    std::fputs(kUsage, stderr);
    return 2;
  }
  if (command == "help" || command == "--help" || command == "-h") {
    if (argc > 3) throw UsageError("flare help: expected at most one command name");
    return help(argc > 2 ? argv[2] : "");
  }
  if (command == "--version") {
    std::printf("flare %s (%s)\n", flare::version(), flare::cuda_built() ? "CUDA" : "CPU only");
    return 0;
  }
  if (command == "demo") return run_demo(argc, argv);
  if (command == "bench") return run_bench(argc, argv);
  if (command == "bench-dist") return run_bench_dist(argc, argv);
  throw UsageError("flare: unknown command '" + command +
                   "' (commands: demo, bench, bench-dist, help)");
}

}  // namespace

int main(int argc, char** argv) {
  // Piped stdout would otherwise be fully buffered: a benchmark's lines would all arrive at the
  // end, and a run that is killed would lose them.
  std::setvbuf(stdout, nullptr, _IOLBF, BUFSIZ);
  try {
    return dispatch(argc, argv);
  } catch (const flare::cli::UsageError& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  } catch (const std::exception& e) {  // RunError, or std::bad_alloc and the like
    std::fflush(stdout);  // so the error follows what was printed before it, even when piped
    std::fprintf(stderr, "flare: %s\n", e.what());
    return 1;
  }
}
