// How a latent KV row is stored in the pool, and the FP8 quantizer: the one
// definition that the CPU backend, the CUDA kernels, the client's reference
// check and the tests share, so that "the reference" is the math over the
// rows exactly as stored.
//
// A bf16 row is 576 bf16 values (1,152 bytes). An fp8 row is 656 bytes:
//   [0, 512)    512 e4m3 codes of the no-rope part (the value columns)
//   [512, 528)  4 fp32 scales, one per 128-value group
//   [528, 656)  the 64 rope values in bf16, unquantized
// (FlashMLA's "FP8 with scale" layout, vLLM's fp8_ds_mla). Value d of group
// g = d / 128 is E4m3ToFloat(code[d]) * scale[g] in fp32. Both sizes are
// multiples of 16 bytes, so rows stay 16-byte aligned in a pool.
//
// The scalar pieces (FloatToE4m3, E4m3ToFloat, Fp8GroupScale,
// QuantizeFp8Group) are __host__ __device__ in CUDA translation units, so a
// kernel quantizes with the same code as the host.
#ifndef MLAVERIFY_COMMON_KV_DTYPE_H_
#define MLAVERIFY_COMMON_KV_DTYPE_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/bf16.h"
#include "common/geometry.h"

#if defined(__CUDACC__)
#define MLAVERIFY_HOST_DEVICE __host__ __device__
#else
#define MLAVERIFY_HOST_DEVICE
#endif

namespace mlaverify {

enum class KvDtype : int32_t { kBf16 = 0, kFp8 = 1 };

inline constexpr int kFp8GroupSize = 128;
inline constexpr int kFp8Groups = kValueDim / kFp8GroupSize;  // 4
inline constexpr int kFp8ScaleOffset = kValueDim;             // bytes
inline constexpr int kFp8RopeOffset = kFp8ScaleOffset + kFp8Groups * 4;
inline constexpr int kFp8RowBytes = kFp8RopeOffset + kRopeDim * 2;  // 656
// The largest finite e4m3 value (OCP FP8 E4M3, "fn": no infinities, one NaN
// pattern per sign).
inline constexpr float kFp8Max = 448.0f;
static_assert(kFp8RowBytes == 656 && kFp8RowBytes % 16 == 0 && kLatentRowBytes % 16 == 0,
              "pool rows must stay 16-byte aligned");

// Bytes of one token's row of one layer.
constexpr int KvRowBytes(KvDtype dtype) {
  return dtype == KvDtype::kFp8 ? kFp8RowBytes : kLatentRowBytes;
}
const char* KvDtypeName(KvDtype dtype);  // "bf16", "fp8"
// "bf16" / "fp8"; false for anything else.
bool ParseKvDtype(const char* text, KvDtype* dtype);

// How a group's scale is chosen from its largest magnitude. kExact is what the
// pool stores; kPowerOfTwo is kept for the measurement that chose it
// (tests/kv_dtype_test.cc, Fp8Scale.*, prints both): the exact scale maps the group's
// amax onto 448 itself and leaves the values' relative rounding error the
// same in the normal range, while a power-of-two scale leaves up to one
// binade of the e4m3 range unused and pushes more small values into e4m3's
// subnormals (2^-9 steps). Measured (tests/kv_dtype_test.cc, 4,096 rows
// each, mean relative error of the 512 quantized values / of a score q.k):
// N(0,1) rows 0.0257 / 0.0243 exact vs 0.0266 / 0.0255 power of two;
// Student-t (nu = 3) rows with four 20x channels 0.0157 / 0.0123 exact vs
// 0.0258 / 0.0252 power of two: a heavy tail sets a large amax, and the
// power-of-two rounding of the scale then costs most of the small values one
// more bit.
enum class Fp8ScaleRule { kExact, kPowerOfTwo };
inline constexpr Fp8ScaleRule kFp8ScaleRule = Fp8ScaleRule::kExact;

namespace fp8_internal {
MLAVERIFY_HOST_DEVICE inline uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}
MLAVERIFY_HOST_DEVICE inline float BitsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}
}  // namespace fp8_internal

