// IEEE binary16 bits -> f32, exactly, for the kernels' plain-loop paths (the SIMD paths use
// F16C). Shared by the matvec and attention kernels.
#pragma once

#include <cstdint>
#include <cstring>

namespace ggmlx_native {

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0 && man == 0) {
    bits = sign;
  } else if (exp == 0) {  // subnormal: normalize
    int e = -1;
    uint32_t m = man;
    do {
      ++e;
      m <<= 1;
    } while ((m & 0x400) == 0);
    bits = sign | ((127 - 15 - e) << 23) | ((m & 0x3ff) << 13);
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

}  // namespace ggmlx_native
