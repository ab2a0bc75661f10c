// common/kv_dtype: the e4m3 conversion, the per-group scales, the 656-byte
// row, and the measurement behind the choice of exact fp32 scales.
#include "common/kv_dtype.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace mlaverify {
namespace {

std::vector<Bf16> RandomRow(std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<Bf16> row(kLatentDim);
  for (Bf16& v : row) v = FloatToBf16(normal(rng));
  return row;
}

float ScaleOf(const uint8_t* row, int g) {
  float s;
  std::memcpy(&s, row + kFp8ScaleOffset + 4 * g, sizeof(s));
  return s;
}

TEST(E4m3, EveryCodeRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    const auto code = static_cast<uint8_t>(c);
    const float v = E4m3ToFloat(code);
    EXPECT_EQ(FloatToE4m3(v), code) << "code " << c << " value " << v;
    if ((c & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(v)) << c;
    } else {
      EXPECT_TRUE(std::isfinite(v)) << c;
      EXPECT_LE(std::fabs(v), 448.0f);
    }
  }
  EXPECT_EQ(E4m3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(E4m3ToFloat(0x08), 0.015625f);     // 2^-6, smallest normal
  EXPECT_EQ(E4m3ToFloat(0x01), 0.001953125f);  // 2^-9, smallest subnormal
  EXPECT_EQ(E4m3ToFloat(0x38), 1.0f);
  EXPECT_EQ(E4m3ToFloat(0xb8), -1.0f);
}

// The nearest finite code by brute force, ties to the even code.
uint8_t NearestCode(float x) {
  int best = 0;
  double best_err = std::numeric_limits<double>::infinity();
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;
    const double err = std::fabs(static_cast<double>(E4m3ToFloat(static_cast<uint8_t>(c))) - x);
    // Same magnitude on both signs: keep the code with x's sign.
    if ((c & 0x80) != (std::signbit(x) ? 0x80 : 0)) continue;
    if (err < best_err || (err == best_err && (c & 1) == 0)) {
      best = c;
      best_err = err;
    }
  }
  return static_cast<uint8_t>(best);
}

TEST(E4m3, RoundsToNearestEvenLikeBruteForce) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> exponent(-12.0f, 9.2f);
  for (int k = 0; k < 20000; ++k) {
    float x = std::exp2(exponent(rng));
    if (x >= 448.0f) continue;
    if (k & 1) x = -x;
    ASSERT_EQ(FloatToE4m3(x), NearestCode(x)) << x;
  }
  // Exact midpoints between neighbouring codes, normal and subnormal.
  for (int c = 0; c < 0x7e; ++c) {
    const float lo = E4m3ToFloat(static_cast<uint8_t>(c));
    const float hi = E4m3ToFloat(static_cast<uint8_t>(c + 1));
    const float mid = 0.5f * (lo + hi);
    const uint8_t even = (c & 1) == 0 ? c : c + 1;
    EXPECT_EQ(FloatToE4m3(mid), even) << "between codes " << c << " and " << c + 1;
    EXPECT_EQ(FloatToE4m3(-mid), even | 0x80) << c;
  }
}

TEST(E4m3, SaturatesAtPlusMinus448) {
  for (float x :
       {448.0f, 448.5f, 463.9f, 464.0f, 500.0f, 1e30f, std::numeric_limits<float>::infinity()}) {
    EXPECT_EQ(FloatToE4m3(x), 0x7e) << x;
    EXPECT_EQ(FloatToE4m3(-x), 0xfe) << x;
  }
  EXPECT_EQ(FloatToE4m3(447.0f), 0x7e);  // rounds up to 448 (416 is further)
  EXPECT_EQ(FloatToE4m3(420.0f), 0x7d);  // 416
  EXPECT_EQ(FloatToE4m3(std::nanf("")) & 0x7f, 0x7f);
  EXPECT_EQ(FloatToE4m3(0.0f), 0x00);
  EXPECT_EQ(FloatToE4m3(-0.0f), 0x80);
  EXPECT_EQ(FloatToE4m3(0.0009765625f), 0x00);  // 2^-10: the tie rounds to even (0)
  EXPECT_EQ(FloatToE4m3(0.00098f), 0x01);
}

