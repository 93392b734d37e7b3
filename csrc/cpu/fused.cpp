// Small fused ops of a decoder layer on CPU. At decode sizes each torch op costs more in dispatch
// than in arithmetic, so each of these replaces several of them with one pass over the rows.
// Math is fp32; results are rounded to the tensor dtype wherever the torch reference rounds, so
// bfloat16 outputs match it but for a rare last bit where an fp32 sum or exp rounds the other way.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "core/numeric.h"
#include "core/tensor_view.h"
#include "cpu/cpu_features.h"
#include "ops.h"

namespace specinfer {
namespace {

template <typename T>
SPECINFER_INLINE float round_to(float x) {
  return to_float(from_float<T>(x));
}

// Element offset of the i-th index (row-major) over the first `dims` dims of v.
int64_t offset_of(const TensorView& v, int64_t i, int dims) {
  int64_t off = 0;
  for (int d = dims - 1; d >= 0; --d) {
    off += (i % v.shape[d]) * v.strides[d];
    i /= v.shape[d];
  }
  return off;
}

// Rows of v: every index of its dims but the last.
int64_t rows_of(const TensorView& v) {
  int64_t n = 1;
  for (int d = 0; d < v.ndim - 1; ++d) n *= v.shape[d];
  return n;
}

// Reads element i (row-major) of an int32/int64 tensor of any shape.
int64_t index_value(const TensorView& v, int64_t i) {
  const int64_t off = offset_of(v, i, v.ndim);
  return v.dtype == DType::kInt32 ? v.ptr<const int32_t>()[off] : v.ptr<const int64_t>()[off];
}

void check_same_shape(const TensorView& v, const TensorView& ref, const std::string& op,
                      const char* name, const char* ref_name) {
  bool same = v.ndim == ref.ndim;
  for (int d = 0; same && d < v.ndim; ++d) same = v.shape[d] == ref.shape[d];
  if (!same) {
    fail(op, std::string(name) + " must have the shape of " + ref_name + " " + ref.shape_str() +
                 ", got " + v.shape_str());
  }
}

// A float32/bfloat16 cpu tensor with at least one dim and a unit-stride last dim.
void check_data(const TensorView& v, const std::string& op, const char* name) {
  if (v.device != Device::kCPU) fail(op, std::string(name) + " must be on cpu");
  if (v.ndim < 1) fail(op, std::string(name) + " must have at least 1 dim");
  check_dtype_is(v, DType::kFloat32, DType::kBFloat16, op, name);
  check_last_dim_contiguous(v, op, name);
}

void check_index(const TensorView& v, const std::string& op, const char* name) {
  if (v.device != Device::kCPU) fail(op, std::string(name) + " must be on cpu");
  check_dtype_is(v, DType::kInt32, DType::kInt64, op, name);
}

template <typename T>
SPECINFER_INLINE void rms_norm_rows(const TensorView& x, const TensorView& w,
                                    const TensorView* residual, const TensorView& out, float eps,
                                    int64_t r0, int64_t r1) {
  const int64_t n = x.shape[x.ndim - 1];
  const T* weight = w.ptr<const T>();
  for (int64_t r = r0; r < r1; ++r) {
    const T* src = x.ptr<const T>() + offset_of(x, r, x.ndim - 1);
    if (residual) {
      T* res = residual->ptr<T>() + offset_of(*residual, r, residual->ndim - 1);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) res[i] = from_float<T>(to_float(res[i]) + to_float(src[i]));
      src = res;
    }
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) sum += to_float(src[i]) * to_float(src[i]);
    // The mean is sum / n, as torch computes it.
    const float scale = 1.0f / std::sqrt(sum / float(n) + eps);
    T* dst = out.ptr<T>() + offset_of(out, r, out.ndim - 1);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      dst[i] = from_float<T>(to_float(weight[i]) * round_to<T>(to_float(src[i]) * scale));
    }
  }
}

// x * cos + rotate_half(x) * sin for every head of every token of x, in place; the tables hold
// float32 or T. A token's position, table rows (rounded to T, as the reference multiplies by
// them) and offset are looked up once for all its heads.
template <typename T, typename C>
SPECINFER_INLINE void rotary_rows(const TensorView& x, const TensorView& cos, const TensorView& sin,
                                  const TensorView& positions, int64_t t0, int64_t t1) {
  const int64_t heads = x.shape[x.ndim - 2], head_stride = x.strides[x.ndim - 2];
  const int64_t dim = x.shape[x.ndim - 1], half = dim / 2;
  std::vector<float> tables(2 * dim);
  float* cs = tables.data();
  float* sn = cs + dim;
  for (int64_t t = t0; t < t1; ++t) {
    T* token = x.ptr<T>() + offset_of(x, t, x.ndim - 2);
    const int64_t pos = index_value(positions, t);
    const C* c = cos.ptr<const C>() + pos * cos.strides[0];
    const C* s = sin.ptr<const C>() + pos * sin.strides[0];
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) {
      cs[i] = round_to<T>(to_float(c[i]));
      sn[i] = round_to<T>(to_float(s[i]));
    }
    for (int64_t h = 0; h < heads; ++h) {
      T* v = token + h * head_stride;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float a = to_float(v[i]), b = to_float(v[i + half]);
        v[i] = from_float<T>(round_to<T>(a * cs[i]) + round_to<T>(-b * sn[i]));
        v[i + half] = from_float<T>(round_to<T>(b * cs[i + half]) + round_to<T>(a * sn[i + half]));
      }
    }
  }
}

