// CPU linear for small M (decode and small tree blocks): y[M, N] = x[M, K] @ w[N, K]^T + bias.
// The weight is streamed once per call: the output is cut into blocks of NB weight rows, and
// each block is used by all M rows of x (x stays in cache) before the next block is read.
#pragma once

#include <cstdint>

#include "core/numeric.h"

namespace specinfer::cpu {

struct LinearProblem {
  const void* x;     // [M, K], rows x_stride apart
  const void* w;     // [N, K], rows w_stride apart
  const void* bias;  // [N] or null
  void* y;           // [M, N], rows y_stride apart
  int64_t x_stride, w_stride, y_stride, bias_stride;
  int64_t M, N, K;
};

// Computes the mb x nb outputs at (m0, n0); each ISA provides one.
using LinearTileFn = void (*)(const LinearProblem& p, int64_t m0, int64_t n0, int mb, int nb);

template <typename T>
SPECINFER_INLINE void store_output(const LinearProblem& p, int64_t m, int64_t n, float acc) {
  if (p.bias) acc += to_float(static_cast<const T*>(p.bias)[n * p.bias_stride]);
  static_cast<T*>(p.y)[m * p.y_stride + n] = from_float<T>(acc);
}

// Portable tile: fp32 dot products the compiler vectorises (for the caller's target).
template <typename T, int MB, int NB>
SPECINFER_INLINE void linear_tile_portable(const LinearProblem& p, int64_t m0, int64_t n0) {
  const T* x = static_cast<const T*>(p.x) + m0 * p.x_stride;
  const T* w = static_cast<const T*>(p.w) + n0 * p.w_stride;
  for (int i = 0; i < MB; ++i) {
    for (int j = 0; j < NB; ++j) {
      const T* xi = x + i * p.x_stride;
      const T* wj = w + j * p.w_stride;
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int64_t k = 0; k < p.K; ++k) acc += to_float(xi[k]) * to_float(wj[k]);
      store_output<T>(p, m0 + i, n0 + j, acc);
    }
  }
}

// Calls tile<MB, NB> for runtime mb in 1..4 and nb in {1, 4, 8}.
template <template <int, int> class Tile>
SPECINFER_INLINE void dispatch_tile(const LinearProblem& p, int64_t m0, int64_t n0, int mb,
                                    int nb) {
  const int key = mb * 10 + nb;
  switch (key) {
#define SPECINFER_TILE_CASE(MB, NB) \
  case MB * 10 + NB:                \
    return Tile<MB, NB>::run(p, m0, n0);
    SPECINFER_TILE_CASE(1, 1)
    SPECINFER_TILE_CASE(2, 1)
    SPECINFER_TILE_CASE(3, 1)
    SPECINFER_TILE_CASE(4, 1)
    SPECINFER_TILE_CASE(1, 4)
    SPECINFER_TILE_CASE(2, 4)
    SPECINFER_TILE_CASE(3, 4)
    SPECINFER_TILE_CASE(4, 4)
    SPECINFER_TILE_CASE(1, 8)
    SPECINFER_TILE_CASE(2, 8)
    SPECINFER_TILE_CASE(3, 8)
    SPECINFER_TILE_CASE(4, 8)
#undef SPECINFER_TILE_CASE
  }
}

}  // namespace specinfer::cpu