TEST(Fp8Row, LayoutScalesAndRope) {
  std::mt19937 rng(1);
  const std::vector<Bf16> row = RandomRow(rng);
  uint8_t q[kFp8RowBytes];
  QuantizeLatentRow(row.data(), q);
  for (int g = 0; g < kFp8Groups; ++g) {
    float amax = 0.0f;
    for (int d = 0; d < kFp8GroupSize; ++d) {
      amax = std::max(amax, std::fabs(Bf16ToFloat(row[g * kFp8GroupSize + d])));
    }
    EXPECT_EQ(ScaleOf(q, g), amax / 448.0f) << g;
  }
  EXPECT_EQ(std::memcmp(q + kFp8RopeOffset, row.data() + kValueDim, kRopeDim * 2), 0);
  float back[kLatentDim];
  DequantizeLatentRow(q, back);
  for (int d = kValueDim; d < kLatentDim; ++d) EXPECT_EQ(back[d], Bf16ToFloat(row[d]));
  // Each value within half an e4m3 step: 2^-4 relative in the normal range,
  // 2^-10 * scale absolute in the subnormal range.
  for (int d = 0; d < kValueDim; ++d) {
    const float x = Bf16ToFloat(row[d]);
    const float s = ScaleOf(q, d / kFp8GroupSize);
    EXPECT_LE(std::fabs(back[d] - x), std::max(std::fabs(x) / 16.0f, s / 1024.0f) * 1.0001f) << d;
  }
}

TEST(Fp8Row, AmaxInAnyGroupMapsTo448AndLeavesTheOthers) {
  std::mt19937 rng(2);
  for (int g = 0; g < kFp8Groups; ++g) {
    for (int pos : {0, 1, 63, 127}) {
      std::vector<Bf16> row = RandomRow(rng);
      const int d = g * kFp8GroupSize + pos;
      row[d] = FloatToBf16(pos % 2 == 0 ? 1000.0f : -3.0e-3f * 1e6f);
      uint8_t q[kFp8RowBytes];
      QuantizeLatentRow(row.data(), q);
      EXPECT_EQ(q[d] & 0x7f, 0x7e) << g << "/" << pos;
      EXPECT_EQ(q[d] & 0x80, std::signbit(Bf16ToFloat(row[d])) ? 0x80 : 0);
      float back[kLatentDim];
      DequantizeLatentRow(q, back);
      EXPECT_NEAR(back[d], Bf16ToFloat(row[d]), std::fabs(Bf16ToFloat(row[d])) * 1e-6f);
      for (int other = 0; other < kFp8Groups; ++other) {
        if (other != g) {
          EXPECT_LT(ScaleOf(q, other), 0.05f) << other;  // N(0,1) amax / 448
        }
      }
    }
  }
}

