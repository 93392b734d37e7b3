// CUDA topk_expand: one thread block per logits row, one pass over the row. Each thread keeps a
// running max and exp-sum (online softmax) and its K best (logit, token) pairs, sorted, in
// registers; the block then combines the sums and merges the threads' lists k times by a
// block-wide argmax of their heads. Ranking is by logit, ties to the lower token id, as on cpu.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "cuda/numeric.cuh"

namespace specinfer::cuda {

constexpr int kTopkThreads = 256;
constexpr int kTopkWarps = kTopkThreads / 32;
constexpr int kTopkMaxK = 64;
constexpr int kTopkNoToken = INT_MAX;  // an empty list slot: ranks below every real token
constexpr int kTopkUnroll = 4;         // loads in flight per thread

struct TopkParams {
  const void* logits;  // [N, V], unit stride along V
  int64_t logits_stride;
  int64_t* tokens;  // [N, k]
  int64_t tokens_stride[2];
  float* probs;  // [N, k]
  int64_t probs_stride[2];
  int vocab, k;
  float inv_t;
  int* bad_row;  // lowest row without a valid softmax; left alone when every row has one
};

// Higher logit first, then lower token id.
__device__ __forceinline__ bool topk_better(float a, int a_token, float b, int b_token) {
  return a > b || (a == b && a_token < b_token);
}

// s, a sum of exp((x - m) * inv_t), rescaled to the larger max m_new.
__device__ __forceinline__ double rescale_sum(double s, float m, float m_new, float inv_t) {
  return m == m_new ? s : s * double(expf((m - m_new) * inv_t));
}

template <int K>
struct TopkList {
  float logit[K];
  int token[K];

  __device__ __forceinline__ void clear() {
#pragma unroll
    for (int j = 0; j < K; ++j) {
      logit[j] = -INFINITY;
      token[j] = kTopkNoToken;
    }
  }

  // Fully unrolled so the arrays stay in registers.
  __device__ __forceinline__ void insert(float v, int t) {
    if (!topk_better(v, t, logit[K - 1], token[K - 1])) return;
    bool placed = false;
#pragma unroll
    for (int j = K - 1; j > 0; --j) {
      if (!placed) {
        if (topk_better(v, t, logit[j - 1], token[j - 1])) {
          logit[j] = logit[j - 1];
          token[j] = token[j - 1];
        } else {
          logit[j] = v;
          token[j] = t;
          placed = true;
        }
      }
    }
    if (!placed) {
      logit[0] = v;
      token[0] = t;
    }
  }

  __device__ __forceinline__ void pop_front() {
#pragma unroll
    for (int j = 0; j + 1 < K; ++j) {
      logit[j] = logit[j + 1];
      token[j] = token[j + 1];
    }
    logit[K - 1] = -INFINITY;
    token[K - 1] = kTopkNoToken;
  }
};

template <typename T, int K>
__global__ void __launch_bounds__(kTopkThreads) topk_expand_kernel(const TopkParams p) {
  static_assert(K <= kTopkMaxK, "K bounds the per-thread list");
  __shared__ float warp_m[kTopkWarps];
  __shared__ double warp_s[kTopkWarps];
  // Double-buffered by round parity, so one barrier per merge round suffices.
  __shared__ float head_logit[2][kTopkWarps];
  __shared__ int head_token[2][kTopkWarps];

  const int row = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const T* x = static_cast<const T*>(p.logits) + int64_t(row) * p.logits_stride;
  const float inv_t = p.inv_t;

  TopkList<K> best;
  best.clear();
  float m = -INFINITY;
  double s = 0.0;  // a float sum over a whole vocabulary row loses ~1e-5 relative
  for (int base = threadIdx.x; base < p.vocab; base += kTopkThreads * kTopkUnroll) {
    float v[kTopkUnroll];
#pragma unroll
    for (int u = 0; u < kTopkUnroll; ++u) {
      const int i = base + u * kTopkThreads;
      v[u] = i < p.vocab ? to_float(x[i]) : -INFINITY;
    }
#pragma unroll
    for (int u = 0; u < kTopkUnroll; ++u) {
      const int i = base + u * kTopkThreads;
      if (i >= p.vocab) break;
      if (v[u] > m) {
        s = rescale_sum(s, m, v[u], inv_t);
        m = v[u];
      }
      // -inf adds nothing; NaN and +inf make s NaN, which marks the row invalid below.
      if (v[u] != -INFINITY) s += double(expf((v[u] - m) * inv_t));
      best.insert(v[u], i);
    }
  }

  // Block-wide (max, sum): warps by shuffles, then warp 0 over the warps.
  for (int o = 16; o > 0; o >>= 1) {
    const float m_other = __shfl_xor_sync(0xffffffffu, m, o);
    const double s_other = __shfl_xor_sync(0xffffffffu, s, o);
    const float m_new = fmaxf(m, m_other);
    s = rescale_sum(s, m, m_new, inv_t) + rescale_sum(s_other, m_other, m_new, inv_t);
    m = m_new;
  }
  if (lane == 0) {
    warp_m[warp] = m;
    warp_s[warp] = s;
  }
  __syncthreads();
  m = warp_m[0];
  for (int w = 1; w < kTopkWarps; ++w) m = fmaxf(m, warp_m[w]);
  s = 0.0;
  for (int w = 0; w < kTopkWarps; ++w) s += rescale_sum(warp_s[w], warp_m[w], m, inv_t);
  if (!(isfinite(s) && s > 0.0)) {  // uniform over the block
    if (threadIdx.x == 0) atomicMin(p.bad_row, row);
    return;
  }

  // Merge: round r takes the best head of all lists; its owner (tokens are unique) pops it.
  int64_t* tokens = p.tokens + int64_t(row) * p.tokens_stride[0];
  float* probs = p.probs + int64_t(row) * p.probs_stride[0];
  for (int r = 0; r < p.k; ++r) {
    float l = best.logit[0];
    int t = best.token[0];
    for (int o = 16; o > 0; o >>= 1) {
      const float l_other = __shfl_xor_sync(0xffffffffu, l, o);
      const int t_other = __shfl_xor_sync(0xffffffffu, t, o);
      if (topk_better(l_other, t_other, l, t)) {
        l = l_other;
        t = t_other;
      }
    }
    const int buf = r & 1;
    if (lane == 0) {
      head_logit[buf][warp] = l;
      head_token[buf][warp] = t;
    }
    __syncthreads();
    for (int w = 0; w < kTopkWarps; ++w) {
      if (topk_better(head_logit[buf][w], head_token[buf][w], l, t)) {
        l = head_logit[buf][w];
        t = head_token[buf][w];
      }
    }
    if (best.token[0] == t) best.pop_front();
    if (threadIdx.x == 0) {
      tokens[r * p.tokens_stride[1]] = t;
      probs[r * p.probs_stride[1]] = float(double(expf((l - m) * inv_t)) / s);
    }
  }
}

}  // namespace specinfer::cuda
