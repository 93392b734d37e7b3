// CPU linear for small M (decode and small tree blocks): y[M, N] = x[M, K] @ w[N, K]^T + bias.
// The weight is streamed once per call: the output is cut into blocks of NB weight rows, and
// each block is used by all M rows of x (x stays in cache) before the next block is read.
#pragma once

#include <cstdint>
#include <vector>

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

// A buffer of at least n elements, 64-byte aligned, owned by the calling thread and reused by its
// later calls: one per (type, role), so buffers one call needs at once never share (the AVX2 path
// takes roles 0-1, AMX 2-4, int8 5-9).
template <typename T, int Role>
T* thread_scratch(int64_t n) {
  thread_local std::vector<T> buf;
  const int64_t pad = 64 / sizeof(T);
  if (int64_t(buf.size()) < n + pad) buf.resize(n + pad);
  const uintptr_t addr = reinterpret_cast<uintptr_t>(buf.data());
  return reinterpret_cast<T*>((addr + 63) & ~uintptr_t(63));
}

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

// Calls Tile<MB, NB>::run for runtime mb in 1..4 and nb in {1, 4} (or any nb when mb == 1).
// A single x row walks the weight rows one after another: one sequential stream, which the
// hardware prefetches best, instead of nb interleaved ones.
template <template <int, int> class Tile>
SPECINFER_INLINE void dispatch_tile(const LinearProblem& p, int64_t m0, int64_t n0, int mb,
                                    int nb) {
  if (mb == 1) {
    for (int j = 0; j < nb; ++j) Tile<1, 1>::run(p, m0, n0 + j);
    return;
  }
  switch (mb * 10 + (nb == 1 ? 1 : 4)) {
    case 21:
      return Tile<2, 1>::run(p, m0, n0);
    case 31:
      return Tile<3, 1>::run(p, m0, n0);
    case 41:
      return Tile<4, 1>::run(p, m0, n0);
    case 24:
      return Tile<2, 4>::run(p, m0, n0);
    case 34:
      return Tile<3, 4>::run(p, m0, n0);
    case 44:
      return Tile<4, 4>::run(p, m0, n0);
  }
}

// bf16 on AMX tiles (linear_amx.cpp) when the CPU has them and K is a multiple of 32, for any M
// (so a row's result never depends on the row count); false, having done nothing, otherwise.
bool run_linear_amx(const LinearProblem& p, bool parallel);

// 8-bit weight codes (uint8) times int8 x into int32 sums y (linear_int8.cpp), when the CPU has
// AMX and K is a multiple of 64; false, having done nothing, otherwise.
bool run_linear_amx_int8(const LinearProblem& p, bool parallel);

}  // namespace specinfer::cpu