TEST(Fp8Row, ZerosAndDenormalsStayFiniteAndSmall) {
  std::vector<Bf16> row(kLatentDim, Bf16{0});
  uint8_t q[kFp8RowBytes];
  QuantizeLatentRow(row.data(), q);
  float back[kLatentDim];
  DequantizeLatentRow(q, back);
  for (int g = 0; g < kFp8Groups; ++g) EXPECT_EQ(ScaleOf(q, g), 0.0f);
  for (float v : back) EXPECT_EQ(v, 0.0f);

  // Group 0: bf16 denormals up to the smallest normal (the scale is an fp32
  // denormal). Group 1: the smallest bf16 normal alone. Group 2: one normal
  // among denormals (they quantize to zero).
  for (int d = 0; d < kFp8GroupSize; ++d) {
    row[d] = Bf16{static_cast<uint16_t>(1 + d)};
    row[kFp8GroupSize + d] = Bf16{0x0080};
    row[2 * kFp8GroupSize + d] = Bf16{static_cast<uint16_t>(0x8000 | (3 + d))};
  }
  row[2 * kFp8GroupSize + 5] = FloatToBf16(0.5f);
  QuantizeLatentRow(row.data(), q);
  DequantizeLatentRow(q, back);
  for (int d = 0; d < kValueDim; ++d) {
    ASSERT_TRUE(std::isfinite(back[d])) << d;
    const float x = Bf16ToFloat(row[d]);
    // Half a step of the group's grid (relative in the normal range, 2^-10 *
    // scale below it), plus the rounding of a denormal scale and product.
    const float s = ScaleOf(q, d / kFp8GroupSize);
    EXPECT_LE(std::fabs(back[d] - x), std::max(std::fabs(x) / 16.0f, s / 1024.0f) * 1.01f + 1e-44f)
        << d;
  }
  EXPECT_EQ(back[2 * kFp8GroupSize + 5], 0.5f);
  EXPECT_NEAR(back[kFp8GroupSize], Bf16ToFloat(Bf16{0x0080}), Bf16ToFloat(Bf16{0x0080}) * 1e-3f);
}

TEST(Fp8Row, StoreAndLoadFollowTheDtype) {
  std::mt19937 rng(3);
  const std::vector<Bf16> row = RandomRow(rng);
  uint8_t bf16_row[kLatentRowBytes], fp8_row[kFp8RowBytes], direct[kFp8RowBytes];
  StoreLatentRow(KvDtype::kBf16, row.data(), bf16_row);
  EXPECT_EQ(std::memcmp(bf16_row, row.data(), kLatentRowBytes), 0);
  StoreLatentRow(KvDtype::kFp8, row.data(), fp8_row);
  QuantizeLatentRow(row.data(), direct);
  EXPECT_EQ(std::memcmp(fp8_row, direct, kFp8RowBytes), 0);
  float a[kLatentDim], b[kLatentDim];
  LoadLatentRow(KvDtype::kBf16, bf16_row, a);
  for (int d = 0; d < kLatentDim; ++d) EXPECT_EQ(a[d], Bf16ToFloat(row[d]));
  LoadLatentRow(KvDtype::kFp8, fp8_row, a);
  DequantizeLatentRow(fp8_row, b);
  EXPECT_EQ(std::memcmp(a, b, sizeof(a)), 0);
  EXPECT_EQ(KvRowBytes(KvDtype::kBf16), 1152);
  EXPECT_EQ(KvRowBytes(KvDtype::kFp8), 656);
}

TEST(KvDtype, NamesAndFiniteCheck) {
  KvDtype d = KvDtype::kBf16;
  EXPECT_TRUE(ParseKvDtype("fp8", &d));
  EXPECT_EQ(d, KvDtype::kFp8);
  EXPECT_TRUE(ParseKvDtype("bf16", &d));
  EXPECT_EQ(d, KvDtype::kBf16);
  EXPECT_FALSE(ParseKvDtype("fp16", &d));
  EXPECT_STREQ(KvDtypeName(KvDtype::kFp8), "fp8");
  std::vector<Bf16> v(kLatentDim, FloatToBf16(1.0f));
  EXPECT_TRUE(AllFinite(v.data(), kLatentDim));
  for (float bad : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                    std::nanf("")}) {
    v[575] = FloatToBf16(bad);
    EXPECT_FALSE(AllFinite(v.data(), kLatentDim)) << bad;
  }
  v[575] = Bf16{0x7f7f};  // the largest finite bf16
  EXPECT_TRUE(AllFinite(v.data(), kLatentDim));
}

