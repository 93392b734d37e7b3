#include "cpu/linear.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "cpu/cpu_features.h"
#include "ops.h"

#ifdef SPECINFER_HAVE_X86
#include "cpu/avx512.h"
#endif

namespace specinfer {
namespace cpu {
namespace {

// Up to this many x rows the weight is streamed one row at a time: by the AVX2 kernel (run_avx2),
// and by the tiles (run_tiles).
constexpr int kStreamMaxRows = 12, kTileStreamMaxRows = 3;

// Calls tile(m0, mb) over rows [0, M) in tiles of at most max_mb rows, of nearly equal size (5 rows
// at most 4 as 3 + 2, not 4 + 1), so no tile is left with a single row.
template <typename Tile>
SPECINFER_INLINE void for_each_row_tile(int64_t M, int64_t max_mb, Tile tile) {
  for (int64_t m0 = 0, tiles = (M + max_mb - 1) / max_mb; m0 < M; --tiles) {
    const int64_t mb = (M - m0 + tiles - 1) / tiles;
    tile(m0, mb);
    m0 += mb;
  }
}

template <typename T>
struct Portable {
  template <int MB, int NB>
  struct Tile {
    SPECINFER_INLINE static void run(const LinearProblem& p, int64_t m0, int64_t n0) {
      linear_tile_portable<T, MB, NB>(p, m0, n0);
    }
  };
};

template <typename T>
void tile_portable(const LinearProblem& p, int64_t m0, int64_t n0, int mb, int nb) {
  dispatch_tile<Portable<T>::template Tile>(p, m0, n0, mb, nb);
}

#ifdef SPECINFER_HAVE_X86
#define SPECINFER_AVX512_BF16 SPECINFER_AVX512 ",avx512bf16"

SPECINFER_TARGET(SPECINFER_AVX2) inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

SPECINFER_TARGET(SPECINFER_AVX512) inline float hsum512(__m512 v) {
  const __m512 halves = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 0, 3, 2)));
  return hsum256(_mm512_castps512_ps256(halves));
}

// The AVX-512 tiles below keep their MB x NB accumulators in registers only because their loops
// over MB and NB are unrolled first (SPECINFER_UNROLL): GCC 12 otherwise kept a stack copy of the
// array, stored every iteration, which made 2 rows cost 5x one.
//
// They prefetch the weight into L2 ahead of use, since the hardware prefetcher alone keeps too
// few lines in flight for the loads to overlap the arithmetic: a streamed row (NB == 1) the row
// kStreamAhead rows on, a block of NB rows (NB interleaved streams, which it prefetches worse
// still) the block kBlocksAhead blocks on. A prefetch never faults, so the ones past the end
// need no guard. Measured (bf16, 2 threads, the 30 layers and LM head of SmolLM2-135M from DRAM):
// streamed 4 rows 17.2 -> 10.6 ms (1 row 10.4 both); in blocks, with the block one on
// prefetched into L1 as before, 4/8/16 rows 13.6/14.0/18.4 ms -> 8.4/9.6/15.7.
constexpr int kStreamAhead = 4, kBlocksAhead = 2;
SPECINFER_INLINE void prefetch_l2(const void* p) {
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1);
}

// 16 lanes into out[16] as from_float<T> converts them.
SPECINFER_TARGET(SPECINFER_AVX512) inline void store16(float* out, __m512 v) {
  _mm512_storeu_ps(out, v);
}
SPECINFER_TARGET(SPECINFER_AVX512) inline void store16(bf16* out, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), to_bf16x16(v));
}

