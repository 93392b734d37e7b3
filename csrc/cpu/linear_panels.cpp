// CPU linear on weights packed in panels: y[M, N] = x[M, K] @ w^T (+ bias), w stored as
// [N / 16, K, 16] (pack_linear_panels), for CPUs whose best linear is the AVX2 one.
//
// Each panel holds 16 output features column by column, so the kernel is an outer product: per
// column k, every x row's value (one broadcast) meets the panel's 16 weights (one 32-byte load of
// bf16), an FMA per 8 outputs. Against the dot products of linear.cpp ([N, K] rows: an x vector
// loaded per FMA) that is ~a tenth of the loads, and the weight is still one sequential stream.
// Measured (`bench_spec.py --sections rows`, SmolLM2-135M's forward with its LM head, bf16, 2
// threads, Zen 3): 1 / 4 / 9 / 64 rows 11.0 / 14.1 / 28.2 / 168.3 ms as loaded, 8.7 / 11.6 / 23.7
// / 138.2 packed.
//
// Summation order: every output is one fp32 FMA chain over k = 0, 1, ..., K - 1, then + bias,
// whatever M is and whichever tile computes it (a row's result does not depend on the rows beside
// it: a token tree's logits equal, bit for bit, those of decoding its nodes one at a time). The
// portable kernel keeps the same order with std::fma, so it gives the same bits.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "cpu/cpu_features.h"
#include "cpu/linear.h"
#include "ops.h"

#ifdef SPECINFER_HAVE_X86
#include <immintrin.h>
#endif

namespace specinfer {
namespace cpu {
namespace {

constexpr int kPanel = 16;  // output features a panel holds

// Where column c of a panel sits among its 16 values. bf16: unpacking 16 values against zeros
// gives 0-3 and 8-11 (low) and 4-7 and 12-15 (high) as float32, so columns 4-7 and 8-11 trade
// places and the halves come out as columns 0-7 and 8-15. float32: in order.
template <typename T>
int slot_of(int c) {
  if (sizeof(T) == 4 || c < 4 || c >= 12) return c;
  return c < 8 ? c + 4 : c - 4;
}

struct PanelProblem {
  const float* x;  // [M, K] float32, rows x_stride apart
  const void* w;   // [N / 16, K, 16]
  const void* bias;
  void* y;
  int64_t x_stride, y_stride, bias_stride, M, N, K;
};

template <typename T>
SPECINFER_INLINE void store(const PanelProblem& p, int64_t m, int64_t n, float acc) {
  if (p.bias) acc += to_float(static_cast<const T*>(p.bias)[n * p.bias_stride]);
  static_cast<T*>(p.y)[m * p.y_stride + n] = from_float<T>(acc);
}

template <typename T>
void tile_portable(const PanelProblem& p, int64_t m0, int64_t mb, int64_t panel, int np) {
  const T* w = static_cast<const T*>(p.w) + panel * p.K * kPanel;
  for (int64_t i = m0; i < m0 + mb; ++i) {
    for (int64_t n = 0; n < int64_t(np) * kPanel; ++n) {
      const T* col = w + (n / kPanel) * p.K * kPanel + slot_of<T>(int(n % kPanel));
      float acc = 0.0f;
      for (int64_t k = 0; k < p.K; ++k) {
        acc = std::fma(p.x[i * p.x_stride + k], to_float(col[k * kPanel]), acc);
      }
      store<T>(p, i, panel * kPanel + n, acc);
    }
  }
}

#ifdef SPECINFER_HAVE_X86
// A panel's 16 weights at column k as two float32 vectors: outputs 0-7 and 8-15.
SPECINFER_TARGET(SPECINFER_AVX2) inline void load_panel(const bf16* w, __m256& a, __m256& b) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  a = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), v));
  b = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), v));
}
SPECINFER_TARGET(SPECINFER_AVX2) inline void load_panel(const float* w, __m256& a, __m256& b) {
  a = _mm256_loadu_ps(w);
  b = _mm256_loadu_ps(w + 8);
}

