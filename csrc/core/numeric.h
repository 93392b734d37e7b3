// Scalar helpers for CPU kernels, written so GCC/Clang vectorise the loops that call them.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__GNUC__)
#define SPECINFER_INLINE inline __attribute__((always_inline))
#else
#define SPECINFER_INLINE inline
#endif

// Unrolls a loop over a compile-time register-tile size before scalar replacement runs, so an
// accumulator array lives in registers (rolled, GCC kept a stack copy stored every iteration).
#if defined(__clang__)
#define SPECINFER_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define SPECINFER_UNROLL _Pragma("GCC unroll 16")
#else
#define SPECINFER_UNROLL
#endif

namespace specinfer {

// bfloat16 storage: the high half of an IEEE float32.
struct bf16 {
  uint16_t bits;
};

SPECINFER_INLINE float to_float(float x) { return x; }

SPECINFER_INLINE float to_float(bf16 x) {
  uint32_t u = uint32_t(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

template <typename T>
SPECINFER_INLINE T from_float(float x);

template <>
SPECINFER_INLINE float from_float<float>(float x) {
  return x;
}

// Round to nearest even, like torch's float -> bfloat16 cast; NaN stays NaN.
template <>
SPECINFER_INLINE bf16 from_float<bf16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{uint16_t((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{uint16_t(u >> 16)};
}

// exp(x) to ~2 ulp, branch-free so it vectorises (libm's expf does not without -ffast-math).
// Returns exactly 0 below -87, so exp(-inf) is 0 as softmax needs.
SPECINFER_INLINE float fast_exp(float x) {
  const float clamped = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  // Round clamped*log2(e) to the nearest integer n with the 1.5*2^23 trick.
  const float n = (clamped * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  // r = x - n*ln2 in two parts for precision; |r| <= ln2/2.
  const float r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.0f;
  const uint32_t bits = uint32_t(int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.0f ? 0.0f : e * scale;
}

}  // namespace specinfer