// The MB x NB outputs of a tile at (m0, n0) from its accumulators, each the hsum512 of its own, as
// store_output writes them. A full block of 4 weight rows reduces all at once (hsum512x16), adds
// the bias and rounds in vectors: per output 3 ops instead of ~20.
template <typename T, int MB, int NB>
SPECINFER_TARGET(SPECINFER_AVX512)
inline void store_tile(const LinearProblem& p, int64_t m0, int64_t n0,
                       const __m512 (&acc)[MB][NB]) {
  if constexpr (NB != 4 || MB < 2) {
    SPECINFER_UNROLL for (int i = 0; i < MB; ++i) {
      SPECINFER_UNROLL for (int j = 0; j < NB; ++j) {
        store_output<T>(p, m0 + i, n0 + j, hsum512(acc[i][j]));
      }
    }
  } else {
    __m512 v[16];
    SPECINFER_UNROLL for (int i = 0; i < 4; ++i) {
      SPECINFER_UNROLL for (int j = 0; j < 4; ++j) {
        v[4 * i + j] = i < MB ? acc[i % MB][j] : _mm512_setzero_ps();  // rows past MB: zeros
      }
    }
    // Lane 4j + i holds output (i, j); row-major puts each output row's 4 values side by side.
    const __m512i row_major =
        _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    __m512 sums = _mm512_permutexvar_ps(row_major, hsum512x16(v));
    if (p.bias) {
      const T* bias = static_cast<const T*>(p.bias);
      const __m128 b = _mm_setr_ps(
          to_float(bias[n0 * p.bias_stride]), to_float(bias[(n0 + 1) * p.bias_stride]),
          to_float(bias[(n0 + 2) * p.bias_stride]), to_float(bias[(n0 + 3) * p.bias_stride]));
      sums = _mm512_add_ps(sums, _mm512_broadcast_f32x4(b));
    }
    alignas(64) T out[16];
    store16(out, sums);
    T* y = static_cast<T*>(p.y) + m0 * p.y_stride + n0;
    for (int i = 0; i < MB; ++i) std::memcpy(y + i * p.y_stride, out + 4 * i, 4 * sizeof(T));
  }
}

// bf16 x bf16 -> fp32: one _mm512_dpbf16_ps multiplies and pair-sums 32 products.
template <int MB, int NB>
struct TileBf16Avx512 {
  SPECINFER_TARGET(SPECINFER_AVX512_BF16)
  static void run(const LinearProblem& p, int64_t m0, int64_t n0) {
    const uint16_t* x = static_cast<const uint16_t*>(p.x) + m0 * p.x_stride;
    const uint16_t* w = static_cast<const uint16_t*>(p.w) + n0 * p.w_stride;
    __m512 acc[MB][NB];
    SPECINFER_UNROLL for (int i = 0; i < MB; ++i) {
      SPECINFER_UNROLL for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
    }
    for (int64_t k = 0; k < p.K; k += 32) {
      const __mmask32 mask = p.K - k >= 32 ? ~__mmask32(0) : __mmask32((1u << (p.K - k)) - 1u);
      __m512i wv[NB];
      SPECINFER_UNROLL for (int j = 0; j < NB; ++j) {
        wv[j] = _mm512_maskz_loadu_epi16(mask, w + j * p.w_stride + k);
        if (NB > 1) prefetch_l2(w + (kBlocksAhead * NB + j) * p.w_stride + k);
      }
      if (NB == 1) prefetch_l2(w + kStreamAhead * p.w_stride + k);
      SPECINFER_UNROLL for (int i = 0; i < MB; ++i) {
        const __m512i xv = _mm512_maskz_loadu_epi16(mask, x + i * p.x_stride + k);
        SPECINFER_UNROLL for (int j = 0; j < NB; ++j) {
          acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xv, (__m512bh)wv[j]);
        }
      }
    }
    store_tile<bf16, MB, NB>(p, m0, n0, acc);
  }
};

template <int MB, int NB>
struct TileF32Avx512 {
  SPECINFER_TARGET(SPECINFER_AVX512)
  static void run(const LinearProblem& p, int64_t m0, int64_t n0) {
    const float* x = static_cast<const float*>(p.x) + m0 * p.x_stride;
    const float* w = static_cast<const float*>(p.w) + n0 * p.w_stride;
    __m512 acc[MB][NB];
    SPECINFER_UNROLL for (int i = 0; i < MB; ++i) {
      SPECINFER_UNROLL for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
    }
    for (int64_t k = 0; k < p.K; k += 16) {
      const __mmask16 mask = p.K - k >= 16 ? __mmask16(0xffff) : __mmask16((1u << (p.K - k)) - 1u);
      __m512 wv[NB];
      SPECINFER_UNROLL for (int j = 0; j < NB; ++j) {
        wv[j] = _mm512_maskz_loadu_ps(mask, w + j * p.w_stride + k);
        if (NB > 1) prefetch_l2(w + (kBlocksAhead * NB + j) * p.w_stride + k);
      }
      if (NB == 1) prefetch_l2(w + kStreamAhead * p.w_stride + k);
      SPECINFER_UNROLL for (int i = 0; i < MB; ++i) {
        const __m512 xv = _mm512_maskz_loadu_ps(mask, x + i * p.x_stride + k);
        SPECINFER_UNROLL for (int j = 0; j < NB; ++j) {
          acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
        }
      }
    }
    store_tile<float, MB, NB>(p, m0, n0, acc);
  }
};

