// split_master.h — the fp32 master weight stored as two 16-bit halves, host and device.
//
// The GPU trainer keeps no separate fp32 copy of the weights: the bf16 weight the model reads is
// the master rounded to nearest even (as the CPU trainer's), and a second 16-bit array holds the
// master's low 16 bits. Together they are the master exactly: the optimizer state is 2 bytes per
// parameter smaller (5.3 GB for GPT-3 2.7B), AdamW moves 2 bytes per parameter less, and its
// arithmetic is unchanged.
//
// The bf16 weight's bits are the master's top 16 bits, plus one where rounding went up; the low
// half tells which (above 0x8000: up; below: down). An exact tie (low half 0x8000), which would
// not tell, is stored one fp32 ulp towards the side it rounded to (0x8001 when it went up, 0x7fff
// when down): the bf16 weight is the same, and the master moves by 2^-24 of its value, in one
// element of 65,536 on average. NaN stays NaN and ±inf stays ±inf.
#pragma once

#include <cstdint>

#include "core/numeric.h"

namespace flare::train {

struct SplitMaster {
  uint16_t weight;  // bf16 bits: the master rounded to nearest even
  uint16_t low;     // the master's low 16 bits (never 0x8000)
};

FLARE_HD SplitMaster split_master(float master) {
  uint32_t u = float_bits(master);
  if ((u & 0xffffu) == 0x8000u) u = (u >> 16) & 1u ? u + 1u : u - 1u;  // a tie: to the side it rounds to
  return {float_to_bf16(bits_float(u)), static_cast<uint16_t>(u & 0xffffu)};
}

FLARE_HD float join_master(uint16_t weight, uint16_t low) {
  const uint32_t top = static_cast<uint32_t>(weight) - (low > 0x8000u ? 1u : 0u);
  return bits_float((top << 16) | low);
}

}  // namespace flare::train