// Round to nearest, ties to even, saturating: |x| >= 448 (infinity
// included) gives ±448; NaN gives the NaN code 0x7f with x's sign. Values
// below 2^-6 become e4m3 subnormals (multiples of 2^-9); below 2^-10, zero
// (with x's sign).
MLAVERIFY_HOST_DEVICE inline uint8_t FloatToE4m3(float x) {
  using fp8_internal::BitsFloat;
  using fp8_internal::FloatBits;
  const uint32_t u = FloatBits(x);
  const auto sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7fu;   // NaN
  if (a >= 0x43e00000u) return sign | 0x7eu;  // >= 448: saturate
  if (a < 0x3c800000u) {
    // Below 2^-6: a multiple of 2^-9; |x| * 512 is exact and rintf rounds
    // half to even. 8 * 2^-9 = 2^-6 is code 0x08, the smallest normal.
    return sign | static_cast<uint8_t>(rintf(BitsFloat(a) * 512.0f));
  }
  // Normal: keep 3 mantissa bits, rounding half to even on the bits (a carry
  // into the exponent is the right result). |x| < 448 rounds to at most 448.
  const uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);
  const uint32_t exponent = (r >> 23) - 120u;  // e4m3 bias 7, fp32 bias 127
  return sign | static_cast<uint8_t>((exponent << 3) | ((r >> 20) & 7u));
}

MLAVERIFY_HOST_DEVICE inline float E4m3ToFloat(uint8_t code) {
  using fp8_internal::BitsFloat;
  const uint32_t exponent = (code >> 3) & 15u;
  const uint32_t mantissa = code & 7u;
  float v;
  if (exponent == 15u && mantissa == 7u) {
    v = BitsFloat(0x7fc00000u);
  } else if (exponent == 0u) {
    v = static_cast<float>(mantissa) * 0.001953125f;  // 2^-9
  } else {
    v = BitsFloat(((exponent + 120u) << 23) | (mantissa << 20));
  }
  return (code & 0x80u) != 0 ? -v : v;
}

// The scale of a group whose largest magnitude is `amax` (finite, >= 0). 0
// for a group of zeros, and for one so small (amax < 448 * 2^-149) that its
// scale underflows: its values are stored as zeros.
MLAVERIFY_HOST_DEVICE inline float Fp8GroupScale(float amax, Fp8ScaleRule rule = kFp8ScaleRule) {
  const float exact = amax / kFp8Max;
  if (rule == Fp8ScaleRule::kExact || exact == 0.0f) return exact;
  // The smallest power of two >= exact: the float with exact's exponent,
  // doubled unless exact is already a power of two. Subnormal scales (amax
  // below ~5e-36) keep the exact scale: no such power of two is normal.
  const uint32_t bits = fp8_internal::FloatBits(exact);
  if ((bits & 0x7f800000u) == 0) return exact;
  const float down = fp8_internal::BitsFloat(bits & 0x7f800000u);
  return (bits & 0x007fffffu) == 0 ? down : down * 2.0f;
}

// Codes of `n` values with the given scale (x / scale, saturated at ±448).
MLAVERIFY_HOST_DEVICE inline uint8_t QuantizeFp8Value(float x, float scale) {
  return scale > 0.0f ? FloatToE4m3(x / scale) : static_cast<uint8_t>(0);
}

// Quantizes 576 bf16 values into a 656-byte fp8 row. Values must be finite
// (the engine rejects rows that are not: RowIsFinite).
void QuantizeLatentRow(const Bf16* row, uint8_t* out, Fp8ScaleRule rule = kFp8ScaleRule);
// The 576 values an fp8 row stands for, in fp32.
void DequantizeLatentRow(const uint8_t* row, float* out);
// A pool row of `dtype` (KvRowBytes(dtype) bytes at `pool_row`) from a bf16
// row: a copy for bf16, QuantizeLatentRow for fp8.
void StoreLatentRow(KvDtype dtype, const Bf16* row, uint8_t* pool_row);
// The 576 values a pool row of `dtype` stands for, in fp32.
void LoadLatentRow(KvDtype dtype, const uint8_t* pool_row, float* out);
// Whether all `n` values are finite (no NaN, no infinity).
bool AllFinite(const Bf16* values, int64_t n);

}  // namespace mlaverify

#endif  // MLAVERIFY_COMMON_KV_DTYPE_H_
