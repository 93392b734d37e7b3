// topk_expand on cpu: per row, a vectorised max and exp-sum give the softmax normaliser, and one
// scalar pass keeps the k best logits in a small heap (exp is monotone, so ranking by logit is
// ranking by probability, without rounding ties). argmax: the top 1 alone, in one vectorised pass.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "core/topk_expand_args.h"
#include "cpu/cpu_features.h"
#include "ops.h"

namespace specinfer {
namespace cpu {
namespace {

struct Candidate {
  float logit;
  int64_t token;
};

// Higher logit first, then lower token id.
inline bool better(const Candidate& a, const Candidate& b) {
  return a.logit > b.logit || (a.logit == b.logit && a.token < b.token);
}

// Forking threads costs tens of microseconds: a few vocabulary rows stay serial.
inline bool rows_in_parallel(int64_t rows, int64_t vocab) {
  return rows > 1 && rows * vocab >= (int64_t(1) << 17);
}

constexpr int kLanes = 8;        // one AVX2 register of floats
constexpr int64_t kChunk = 256;  // terms per float partial sum

// Max and sum of exp((x - max) * inv_t) over one row; the sum is NaN unless the row is valid.
template <typename T>
SPECINFER_INLINE void row_stats(const T* x, int64_t n, float inv_t, float* max_out,
                                double* sum_out) {
  // One register of running maxima: GCC does not vectorise an omp max reduction without
  // fast-math, but does this elementwise max.
  float lanes[kLanes];
  std::fill(lanes, lanes + kLanes, -INFINITY);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) lanes[j] = std::max(lanes[j], to_float(x[i + j]));
  }
  float m = -INFINITY;
  for (; i < n; ++i) m = std::max(m, to_float(x[i]));
  for (int j = 0; j < kLanes; ++j) m = std::max(m, lanes[j]);

  // Float sums of short chunks, added in double: one float sum over a whole vocabulary drops the
  // many terms below half an ulp of it (1e-4 relative error at 49152 tokens).
  double sum = 0.0;
  for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
    const int64_t i1 = std::min(n, i0 + kChunk);
    float chunk = 0.0f;
#pragma omp simd reduction(+ : chunk)
    for (int64_t t = i0; t < i1; ++t) chunk += fast_exp((to_float(x[t]) - m) * inv_t);
    sum += chunk;
  }
  *max_out = m;
  *sum_out = sum;
}

template <typename T>
SPECINFER_TARGET(SPECINFER_AVX2)
void row_stats_avx2(const T* x, int64_t n, float inv_t, float* m, double* sum) {
  row_stats(x, n, inv_t, m, sum);
}

template <typename T>
void row_stats_generic(const T* x, int64_t n, float inv_t, float* m, double* sum) {
  row_stats(x, n, inv_t, m, sum);
}

// Returns false when the row has no valid softmax (NaN, +inf, or every logit -inf).
template <typename T>
bool topk_row(const T* x, int64_t n, int64_t k, float inv_t, int64_t* tokens, int64_t token_stride,
              float* probs, int64_t prob_stride, std::vector<Candidate>& heap) {
  float m;
  double sum;
  if (has_avx2_fma()) {
    row_stats_avx2(x, n, inv_t, &m, &sum);
  } else {
    row_stats_generic(x, n, inv_t, &m, &sum);
  }
  if (!std::isfinite(sum) || !(sum > 0.0)) return false;

  // A heap of the k best so far with the worst on top. Later tokens have higher ids, so once the
  // heap is full only a strictly higher logit than the worst kept can enter: one compare each.
  heap.clear();
  int64_t i = 0;
  for (; i < n && int64_t(heap.size()) < k; ++i) {
    heap.push_back({to_float(x[i]), i});
    std::push_heap(heap.begin(), heap.end(), better);
  }
  for (; i < n; ++i) {
    const float v = to_float(x[i]);
    if (v > heap.front().logit) {
      std::pop_heap(heap.begin(), heap.end(), better);
      heap.back() = {v, i};
      std::push_heap(heap.begin(), heap.end(), better);
    }
  }
  std::sort_heap(heap.begin(), heap.end(), better);  // best first
  for (int64_t j = 0; j < k; ++j) {
    tokens[j * token_stride] = heap[j].token;
    probs[j * prob_stride] = float(fast_exp((heap[j].logit - m) * inv_t) / sum);
  }
  return true;
}

template <typename T>
void run(const TensorView& logits, int64_t k, float inv_t, const TensorView& tokens,
         const TensorView& probs) {
  const int64_t N = logits.shape[0], V = logits.shape[1];
  std::vector<char> ok(N, 1);
  const bool parallel = rows_in_parallel(N, V);
#pragma omp parallel if (parallel)
  {
    std::vector<Candidate> heap;
    heap.reserve(k);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < N; ++r) {
      ok[r] = topk_row(logits.ptr<const T>() + r * logits.strides[0], V, k, inv_t,
                       tokens.ptr<int64_t>() + r * tokens.strides[0], tokens.strides[1],
                       probs.ptr<float>() + r * probs.strides[0], probs.strides[1], heap);
    }
  }
  for (int64_t r = 0; r < N; ++r) {
    if (!ok[r]) {
      fail("topk_expand", "logits row " + std::to_string(r) +
                              " has no softmax (it holds NaN or +inf, or every logit is -inf)");
    }
  }
}

