// CUDA tree attention. One thread block per (request, KV head, chunk of query rows), where a query
// row is a (tree token, query head of the KV head's group) pair; a chunk holds up to
// kWarps * kRowsPerWarp rows, so a whole tree of up to that many rows is one block. The block's
// queries sit in shared memory; each K/V row is read from global memory once per block into a
// shared tile and used by every query row. Each lane owns one key of a 32-key tile for scores and
// DP / 32 output columns for the weighted sum; softmax is online (running max and sum). DP is
// head_dim rounded up to a multiple of 32: the shared rows are zero past head_dim, so the padded
// columns add exact zeros to the scores and are never stored.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/numeric.cuh"

namespace specinfer::cuda {

constexpr int kWarps = 8;
constexpr int kRowsPerWarp = 8;
constexpr int kRowsPerBlock = kWarps * kRowsPerWarp;
constexpr int kKeyTile = 32;  // one key per lane

struct TreeAttentionParams {
  const void* q;  // [B, T, Hq, D]
  int64_t q_stride[3];
  const void* k;  // [N, Hkv, S, D]
  const void* v;
  int64_t k_stride[3];
  int64_t v_stride[3];
  void* out;  // [B, T, Hq, D]
  int64_t out_stride[3];
  // [B] rows or a [B, MB] block table (int32 or int64): position pos of request b is slot
  // pos % seq_len of row cache_rows[b * stride[0] + (pos / seq_len) * stride[1]]; a [B] view
  // has stride[1] = 0 (and every position below seq_len).
  const void* cache_rows;
  int64_t cache_rows_stride[2];
  bool cache_rows_64;
  int64_t seq_len;
  const void* prefix_lens;  // [B] int32 or int64
  int64_t prefix_lens_stride;
  bool prefix_lens_64;
  const uint32_t* mask_bits;    // [B, T, words]: bit j of token i = tree_mask[b, i, j]
  const int32_t* last_visible;  // [B, T]: last mask column j token i sees, -1 if none
  int tokens, mask_cols, words, group, kv_heads, head_dim;
  float scale_log2;  // softmax scale * log2(e): scores are kept in base 2 for exp2f
};

__device__ __forceinline__ int64_t load_index(const void* p, int64_t i, bool is64) {
  return is64 ? static_cast<const int64_t*>(p)[i] : static_cast<const int32_t*>(p)[i];
}

// Packs the [B, T, M] byte mask (any strides) into bits and records each row's last visible
// column, which bounds how far a block must read. One thread per (request, token) row.
__global__ void pack_tree_mask(const uint8_t* mask, int64_t s0, int64_t s1, int64_t s2, int batch,
                               int tokens, int cols, int words, uint32_t* bits,
                               int32_t* last_visible) {
  const int64_t row = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= int64_t(batch) * tokens) return;
  const uint8_t* src = mask + (row / tokens) * s0 + (row % tokens) * s1;
  int32_t last = -1;
  for (int w = 0; w < words; ++w) {
    uint32_t word = 0;
    for (int j = w * 32; j < min(cols, w * 32 + 32); ++j) {
      if (src[j * s2]) {
        word |= 1u << (j - w * 32);
        last = j;
      }
    }
    bits[row * words + w] = word;
  }
  last_visible[row] = last;
}

