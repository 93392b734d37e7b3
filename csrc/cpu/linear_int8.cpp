// CPU linear with 8-bit weights, for draft models: their weights are streamed from memory at every
// drafting call (the target's evict them), so half the bytes of bf16 is nearly half the time.
// Weight row n holds codes c = round(w / scale[n]) + 128 (uint8, 1..255) and one float scale; x is
// quantized per row to int8 (its own scale, max |x| / 127) once per call, and the dot products
// are exact int32 sums: out[m, n] = scale_x[m] scale[n] sum_k xq[m, k] (c[n, k] - 128) + bias[n].
//
// Integer sums do not depend on their order, so every kernel family (AVX512-VNNI, AVX2, or the
// compiler's vectorisation of the portable loop) gives the same bits, and a row's result never
// depends on the rows beside it.
#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu/cpu_features.h"
#include "cpu/linear.h"
#include "ops.h"

#ifdef SPECINFER_HAVE_X86
#include "cpu/avx512.h"
#define SPECINFER_AVX512_VNNI SPECINFER_AVX512 ",avx512vnni"
#endif

namespace specinfer {
namespace cpu {
namespace {

constexpr int kRows = 4;      // x rows met by each block of weight rows while it is in L1
constexpr int kBlock = 4;     // weight rows per block
constexpr int64_t kPad = 64;  // quantized x rows are padded to whole 64-byte vectors
constexpr int kZero = 128;    // the weight codes' zero point

struct Int8Problem {
  const int8_t* x;     // [M, Kp] quantized x, rows Kp apart (zeros past K)
  const int16_t* x16;  // the same widened to 16 bits, for the kernels that want it (else null)
  const uint8_t* w;
  int64_t w_stride, M, K, Kp;
};

// dots[r * kRows + i] = sum_k x[m0 + i, k] w[n0 + r, k] for i < mb, r < nb (the codes as they
// are: the zero point is taken out after).
using Int8TileFn = void (*)(const Int8Problem& p, int64_t n0, int nb, int64_t m0, int mb,
                            int32_t* dots);

void tile_portable(const Int8Problem& p, int64_t n0, int nb, int64_t m0, int mb, int32_t* dots) {
  for (int r = 0; r < nb; ++r) {
    const uint8_t* w = p.w + (n0 + r) * p.w_stride;
    for (int i = 0; i < mb; ++i) {
      const int8_t* x = p.x + (m0 + i) * p.Kp;
      int32_t s = 0;
#pragma omp simd reduction(+ : s)
      for (int64_t k = 0; k < p.K; ++k) s += int32_t(x[k]) * int32_t(w[k]);
      dots[r * kRows + i] = s;
    }
  }
}

#ifdef SPECINFER_HAVE_X86
// VPDPBUSD: each 32-bit lane adds four products of unsigned weight codes and signed x bytes, 64
// multiply-adds an instruction. NB weight rows (a whole block, or one) by MB x rows.
template <int NB, int MB>
SPECINFER_TARGET(SPECINFER_AVX512_VNNI)
SPECINFER_INLINE void tile_vnni(const Int8Problem& p, int64_t n0, int64_t m0, int32_t* dots) {
  const uint8_t* w = p.w + n0 * p.w_stride;
  const int8_t* x = p.x + m0 * p.Kp;
  __m512i acc[NB][MB];
  SPECINFER_UNROLL for (int r = 0; r < NB; ++r) {
    SPECINFER_UNROLL for (int i = 0; i < MB; ++i) acc[r][i] = _mm512_setzero_si512();
  }
  for (int64_t k = 0; k < p.K; k += kPad) {
    const int64_t left = p.K - k;
    const __mmask64 mask = left >= kPad ? ~__mmask64(0) : (__mmask64(1) << left) - 1;
    SPECINFER_UNROLL for (int r = 0; r < NB; ++r) {
      const __m512i wk = _mm512_maskz_loadu_epi8(mask, w + r * p.w_stride + k);
      SPECINFER_UNROLL for (int i = 0; i < MB; ++i) {
        acc[r][i] = _mm512_dpbusd_epi32(acc[r][i], wk, _mm512_loadu_si512(x + i * p.Kp + k));
      }
    }
  }
  if constexpr (NB == kBlock) {  // all at once: dot (r, i) in lane 4r + i, as dots holds them
    __m512 v[16];
    SPECINFER_UNROLL for (int j = 0; j < 16; ++j) {
      const int r = j % 4, i = j / 4;  // hsum512x16 puts v[4i + r] in lane 4r + i
      v[j] = i < MB ? _mm512_castsi512_ps(acc[r][i < MB ? i : 0]) : _mm512_setzero_ps();
    }
    _mm512_storeu_si512(dots, _mm512_castps_si512(hsum512x16<AddInt32s>(v)));
  } else {
    SPECINFER_UNROLL for (int i = 0; i < MB; ++i) dots[i] = _mm512_reduce_add_epi32(acc[0][i]);
  }
}

template <int NB>
SPECINFER_TARGET(SPECINFER_AVX512_VNNI)
SPECINFER_INLINE
    void tile_vnni_rows(const Int8Problem& p, int64_t n0, int64_t m0, int mb, int32_t* dots) {
  switch (mb) {
    case 1:
      return tile_vnni<NB, 1>(p, n0, m0, dots);
    case 2:
      return tile_vnni<NB, 2>(p, n0, m0, dots);
    case 3:
      return tile_vnni<NB, 3>(p, n0, m0, dots);
    default:
      return tile_vnni<NB, 4>(p, n0, m0, dots);
  }
}

SPECINFER_TARGET(SPECINFER_AVX512_VNNI)
void tile_vnni_any(const Int8Problem& p, int64_t n0, int nb, int64_t m0, int mb, int32_t* dots) {
  if (nb == kBlock) return tile_vnni_rows<kBlock>(p, n0, m0, mb, dots);
  for (int r = 0; r < nb; ++r) tile_vnni_rows<1>(p, n0 + r, m0, mb, dots + r * kRows);
}

// AVX2 has no byte dot product that cannot saturate (VPMADDUBSW adds two products of up to 255 x
// 127 in 16 bits), so the codes are widened to 16 bits as they stream by and meet x widened once
// per call (x16): VPMADDWD adds pairs of products exactly into 32 bits. One weight row at a time
// meets all mb x rows while its 16 columns are in a register. Measured (a feature head's two
// layers and 8192-row LM head, 2 threads, caches flushed between calls, Zen 3): 1 / 4 / 8 rows
// 1.44 / 5.3 / 10.5 ms with the compiler's vectorisation of the portable loop, 0.87 / 1.2 / 2.2.

// acc[i] += pair sums of 16 codes times x16 row i's 16 values at x (rows Kp apart).
template <int MB>
SPECINFER_TARGET(SPECINFER_AVX2)
SPECINFER_INLINE void madd_codes(__m128i codes, const int16_t* x, int64_t Kp, __m256i (&acc)[MB]) {
  const __m256i wv = _mm256_cvtepu8_epi16(codes);
  SPECINFER_UNROLL for (int i = 0; i < MB; ++i) {
    const __m256i xv = _mm256_load_si256(reinterpret_cast<const __m256i*>(x + i * Kp));
    acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(wv, xv));
  }
}

template <int MB>
SPECINFER_TARGET(SPECINFER_AVX2)
void dots_row_avx2(const Int8Problem& p, const uint8_t* w, int64_t m0, int32_t* dots) {
  const int16_t* x = p.x16 + m0 * p.Kp;
  const int64_t k_main = p.K / 16 * 16;
  __m256i acc[MB];
  SPECINFER_UNROLL for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_si256();
  for (int64_t k = 0; k < k_main; k += 16) {
    madd_codes(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k)), x + k, p.Kp, acc);
  }
  if (k_main < p.K) {  // the codes past K are read as zeros (x is zero there too)
    alignas(16) uint8_t tail[16] = {};
    std::copy(w + k_main, w + p.K, tail);
    madd_codes(_mm_load_si128(reinterpret_cast<const __m128i*>(tail)), x + k_main, p.Kp, acc);
  }
  SPECINFER_UNROLL for (int i = 0; i < MB; ++i) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(acc[i]), _mm256_extracti128_si256(acc[i], 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    dots[i] = _mm_cvtsi128_si32(s);
  }
}

