// AVX-512 helpers the x86 kernels share (include only under __x86_64__ with GCC or Clang).
#pragma once

// GCC 12's AVX-512 headers trip -Wuninitialized on their own __Y temporaries (GCC PR 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include "core/numeric.h"
#include "cpu/cpu_features.h"

namespace specinfer::cpu {

// from_float<bf16> on 16 lanes: round to nearest even, NaN stays NaN.
SPECINFER_TARGET(SPECINFER_AVX512) inline __m256i to_bf16x16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
}

// r[i] becomes column i of the 16 x 16 matrix of 32-bit elements whose rows were r[0..15]:
// pairs of rows interleaved by 32 then 64 bits (within 128-bit lanes), then the 4 x 4 matrix of
// 128-bit lanes transposed.
SPECINFER_TARGET(SPECINFER_AVX512) inline void transpose16x16(__m512i (&r)[16]) {
  __m512i a[16], b[16];
  SPECINFER_UNROLL for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // b[4i + j], lane l: column 4l + j of rows 4i .. 4i + 3.
  SPECINFER_UNROLL for (int i = 0; i < 4; ++i) {
    b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  SPECINFER_UNROLL for (int j = 0; j < 4; ++j) {
    const __m512i c0 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0x44);
    const __m512i c1 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0xee);
    const __m512i c2 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0x44);
    const __m512i c3 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0xee);
    r[j] = _mm512_shuffle_i32x4(c0, c2, 0x88);
    r[4 + j] = _mm512_shuffle_i32x4(c0, c2, 0xdd);
    r[8 + j] = _mm512_shuffle_i32x4(c1, c3, 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(c1, c3, 0xdd);
  }
}

// Adds two vectors lane by lane: floats, or int32 lanes through their bits (for hsum512x16).
struct AddFloats {
  SPECINFER_TARGET(SPECINFER_AVX512) __m512 operator()(__m512 a, __m512 b) const {
    return _mm512_add_ps(a, b);
  }
};
struct AddInt32s {
  SPECINFER_TARGET(SPECINFER_AVX512) __m512 operator()(__m512 a, __m512 b) const {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  }
};

// The 16 lanes of each of 16 vectors summed, all at once: lane 4c + r of the result is the sum of
// v[4r + c]'s, and every lane is summed in the same order (pairs of lanes l and l + 8, then
// l + 4, l + 2, l + 1), so a sum does not depend on its place. 30 shuffles and 15 adds instead
// of 16 x 8 ops. (Int32 lanes: hsum512x16<AddInt32s> on their bits.)
template <typename Add = AddFloats>
SPECINFER_TARGET(SPECINFER_AVX512)
inline __m512 hsum512x16(const __m512 (&v)[16]) {
  const Add add;
  __m512 halves[8], quarters[4], pairs[2];
  SPECINFER_UNROLL for (int a = 0; a < 8; ++a) {
    const __m512 x = v[2 * a], y = v[2 * a + 1];
    halves[a] = add(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(1, 0, 1, 0)),
                    _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  SPECINFER_UNROLL for (int b = 0; b < 4; ++b) {
    const __m512 x = halves[2 * b], y = halves[2 * b + 1];
    quarters[b] = add(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                      _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
  }
  SPECINFER_UNROLL for (int c = 0; c < 2; ++c) {
    const __m512 x = quarters[2 * c], y = quarters[2 * c + 1];
    pairs[c] = add(_mm512_shuffle_ps(x, y, _MM_SHUFFLE(1, 0, 1, 0)),
                   _mm512_shuffle_ps(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  return add(_mm512_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(2, 0, 2, 0)),
             _mm512_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

}  // namespace specinfer::cpu
