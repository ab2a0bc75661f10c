// bfloat16 storage type shared by host code (no CUDA headers needed) and the
// CUDA kernels (which reinterpret it as __nv_bfloat16; same 16-bit layout).
#ifndef MLAVERIFY_COMMON_BF16_H_
#define MLAVERIFY_COMMON_BF16_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace mlaverify {

// A bfloat16 value: the upper 16 bits of an IEEE-754 binary32. Trivially
// copyable so tensors of it can be memcpy'd to and from wire bytes
// (little-endian, as every supported host is).
struct Bf16 {
  uint16_t bits;
};
static_assert(sizeof(Bf16) == 2, "Bf16 must be exactly two bytes");

inline float Bf16ToFloat(Bf16 v) {
  uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Round to nearest, ties to even (what __float2bfloat16_rn does on the GPU);
// NaN stays a quiet NaN.
inline Bf16 FloatToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) {
    return Bf16{static_cast<uint16_t>((u >> 16) | 0x0040u)};
  }
  const uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);
  return Bf16{static_cast<uint16_t>((u + rounding_bias) >> 16)};
}

inline Bf16 Bf16QuietNaN() { return Bf16{0x7fc0}; }

}  // namespace mlaverify

#endif  // MLAVERIFY_COMMON_BF16_H_