// MB x rows from m0 against NP panels from `panel`: 2 x MB x NP accumulators (at most 12 of the
// 16 registers, the rest for weights and broadcasts; at least 8 chains hide the FMA latency).
// The first row tile of a panel prefetches its stream 1 KB ahead into L1 (2-4 KB ahead into L2
// was tried: no steady gain).
template <typename T, int MB, int NP>
SPECINFER_TARGET(SPECINFER_AVX2)
void tile_avx2(const PanelProblem& p, int64_t m0, int64_t panel, bool prefetch) {
  const T* w = static_cast<const T*>(p.w) + panel * p.K * kPanel;
  const float* x = p.x + m0 * p.x_stride;
  const int64_t stride = p.K * kPanel;  // between panels
  constexpr int64_t kAhead = 1024 / sizeof(T);
  __m256 acc[MB][NP][2];
  SPECINFER_UNROLL for (int i = 0; i < MB; ++i) {
    SPECINFER_UNROLL for (int j = 0; j < NP; ++j) acc[i][j][0] = acc[i][j][1] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < p.K; ++k) {
    __m256 a[NP], b[NP];
    SPECINFER_UNROLL for (int j = 0; j < NP; ++j) {
      const T* at = w + j * stride + k * kPanel;
      if (prefetch && k % (64 / (kPanel * sizeof(T))) == 0) {  // once a cache line
        _mm_prefetch(reinterpret_cast<const char*>(at + kAhead), _MM_HINT_T0);
      }
      load_panel(at, a[j], b[j]);
    }
    SPECINFER_UNROLL for (int i = 0; i < MB; ++i) {
      const __m256 xi = _mm256_broadcast_ss(x + i * p.x_stride + k);
      SPECINFER_UNROLL for (int j = 0; j < NP; ++j) {
        acc[i][j][0] = _mm256_fmadd_ps(xi, a[j], acc[i][j][0]);
        acc[i][j][1] = _mm256_fmadd_ps(xi, b[j], acc[i][j][1]);
      }
    }
  }
  alignas(32) float out[2 * 8];
  SPECINFER_UNROLL for (int i = 0; i < MB; ++i) {
    SPECINFER_UNROLL for (int j = 0; j < NP; ++j) {
      _mm256_store_ps(out, acc[i][j][0]);
      _mm256_store_ps(out + 8, acc[i][j][1]);
      const int64_t n0 = (panel + j) * kPanel;
      for (int c = 0; c < kPanel; ++c) store<T>(p, m0 + i, n0 + c, out[c]);
    }
  }
}

// Rows [m0, m0 + mb) against panels [panel, panel + np): np 4 (one row), 2 (2-3 rows) or 1.
template <typename T>
void tile_x86(const PanelProblem& p, int64_t m0, int64_t mb, int64_t panel, int np) {
  const bool first = m0 == 0;
  if (np == 4) return tile_avx2<T, 1, 4>(p, m0, panel, first);
  if (np == 2)
    return mb == 2 ? tile_avx2<T, 2, 2>(p, m0, panel, first)
                   : tile_avx2<T, 3, 2>(p, m0, panel, first);
  switch (mb) {
    case 1:
      return tile_avx2<T, 1, 1>(p, m0, panel, first);
    case 2:
      return tile_avx2<T, 2, 1>(p, m0, panel, first);
    case 3:
      return tile_avx2<T, 3, 1>(p, m0, panel, first);
    case 4:
      return tile_avx2<T, 4, 1>(p, m0, panel, first);
    case 5:
      return tile_avx2<T, 5, 1>(p, m0, panel, first);
    default:
      return tile_avx2<T, 6, 1>(p, m0, panel, first);
  }
}
#endif

using PanelTileFn = void (*)(const PanelProblem&, int64_t m0, int64_t mb, int64_t panel, int np);

// Panels a tile takes at once: with one or few x rows, several, so a tile still has 8
// independent chains; past 3 rows, one, with up to 6 rows a pass (further rows take another pass
// over the panel while it is in cache).
int panels_per_tile(int64_t M) { return M == 1 ? 4 : M <= 3 ? 2 : 1; }
constexpr int kMaxTileRows = 6;

// All rows against the np panels from `panel`: up to 3 rows in one tile, more in passes of
// nearly equal size (9 as 5 + 4), one panel at a time.
void panel_rows(const PanelProblem& p, PanelTileFn tile, int64_t panel, int np) {
  if (p.M <= 3) return tile(p, 0, p.M, panel, np);
  for (int64_t m0 = 0, passes = (p.M + kMaxTileRows - 1) / kMaxTileRows; m0 < p.M; --passes) {
    const int64_t mb = (p.M - m0 + passes - 1) / passes;
    tile(p, m0, mb, panel, 1);
    m0 += mb;
  }
}

void run_panels(const PanelProblem& p, PanelTileFn tile, bool parallel) {
  const int64_t panels = p.N / kPanel;
  const int np = panels_per_tile(p.M);
  const int64_t groups = (panels + np - 1) / np;
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t g = 0; g < groups; ++g) {
    if ((g + 1) * np <= panels) {
      panel_rows(p, tile, g * np, np);
    } else {  // a short last group: one panel at a time (each output sums the same way)
      for (int64_t panel = g * np; panel < panels; ++panel) panel_rows(p, tile, panel, 1);
    }
  }
}

template <typename T>
void run_typed(const PanelProblem& p, bool parallel) {
#ifdef SPECINFER_HAVE_X86
  if (has_avx2_fma()) return run_panels(p, tile_x86<T>, parallel);
#endif
  run_panels(p, tile_portable<T>, parallel);
}

// Each panel's 16 rows of w into their slots, column by column; panels in parallel (the LM head
// alone is tens of MB, packed at every load).
template <typename T>
void pack_panels(const T* w, int64_t row_stride, int64_t col_stride, T* out, int64_t N, int64_t K) {
#pragma omp parallel for schedule(static)
  for (int64_t panel = 0; panel < N / kPanel; ++panel) {
    for (int c = 0; c < kPanel; ++c) {
      const T* row = w + (panel * kPanel + c) * row_stride;
      T* slots = out + panel * K * kPanel + slot_of<T>(c);
      for (int64_t k = 0; k < K; ++k) slots[k * kPanel] = row[k * col_stride];
    }
  }
}