SPECINFER_TARGET(SPECINFER_AVX2)
void tile_avx2(const Int8Problem& p, int64_t n0, int nb, int64_t m0, int mb, int32_t* dots) {
  for (int r = 0; r < nb; ++r) {
    const uint8_t* w = p.w + (n0 + r) * p.w_stride;
    int32_t* out = dots + r * kRows;
    switch (mb) {
      case 1:
        dots_row_avx2<1>(p, w, m0, out);
        break;
      case 2:
        dots_row_avx2<2>(p, w, m0, out);
        break;
      case 3:
        dots_row_avx2<3>(p, w, m0, out);
        break;
      default:
        dots_row_avx2<4>(p, w, m0, out);
    }
  }
}
#endif

// A tile function, and whether it reads x widened to 16 bits.
struct Int8Kernel {
  Int8TileFn tile;
  bool wide_x;
};

Int8Kernel select_tile_kernel() {
#ifdef SPECINFER_HAVE_X86
  if (has_avx512_vnni()) return {tile_vnni_any, false};
  if (has_avx2_fma()) return {tile_avx2, true};
#endif
  return {tile_portable, false};
}

// x's rows as int8 round(x / s), s = max |x| / 127 (1 for a zero row), zeros past K.
template <typename T>
void quantize_rows(const TensorView& x, int64_t Kp, int8_t* xq, float* scales, int32_t* sums) {
  const int64_t M = x.shape[0], K = x.shape[1];
  for (int64_t m = 0; m < M; ++m) {
    const T* row = x.ptr<const T>() + m * x.strides[0];
    float top = 0.0f;
#pragma omp simd reduction(max : top)
    for (int64_t k = 0; k < K; ++k) {
      const float a = std::fabs(to_float(row[k]));
      top = a > top ? a : top;
    }
    const float s = top > 0.0f ? top / 127.0f : 1.0f, inv = 1.0f / s;
    int8_t* q = xq + m * Kp;
    int32_t sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t k = 0; k < K; ++k) {
      // Rounded to nearest even by adding and taking away 1.5 * 2^23 (|v| <= 127).
      const float v = std::min(127.0f, std::max(-127.0f, to_float(row[k]) * inv));
      q[k] = int8_t((v + 12582912.0f) - 12582912.0f);
      sum += q[k];
    }
    std::fill(q + K, q + Kp, int8_t(0));
    scales[m] = s;
    sums[m] = kZero * sum;
  }
}

