#include "cpu/linear.h"

#include <algorithm>
#include <string>

#include "cpu/cpu_features.h"
#include "ops.h"

#if defined(__x86_64__) && defined(__GNUC__)
// GCC 12's AVX-512 headers trip -Wuninitialized on their own __Y temporaries (GCC PR 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#define SPECINFER_HAVE_X86 1
#endif

namespace specinfer {
namespace cpu {
namespace {

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

// bf16 x bf16 -> fp32: one _mm512_dpbf16_ps multiplies and pair-sums 32 products.
template <int MB, int NB>
struct TileBf16Avx512 {
  SPECINFER_TARGET(SPECINFER_AVX512_BF16)
  static void run(const LinearProblem& p, int64_t m0, int64_t n0) {
    const uint16_t* x = static_cast<const uint16_t*>(p.x) + m0 * p.x_stride;
    const uint16_t* w = static_cast<const uint16_t*>(p.w) + n0 * p.w_stride;
    __m512 acc[MB][NB];
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < p.K; k += 32) {
      const __mmask32 mask = p.K - k >= 32 ? ~__mmask32(0) : __mmask32((1u << (p.K - k)) - 1u);
      __m512i wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = _mm512_maskz_loadu_epi16(mask, w + j * p.w_stride + k);
      for (int i = 0; i < MB; ++i) {
        const __m512i xv = _mm512_maskz_loadu_epi16(mask, x + i * p.x_stride + k);
        for (int j = 0; j < NB; ++j) {
          acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xv, (__m512bh)wv[j]);
        }
      }
    }
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) store_output<bf16>(p, m0 + i, n0 + j, hsum512(acc[i][j]));
  }
};

template <int MB, int NB>
struct TileF32Avx512 {
  SPECINFER_TARGET(SPECINFER_AVX512)
  static void run(const LinearProblem& p, int64_t m0, int64_t n0) {
    const float* x = static_cast<const float*>(p.x) + m0 * p.x_stride;
    const float* w = static_cast<const float*>(p.w) + n0 * p.w_stride;
    __m512 acc[MB][NB];
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < p.K; k += 16) {
      const __mmask16 mask = p.K - k >= 16 ? __mmask16(0xffff) : __mmask16((1u << (p.K - k)) - 1u);
      __m512 wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = _mm512_maskz_loadu_ps(mask, w + j * p.w_stride + k);
      for (int i = 0; i < MB; ++i) {
        const __m512 xv = _mm512_maskz_loadu_ps(mask, x + i * p.x_stride + k);
        for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
      }
    }
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) store_output<float>(p, m0 + i, n0 + j, hsum512(acc[i][j]));
  }
};

// AVX2 tiles step 16 (fp32) or 32 (bf16) columns at a time; the last K % step columns go through
// zero-padded copies. 16 ymm registers: tiles are at most 2 x 4. Small tiles split each
// dot product over kSplits accumulators so the FMA latency chain does not limit a single row.
template <int MB, int NB>
constexpr int kSplits = MB* NB >= 4 ? 1 : 4 / (MB * NB);

template <int MB, int NB>
using Avx2Acc = __m256[MB][NB][kSplits<MB, NB>];

template <int MB, int NB, int kStep, typename T>
SPECINFER_INLINE void run_steps_with_tail(const T* x, int64_t xs, const T* w, int64_t ws, int64_t K,
                                          void (*step)(const T*, int64_t, const T*, int64_t,
                                                       Avx2Acc<MB, NB>&),
                                          Avx2Acc<MB, NB>& acc) {
  int64_t k = 0;
  for (; k + kStep <= K; k += kStep) {
    // Prefetch the same columns of the next block's rows: the weight streams ahead of use.
    for (int j = 0; j < NB; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (j + NB) * ws + k), _MM_HINT_T0);
    }
    step(x + k, xs, w + k, ws, acc);
  }
  if (k == K) return;
  T xt[MB][kStep] = {}, wt[NB][kStep] = {};
  for (int64_t c = 0; c < K - k; ++c) {
    for (int i = 0; i < MB; ++i) xt[i][c] = x[i * xs + k + c];
    for (int j = 0; j < NB; ++j) wt[j][c] = w[j * ws + k + c];
  }
  step(&xt[0][0], kStep, &wt[0][0], kStep, acc);
}