// --- AVX2 + FMA ---
// The engine packs its weights for the faster panel kernel on these CPUs (linear_panels.cpp);
// this one serves the weights left as loaded (out_features not a multiple of 16, other callers).
// x is first converted to float32 rows padded with zeros to a multiple of 16 columns (it is small
// and read many times); the weight is converted to float32 as it streams by.
//
// The summation order of every output, whatever M is (so a row's result does not depend on the
// rows beside it: a token tree's logits equal, bit for bit, those of decoding its nodes one at a
// time): lane l of two accumulators a and b takes, 16 columns at a time, columns l, l + 8 (a) and
// l + 4, l + 12 (b), l < 4, in order along K; then lane l of [a.lo + a.hi, b.lo + b.hi] sums a
// column and the one 8 on, and the 8 lanes are summed horizontally. Two chains per lane hide the
// FMA latency of a decode GEMV. Columns 0-3, 8-11 (and 4-7, 12-15) are what one unpack of 16 bf16
// weights against zeros gives, so a weight vector costs a load and two unpacks; x is stored in
// the same column order ("paired"), so each x vector is one aligned load.

constexpr int64_t kStep = 16;  // columns a pair of vectors takes

int64_t padded(int64_t k) { return (k + kStep - 1) / kStep * kStep; }

// Columns [k, k + 16) at p as float32 vectors in paired order: a = 0-3, 8-11; b = 4-7, 12-15.
SPECINFER_TARGET(SPECINFER_AVX2) inline void load16(const bf16* p, __m256& a, __m256& b) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  a = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), w));
  b = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), w));
}
SPECINFER_TARGET(SPECINFER_AVX2) inline void load16(const float* p, __m256& a, __m256& b) {
  const __m256 lo = _mm256_loadu_ps(p), hi = _mm256_loadu_ps(p + 8);
  a = _mm256_permute2f128_ps(lo, hi, 0x20);
  b = _mm256_permute2f128_ps(lo, hi, 0x31);
}

// The columns of src past the last whole 16 and zeros up to 16, for load16.
template <typename T>
SPECINFER_INLINE void tail16(const T* src, int64_t k_main, int64_t cols, T (&tail)[kStep]) {
  for (int64_t k = 0; k < kStep; ++k) {
    tail[k] = k_main + k < cols ? src[k_main + k] : from_float<T>(0.0f);
  }
}

// dst[r, :] = float(src row r) in paired order, r < rows, zero-padded to `width` (a multiple of
// 16).
template <typename T>
SPECINFER_TARGET(SPECINFER_AVX2)
void to_paired_rows(const T* src, int64_t stride, int64_t rows, int64_t cols, float* dst,
                    int64_t width) {
  const int64_t k_main = cols / kStep * kStep;
  for (int64_t r = 0; r < rows; ++r, src += stride, dst += width) {
    __m256 a, b;
    for (int64_t c = 0; c < k_main; c += kStep) {
      load16(src + c, a, b);
      _mm256_store_ps(dst + c, a);
      _mm256_store_ps(dst + c + 8, b);
    }
    if (k_main < width) {
      T tail[kStep];
      tail16(src, k_main, cols, tail);
      load16(tail, a, b);
      _mm256_store_ps(dst + k_main, a);
      _mm256_store_ps(dst + k_main + 8, b);
    }
  }
}

// The end of the order: [a.lo + a.hi, b.lo + b.hi], summed horizontally.
SPECINFER_TARGET(SPECINFER_AVX2) inline float paired_sum(__m256 a, __m256 b) {
  return hsum256(
      _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31)));
}

// Up to kStreamMaxRows rows (decode, small trees): weight rows one after another, so the weight
// is one sequential stream, which the hardware prefetches best (the next row is prefetched as this
// one is read). Each 16 weight columns are converted in registers and meet up to kMaxStreamMB rows
// of x (two accumulators a row; two registers hold the weights); further rows take another pass
// over the weight row while it is in L1. Measured (bf16, 2 threads, the 30 layers' projections
// and the LM head of SmolLM2-135M from DRAM, Zen 3, best of 7): 1 / 4 / 6 / 9 / 10 rows 12.4 /
// 15.8 / 21.6 / 32.3 / 37.7 ms with 8 columns converted at a time, 4 x rows a pass and panels
// past 8 rows, against 12.3 / 12.6 / 17.1 / 25.8 / 28.7 now: past ~5 rows each row adds its
// arithmetic (~6 G 8-lane FMAs a second, half the two cores' peak: in L1 this loop reaches ~80%,
// but the weight stream from DRAM and the FMAs overlap only partly). 7 rows a pass (all 16
// registers) measured no faster than 4 + 3; at 12 rows streaming and the panels below are even.
constexpr int kMaxStreamMB = 6;