// dots[m, n] = sum_k xq[m, k] c[n, k], on AMX tiles or in tiles of kBlock x kRows.
void int8_dots(Int8Problem p, int64_t N, int32_t* dots, bool parallel) {
  LinearProblem amx{p.x, p.w, nullptr, dots, p.Kp, p.w_stride, N, 0, p.M, N, p.K};
  if (p.K == p.Kp && run_linear_amx_int8(amx, parallel)) return;
  const Int8Kernel kernel = select_tile_kernel();
  if (kernel.wide_x) {
    int16_t* x16 = thread_scratch<int16_t, 9>(p.M * p.Kp);
    std::copy(p.x, p.x + p.M * p.Kp, x16);
    p.x16 = x16;
  }
  const int64_t blocks = (N + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t block = 0; block < blocks; ++block) {
    const int64_t n0 = block * kBlock;
    const int nb = int(std::min<int64_t>(kBlock, N - n0));
    for (int64_t m0 = 0; m0 < p.M; m0 += kRows) {
      alignas(64) int32_t tile_dots[kBlock * kRows];
      const int mb = int(std::min<int64_t>(kRows, p.M - m0));
      kernel.tile(p, n0, nb, m0, mb, tile_dots);
      for (int r = 0; r < nb; ++r) {
        for (int i = 0; i < mb; ++i) dots[(m0 + i) * N + n0 + r] = tile_dots[r * kRows + i];
      }
    }
  }
}