constexpr int kArgmaxLanes = 16;

// The index of the first maximum of a row; a NaN counts as the maximum (as in torch.max). Each
// lane keeps its largest value and where it first saw it, so the smallest index among the lanes
// holding the maximum is the row's first.
template <typename T>
SPECINFER_INLINE int64_t argmax_row(const T* x, int64_t n) {
  float best[kArgmaxLanes];
  int32_t where[kArgmaxLanes], nan[kArgmaxLanes];
  std::fill(best, best + kArgmaxLanes, -INFINITY);
  std::fill(where, where + kArgmaxLanes, 0);
  std::fill(nan, nan + kArgmaxLanes, 0);
  int32_t i = 0;
  for (; i + kArgmaxLanes <= n; i += kArgmaxLanes) {
#pragma omp simd
    for (int j = 0; j < kArgmaxLanes; ++j) {
      const float v = to_float(x[i + j]);
      const bool more = v > best[j];
      best[j] = more ? v : best[j];
      where[j] = more ? i + j : where[j];
      nan[j] |= v != v;
    }
  }
  int64_t first = 0;
  float m = -INFINITY;
  bool any_nan = false;
  for (int j = 0; j < kArgmaxLanes; ++j) {
    any_nan |= nan[j] != 0;
    if (best[j] > m || (best[j] == m && where[j] < first)) m = best[j], first = where[j];
  }
  for (; i < n; ++i) {  // the tail's indices come after every lane's
    const float v = to_float(x[i]);
    any_nan |= v != v;
    if (v > m) m = v, first = i;
  }
  if (any_nan) {
    for (int64_t t = 0; t < n; ++t) {
      if (std::isnan(to_float(x[t]))) return t;
    }
  }
  return first;
}

template <typename T>
SPECINFER_TARGET(SPECINFER_AVX512_WIDE)
int64_t argmax_row_avx512(const T* x, int64_t n) {
  return argmax_row(x, n);
}

template <typename T>
SPECINFER_TARGET(SPECINFER_AVX2)
int64_t argmax_row_avx2(const T* x, int64_t n) {
  return argmax_row(x, n);
}

template <typename T>
int64_t argmax_row_portable(const T* x, int64_t n) {
  return argmax_row(x, n);
}

template <typename T>
void argmax_rows(const TensorView& logits, const TensorView& out) {
  auto kernel = has_avx512()     ? argmax_row_avx512<T>
                : has_avx2_fma() ? argmax_row_avx2<T>
                                 : argmax_row_portable<T>;
  const int64_t N = logits.shape[0], V = logits.shape[1];
  const bool parallel = rows_in_parallel(N, V);
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t r = 0; r < N; ++r) {
    out.ptr<int64_t>()[r * out.strides[0]] =
        kernel(logits.ptr<const T>() + r * logits.strides[0], V);
  }
}

}  // namespace
}  // namespace cpu

void argmax_cpu(const TensorView& logits, const TensorView& out) {
  const std::string op = "argmax";
  check_ndim(logits, 2, op, "logits", "[rows, vocab]");
  check_last_dim_contiguous(logits, op, "logits");
  check_dtype_is(logits, DType::kFloat32, DType::kBFloat16, op, "logits");
  check_ndim(out, 1, op, "out", "[rows]");
  if (out.dtype != DType::kInt64) {
    fail(op, std::string("out must be int64, got ") + dtype_name(out.dtype));
  }
  check_size(out, 0, logits.shape[0], op, "out", "rows of logits");
  if (logits.device != Device::kCPU || out.device != Device::kCPU) {
    fail(op, "logits and out must be on cpu");
  }
  if (logits.shape[1] == 0) fail(op, "logits has no columns (an empty vocabulary has no maximum)");
  if (logits.shape[1] > INT32_MAX) fail(op, "logits rows longer than 2^31 - 1 are not supported");
  if (logits.dtype == DType::kFloat32) {
    cpu::argmax_rows<float>(logits, out);
  } else {
    cpu::argmax_rows<bf16>(logits, out);
  }
}

void topk_expand_cpu(const TensorView& logits, int64_t k, float temperature,
                     const TensorView& tokens, const TensorView& probs) {
  check_topk_expand_args(logits, k, temperature, tokens, probs);
  check_dtype_is(logits, DType::kFloat32, DType::kBFloat16, "topk_expand", "logits");
  if (logits.device != Device::kCPU) {
    fail("topk_expand", std::string("logits must be on cpu, got ") + device_name(logits.device));
  }
  const int64_t N = logits.shape[0];
  if (N == 0 || k == 0) return;
  const float inv_t = topk_inverse_temperature(temperature);
  if (logits.dtype == DType::kFloat32) {
    cpu::run<float>(logits, k, inv_t, tokens, probs);
  } else {
    cpu::run<bf16>(logits, k, inv_t, tokens, probs);
  }
}

}  // namespace specinfer