// acc_a[i] += x[i, 0:8] * a, acc_b[i] += x[i, 8:16] * b for the MB x rows `width` apart.
template <int MB>
SPECINFER_TARGET(SPECINFER_AVX2)
SPECINFER_INLINE void madd_rows(const float* x, int64_t width, __m256 a, __m256 b,
                                __m256 (&acc_a)[MB], __m256 (&acc_b)[MB]) {
  SPECINFER_UNROLL for (int i = 0; i < MB; ++i) {
    acc_a[i] = _mm256_fmadd_ps(_mm256_load_ps(x + i * width), a, acc_a[i]);
    acc_b[i] = _mm256_fmadd_ps(_mm256_load_ps(x + i * width + 8), b, acc_b[i]);
  }
}

template <typename T, int MB>
SPECINFER_TARGET(SPECINFER_AVX2)
void stream_row_avx2(const LinearProblem& p, const float* x, int64_t width, int64_t m0, int64_t n) {
  const int64_t k_main = p.K / kStep * kStep;
  const T* w = static_cast<const T*>(p.w) + n * p.w_stride;
  x += m0 * width;
  __m256 acc_a[MB], acc_b[MB], a, b;
  SPECINFER_UNROLL for (int i = 0; i < MB; ++i) {
    acc_a[i] = _mm256_setzero_ps();
    acc_b[i] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < k_main; k += kStep) {
    if (m0 == 0 && k % (64 / sizeof(T)) < kStep) {
      _mm_prefetch(reinterpret_cast<const char*>(w + p.w_stride + k), _MM_HINT_T0);
    }
    load16(w + k, a, b);
    madd_rows<MB>(x + k, width, a, b, acc_a, acc_b);
  }
  if (k_main < width) {
    T tail[kStep];
    tail16(w, k_main, p.K, tail);
    load16(tail, a, b);
    madd_rows<MB>(x + k_main, width, a, b, acc_a, acc_b);
  }
  SPECINFER_UNROLL for (int i = 0; i < MB; ++i) {
    store_output<T>(p, m0 + i, n, paired_sum(acc_a[i], acc_b[i]));
  }
}

template <typename T>
SPECINFER_TARGET(SPECINFER_AVX2)
void stream_rows_avx2(const LinearProblem& p, const float* x, int64_t width, int64_t n_begin,
                      int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    for_each_row_tile(p.M, kMaxStreamMB, [&](int64_t m0, int64_t mb) {
      switch (mb) {
        case 1:
          return stream_row_avx2<T, 1>(p, x, width, m0, n);
        case 2:
          return stream_row_avx2<T, 2>(p, x, width, m0, n);
        case 3:
          return stream_row_avx2<T, 3>(p, x, width, m0, n);
        case 4:
          return stream_row_avx2<T, 4>(p, x, width, m0, n);
        case 5:
          return stream_row_avx2<T, 5>(p, x, width, m0, n);
        default:
          return stream_row_avx2<T, kMaxStreamMB>(p, x, width, m0, n);
      }
    });
  }
}

// Tiles (more rows): a block of kBlockRows weight rows (contiguous in memory, so one sequential
// read) is converted to float32 (paired order) into a panel that stays in L1, then every tile of
// up to kMaxMB x rows meets the whole block: per 8 columns kBlockRows + MB loads feed kBlockRows x
// MB FMAs. The a and b halves of the order are summed in separate passes over the panel, so a
// pass holds only kBlockRows x MB accumulators (12, plus the x registers).
constexpr int kBlockRows = 4, kMaxMB = 3;