template <typename T>
SPECINFER_INLINE void silu_mul_rows(const TensorView& x, const TensorView& out, int64_t r0,
                                    int64_t r1) {
  const int64_t n = out.shape[out.ndim - 1];
  for (int64_t r = r0; r < r1; ++r) {
    const T* gate = x.ptr<const T>() + offset_of(x, r, x.ndim - 1);
    const T* up = gate + n;
    T* dst = out.ptr<T>() + offset_of(out, r, out.ndim - 1);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float g = to_float(gate[i]);
      dst[i] = from_float<T>(round_to<T>(g / (1.0f + fast_exp(-g))) * to_float(up[i]));
    }
  }
}

// Rows [0, rows) split between the threads when a call has enough elements to pay for waking
// them; every row is computed the same way however they are split.
constexpr int64_t kParallelElements = 8192;

template <typename Fn>
void for_row_ranges(int64_t rows, int64_t row_elements, Fn&& fn) {
  int threads = 1;
#ifdef _OPENMP
  if (rows > 1 && rows * row_elements >= kParallelElements) {
    threads = int(std::min<int64_t>(omp_get_max_threads(), rows));
  }
#endif
  if (threads == 1) return fn(int64_t(0), rows);
#pragma omp parallel num_threads(threads)
  {
#ifdef _OPENMP
    const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
    fn(rows * t / n, rows * (t + 1) / n);
#endif
  }
}

// The arithmetic-heavy kernels also get an AVX2+FMA copy (8 lanes instead of SSE2's 4) and an
// AVX-512 one, picked at run time; the always-inline kernel is vectorised for each copy's target.
template <typename T>
void rms_norm_portable(const TensorView& x, const TensorView& w, const TensorView* residual,
                       const TensorView& out, float eps, int64_t r0, int64_t r1) {
  rms_norm_rows<T>(x, w, residual, out, eps, r0, r1);
}

template <typename T>
SPECINFER_TARGET(SPECINFER_AVX2)
void rms_norm_avx2(const TensorView& x, const TensorView& w, const TensorView* residual,
                   const TensorView& out, float eps, int64_t r0, int64_t r1) {
  rms_norm_rows<T>(x, w, residual, out, eps, r0, r1);
}

template <typename T>
SPECINFER_TARGET(SPECINFER_AVX512_WIDE)
void rms_norm_avx512(const TensorView& x, const TensorView& w, const TensorView* residual,
                     const TensorView& out, float eps, int64_t r0, int64_t r1) {
  rms_norm_rows<T>(x, w, residual, out, eps, r0, r1);
}

template <typename T>
void rms_norm_run(const TensorView& x, const TensorView& w, const TensorView* residual,
                  const TensorView& out, float eps) {
  auto kernel = cpu::has_avx512()     ? rms_norm_avx512<T>
                : cpu::has_avx2_fma() ? rms_norm_avx2<T>
                                      : rms_norm_portable<T>;
  for_row_ranges(rows_of(x), x.shape[x.ndim - 1],
                 [&](int64_t r0, int64_t r1) { kernel(x, w, residual, out, eps, r0, r1); });
}

template <typename T>
void silu_mul_portable(const TensorView& x, const TensorView& out, int64_t r0, int64_t r1) {
  silu_mul_rows<T>(x, out, r0, r1);
}

template <typename T>
SPECINFER_TARGET(SPECINFER_AVX2)
void silu_mul_avx2(const TensorView& x, const TensorView& out, int64_t r0, int64_t r1) {
  silu_mul_rows<T>(x, out, r0, r1);
}

// silu's exp and divide are most of a decode layer's elementwise work at tree sizes.
template <typename T>
SPECINFER_TARGET(SPECINFER_AVX512_WIDE)
void silu_mul_avx512(const TensorView& x, const TensorView& out, int64_t r0, int64_t r1) {
  silu_mul_rows<T>(x, out, r0, r1);
}