template <typename T, int MB, int NB, int kStep>
SPECINFER_TARGET(SPECINFER_AVX2)
void run_avx2_tile(const LinearProblem& p, int64_t m0, int64_t n0,
                   void (*step)(const T*, int64_t, const T*, int64_t, Avx2Acc<MB, NB>&)) {
  Avx2Acc<MB, NB> acc;
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j)
      for (int s = 0; s < kSplits<MB, NB>; ++s) acc[i][j][s] = _mm256_setzero_ps();
  run_steps_with_tail<MB, NB, kStep>(static_cast<const T*>(p.x) + m0 * p.x_stride, p.x_stride,
                                     static_cast<const T*>(p.w) + n0 * p.w_stride, p.w_stride, p.K,
                                     step, acc);
  for (int i = 0; i < MB; ++i) {
    for (int j = 0; j < NB; ++j) {
      __m256 sum = acc[i][j][0];
      for (int s = 1; s < kSplits<MB, NB>; ++s) sum = _mm256_add_ps(sum, acc[i][j][s]);
      store_output<T>(p, m0 + i, n0 + j, hsum256(sum));
    }
  }
}

template <int MB, int NB>
struct TileF32Avx2 {
  SPECINFER_TARGET(SPECINFER_AVX2)
  static void step(const float* x, int64_t xs, const float* w, int64_t ws, Avx2Acc<MB, NB>& acc) {
    for (int part = 0; part < 2; ++part) {
      __m256 xv[MB];
      for (int i = 0; i < MB; ++i) xv[i] = _mm256_loadu_ps(x + i * xs + 8 * part);
      for (int j = 0; j < NB; ++j) {
        const __m256 wv = _mm256_loadu_ps(w + j * ws + 8 * part);
        for (int i = 0; i < MB; ++i) {
          __m256& a = acc[i][j][part % kSplits<MB, NB>];
          a = _mm256_fmadd_ps(xv[i], wv, a);
        }
      }
    }
  }

  SPECINFER_TARGET(SPECINFER_AVX2)
  static void run(const LinearProblem& p, int64_t m0, int64_t n0) {
    run_avx2_tile<float, MB, NB, 16>(p, m0, n0, step);
  }
};

// bf16 on AVX2: a 32-bit lane holds two bf16; shifting left by 16 gives the even one as fp32 and
// masking the low half gives the odd one. A dot product does not care about the order, so x and
// w are split the same way and no unpacking is needed.
template <int MB, int NB>
struct TileBf16Avx2 {
  SPECINFER_TARGET(SPECINFER_AVX2)
  static void step(const bf16* x, int64_t xs, const bf16* w, int64_t ws, Avx2Acc<MB, NB>& acc) {
    const __m256i high = _mm256_set1_epi32(int(0xffff0000u));
    for (int part = 0; part < 2; ++part) {
      __m256 xe[MB], xo[MB];
      for (int i = 0; i < MB; ++i) {
        const __m256i v =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i * xs + 16 * part));
        xe[i] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        xo[i] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
      }
      for (int j = 0; j < NB; ++j) {
        const __m256i v =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * ws + 16 * part));
        const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, high));
        for (int i = 0; i < MB; ++i) {
          __m256& even = acc[i][j][(2 * part) % kSplits<MB, NB>];
          even = _mm256_fmadd_ps(xe[i], we, even);
          __m256& odd = acc[i][j][(2 * part + 1) % kSplits<MB, NB>];
          odd = _mm256_fmadd_ps(xo[i], wo, odd);
        }
      }
    }
  }

  SPECINFER_TARGET(SPECINFER_AVX2)
  static void run(const LinearProblem& p, int64_t m0, int64_t n0) {
    run_avx2_tile<bf16, MB, NB, 32>(p, m0, n0, step);
  }
};