template <typename T, int MB>
SPECINFER_TARGET(SPECINFER_AVX2)
void block_tile_avx2(const LinearProblem& p, const float* x, int64_t width, const float* panel,
                     int64_t m0, int64_t n0) {
  x += m0 * width;
  __m256 part[2][MB][kBlockRows];  // the a and b accumulators
  SPECINFER_UNROLL for (int half = 0; half < 2; ++half) {
    __m256 acc[MB][kBlockRows];
    SPECINFER_UNROLL for (int i = 0; i < MB; ++i) {
      SPECINFER_UNROLL for (int j = 0; j < kBlockRows; ++j) acc[i][j] = _mm256_setzero_ps();
    }
    for (int64_t k = half * 8; k < width; k += kStep) {
      __m256 xv[MB];
      SPECINFER_UNROLL for (int i = 0; i < MB; ++i) xv[i] = _mm256_load_ps(x + i * width + k);
      SPECINFER_UNROLL for (int j = 0; j < kBlockRows; ++j) {
        const __m256 wv = _mm256_load_ps(panel + j * width + k);
        SPECINFER_UNROLL for (int i = 0; i < MB; ++i) {
          acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]);
        }
      }
    }
    SPECINFER_UNROLL for (int i = 0; i < MB; ++i) {
      SPECINFER_UNROLL for (int j = 0; j < kBlockRows; ++j) part[half][i][j] = acc[i][j];
    }
  }
  const int nb = int(std::min<int64_t>(kBlockRows, p.N - n0));
  for (int i = 0; i < MB; ++i) {
    for (int j = 0; j < nb; ++j) {
      store_output<T>(p, m0 + i, n0 + j, paired_sum(part[0][i][j], part[1][i][j]));
    }
  }
}

template <typename T>
SPECINFER_TARGET(SPECINFER_AVX2)
void gemm_block_avx2(const LinearProblem& p, const float* x, int64_t width, int64_t block) {
  float* panel = thread_scratch<float, 1>(kBlockRows * width);
  const int64_t n0 = block * kBlockRows, rows = std::min<int64_t>(kBlockRows, p.N - n0);
  to_paired_rows(static_cast<const T*>(p.w) + n0 * p.w_stride, p.w_stride, rows, p.K, panel, width);
  std::fill(panel + rows * width, panel + kBlockRows * width, 0.0f);
  for_each_row_tile(p.M, kMaxMB, [&](int64_t m0, int64_t mb) {
    if (mb == 3) block_tile_avx2<T, 3>(p, x, width, panel, m0, n0);
    if (mb == 2) block_tile_avx2<T, 2>(p, x, width, panel, m0, n0);
    if (mb == 1) block_tile_avx2<T, 1>(p, x, width, panel, m0, n0);
  });
}

template <typename T>
void run_avx2(const LinearProblem& p, bool parallel) {
  const int64_t width = padded(p.K);
  float* x = thread_scratch<float, 0>(p.M * width);
  to_paired_rows(static_cast<const T*>(p.x), p.x_stride, p.M, p.K, x, width);
  // Both paths sum every output in the order given above.
  const bool stream = p.M <= kStreamMaxRows;
  const int64_t per_block = stream ? 16 : kBlockRows;
  const int64_t blocks = (p.N + per_block - 1) / per_block;
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t b = 0; b < blocks; ++b) {
    if (stream) {
      stream_rows_avx2<T>(p, x, width, b * per_block, std::min(p.N, (b + 1) * per_block));
    } else {
      gemm_block_avx2<T>(p, x, width, b);
    }
  }
}

SPECINFER_TARGET(SPECINFER_AVX512_BF16)
void tile_bf16_avx512bf16(const LinearProblem& p, int64_t m0, int64_t n0, int mb, int nb) {
  dispatch_tile<TileBf16Avx512>(p, m0, n0, mb, nb);
}

SPECINFER_TARGET(SPECINFER_AVX512)
void tile_f32_avx512(const LinearProblem& p, int64_t m0, int64_t n0, int mb, int nb) {
  dispatch_tile<TileF32Avx512>(p, m0, n0, mb, nb);
}

#endif  // SPECINFER_HAVE_X86

// A tile function and the most x rows it takes at once.
struct LinearKernel {
  LinearTileFn tile;
  int max_rows;
};

LinearKernel select_tile_kernel(DType dtype) {
#ifdef SPECINFER_HAVE_X86
  if (dtype == DType::kBFloat16 && has_avx512_bf16()) return {tile_bf16_avx512bf16, 4};
  if (dtype == DType::kFloat32 && has_avx512()) return {tile_f32_avx512, 4};
#endif
  if (dtype == DType::kBFloat16) return {tile_portable<bf16>, 4};
  return {tile_portable<float>, 4};
}

