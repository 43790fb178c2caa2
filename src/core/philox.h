// philox.h — the dropout mask, as a pure function of (seed, offset, batch·head, row, column).
//
// Philox 4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11) is a
// counter-based generator: no state, so any thread on any device can regenerate the draw for any
// element. The forward and backward passes, and the CPU and GPU backends, therefore agree on the
// mask bit for bit. One Philox call yields four 32-bit words, used for four consecutive columns.
//
//   key     = (lo32(seed), hi32(seed) ^ hi32(offset))
//   counter = (col / 4, row, batch·heads_q + head, lo32(offset))
//   u       = (word[col % 4] >> 8) · 2^-24  ∈ [0, 1)      keep ⇔ u ≥ p
#pragma once

#include <cstdint>

#include "core/host_device.h"

namespace flare {

struct Philox4 {
  uint32_t x, y, z, w;
};

FLARE_HD uint32_t philox_mulhi(uint32_t a, uint32_t b, uint32_t* lo) {
  const uint64_t prod = static_cast<uint64_t>(a) * b;
  *lo = static_cast<uint32_t>(prod);
  return static_cast<uint32_t>(prod >> 32);
}

FLARE_HD Philox4 philox4x32_10(Philox4 ctr, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    uint32_t lo0, lo1;
    const uint32_t hi0 = philox_mulhi(kM0, ctr.x, &lo0);
    const uint32_t hi1 = philox_mulhi(kM1, ctr.z, &lo1);
    ctr = {hi1 ^ ctr.y ^ k0, lo1, hi0 ^ ctr.w ^ k1, lo0};
    k0 += kW0;
    k1 += kW1;
  }
  return ctr;
}

// The four uniforms for columns [4·(col/4), 4·(col/4) + 4) of one row, as raw 32-bit words.
FLARE_HD Philox4 dropout_words(uint64_t seed, uint64_t offset, uint32_t bh, uint32_t row,
                               uint32_t col_group) {
  const Philox4 ctr = {col_group, row, bh, static_cast<uint32_t>(offset)};
  return philox4x32_10(ctr, static_cast<uint32_t>(seed),
                       static_cast<uint32_t>(seed >> 32) ^ static_cast<uint32_t>(offset >> 32));
}

FLARE_HD float dropout_uniform(uint32_t word) {
  return static_cast<float>(word >> 8) * (1.0f / 16777216.0f);
}

FLARE_HD uint32_t philox_word(const Philox4& r, int i) {
  return i == 0 ? r.x : i == 1 ? r.y : i == 2 ? r.z : r.w;
}

// True when element (bh, row, col) survives dropout with drop probability p.
FLARE_HD bool dropout_keep(uint64_t seed, uint64_t offset, uint32_t bh, uint32_t row, uint32_t col,
                           float p) {
  const Philox4 r = dropout_words(seed, offset, bh, row, col >> 2);
  return dropout_uniform(philox_word(r, static_cast<int>(col & 3u))) >= p;
}

}  // namespace flare
