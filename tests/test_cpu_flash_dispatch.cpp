// test_cpu_flash_dispatch.cpp — the CPU flash backend's run-time choice of instruction-set level
// (src/cpu/flash_dispatch.cpp).
//
// The library keeps its choice for the life of the process, so the choice under each value of
// FLARE_CPU_ISA is tested by running this binary again with the variable set (tests/CMakeLists.txt
// registers a run per level and one with a name no build has). Each run derives the level it
// expects from the CPU's features and the variable on its own, and prints the level chosen.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/backends.h"
#include "flare/attention.h"

namespace flare::test {
namespace {

const char* cap_from_environment() {
  const char* cap = std::getenv("FLARE_CPU_ISA");
  return cap != nullptr && *cap != '\0' ? cap : nullptr;
}

struct ExpectedLevel {
  const char* name;
  bool cpu_runs;
};

// The levels a build compiles, best first, with whether this CPU runs each.
std::vector<ExpectedLevel> compiled_levels() {
#if defined(FLARE_SIMD_MULTI_LEVEL)
  const bool v3 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool v4 = v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
                  __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
                  __builtin_cpu_supports("avx512vl");
  const bool v4_bf16 = v4 && __builtin_cpu_supports("avx512bf16");
  return {{"x86-64-v4-bf16", v4_bf16}, {"x86-64-v4", v4}, {"x86-64-v3", v3}, {"x86-64", true}};
#else
  return {{"native", true}};
#endif
}

bool names_a_level(const char* cap) {
  for (const ExpectedLevel& level : compiled_levels())
    if (std::strcmp(level.name, cap) == 0) return true;
  return false;
}

// The best level the CPU runs, at or below the cap.
std::string expected_level(const char* cap) {
  bool at_or_below_cap = cap == nullptr;
  for (const ExpectedLevel& level : compiled_levels()) {
    at_or_below_cap = at_or_below_cap || std::strcmp(level.name, cap) == 0;
    if (at_or_below_cap && level.cpu_runs) return level.name;
  }
  return "(none)";
}

TEST(CpuFlashDispatch, ChoosesTheBestLevelThisCpuRunsUnderTheCap) {
  const char* cap = cap_from_environment();
  if (cap != nullptr && !names_a_level(cap))
    GTEST_SKIP() << "FLARE_CPU_ISA=" << cap << " names no level; the rejection test covers it";
  const char* name = nullptr;
  const Status st = cpu::flash_simd_level(&name);
  ASSERT_TRUE(st.ok()) << st.to_string();
  std::cout << "CPU flash level: " << name << " (FLARE_CPU_ISA " << (cap ? cap : "unset")
            << ")\n";
  EXPECT_EQ(std::string(name), expected_level(cap));
}

TEST(CpuFlashDispatch, RejectsALevelTheBuildLacksWithoutWriting) {
  const char* cap = cap_from_environment();
  if (cap == nullptr || names_a_level(cap))
    GTEST_SKIP() << "FLARE_CPU_ISA is unset or names a level; the run with an unknown name "
                    "tests the rejection";
  const char* name = nullptr;
  const Status level = cpu::flash_simd_level(&name);
  EXPECT_EQ(level.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(level.message().find("FLARE_CPU_ISA"), std::string::npos) << level.message();
  EXPECT_NE(level.message().find(cap), std::string::npos) << level.message();

  // A tiny forward and backward through the public API: rejected, every output untouched.
  const int s = 3, d = 4;
  std::vector<float> q(s * d, 0.5f), k(s * d, 0.25f), v(s * d, 1.0f), dout(s * d, 1.0f);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> o(s * d, nan), lse(s, nan), dq(s * d, nan), dk(s * d, nan), dv(s * d, nan);
  const auto view = [&](std::vector<float>& x) {
    return TensorView::contiguous(x.data(), DType::kFloat32, {1, s, 1, d});
  };
  const TensorView lse_view = TensorView::contiguous(lse.data(), DType::kFloat32, {1, 1, s});
  const Status fwd = attention_forward(view(q), view(k), view(v), view(o), lse_view);
  EXPECT_EQ(fwd.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(fwd.message(), level.message());
  const Status bwd = attention_backward(view(dout), view(q), view(k), view(v), view(o), lse_view,
                                        view(dq), view(dk), view(dv));
  EXPECT_EQ(bwd.code(), StatusCode::kInvalidArgument);
  for (const std::vector<float>* out : {&o, &lse, &dq, &dk, &dv})
    for (float x : *out) EXPECT_TRUE(std::isnan(x)) << "an output was written";
}

}  // namespace
}  // namespace flare::test