template <typename T, int D>
__global__ void __launch_bounds__(kWarps * 32) tree_attention_kernel(const TreeAttentionParams p) {
  static_assert(D % 32 == 0, "each lane owns D / 32 output columns");
  constexpr int kCols = D / 32;
  const int head_dim = p.head_dim;  // <= D
  extern __shared__ float smem[];
  float* qs = smem;                     // [kRowsPerBlock, D]
  float* ks = qs + kRowsPerBlock * D;   // [kKeyTile, D + 1]; +1 avoids bank conflicts
  float* vs = ks + kKeyTile * (D + 1);  // [kKeyTile, D]
  __shared__ int block_last_visible;
  __shared__ int64_t k_offset[kKeyTile], v_offset[kKeyTile];  // the tile's keys in the caches

  const int b = blockIdx.x / p.kv_heads, h = blockIdx.x % p.kv_heads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int total_rows = p.tokens * p.group;
  const int row0 = blockIdx.y * kRowsPerBlock;
  const int rows = min(kRowsPerBlock, total_rows - row0);
  const int t_first = row0 / p.group, t_last = (row0 + rows - 1) / p.group;

  const T* q = static_cast<const T*>(p.q);
  for (int i = threadIdx.x; i < rows * D; i += blockDim.x) {
    const int r = row0 + i / D, t = r / p.group, head = h * p.group + r % p.group, d = i % D;
    qs[i] = d < head_dim ? to_float(q[b * p.q_stride[0] + t * p.q_stride[1] +
                                      head * p.q_stride[2] + d]) * p.scale_log2
                         : 0.0f;
  }
  if (threadIdx.x == 0) block_last_visible = -1;
  __syncthreads();
  for (int t = t_first + int(threadIdx.x); t <= t_last; t += blockDim.x) {
    atomicMax(&block_last_visible, p.last_visible[int64_t(b) * p.tokens + t]);
  }
  __syncthreads();

  // Slots before n are visible to every row; slot n + j is visible iff mask column j is set.
  const int64_t n = load_index(p.prefix_lens, b * p.prefix_lens_stride, p.prefix_lens_64) +
                    p.tokens - p.mask_cols;
  const int64_t key_end = n + block_last_visible + 1;
  const T* kbase = static_cast<const T*>(p.k) + h * p.k_stride[1];
  const T* vbase = static_cast<const T*>(p.v) + h * p.v_stride[1];

  // Warp w owns block rows w, w + kWarps, ...: a small tree still spreads over the warps.
  float acc[kRowsPerWarp][kCols];
  float m[kRowsPerWarp], l[kRowsPerWarp];
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    m[i] = -INFINITY;
    l[i] = 0.0f;
#pragma unroll
    for (int c = 0; c < kCols; ++c) acc[i][c] = 0.0f;
  }

  for (int64_t k0 = 0; k0 < key_end; k0 += kKeyTile) {
    __syncthreads();  // the previous tile is no longer read
    if (threadIdx.x < kKeyTile && k0 + threadIdx.x < key_end) {
      const int64_t pos = k0 + threadIdx.x, block = pos / p.seq_len, slot = pos % p.seq_len;
      const int64_t row = load_index(
          p.cache_rows, b * p.cache_rows_stride[0] + block * p.cache_rows_stride[1],
          p.cache_rows_64);
      k_offset[threadIdx.x] = row * p.k_stride[0] + slot * p.k_stride[2];
      v_offset[threadIdx.x] = row * p.v_stride[0] + slot * p.v_stride[2];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < kKeyTile * D; i += blockDim.x) {
      const int j = i / D, d = i % D;
      const bool in = k0 + j < key_end && d < head_dim;
      ks[j * (D + 1) + d] = in ? to_float(kbase[k_offset[j] + d]) : 0.0f;
      vs[j * D + d] = in ? to_float(vbase[v_offset[j] + d]) : 0.0f;
    }
    __syncthreads();

    const int64_t key = k0 + lane;
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int r = i * kWarps + warp;
      if (r >= rows) break;  // warp-uniform
      const float* qr = qs + r * D;
      const float* kr = ks + lane * (D + 1);
      float s = 0.0f;
#pragma unroll 16
      for (int d = 0; d < D; ++d) s += qr[d] * kr[d];
      bool visible = key < key_end;
      if (visible && key >= n) {
        const int t = (row0 + r) / p.group;
        const int64_t j = key - n;
        const uint32_t word = p.mask_bits[(int64_t(b) * p.tokens + t) * p.words + (j >> 5)];
        visible = (word >> (j & 31)) & 1u;
      }
      s = visible ? s : -INFINITY;
      const float tile_max = warp_max(s);
      if (tile_max == -INFINITY) continue;  // warp-uniform: nothing visible in this tile
      const float m_new = fmaxf(m[i], tile_max);
      const float alpha = exp2f(m[i] - m_new);  // 0 on the first visible tile
      const float prob = visible ? exp2f(s - m_new) : 0.0f;
      l[i] = l[i] * alpha + warp_sum(prob);
      m[i] = m_new;
#pragma unroll
      for (int c = 0; c < kCols; ++c) acc[i][c] *= alpha;
#pragma unroll 8
      for (int j = 0; j < kKeyTile; ++j) {
        const float pj = __shfl_sync(0xffffffffu, prob, j);
#pragma unroll
        for (int c = 0; c < kCols; ++c) acc[i][c] += pj * vs[j * D + c * 32 + lane];
      }
    }
  }

  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = i * kWarps + warp;
    if (r >= rows) break;
    const int t = (row0 + r) / p.group, head = h * p.group + (row0 + r) % p.group;
    const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;  // a row that saw nothing gets zeros
    T* o = out + b * p.out_stride[0] + t * p.out_stride[1] + head * p.out_stride[2];
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      if (c * 32 + lane < head_dim) o[c * 32 + lane] = from_float<T>(acc[i][c] * inv);
    }
  }
}

template <int D>
constexpr size_t tree_attention_smem_bytes() {
  return sizeof(float) * (kRowsPerBlock * D + kKeyTile * (D + 1) + kKeyTile * D);
}

}  // namespace specinfer::cuda
