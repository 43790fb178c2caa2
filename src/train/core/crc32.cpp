// crc32.cpp — table-driven CRC-32, eight bytes per step ("slicing by 8"): table[k][b] is the CRC
// of byte b followed by k zero bytes, so eight table lookups advance the state by eight bytes.
// Byte-at-a-time runs at about 0.4 GB/s, which would add minutes to a 7B model's 80 GB checkpoint.
#include "train/core/crc32.h"

#include <array>
#include <bit>
#include <cstring>

namespace flare::train {
namespace {

static_assert(std::endian::native == std::endian::little, "the 8-byte step reads little-endian words");

constexpr uint32_t kPolynomial = 0xEDB88320u;  // reflected form of 0x04C11DB7

using Tables = std::array<std::array<uint32_t, 256>, 8>;

constexpr Tables make_tables() {
  Tables t{};
  for (uint32_t b = 0; b < 256; ++b) {
    uint32_t c = b;
    for (int bit = 0; bit < 8; ++bit) c = (c & 1u) ? (c >> 1) ^ kPolynomial : c >> 1;
    t[0][b] = c;
  }
  for (uint32_t b = 0; b < 256; ++b) {
    for (int k = 1; k < 8; ++k) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFFu];
  }
  return t;
}

constexpr Tables kTables = make_tables();

}  // namespace

void Crc32::update(const void* data, size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = state_;
  // Eight bytes at a time; the reflected CRC consumes the little-endian low word first.
  while (bytes >= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;
    c = kTables[7][lo & 0xFFu] ^ kTables[6][(lo >> 8) & 0xFFu] ^ kTables[5][(lo >> 16) & 0xFFu] ^
        kTables[4][lo >> 24] ^ kTables[3][hi & 0xFFu] ^ kTables[2][(hi >> 8) & 0xFFu] ^
        kTables[1][(hi >> 16) & 0xFFu] ^ kTables[0][hi >> 24];
    p += 8;
    bytes -= 8;
  }
  while (bytes-- > 0) c = (c >> 8) ^ kTables[0][(c ^ *p++) & 0xFFu];
  state_ = c;
}

uint32_t crc32(const void* data, size_t bytes) {
  Crc32 c;
  c.update(data, bytes);
  return c.value();
}

}  // namespace flare::train