// Panels are read as one block: [panels, K, 16] with nothing between them.
void check_packed(const TensorView& v, const std::string& op, const char* name) {
  if (v.strides[2] != 1 || v.strides[1] != kPanel || v.strides[0] != v.shape[1] * kPanel) {
    fail(op, std::string(name) + " must be contiguous (as pack_linear_panels makes it)");
  }
}

}  // namespace

}  // namespace cpu

std::vector<int> linear_panel_slots(const std::string& dtype) {
  std::vector<int> slots(cpu::kPanel);
  for (int c = 0; c < cpu::kPanel; ++c) {
    slots[c] = dtype == "float32" ? cpu::slot_of<float>(c) : cpu::slot_of<bf16>(c);
  }
  return slots;
}

bool linear_panels_preferred(const std::string& dtype) {
  if (dtype == "bfloat16") return cpu::has_avx2_fma() && !cpu::has_avx512_bf16();
  if (dtype == "float32") return cpu::has_avx2_fma() && !cpu::has_avx512();
  return false;
}

void pack_linear_panels_cpu(const TensorView& w, const TensorView& out) {
  const std::string op = "pack_linear_panels";
  check_ndim(w, 2, op, "weight", "[out_features, in_features]");
  check_ndim(out, 3, op, "out", "[out_features / 16, in_features, 16]");
  check_same_dtype(out, w, op, "out", "weight");
  check_dtype_is(w, DType::kFloat32, DType::kBFloat16, op, "weight");
  if (w.device != Device::kCPU || out.device != Device::kCPU) fail(op, "tensors must be on cpu");
  const int64_t N = w.shape[0], K = w.shape[1];
  if (N % cpu::kPanel != 0) fail(op, "out_features must be a multiple of 16");
  check_size(out, 0, N / cpu::kPanel, op, "out", "out_features / 16");
  check_size(out, 1, K, op, "out", "in_features");
  check_size(out, 2, cpu::kPanel, op, "out", "16");
  cpu::check_packed(out, op, "out");
  const int64_t s0 = w.strides[0], s1 = w.strides[1];
  if (w.dtype == DType::kFloat32) {
    cpu::pack_panels(static_cast<const float*>(w.data), s0, s1, static_cast<float*>(out.data), N,
                     K);
  } else {
    cpu::pack_panels(static_cast<const bf16*>(w.data), s0, s1, static_cast<bf16*>(out.data), N, K);
  }
}

void linear_panels_cpu(const TensorView& x, const TensorView& w, const TensorView* bias,
                       const TensorView& out) {
  const std::string op = "linear";
  const int64_t N = w.shape[0] * cpu::kPanel, K = w.shape[1];
  check_size(w, 2, cpu::kPanel, op, "weight", "16 (a panel's outputs)");
  cpu::check_packed(w, op, "weight");
  if (x.shape[1] != K)
    fail(op, "x has " + std::to_string(x.shape[1]) + " in_features, the " + "packed weight " +
                 std::to_string(K));
  check_size(out, 0, x.shape[0], op, "out", "rows of x");
  if (out.shape[1] != N)
    fail(op, "out has " + std::to_string(out.shape[1]) + " columns, the " + "packed weight " +
                 std::to_string(N) + " out_features");
  if (bias) {
    check_ndim(*bias, 1, op, "bias", "[out_features]");
    check_size(*bias, 0, N, op, "bias", "out_features of weight");
  }
  check_last_dim_contiguous(x, op, "x");
  check_last_dim_contiguous(out, op, "out");
  const int64_t M = x.shape[0];
  if (M == 0) return;

  cpu::PanelProblem p;
  p.w = w.data;
  p.bias = bias ? bias->data : nullptr;
  p.y = out.data;
  p.y_stride = out.strides[0];
  p.bias_stride = bias ? bias->strides[0] : 0;
  p.M = M;
  p.N = N;
  p.K = K;
  // Same rule as linear.cpp: threads pay off past ~0.5 MB of weight at one row.
  const int64_t elem = x.dtype == DType::kFloat32 ? 4 : 2;
  const bool parallel = N * K * std::max(M, elem) >= (int64_t(1) << 19);
  if (x.dtype == DType::kFloat32) {
    p.x = static_cast<const float*>(x.data);
    p.x_stride = x.strides[0];
    return cpu::run_typed<float>(p, parallel);
  }
  float* xf = cpu::thread_scratch<float, 0>(M * K);
  const bf16* xb = static_cast<const bf16*>(x.data);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) xf[m * K + k] = to_float(xb[m * x.strides[0] + k]);
  }
  p.x = xf;
  p.x_stride = K;
  cpu::run_typed<bf16>(p, parallel);
}

}  // namespace specinfer