SPECINFER_TARGET(SPECINFER_AVX512_BF16)
void tile_bf16_avx512bf16(const LinearProblem& p, int64_t m0, int64_t n0, int mb, int nb) {
  dispatch_tile<TileBf16Avx512>(p, m0, n0, mb, nb);
}

SPECINFER_TARGET(SPECINFER_AVX512)
void tile_f32_avx512(const LinearProblem& p, int64_t m0, int64_t n0, int mb, int nb) {
  dispatch_tile<TileF32Avx512>(p, m0, n0, mb, nb);
}

SPECINFER_TARGET(SPECINFER_AVX2)
void tile_f32_avx2(const LinearProblem& p, int64_t m0, int64_t n0, int mb, int nb) {
  dispatch_tile<TileF32Avx2>(p, m0, n0, mb, nb);
}

SPECINFER_TARGET(SPECINFER_AVX2)
void tile_bf16_avx2(const LinearProblem& p, int64_t m0, int64_t n0, int mb, int nb) {
  dispatch_tile<TileBf16Avx2>(p, m0, n0, mb, nb);
}
#endif  // SPECINFER_HAVE_X86

// A tile function and the most x rows it takes at once (AVX2 has 16 vector registers, AVX-512 32).
struct LinearKernel {
  LinearTileFn tile;
  int max_rows;
};

LinearKernel select_kernel(DType dtype) {
#ifdef SPECINFER_HAVE_X86
  if (dtype == DType::kBFloat16) {
    if (has_avx512_bf16()) return {tile_bf16_avx512bf16, 4};
    if (has_avx2_fma()) return {tile_bf16_avx2, 2};
  } else {
    if (has_avx512()) return {tile_f32_avx512, 4};
    if (has_avx2_fma()) return {tile_f32_avx2, 2};
  }
#endif
  if (dtype == DType::kBFloat16) return {tile_portable<bf16>, 4};
  return {tile_portable<float>, 4};
}

void run(const LinearProblem& p, LinearKernel kernel, int64_t elem_size) {
  // Several rows share each loaded block of 4 weight rows; a single row takes 16 weight rows per
  // call, one after another.
  const int nb = p.M == 1 ? 16 : 4;
  const int64_t blocks = (p.N + nb - 1) / nb;
  // Forking threads costs more than it saves below ~0.5 MB of weight (measured: 192x576 bf16 is
  // 20 us on one thread, 31 us on two).
  const bool parallel = p.N * p.K * elem_size >= (int64_t(1) << 19);
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t block = 0; block < blocks; ++block) {
    const int64_t n0 = block * nb, n_end = std::min(p.N, n0 + nb);
    for (int64_t m0 = 0; m0 < p.M; m0 += kernel.max_rows) {
      const int mb = int(std::min<int64_t>(kernel.max_rows, p.M - m0));
      if (n_end - n0 == nb) {
        kernel.tile(p, m0, n0, mb, nb);
      } else {
        for (int64_t n = n0; n < n_end; ++n) kernel.tile(p, m0, n, mb, 1);
      }
    }
  }
}

}  // namespace
}  // namespace cpu

void linear_cpu(const TensorView& x, const TensorView& w, const TensorView* bias,
                const TensorView& out) {
  const std::string op = "linear";
  check_ndim(x, 2, op, "x", "[rows, in_features]");
  check_ndim(w, 2, op, "weight", "[out_features, in_features]");
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
  cpu::run(p, cpu::select_kernel(x.dtype), x.dtype == DType::kFloat32 ? 4 : 2);
}

}  // namespace specinfer
