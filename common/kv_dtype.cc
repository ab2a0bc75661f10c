#include "common/kv_dtype.h"

#include <algorithm>
#include <cstring>

namespace mlaverify {

const char* KvDtypeName(KvDtype dtype) { return dtype == KvDtype::kFp8 ? "fp8" : "bf16"; }

bool ParseKvDtype(const char* text, KvDtype* dtype) {
  if (std::strcmp(text, "bf16") == 0) {
    *dtype = KvDtype::kBf16;
  } else if (std::strcmp(text, "fp8") == 0) {
    *dtype = KvDtype::kFp8;
  } else {
    return false;
  }
  return true;
}

void QuantizeLatentRow(const Bf16* row, uint8_t* out, Fp8ScaleRule rule) {
  float scales[kFp8Groups];
  for (int g = 0; g < kFp8Groups; ++g) {
    float values[kFp8GroupSize];
    float amax = 0.0f;
    for (int d = 0; d < kFp8GroupSize; ++d) {
      values[d] = Bf16ToFloat(row[g * kFp8GroupSize + d]);
      amax = std::max(amax, std::fabs(values[d]));
    }
    scales[g] = Fp8GroupScale(amax, rule);
    for (int d = 0; d < kFp8GroupSize; ++d) {
      out[g * kFp8GroupSize + d] = QuantizeFp8Value(values[d], scales[g]);
    }
  }
  std::memcpy(out + kFp8ScaleOffset, scales, sizeof(scales));
  std::memcpy(out + kFp8RopeOffset, row + kValueDim, kRopeDim * sizeof(Bf16));
}

void DequantizeLatentRow(const uint8_t* row, float* out) {
  float scales[kFp8Groups];
  std::memcpy(scales, row + kFp8ScaleOffset, sizeof(scales));
  for (int d = 0; d < kValueDim; ++d) {
    out[d] = E4m3ToFloat(row[d]) * scales[d / kFp8GroupSize];
  }
  Bf16 rope[kRopeDim];
  std::memcpy(rope, row + kFp8RopeOffset, sizeof(rope));
  for (int d = 0; d < kRopeDim; ++d) out[kValueDim + d] = Bf16ToFloat(rope[d]);
}

void StoreLatentRow(KvDtype dtype, const Bf16* row, uint8_t* pool_row) {
  if (dtype == KvDtype::kFp8) {
    QuantizeLatentRow(row, pool_row);
  } else {
    std::memcpy(pool_row, row, kLatentRowBytes);
  }
}

void LoadLatentRow(KvDtype dtype, const uint8_t* pool_row, float* out) {
  if (dtype == KvDtype::kFp8) {
    DequantizeLatentRow(pool_row, out);
    return;
  }
  Bf16 row[kLatentDim];
  std::memcpy(row, pool_row, sizeof(row));
  for (int d = 0; d < kLatentDim; ++d) out[d] = Bf16ToFloat(row[d]);
}

bool AllFinite(const Bf16* values, int64_t n) {
  for (int64_t k = 0; k < n; ++k) {
    // Exponent all ones: infinity or NaN.
    if ((values[k].bits & 0x7f80u) == 0x7f80u) return false;
  }
  return true;
}

}  // namespace mlaverify
