// Tests of the shared numeric building blocks: fp16/bf16/fp8-e4m3 conversions (exhaustive where
// the domain is small, against the compiler's own _Float16 where available) and the Philox 4x32-10 dropout
// generator (published known-answer vectors, and the statistics of the resulting mask).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "core/numeric.h"
#include "core/philox.h"
#include "test_util.h"

namespace flare {
namespace {

TEST(Numeric, HalfRoundTripsEveryValue) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = half_to_float(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(half_to_float(float_to_half(f))));
      continue;
    }
    EXPECT_EQ(float_to_half(f), h) << "half bits " << h;
  }
}

TEST(Numeric, BFloat16RoundTripsEveryValue) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = bf16_to_float(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(f))));
      continue;
    }
    EXPECT_EQ(float_to_bf16(f), h) << "bf16 bits " << h;
  }
}

#if defined(__FLT16_MAX__)
TEST(Numeric, HalfRoundingMatchesCompiler) {
  std::mt19937 rng(static_cast<uint32_t>(test::test_seed()));
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 1000000; ++i) {
    // Random bit patterns cover normals, subnormals, overflow and ties alike.
    const float f = bits_float(bits(rng));
    if (std::isnan(f)) continue;
    const _Float16 h = static_cast<_Float16>(f);
    uint16_t expected;
    std::memcpy(&expected, &h, 2);
    ASSERT_EQ(float_to_half(f), expected) << "float " << f << " seed " << test::test_seed();
  }
}
#endif

TEST(Numeric, BFloat16RoundsToNearestEven) {
  // 1 + 2^-8 is exactly halfway between bf16 neighbours 1 and 1 + 2^-7: ties go to even (1).
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + 1.0f / 256)), 1.0f);
  // 1 + 3·2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even).
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + 3.0f / 256)), 1.0f + 1.0f / 64);
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + 1.0f / 256 + 1.0f / 65536)), 1.0f + 1.0f / 128);
  EXPECT_TRUE(std::isinf(bf16_to_float(float_to_bf16(3.4e38f * 2))));
}

// Every E4M3 code against the format's definition, computed in double.
double e4m3_definition(int code) {
  const int exp = (code >> 3) & 15, man = code & 7;
  if (exp == 15 && man == 7) return std::nan("");
  const double mag = exp == 0 ? std::ldexp(man, -9) : std::ldexp(8 + man, exp - 10);
  return (code & 0x80) ? -mag : mag;
}

TEST(Numeric, E4M3DecodesEveryCode) {
  for (int code = 0; code < 256; ++code) {
    const double want = e4m3_definition(code);
    const float got = e4m3_to_float(static_cast<uint8_t>(code));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "code " << code;
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << "code " << code;
      EXPECT_EQ(std::signbit(got), (code & 0x80) != 0) << "code " << code;
    }
  }
  EXPECT_EQ(e4m3_to_float(0x7e), kE4M3Max);
}

TEST(Numeric, E4M3RoundTripsEveryValue) {
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7f) == 0x7f) continue;  // NaN
    EXPECT_EQ(float_to_e4m3(e4m3_to_float(static_cast<uint8_t>(code))), code) << "code " << code;
  }
}

