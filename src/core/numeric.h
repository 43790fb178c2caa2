// numeric.h — fp16 / bf16 <-> fp32 conversions (round to nearest even), host and device, and
// loads/stores of any supported element type as float. The CPU backends read user tensors with
// these; the rounding matches the hardware conversions the CUDA kernels use.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/host_device.h"
#include "flare/tensor.h"

namespace flare {

// log2(e) and ln(2) as floats: the kernels' online softmax runs in base 2 (exp2 with the scale
// folded into one FFMA) and turns its LSE back to base e.
inline constexpr double kLog2eDouble = 1.4426950408889634;  // for host products taken in double
inline constexpr float kLog2e = static_cast<float>(kLog2eDouble);
inline constexpr float kLn2 = 0.6931471805599453f;

// The base an online softmax subtracts from a row's scores before exponentiating: its running
// max, or 0 while the row has seen only −inf scores, so that those give exp(−inf − 0) = 0 rather
// than the NaN of −inf − (−inf). Every backend's online softmax and merge of partial results
// takes it from here (in base 2 or e alike).
FLARE_HD float softmax_base(float max) { return max == -INFINITY ? 0.0f : max; }

// A row's LSE (base e) from a base-2 online softmax: its max in log2 units and its row sum l > 0
// taken relative to that max. The GPU kernels' finishing steps (FinishedRow, the decoding kernel)
// take it from here.
FLARE_HD float lse_from_log2(float max_log2, float l) { return max_log2 * kLn2 + logf(l); }

FLARE_HD uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
FLARE_HD float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// x ≥ 0 (below 2^23) rounded to the nearest integer, ties to even, in float arithmetic: the
// subnormal ranges of the narrow formats, in units of their smallest step.
FLARE_HD uint32_t round_to_integer_even(float x) {
  const uint32_t m = static_cast<uint32_t>(x);
  const float frac = x - static_cast<float>(m);
  return m + ((frac > 0.5f || (frac == 0.5f && (m & 1u))) ? 1u : 0u);
}

FLARE_HD float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

FLARE_HD uint16_t float_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN
  const uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding) >> 16);
}

FLARE_HD float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: man · 2^-24
    const float mag = static_cast<float>(man) * (1.0f / 16777216.0f);
    return sign ? -mag : mag;
  }
  if (exp == 31) return bits_float(sign | 0x7f800000u | (man << 13));  // inf / NaN
  return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
}

FLARE_HD uint16_t float_to_half(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;            // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;           // rounds to >= 65520 → inf
  if (abs < 0x38800000u) {                                 // below 2^-14: subnormal half
    // In units of 2^-24 (an exact power-of-two scale), rounded to nearest even.
    return sign | static_cast<uint16_t>(round_to_integer_even(bits_float(abs) * 16777216.0f));
  }
  const uint32_t rounding = 0xfffu + ((abs >> 13) & 1u);
  return sign | static_cast<uint16_t>(((abs + rounding) >> 13) - (112u << 10));
}

// FP8 E4M3 as OCP's FP8 formats define it (torch.float8_e4m3fn, CUDA's __nv_fp8_e4m3): sign, four
// exponent bits (bias 7), three mantissa bits; subnormals down to 2^-9, the largest finite value
// 448 and no infinities (S.1111.111 is NaN). The FP8 forward (src/cuda/sm90/notes.md) takes its
// inputs in it and rounds P to it; the reference and the kernels convert through these two.
inline constexpr float kE4M3Max = 448.0f;

FLARE_HD float e4m3_to_float(uint8_t x) {
  const uint32_t sign = static_cast<uint32_t>(x & 0x80u) << 24;
  const uint32_t exp = (x >> 3) & 0xfu, man = x & 0x7u;
  if (exp == 15 && man == 7) return bits_float(sign | 0x7fc00000u);  // NaN
  if (exp == 0) {  // zero or subnormal: man · 2^-9
    const float mag = static_cast<float>(man) * (1.0f / 512.0f);
    return sign ? -mag : mag;
  }
  return bits_float(sign | ((exp + 120u) << 23) | (man << 20));
}

// Round to nearest even and saturate, as the hardware's cvt.rn.satfinite does: a magnitude of
// 448 or more (infinities included) gives ±448, NaN gives NaN.
FLARE_HD uint8_t float_to_e4m3(float f) {
  const uint32_t u = float_bits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7fu;   // NaN
  if (abs >= 0x43e00000u) return sign | 0x7eu;  // ≥ 448 (rounding cannot pass it below)
  if (abs < 0x3c800000u) {                      // below 2^-6: subnormal
    // In units of 2^-9 (an exact scale), rounded to nearest even; 8 units carry into the
    // smallest normal's code, 0x08.
    return sign | static_cast<uint8_t>(round_to_integer_even(bits_float(abs) * 512.0f));
  }
  const uint32_t rounding = 0x7ffffu + ((abs >> 20) & 1u);
  return sign | static_cast<uint8_t>(((abs + rounding) >> 20) - (120u << 3));
}

// Round a float to the precision of `dtype` (identity for fp32).
FLARE_HD float round_to(DType dtype, float x) {
  if (dtype == DType::kFloat16) return half_to_float(float_to_half(x));
  if (dtype == DType::kBFloat16) return bf16_to_float(float_to_bf16(x));
  return x;
}

FLARE_HD float load_as_float(const void* base, int64_t index, DType dtype) {
  if (dtype == DType::kFloat16) return half_to_float(static_cast<const uint16_t*>(base)[index]);
  if (dtype == DType::kBFloat16) return bf16_to_float(static_cast<const uint16_t*>(base)[index]);
  return static_cast<const float*>(base)[index];
}

FLARE_HD void store_from_float(void* base, int64_t index, DType dtype, float x) {
  if (dtype == DType::kFloat16) {
    static_cast<uint16_t*>(base)[index] = float_to_half(x);
  } else if (dtype == DType::kBFloat16) {
    static_cast<uint16_t*>(base)[index] = float_to_bf16(x);
  } else {
    static_cast<float*>(base)[index] = x;
  }
}

// Unit roundoff of a dtype: 2^-11 (fp16), 2^-8 (bf16), 2^-24 (fp32).
inline double unit_roundoff(DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return 1.0 / 2048.0;
    case DType::kBFloat16: return 1.0 / 256.0;
    default: return 1.0 / 16777216.0;
  }
}

}  // namespace flare
