// AVX-512 inner loops of CPU tree attention (see GenericTiles in tree_attention.h), for head
// dims that are a multiple of 16. Include only under __x86_64__ with GCC or Clang.
//
// Scores: 16 keys at a time, each key's products summed over its 16 lanes, then the 16 vectors
// reduced to one (lane j = key j) by a tree of shuffles and adds. Every lane follows the same
// tree, so a key's score does not depend on its place in the tile. The generic dot4 spends most
// of its time in one horizontal sum per key instead.
// Values: several query rows share each value vector, so their accumulators are independent
// chains (one row's chain alone waits on the FMA latency at every key).
#pragma once

#include <cstdint>

#include "cpu/avx512.h"

namespace specinfer::cpu {

// Lane j of the result: the sum of the 16 lanes of v[j], summed the same way for every j.
SPECINFER_TARGET(SPECINFER_AVX512) inline __m512 sum_lanes16(const __m512 (&v)[16]) {
  // Pairs of vectors: within each 128-bit lane, lanes 0 + 2 and 1 + 3 of both.
  __m512 t[8];
  SPECINFER_UNROLL for (int i = 0; i < 8; ++i) {
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  // Then (0 + 2) + (1 + 3): u[i], 128-bit lane L, holds keys 4i .. 4i + 3 summed over lane L.
  __m512 u[4];
  SPECINFER_UNROLL for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // The four 128-bit lanes: (L0 + L2) + (L1 + L3), with u[i]'s keys moved to lane i.
  const __m512 x01 =
      _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44), _mm512_shuffle_f32x4(u[0], u[1], 0xee));
  const __m512 x23 =
      _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44), _mm512_shuffle_f32x4(u[2], u[3], 0xee));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, 0x88), _mm512_shuffle_f32x4(x01, x23, 0xdd));
}

struct Avx512Tiles {
  // s[r * cap + j] = q[r] . kv[j] for j < kn, and up to the next multiple of 16 from the tile's
  // stale rows (never read).
  template <int kD>
  SPECINFER_TARGET(SPECINFER_AVX512)
  static void scores(const float* q, int64_t R, int64_t, const float* kv, int64_t kn, float* s,
                     int64_t cap) {
    constexpr int C = kD / 16;
    for (int64_t r = 0; r < R; ++r) {
      __m512 qc[C];
      SPECINFER_UNROLL for (int c = 0; c < C; ++c) qc[c] = _mm512_loadu_ps(q + r * kD + 16 * c);
      for (int64_t j0 = 0; j0 < kn; j0 += 16) {
        __m512 v[16];
        SPECINFER_UNROLL for (int j = 0; j < 16; ++j) {
          const float* k = kv + (j0 + j) * kD;
          __m512 a = _mm512_mul_ps(qc[0], _mm512_loadu_ps(k));
          SPECINFER_UNROLL for (int c = 1; c < C; ++c) {
            a = _mm512_fmadd_ps(qc[c], _mm512_loadu_ps(k + 16 * c), a);
          }
          v[j] = a;
        }
        _mm512_storeu_ps(s + r * cap + j0, sum_lanes16(v));
      }
    }
  }

  // acc[r] += sum_j p[r * cap + j] * kv[j] and l[r] += sum_j p[r * cap + j], in key order,
  // kRows rows at a time.
  template <int kD>
  SPECINFER_TARGET(SPECINFER_AVX512)
  static void values(const float* p, int64_t R, int64_t, const float* kv, int64_t kn, int64_t cap,
                     float* acc, float* l) {
    constexpr int C = kD / 16, kRows = C <= 4 ? 16 / C : 1;  // 16 accumulators
    int64_t r = 0;
    for (; r + kRows <= R; r += kRows)
      rows<kD, kRows>(p + r * cap, kv, kn, cap, acc + r * kD, l + r);
    for (; r < R; ++r) rows<kD, 1>(p + r * cap, kv, kn, cap, acc + r * kD, l + r);
  }

  template <int kD, int kRows>
  SPECINFER_TARGET(SPECINFER_AVX512)
  static void rows(const float* p, const float* kv, int64_t kn, int64_t cap, float* acc, float* l) {
    constexpr int C = kD / 16;
    __m512 a[kRows][C];
    float sum[kRows];
    SPECINFER_UNROLL for (int i = 0; i < kRows; ++i) {
      sum[i] = l[i];
      SPECINFER_UNROLL for (int c = 0; c < C; ++c) a[i][c] = _mm512_loadu_ps(acc + i * kD + 16 * c);
    }
    for (int64_t j = 0; j < kn; ++j) {
      __m512 v[C];
      SPECINFER_UNROLL for (int c = 0; c < C; ++c) v[c] = _mm512_loadu_ps(kv + j * kD + 16 * c);
      SPECINFER_UNROLL for (int i = 0; i < kRows; ++i) {
        const float pj = p[i * cap + j];
        sum[i] += pj;
        const __m512 pv = _mm512_set1_ps(pj);
        SPECINFER_UNROLL for (int c = 0; c < C; ++c) a[i][c] = _mm512_fmadd_ps(pv, v[c], a[i][c]);
      }
    }
    SPECINFER_UNROLL for (int i = 0; i < kRows; ++i) {
      l[i] = sum[i];
      SPECINFER_UNROLL for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + i * kD + 16 * c, a[i][c]);
    }
  }
};

}  // namespace specinfer::cpu