// The epilogue of every kernel family: out[m, n] = float(dots[m, n] - zero[m]) (x_scale[m]
// w_scale[n]) + bias[n], rounded to the output dtype; the product is rounded before the bias is
// added, never fused with it (the reference rounds both), so the AVX-512 loop gives the scalar
// loop's bits.
struct Dequant {
  const int32_t* dots;  // [M, N]
  const int32_t* zeros;
  const float* x_scales;
  const TensorView& w_scales;
  const TensorView* bias;
  const TensorView& out;
  int64_t M, N;
};

template <typename T>
void dequantize_scalar(const Dequant& d, int64_t n0, int64_t n1) {
  const float* ws = d.w_scales.ptr<const float>();
  const T* b = d.bias != nullptr ? d.bias->ptr<const T>() : nullptr;
  const int64_t ws_stride = d.w_scales.strides[0], b_stride = b ? d.bias->strides[0] : 0;
  for (int64_t m = 0; m < d.M; ++m) {
    const int32_t* dm = d.dots + m * d.N;
    T* ym = d.out.ptr<T>() + m * d.out.strides[0];
    for (int64_t n = n0; n < n1; ++n) {
      const float y = float(dm[n] - d.zeros[m]) * (d.x_scales[m] * ws[n * ws_stride]);
      ym[n] = from_float<T>(b != nullptr ? y + to_float(b[n * b_stride]) : y);
    }
  }
}

#ifdef SPECINFER_HAVE_X86
template <typename T>
SPECINFER_TARGET(SPECINFER_AVX512)
__m512 load16(const T* v, __mmask16 mask) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_maskz_loadu_ps(mask, v);
  } else {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, v));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
}

// Contiguous scales and bias (as layers hold them); 16 columns at a time.
template <typename T>
SPECINFER_TARGET(SPECINFER_AVX512)
void dequantize_avx512(const Dequant& d, int64_t n0, int64_t n1) {
  const float* ws = d.w_scales.ptr<const float>();
  const T* b = d.bias != nullptr ? d.bias->ptr<const T>() : nullptr;
  for (int64_t m = 0; m < d.M; ++m) {
    const int32_t* dm = d.dots + m * d.N;
    T* ym = d.out.ptr<T>() + m * d.out.strides[0];
    const __m512i zero = _mm512_set1_epi32(d.zeros[m]);
    const __m512 xs = _mm512_set1_ps(d.x_scales[m]);
    for (int64_t n = n0; n < n1; n += 16) {
      const __mmask16 mask = n1 - n >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n1 - n)) - 1);
      const __m512 q =
          _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_maskz_loadu_epi32(mask, dm + n), zero));
      __m512 y = _mm512_mul_round_ps(q, _mm512_mul_ps(xs, _mm512_maskz_loadu_ps(mask, ws + n)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      if (b != nullptr) y = _mm512_add_ps(y, load16(b + n, mask));
      if constexpr (std::is_same_v<T, float>) {
        _mm512_mask_storeu_ps(ym + n, mask, y);
      } else {
        _mm256_mask_storeu_epi16(ym + n, mask, to_bf16x16(y));
      }
    }
  }
}
#endif

