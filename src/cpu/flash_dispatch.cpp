// flash_dispatch.cpp — which compiled copy of the CPU flash backend runs.
//
// A portable x86-64 build compiles flash.cpp once per instruction-set level (CMakeLists.txt;
// flash_simd.h gives each copy its target and namespace) so that one library runs anywhere and
// still uses the widest vectors the CPU has. The first call picks the best level the CPU
// supports, no higher than the environment variable FLARE_CPU_ISA when that is set (to compare
// or test the levels on one machine), and keeps the choice for the life of the process.
// FLARE_NATIVE builds and other hosts compile one copy, for the compiler's target: "native".
#include <cstdlib>
#include <iterator>
#include <string>

#include "core/backends.h"
#include "cpu/flash_simd.h"  // FLARE_SIMD_NAMESPACE: the one copy of a single-level build
#include "cpu/key_rows.h"

namespace flare::cpu {

#if defined(FLARE_SIMD_MULTI_LEVEL)
// The copies' entry points: flash.cpp compiled with FLARE_SIMD_LEVEL 1, 3, 4 and 5.
namespace generic {
Status flash_forward(const AttentionParams& p, const KeyRows& keys);
Status flash_backward(const AttentionParams& p);
}  // namespace generic
namespace avx_fma {
Status flash_forward(const AttentionParams& p, const KeyRows& keys);
Status flash_backward(const AttentionParams& p);
}  // namespace avx_fma
namespace avx512 {
Status flash_forward(const AttentionParams& p, const KeyRows& keys);
Status flash_backward(const AttentionParams& p);
}  // namespace avx512
namespace avx512bf16 {
Status flash_forward(const AttentionParams& p, const KeyRows& keys);
Status flash_backward(const AttentionParams& p);
}  // namespace avx512bf16
#else
// The one copy: flash.cpp compiled for the compiler's target, as this file is.
namespace FLARE_SIMD_NAMESPACE {
Status flash_forward(const AttentionParams& p, const KeyRows& keys);
Status flash_backward(const AttentionParams& p);
}  // namespace FLARE_SIMD_NAMESPACE
#endif

namespace {

struct SimdLevel {
  const char* name;
  bool (*cpu_supports)();
  Status (*forward)(const AttentionParams&, const KeyRows&);
  Status (*backward)(const AttentionParams&);
};

bool always() { return true; }

// Best first. A level needs every feature its copy is compiled with (flash_simd.h's targets).
#if defined(FLARE_SIMD_MULTI_LEVEL)
bool has_x86_64_v4() {
  __builtin_cpu_init();  // in case the first call comes from a static initialiser
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2") &&
         __builtin_cpu_supports("fma");
}
bool has_x86_64_v4_bf16() { return has_x86_64_v4() && __builtin_cpu_supports("avx512bf16"); }
bool has_x86_64_v3() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

constexpr SimdLevel kLevels[] = {
    {"x86-64-v4-bf16", has_x86_64_v4_bf16, avx512bf16::flash_forward, avx512bf16::flash_backward},
    {"x86-64-v4", has_x86_64_v4, avx512::flash_forward, avx512::flash_backward},
    {"x86-64-v3", has_x86_64_v3, avx_fma::flash_forward, avx_fma::flash_backward},
    {"x86-64", always, generic::flash_forward, generic::flash_backward},
};
#else
constexpr SimdLevel kLevels[] = {
    {"native", always, FLARE_SIMD_NAMESPACE::flash_forward, FLARE_SIMD_NAMESPACE::flash_backward},
};
#endif

struct Choice {
  const SimdLevel* level = nullptr;  // null when FLARE_CPU_ISA names no level of this build
  Status error;
};

Choice choose() {
  const char* cap = std::getenv("FLARE_CPU_ISA");
  const SimdLevel* first = &kLevels[0];
  if (cap != nullptr && *cap != '\0') {
    first = nullptr;
    std::string names;
    for (const SimdLevel& level : kLevels) {
      if (level.name == std::string(cap)) first = &level;
      names += names.empty() ? "" : ", ";
      names += level.name;
    }
    if (first == nullptr)
      return {nullptr, Status::invalid_argument("FLARE_CPU_ISA: must be one of the levels this "
                                                "build compiled (" + names + ") or unset, got \"" +
                                                cap + "\"")};
  }
  for (const SimdLevel* level = first; level != std::end(kLevels); ++level)
    if (level->cpu_supports()) return {level, {}};
  return {nullptr, Status::internal("cpu flash: no compiled instruction-set level runs here")};
}

const Choice& chosen() {
  static const Choice choice = choose();
  return choice;
}

}  // namespace

Status flash_simd_level(const char** name) {
  const Choice& c = chosen();
  if (c.level == nullptr) return c.error;
  *name = c.level->name;
  return {};
}

Status flash_forward(const AttentionParams& p) { return flash_forward(p, KeyRows{}); }

Status flash_forward(const AttentionParams& p, const KeyRows& keys) {
  const Choice& c = chosen();
  if (c.level == nullptr) return c.error;
  return c.level->forward(p, keys);
}

Status flash_backward(const AttentionParams& p) {
  const Choice& c = chosen();
  if (c.level == nullptr) return c.error;
  return c.level->backward(p);
}

}  // namespace flare::cpu