TEST(Fp8Scale, PowerOfTwoRuleRoundsUp) {
  EXPECT_EQ(Fp8GroupScale(448.0f, Fp8ScaleRule::kPowerOfTwo), 1.0f);
  EXPECT_EQ(Fp8GroupScale(449.0f, Fp8ScaleRule::kPowerOfTwo), 2.0f);
  EXPECT_EQ(Fp8GroupScale(3.5f, Fp8ScaleRule::kPowerOfTwo), 0.0078125f);  // 3.5/448 = 2^-7
  EXPECT_EQ(Fp8GroupScale(0.0f, Fp8ScaleRule::kPowerOfTwo), 0.0f);
  EXPECT_EQ(Fp8GroupScale(3.0f, Fp8ScaleRule::kExact), 3.0f / 448.0f);
}

// The measurement behind kFp8ScaleRule: relative error ||deq - x|| / ||x|| of
// the 512 quantized values per row, and the relative error of a score
// q . k (576 columns, q ~ N(0,1)), on 4,096 rows of each kind, with either
// scale rule. Prints both; fails if the rule kept were the worse one.
struct ErrorStats {
  double row_mean = 0, row_max = 0, score_rms = 0;
};

ErrorStats Measure(const std::vector<std::vector<Bf16>>& rows, Fp8ScaleRule rule,
                   std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  ErrorStats e;
  double score_err_sq = 0, score_sq = 0;
  for (const std::vector<Bf16>& row : rows) {
    uint8_t q[kFp8RowBytes];
    QuantizeLatentRow(row.data(), q, rule);
    float back[kLatentDim];
    DequantizeLatentRow(q, back);
    double diff = 0, norm = 0, dot = 0, dot_ref = 0;
    for (int d = 0; d < kLatentDim; ++d) {
      const double x = Bf16ToFloat(row[d]);
      if (d < kValueDim) {
        diff += (back[d] - x) * (back[d] - x);
        norm += x * x;
      }
      const double w = normal(rng);
      dot += w * back[d];
      dot_ref += w * x;
    }
    const double rel = std::sqrt(diff / norm);
    e.row_mean += rel / rows.size();
    e.row_max = std::max(e.row_max, rel);
    score_err_sq += (dot - dot_ref) * (dot - dot_ref);
    score_sq += dot_ref * dot_ref;
  }
  e.score_rms = std::sqrt(score_err_sq / score_sq);
  return e;
}

TEST(Fp8Scale, ExactScalesMeasureNoWorseThanPowersOfTwo) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::student_t_distribution<float> student(3.0f);
  std::vector<std::vector<Bf16>> gaussian, heavy;
  for (int r = 0; r < 4096; ++r) {
    gaussian.push_back(RandomRow(rng));
    std::vector<Bf16> row(kLatentDim);
    for (int d = 0; d < kLatentDim; ++d) {
      // A few large channels, as real latent caches have.
      const float channel = (d == 7 || d == 200 || d == 301 || d == 450) ? 20.0f : 1.0f;
      row[d] = FloatToBf16(student(rng) * channel);
    }
    heavy.push_back(std::move(row));
  }
  for (const auto& [name, rows] :
       {std::pair{"N(0,1)", &gaussian}, std::pair{"t3+channels", &heavy}}) {
    std::mt19937 a(5), b(5);  // the same q for both rules
    const ErrorStats exact = Measure(*rows, Fp8ScaleRule::kExact, a);
    const ErrorStats pow2 = Measure(*rows, Fp8ScaleRule::kPowerOfTwo, b);
    std::printf(
        "%-12s exact fp32 scale: row rel err mean %.5f max %.5f, score rel err %.5f | "
        "power-of-two: mean %.5f max %.5f, score %.5f\n",
        name, exact.row_mean, exact.row_max, exact.score_rms, pow2.row_mean, pow2.row_max,
        pow2.score_rms);
    EXPECT_LE(exact.row_mean, pow2.row_mean) << name;
    EXPECT_LE(exact.score_rms, pow2.score_rms * 1.02) << name;
  }
}

}  // namespace
}  // namespace mlaverify