template <typename T>
void silu_mul_run(const TensorView& x, const TensorView& out) {
  auto kernel = cpu::has_avx512()     ? silu_mul_avx512<T>
                : cpu::has_avx2_fma() ? silu_mul_avx2<T>
                                      : silu_mul_portable<T>;
  for_row_ranges(rows_of(out), out.shape[out.ndim - 1],
                 [&](int64_t r0, int64_t r1) { kernel(x, out, r0, r1); });
}

template <typename T, typename C>
void rotary_portable(const TensorView& x, const TensorView& cos, const TensorView& sin,
                     const TensorView& positions, int64_t t0, int64_t t1) {
  rotary_rows<T, C>(x, cos, sin, positions, t0, t1);
}

template <typename T, typename C>
SPECINFER_TARGET(SPECINFER_AVX2)
void rotary_avx2(const TensorView& x, const TensorView& cos, const TensorView& sin,
                 const TensorView& positions, int64_t t0, int64_t t1) {
  rotary_rows<T, C>(x, cos, sin, positions, t0, t1);
}

template <typename T, typename C>
SPECINFER_TARGET(SPECINFER_AVX512_WIDE)
void rotary_avx512(const TensorView& x, const TensorView& cos, const TensorView& sin,
                   const TensorView& positions, int64_t t0, int64_t t1) {
  rotary_rows<T, C>(x, cos, sin, positions, t0, t1);
}

// Split by token: a token's table rows are looked up once for all its heads.
template <typename T, typename C>
void rotary_run(const TensorView& x, const TensorView& cos, const TensorView& sin,
                const TensorView& positions) {
  auto kernel = cpu::has_avx512()     ? rotary_avx512<T, C>
                : cpu::has_avx2_fma() ? rotary_avx2<T, C>
                                      : rotary_portable<T, C>;
  const int64_t heads = x.shape[x.ndim - 2];
  for_row_ranges(rows_of(x) / heads, heads * x.shape[x.ndim - 1],
                 [&](int64_t t0, int64_t t1) { kernel(x, cos, sin, positions, t0, t1); });
}

}  // namespace

void rms_norm_cpu(const TensorView& x, const TensorView& weight, const TensorView* residual,
                  const TensorView& out, float eps) {
  const std::string op = "rms_norm";
  check_data(x, op, "x");
  const TensorView* all[] = {&weight, &out, residual};
  const char* names[] = {"weight", "out", "residual"};
  for (int i = 0; i < 3; ++i) {
    if (all[i] == nullptr) continue;
    check_data(*all[i], op, names[i]);
    check_same_dtype(*all[i], x, op, names[i], "x");
  }
  check_ndim(weight, 1, op, "weight", "[hidden]");
  check_size(weight, 0, x.shape[x.ndim - 1], op, "weight", "the last dim of x");
  check_same_shape(out, x, op, "out", "x");
  if (residual) check_same_shape(*residual, x, op, "residual", "x");
  if (x.dtype == DType::kFloat32) {
    rms_norm_run<float>(x, weight, residual, out, eps);
  } else {
    rms_norm_run<bf16>(x, weight, residual, out, eps);
  }
}

void rotary_cpu(const TensorView& q, const TensorView& k, const TensorView& cos,
                const TensorView& sin, const TensorView& positions) {
  const std::string op = "rotary";
  check_data(q, op, "q");
  check_data(k, op, "k");
  check_same_dtype(k, q, op, "k", "q");
  if (q.ndim < 2) fail(op, "q must have at least 2 dims [..., heads, head_dim]");
  check_ndim(k, q.ndim, op, "k", "[..., kv_heads, head_dim] like q");
  const int64_t head_dim = q.shape[q.ndim - 1];
  if (head_dim % 2) fail(op, "head_dim must be even, got " + std::to_string(head_dim));
  check_size(k, k.ndim - 1, head_dim, op, "k", "head_dim of q");
  for (const TensorView* t : {&cos, &sin}) {
    const char* name = t == &cos ? "cos" : "sin";
    if (t->device != Device::kCPU) fail(op, std::string(name) + " must be on cpu");
    check_ndim(*t, 2, op, name, "[positions, head_dim]");
    check_dtype_is(*t, DType::kFloat32, q.dtype, op, name);
    check_size(*t, 1, head_dim, op, name, "head_dim of q");
    check_last_dim_contiguous(*t, op, name);
  }
  check_size(sin, 0, cos.shape[0], op, "sin", "positions of cos");
  check_same_dtype(sin, cos, op, "sin", "cos");
  check_index(positions, op, "positions");
  check_ndim(positions, q.ndim - 2, op, "positions", "(the leading dims of q)");
  for (int d = 0; d < q.ndim - 2; ++d) {
    check_size(positions, d, q.shape[d], op, "positions", "leading dims of q");
    check_size(k, d, q.shape[d], op, "k", "leading dims of q");
  }
  const int64_t n = positions.numel();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t pos = index_value(positions, i);
    if (pos < 0 || pos >= cos.shape[0]) {
      fail(op, "position " + std::to_string(pos) + " is outside the cos/sin table [0, " +
                   std::to_string(cos.shape[0]) + ")");
    }
  }
  for (const TensorView* x : {&q, &k}) {
    if (q.dtype == DType::kFloat32) {
      rotary_run<float, float>(*x, cos, sin, positions);
    } else if (cos.dtype == DType::kFloat32) {
      rotary_run<bf16, float>(*x, cos, sin, positions);
    } else {
      rotary_run<bf16, bf16>(*x, cos, sin, positions);
    }
  }
}

