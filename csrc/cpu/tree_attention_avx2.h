// AVX2 inner loops of CPU tree attention (see GenericTiles in tree_attention.h), for head dims
// that are a multiple of 64. Include only under __x86_64__ with GCC or Clang.
//
// Scores: 8 keys at a time, each key's products summed over its 8 lanes (lane l takes dims l,
// l + 8, ... in order), then the 8 vectors reduced to one (lane j = key j) by hsum256x8, which
// sums every lane the same way, so a key's score does not depend on its place in the tile. The
// generic dot4 spends most of its time in one horizontal sum per key instead.
// Values: a query row's 64 dims in 8 accumulators, so a key's 8 FMAs are independent chains (two
// rows sharing each value vector's loads measured no faster).
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "cpu/cpu_features.h"

namespace specinfer::cpu {

// Lane j of the result is the sum of v[j]'s 8 lanes, every lane summed as ((0 + 1) + (2 + 3)) +
// ((4 + 5) + (6 + 7)).
SPECINFER_TARGET(SPECINFER_AVX2) inline __m256 hsum256x8(const __m256 (&v)[8]) {
  // hadd(x, y) = [x0+x1, x2+x3, y0+y1, y2+y3 | x4+x5, x6+x7, y4+y5, y6+y7]
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // a = [v0 0-3, v1 0-3, v2 0-3, v3 0-3 | v0 4-7, ...]: low halves plus high halves.
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

struct Avx2Tiles {
  static constexpr bool kRawKeys = false;
  static constexpr int kChunk = 64;  // dims a row's accumulators hold at once (8 registers)

  // s[r * cap + j] = q[r] . kv[j] for j < kn, and up to the next multiple of 8 from the tile's
  // stale rows (never read).
  template <int kD>
  SPECINFER_TARGET(SPECINFER_AVX2)
  static void scores(const float* q, int64_t R, int64_t, const float* kv, int64_t kn, float* s,
                     int64_t cap) {
    constexpr int C = kD / 8;
    for (int64_t r = 0; r < R; ++r) {
      __m256 qc[C];
      SPECINFER_UNROLL for (int c = 0; c < C; ++c) qc[c] = _mm256_loadu_ps(q + r * kD + 8 * c);
      for (int64_t j0 = 0; j0 < kn; j0 += 8) {
        __m256 v[8];
        SPECINFER_UNROLL for (int j = 0; j < 8; ++j) {
          const float* k = kv + (j0 + j) * kD;
          __m256 a = _mm256_mul_ps(qc[0], _mm256_loadu_ps(k));
          SPECINFER_UNROLL for (int c = 1; c < C; ++c) {
            a = _mm256_fmadd_ps(qc[c], _mm256_loadu_ps(k + 8 * c), a);
          }
          v[j] = a;
        }
        _mm256_storeu_ps(s + r * cap + j0, hsum256x8(v));
      }
    }
  }

  // acc[r] += sum_j p[r * cap + j] * kv[j] and l[r] += sum_j p[r * cap + j], in key order.
  template <int kD>
  SPECINFER_TARGET(SPECINFER_AVX2)
  static void values(const float* p, int64_t R, int64_t, const float* kv, int64_t kn, int64_t cap,
                     float* acc, float* l) {
    for (int64_t r = 0; r < R; ++r) {
      const float* pr = p + r * cap;
      float sum = l[r];
      for (int64_t j = 0; j < kn; ++j) sum += pr[j];
      l[r] = sum;
      for (int d0 = 0; d0 < kD; d0 += kChunk) {
        float* ar = acc + r * kD + d0;
        __m256 a[kChunk / 8];
        SPECINFER_UNROLL for (int c = 0; c < kChunk / 8; ++c) a[c] = _mm256_loadu_ps(ar + 8 * c);
        for (int64_t j = 0; j < kn; ++j) {
          const __m256 pj = _mm256_set1_ps(pr[j]);
          const float* v = kv + j * kD + d0;
          SPECINFER_UNROLL for (int c = 0; c < kChunk / 8; ++c) {
            a[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8 * c), a[c]);
          }
        }
        SPECINFER_UNROLL for (int c = 0; c < kChunk / 8; ++c) _mm256_storeu_ps(ar + 8 * c, a[c]);
      }
    }
  }
};

}  // namespace specinfer::cpu
