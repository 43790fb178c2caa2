// commands.h — the subcommands of the flare program. Each takes the full argv (its own flags
// start at argv[2]), returns the exit status, and throws UsageError / RunError (args.h) for main()
// to report.
#pragma once

namespace flare::cli {

int run_demo(int argc, char** argv);
int run_bench(int argc, char** argv);
int run_bench_dist(int argc, char** argv);

// Usage text of each subcommand, for `flare help <command>` and `flare <command> --help`.
const char* demo_help();
const char* bench_help();
const char* bench_dist_help();

}  // namespace flare::cli
