// crc32.h — CRC-32 (IEEE 802.3: reflected polynomial 0xEDB88320, initial value and final xor
// 0xFFFFFFFF; the value zlib's crc32() and Python's binascii.crc32 give), fed in pieces so a
// checkpoint of tens of gigabytes is checked while it streams. crc32 of "123456789" = 0xCBF43926.
#pragma once

#include <cstddef>
#include <cstdint>

namespace flare::train {

class Crc32 {
 public:
  void update(const void* data, size_t bytes);
  uint32_t value() const { return ~state_; }

 private:
  uint32_t state_ = 0xFFFFFFFFu;
};

// The CRC-32 of one buffer.
uint32_t crc32(const void* data, size_t bytes);

}  // namespace flare::train