template <typename T>
void dequantize(const Dequant& d, bool parallel) {
  auto kernel = dequantize_scalar<T>;
#ifdef SPECINFER_HAVE_X86
  const bool contiguous = d.w_scales.strides[0] == 1 && (!d.bias || d.bias->strides[0] == 1);
  if (has_avx512() && contiguous) kernel = dequantize_avx512<T>;
#endif
  // Columns split between the threads in whole vectors; each output is computed the same way.
#pragma omp parallel if (parallel && d.M * d.N >= 8192)
  {
    int64_t t = 0, threads = 1;
#ifdef _OPENMP
    t = omp_get_thread_num();
    threads = omp_get_num_threads();
#endif
    const int64_t vectors = (d.N + 15) / 16;
    kernel(d, std::min(d.N, vectors * t / threads * 16),
           std::min(d.N, vectors * (t + 1) / threads * 16));
  }
}

template <typename T>
void run(const TensorView& x, const TensorView& w, const TensorView& scale, const TensorView* bias,
         const TensorView& out) {
  Int8Problem p{};
  p.M = x.shape[0];
  p.K = x.shape[1];
  p.Kp = (p.K + kPad - 1) / kPad * kPad;
  p.w = w.ptr<const uint8_t>();
  p.w_stride = w.strides[0];
  int8_t* xq = thread_scratch<int8_t, 5>(p.M * p.Kp);
  float* x_scales = thread_scratch<float, 6>(p.M);
  int32_t* x_sums = thread_scratch<int32_t, 7>(p.M);
  quantize_rows<T>(x, p.Kp, xq, x_scales, x_sums);
  p.x = xq;
  const int64_t N = w.shape[0];
  int32_t* dots = thread_scratch<int32_t, 8>(p.M * N);
  // As for bf16 (linear.cpp): threads only once the work outweighs forking them.
  const bool parallel = N * p.K * std::max<int64_t>(p.M, 2) >= (int64_t(1) << 19);
  int8_dots(p, N, dots, parallel);

  dequantize<T>(Dequant{dots, x_sums, x_scales, scale, bias, out, p.M, N}, parallel);
}

}  // namespace
}  // namespace cpu

void linear_int8_cpu(const TensorView& x, const TensorView& w, const TensorView& scale,
                     const TensorView* bias, const TensorView& out) {
  const std::string op = "linear_int8";
  check_ndim(x, 2, op, "x", "[rows, in_features]");
  check_ndim(w, 2, op, "weight", "[out_features, in_features]");
  check_ndim(scale, 1, op, "scale", "[out_features]");
  check_ndim(out, 2, op, "out", "[rows, out_features]");
  const TensorView* all[] = {&x, &w, &scale, &out, bias};
  const char* names[] = {"x", "weight", "scale", "out", "bias"};
  for (int i = 0; i < 5; ++i) {
    if (all[i] != nullptr && all[i]->device != Device::kCPU) {
      fail(op, std::string(names[i]) + " must be on cpu");
    }
  }
  check_dtype_is(x, DType::kFloat32, DType::kBFloat16, op, "x");
  if (w.dtype != DType::kUInt8) {
    fail(op, std::string("weight must be uint8 codes (specinfer.ops.quantize_int8), got ") +
                 dtype_name(w.dtype));
  }
  if (scale.dtype != DType::kFloat32) {
    fail(op, std::string("scale must be float32, got ") + dtype_name(scale.dtype));
  }
  check_same_dtype(out, x, op, "out", "x");
  if (bias) check_same_dtype(*bias, x, op, "bias", "x");
  check_size(scale, 0, w.shape[0], op, "scale", "out_features of weight");
  check_linear_sizes(op, x, w, bias, out);
  if (x.shape[0] == 0 || w.shape[0] == 0) return;
  if (x.dtype == DType::kFloat32) return cpu::run<float>(x, w, scale, bias, out);
  cpu::run<bf16>(x, w, scale, bias, out);
}

}  // namespace specinfer
