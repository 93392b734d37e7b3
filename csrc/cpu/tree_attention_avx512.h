// AVX-512 inner loops of CPU tree attention (see GenericTiles in tree_attention.h), for head
// dims that are a multiple of 16. Include only under __x86_64__ with GCC or Clang.
//
// Scores: 16 keys at a time, each key's products summed over its 16 lanes, then the 16 vectors
// reduced to one (lane j = key j) by hsum512x16, which sums every lane the same way, so a key's
// score does not depend on its place in the tile. The generic dot4 spends most of its time in
// one horizontal sum per key instead.
// Values: several query rows share each value vector, so their accumulators are independent
// chains (one row's chain alone waits on the FMA latency at every key).
#pragma once

#include <cstdint>

#include "cpu/avx512.h"

namespace specinfer::cpu {

struct Avx512Tiles {
  static constexpr bool kRawKeys = false;

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
        __m512 v[16];  // key j's products in v[4 (j % 4) + j / 4], so its sum lands in lane j
        SPECINFER_UNROLL for (int j = 0; j < 16; ++j) {
          const float* k = kv + (j0 + j) * kD;
          __m512 a = _mm512_mul_ps(qc[0], _mm512_loadu_ps(k));
          SPECINFER_UNROLL for (int c = 1; c < C; ++c) {
            a = _mm512_fmadd_ps(qc[c], _mm512_loadu_ps(k + 16 * c), a);
          }
          v[4 * (j % 4) + j / 4] = a;
        }
        _mm512_storeu_ps(s + r * cap + j0, hsum512x16(v));
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