void silu_mul_cpu(const TensorView& x, const TensorView& out) {
  const std::string op = "silu_mul";
  check_data(x, op, "x");
  check_data(out, op, "out");
  check_same_dtype(out, x, op, "out", "x");
  check_ndim(out, x.ndim, op, "out", "like x");
  for (int d = 0; d < x.ndim - 1; ++d) check_size(out, d, x.shape[d], op, "out", "rows of x");
  if (x.shape[x.ndim - 1] % 2) fail(op, "the last dim of x (gate, then up) must be even");
  check_size(out, out.ndim - 1, x.shape[x.ndim - 1] / 2, op, "out", "half the last dim of x");
  if (x.dtype == DType::kFloat32) {
    silu_mul_run<float>(x, out);
  } else {
    silu_mul_run<bf16>(x, out);
  }
}

void kv_write_cpu(const TensorView& k_cache, const TensorView& v_cache, const TensorView& k,
                  const TensorView& v, const TensorView& cache_rows, const TensorView& slots) {
  const std::string op = "kv_write";
  check_data(k_cache, op, "k_cache");
  check_ndim(k_cache, 4, op, "k_cache", "[rows, kv_heads, seq, head_dim]");
  const TensorView* data[] = {&v_cache, &k, &v};
  const char* names[] = {"v_cache", "k", "v"};
  for (int i = 0; i < 3; ++i) {
    check_data(*data[i], op, names[i]);
    check_same_dtype(*data[i], k_cache, op, names[i], "k_cache");
  }
  check_same_shape(v_cache, k_cache, op, "v_cache", "k_cache");
  check_ndim(k, 4, op, "k", "[batch, tokens, kv_heads, head_dim]");
  check_same_shape(v, k, op, "v", "k");
  check_size(k, 2, k_cache.shape[1], op, "k", "kv_heads of the cache");
  check_size(k, 3, k_cache.shape[3], op, "k", "head_dim of the cache");
  check_index(cache_rows, op, "cache_rows");
  check_index(slots, op, "slots");
  check_cache_rows(cache_rows, op);
  check_size(cache_rows, 0, k.shape[0], op, "cache_rows", "batch of k");
  check_ndim(slots, 2, op, "slots", "[batch, tokens]");
  check_size(slots, 0, k.shape[0], op, "slots", "batch of k");
  check_size(slots, 1, k.shape[1], op, "slots", "tokens of k");
  const int64_t B = k.shape[0], T = k.shape[1], H = k.shape[2], D = k.shape[3];
  const int64_t S = k_cache.shape[2], MB = cache_rows.ndim == 2 ? cache_rows.shape[1] : 1;
  // Position `slots[b, t]` of request b: row cache_rows[b, pos / S] (or cache_rows[b]), slot pos %
  // S.
  std::vector<int64_t> rows(B * T), places(B * T);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      const int64_t pos = index_value(slots, b * T + t);
      if (pos < 0 || pos >= MB * S) {
        fail(op, "slot " + std::to_string(pos) +
                     " is outside the positions its cache rows hold [0, " + std::to_string(MB * S) +
                     ")");
      }
      const int64_t row = index_value(cache_rows, b * MB + pos / S);
      if (row < 0 || row >= k_cache.shape[0]) {
        fail(op, "cache row " + std::to_string(row) + " is outside [0, " +
                     std::to_string(k_cache.shape[0]) + ")");
      }
      rows[b * T + t] = row;
      places[b * T + t] = pos % S;
    }
  }
  const int64_t elem = k.dtype == DType::kFloat32 ? 4 : 2;
  const auto at = [elem](const TensorView& t, int64_t i0, int64_t i1, int64_t i2) {
    return static_cast<char*>(t.data) +
           (i0 * t.strides[0] + i1 * t.strides[1] + i2 * t.strides[2]) * elem;
  };
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      const int64_t row = rows[b * T + t], slot = places[b * T + t];
      for (int64_t h = 0; h < H; ++h) {
        std::memcpy(at(k_cache, row, h, slot), at(k, b, t, h), D * elem);
        std::memcpy(at(v_cache, row, h, slot), at(v, b, t, h), D * elem);
      }
    }
  }
}

}  // namespace specinfer