void run_tiles(const LinearProblem& p, LinearKernel kernel, bool parallel) {
  // Up to kTileStreamMaxRows x rows (decode, the smallest trees) walk the weight rows one after
  // another, each met by every x row while it is in L1: one sequential stream. More rows share
  // each loaded block of 4 weight rows: 4 accumulator chains per x row instead of 1, which also
  // makes weights already in cache (a draft model's, level after level) faster to go through.
  // Measured (bf16 AVX-512, 2 threads, SmolLM2-135M's 30 layers and LM head from DRAM / a
  // 2-layer draft head's weights in cache), 2 and 3 rows: streamed 8.3/0.37 and 8.4/0.40 ms, in
  // blocks 8.8/0.28 and 8.8/0.28; 4 rows 8.8/0.44 streamed, 8.4/0.32 in blocks.
  const bool stream = p.M <= kTileStreamMaxRows;
  const int nb = stream ? 16 : 4;
  const int64_t blocks = (p.N + nb - 1) / nb;
  auto row_tiles = [&](int64_t n, int width) {
    for_each_row_tile(p.M, kernel.max_rows,
                      [&](int64_t m0, int64_t mb) { kernel.tile(p, m0, n, int(mb), width); });
  };
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t block = 0; block < blocks; ++block) {
    const int64_t n0 = block * nb, n_end = std::min(p.N, n0 + nb);
    if (!stream && n_end - n0 == nb) {
      row_tiles(n0, nb);
    } else {
      for (int64_t n = n0; n < n_end; ++n) row_tiles(n, 1);
    }
  }
}

void run(const LinearProblem& p, DType dtype) {
  // Forking threads costs more than it saves below ~0.5 MB of weight at one row (measured: 192x576
  // bf16 is 20 us on one thread, 31 us on two); more rows mean more work per byte.
  const int64_t elem_size = dtype == DType::kFloat32 ? 4 : 2;
  const bool parallel = p.N * p.K * std::max(p.M, elem_size) >= (int64_t(1) << 19);
  if (dtype == DType::kBFloat16 && run_linear_amx(p, parallel)) return;
#ifdef SPECINFER_HAVE_X86
  const bool avx512 = dtype == DType::kBFloat16 ? has_avx512_bf16() : has_avx512();
  if (!avx512 && has_avx2_fma()) {
    if (dtype == DType::kBFloat16) return run_avx2<bf16>(p, parallel);
    return run_avx2<float>(p, parallel);
  }
#endif
  run_tiles(p, select_tile_kernel(dtype), parallel);
}

}  // namespace
}  // namespace cpu

void check_linear_sizes(const std::string& op, const TensorView& x, const TensorView& w,
                        const TensorView* bias, const TensorView& out) {
  check_size(w, 1, x.shape[1], op, "weight", "in_features of x");
  check_size(out, 0, x.shape[0], op, "out", "rows of x");
  check_size(out, 1, w.shape[0], op, "out", "out_features of weight");
  if (bias) {
    check_ndim(*bias, 1, op, "bias", "[out_features]");
    check_size(*bias, 0, w.shape[0], op, "bias", "out_features of weight");
  }
  check_last_dim_contiguous(x, op, "x");
  check_last_dim_contiguous(w, op, "weight");
  check_last_dim_contiguous(out, op, "out");
}

void linear_cpu(const TensorView& x, const TensorView& w, const TensorView* bias,
                const TensorView& out) {
  const std::string op = "linear";
  check_ndim(x, 2, op, "x", "[rows, in_features]");
  if (w.ndim != 3) check_ndim(w, 2, op, "weight", "[out_features, in_features] or packed");
  check_ndim(out, 2, op, "out", "[rows, out_features]");
  const TensorView* all[] = {&w, &out, bias};
  const char* names[] = {"weight", "out", "bias"};
  for (int i = 0; i < 3; ++i) {
    if (all[i] == nullptr) continue;
    if (all[i]->device != Device::kCPU) fail(op, std::string(names[i]) + " must be on cpu");
    check_same_dtype(*all[i], x, op, names[i], "x");
  }
  if (x.device != Device::kCPU) fail(op, "x must be on cpu");
  check_dtype_is(x, DType::kFloat32, DType::kBFloat16, op, "x");
  if (w.ndim == 3) return linear_panels_cpu(x, w, bias, out);
  check_linear_sizes(op, x, w, bias, out);

  cpu::LinearProblem p;
  p.x = x.data;
  p.w = w.data;
  p.bias = bias ? bias->data : nullptr;
  p.y = out.data;
  p.x_stride = x.strides[0];
  p.w_stride = w.strides[0];
  p.y_stride = out.strides[0];
  p.bias_stride = bias ? bias->strides[0] : 0;
  p.M = x.shape[0];
  p.N = w.shape[0];
  p.K = x.shape[1];
  if (p.M == 0 || p.N == 0) return;
  cpu::run(p, x.dtype);
}

}  // namespace specinfer