// Against the nearest code found by search (ties to the even code, whose mantissa's last bit is
// 0), over every midpoint, its neighbours, and random values across the whole range.
TEST(Numeric, E4M3RoundsToNearestEvenAndSaturates) {
  auto nearest = [](float x) {
    int best = 0;
    double best_err = INFINITY;
    for (int code = 0; code <= 0x7e; ++code) {
      const double err = std::fabs(std::fabs(static_cast<double>(x)) - e4m3_definition(code));
      if (err < best_err || (err == best_err && (code & 1) == 0)) {
        best = code;
        best_err = err;
      }
    }
    return (std::signbit(x) ? 0x80 : 0) | best;
  };
  std::vector<float> xs;
  for (int code = 0; code < 0x7e; ++code) {
    const float mid = static_cast<float>(0.5 * (e4m3_definition(code) + e4m3_definition(code + 1)));
    xs.insert(xs.end(), {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)});
  }
  std::mt19937 rng(static_cast<uint32_t>(test::test_seed()));
  std::uniform_real_distribution<float> exponent(-12.0f, 9.0f);
  for (int i = 0; i < 20000; ++i) xs.push_back(std::exp2(exponent(rng)) * (i % 2 ? -1.0f : 1.0f));
  for (float x : xs) {
    if (std::fabs(x) >= kE4M3Max) continue;  // saturation, below
    EXPECT_EQ(float_to_e4m3(x), nearest(x)) << "x " << x << " (seed " << test::test_seed() << ")";
  }
  for (float x : {448.0f, 449.0f, 464.0f, 1e30f, INFINITY})
    EXPECT_EQ(float_to_e4m3(x), 0x7e) << "x " << x;
  EXPECT_EQ(float_to_e4m3(-INFINITY), 0xfe);
  EXPECT_EQ(float_to_e4m3(1e-30f), 0x00);
  EXPECT_EQ(float_to_e4m3(-1e-30f), 0x80);
  EXPECT_TRUE(std::isnan(e4m3_to_float(float_to_e4m3(NAN))));
}

// Known-answer vectors of Philox4x32-10 published with the Random123 library.
TEST(Philox, KnownAnswers) {
  Philox4 r = philox4x32_10({0, 0, 0, 0}, 0, 0);
  EXPECT_EQ(r.x, 0x6627e8d5u);
  EXPECT_EQ(r.y, 0xe169c58du);
  EXPECT_EQ(r.z, 0xbc57ac4cu);
  EXPECT_EQ(r.w, 0x9b00dbd8u);
  r = philox4x32_10({0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, 0xffffffffu, 0xffffffffu);
  EXPECT_EQ(r.x, 0x408f276du);
  EXPECT_EQ(r.y, 0x41c83b0eu);
  EXPECT_EQ(r.z, 0xa20bc7c6u);
  EXPECT_EQ(r.w, 0x6d5451fdu);
  r = philox4x32_10({0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, 0xa4093822u, 0x299f31d0u);
  EXPECT_EQ(r.x, 0xd16cfe09u);
  EXPECT_EQ(r.y, 0x94fdccebu);
  EXPECT_EQ(r.z, 0x5001e420u);
  EXPECT_EQ(r.w, 0x24126ea1u);
}

// The keep rate over a large block is within 5 standard deviations of 1 − p, for several p, and
// changing seed or offset changes the mask.
TEST(Philox, DropoutRateAndIndependence) {
  const uint64_t seed = test::test_seed();
  for (float p : {0.1f, 0.5f, 0.9f}) {
    int64_t kept = 0, differ_seed = 0, differ_offset = 0;
    const int rows = 512, cols = 1024;
    for (int i = 0; i < rows; ++i)
      for (int j = 0; j < cols; ++j) {
        const bool k = dropout_keep(seed, 3, 5, i, j, p);
        kept += k;
        differ_seed += k != dropout_keep(seed + 1, 3, 5, i, j, p);
        differ_offset += k != dropout_keep(seed, 4, 5, i, j, p);
      }
    const double n = double(rows) * cols;
    const double sd = std::sqrt(n * p * (1 - p));
    EXPECT_NEAR(double(kept), n * (1 - p), 5 * sd) << "p=" << p << " seed=" << seed;
    // Two independent masks differ with probability 2p(1−p).
    EXPECT_NEAR(double(differ_seed), n * 2 * p * (1 - p), 5 * std::sqrt(n)) << "p=" << p;
    EXPECT_NEAR(double(differ_offset), n * 2 * p * (1 - p), 5 * std::sqrt(n)) << "p=" << p;
  }
}

}  // namespace
}  // namespace flare
