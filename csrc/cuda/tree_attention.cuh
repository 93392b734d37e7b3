// CUDA tree attention, split over the keys (flash-decoding). One thread block per (request, KV
// head, chunk of query rows, split of the keys), where a query row is a (tree token, query head
// of the KV head's group) pair; a chunk holds up to kWarps * kRowsPerWarp rows, so a whole tree
// of up to that many rows is one chunk. A request's keys (its prefix and the tree) are cut into
// `splits` equal runs of 32-key tiles, each run a block, so a short batch still fills the GPU;
// with one split the block writes the output, else its unnormalised partial sums and a second
// kernel combines them.
//
// In a block the queries sit in shared memory; each K/V tile is read from global memory once
// (16-byte loads where aligned) into shared memory and used by every query row. Each lane owns
// one key of a tile for scores and DP / 32 output columns for the weighted sum; softmax is online
// (running max and sum, base 2). DP is head_dim rounded up to a multiple of 32: the shared rows
// are zero past head_dim, so the padded columns add exact zeros and are never stored.
//
// Nothing is copied to the host: a key whose cache row or block index is out of range is skipped
// (never read), so unchecked indices cannot read outside the caches.
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
  // has stride[1] = 0 and blocks = 1.
  const void* cache_rows;
  int64_t cache_rows_stride[2];
  bool cache_rows_64;
  int64_t seq_len, rows_count, blocks;  // S, N, MB
  const void* prefix_lens;              // [B] int32 or int64
  int64_t prefix_lens_stride;
  bool prefix_lens_64;
  const uint8_t* mask;  // [B, T, M] bool/uint8: token i may see slot n + j iff mask[b, i, j]
  int64_t mask_stride[3];
  int batch, tokens, mask_cols, group, kv_heads, q_heads, head_dim;
  bool vector_loads;  // K/V rows, strides and head_dim allow 16-byte loads
  float scale_log2;   // softmax scale * log2(e): scores are kept in base 2 for exp2f
  int splits;
  // With splits > 1: per (split, request, token, q head) row (partial_row) the running max and
  // sum [.., 2] and the unnormalised output [.., head_dim].
  float* partial_ml;
  float* partial_acc;
};

// The row of the splits' partial sums that split z keeps for (request b, token t, q head).
__device__ __forceinline__ int64_t partial_row(const TreeAttentionParams& p, int z, int b, int t,
                                               int head) {
  return ((int64_t(z) * p.batch + b) * p.tokens + t) * p.q_heads + head;
}

__device__ __forceinline__ int64_t load_index(const void* p, int64_t i, bool is64) {
  return is64 ? static_cast<const int64_t*>(p)[i] : static_cast<const int32_t*>(p)[i];
}

// Request b's keys as a block sees them: slots before n are visible to every row, slot n + j iff
// mask column j is set; keys end at `end`, and the block's split takes tiles [begin, stop).
struct BlockKeys {
  int64_t n, end, begin, stop;
};

__device__ __forceinline__ BlockKeys block_keys(const TreeAttentionParams& p, int b) {
  const int64_t prefix = load_index(p.prefix_lens, b * p.prefix_lens_stride, p.prefix_lens_64);
  const int64_t end = prefix + p.tokens, tiles = end > 0 ? (end + kKeyTile - 1) / kKeyTile : 0;
  return {end - p.mask_cols, end, tiles * blockIdx.z / p.splits,
          tiles * (blockIdx.z + 1) / p.splits};
}

// The cache row holding position pos of request b, or -1 (never read) past its keys or where
// its block or row is out of range.
__device__ __forceinline__ int64_t key_row(const TreeAttentionParams& p, int b, int64_t pos,
                                           int64_t end) {
  const int64_t block = pos / p.seq_len;
  if (pos >= end || block >= p.blocks) return -1;
  const int64_t row = load_index(
      p.cache_rows, b * p.cache_rows_stride[0] + block * p.cache_rows_stride[1], p.cache_rows_64);
  return row >= 0 && row < p.rows_count ? row : -1;
}

// Whether request b's token t may see mask column j (mask_b: its [T, M] mask).
__device__ __forceinline__ bool mask_allows(const TreeAttentionParams& p, const uint8_t* mask_b,
                                            int t, int64_t j) {
  return mask_b[t * p.mask_stride[1] + j * p.mask_stride[2]] != 0;
}

// Loads kKeyTile cache rows (row j at base + offset[j], absent where offset[j] < 0) into a
// shared [kKeyTile, stride] float tile, zero past head_dim and for absent keys.
template <typename T, int D>
__device__ __forceinline__ void load_tile(const T* base, const int64_t* offset, int head_dim,
                                          bool vector_loads, float* tile, int stride) {
  constexpr int kVec = 16 / sizeof(T);
  if (vector_loads) {  // head_dim % kVec == 0 and every row 16-byte aligned
    for (int i = threadIdx.x; i < kKeyTile * (D / kVec); i += blockDim.x) {
      const int j = i / (D / kVec), d = (i % (D / kVec)) * kVec;
      float* dst = tile + j * stride + d;
      if (offset[j] >= 0 && d < head_dim) {
        const uint4 raw = *reinterpret_cast<const uint4*>(base + offset[j] + d);
        const T* vals = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int e = 0; e < kVec; ++e) dst[e] = to_float(vals[e]);
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) dst[e] = 0.0f;
      }
    }
    return;
  }
  for (int i = threadIdx.x; i < kKeyTile * D; i += blockDim.x) {
    const int j = i / D, d = i % D;
    tile[j * stride + d] = offset[j] >= 0 && d < head_dim ? to_float(base[offset[j] + d]) : 0.0f;
  }
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
  __shared__ int64_t k_offset[kKeyTile], v_offset[kKeyTile];  // -1: no such key

  const int b = blockIdx.x / p.kv_heads, h = blockIdx.x % p.kv_heads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row0 = blockIdx.y * kRowsPerBlock;
  const int rows = min(kRowsPerBlock, p.tokens * p.group - row0);

  const T* q = static_cast<const T*>(p.q);
  for (int i = threadIdx.x; i < rows * D; i += blockDim.x) {
    const int r = row0 + i / D, t = r / p.group, head = h * p.group + r % p.group, d = i % D;
    qs[i] = d < head_dim
                ? to_float(q[b * p.q_stride[0] + t * p.q_stride[1] + head * p.q_stride[2] + d]) *
                      p.scale_log2
                : 0.0f;
  }

  const BlockKeys keys = block_keys(p, b);
  const int64_t n = keys.n;
  const T* kbase = static_cast<const T*>(p.k) + h * p.k_stride[1];
  const T* vbase = static_cast<const T*>(p.v) + h * p.v_stride[1];
  const uint8_t* mask_b = p.mask + b * p.mask_stride[0];

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

  for (int64_t tile = keys.begin; tile < keys.stop; ++tile) {
    const int64_t k0 = tile * kKeyTile;
    __syncthreads();  // the previous tile is no longer read (and the queries are stored)
    if (threadIdx.x < kKeyTile) {
      const int64_t pos = k0 + threadIdx.x, slot = pos % p.seq_len;
      const int64_t row = key_row(p, b, pos, keys.end);
      k_offset[threadIdx.x] = row >= 0 ? row * p.k_stride[0] + slot * p.k_stride[2] : -1;
      v_offset[threadIdx.x] = row >= 0 ? row * p.v_stride[0] + slot * p.v_stride[2] : -1;
    }
    __syncthreads();
    load_tile<T, D>(kbase, k_offset, head_dim, p.vector_loads, ks, D + 1);
    load_tile<T, D>(vbase, v_offset, head_dim, p.vector_loads, vs, D);
    __syncthreads();

    const int64_t key = k0 + lane;
    const bool key_ok = k_offset[lane] >= 0;
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int r = i * kWarps + warp;
      if (r >= rows) break;  // warp-uniform
      const float* qr = qs + r * D;
      const float* kr = ks + lane * (D + 1);
      float s = 0.0f;
#pragma unroll 16
      for (int d = 0; d < D; ++d) s += qr[d] * kr[d];
      // Keys before n are visible to every row, the rest as the row's mask says.
      const bool visible =
          key_ok && (key < n || mask_allows(p, mask_b, (row0 + r) / p.group, key - n));
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
    if (p.splits > 1) {
      const int64_t at = partial_row(p, blockIdx.z, b, t, head);
      if (lane == 0) {
        p.partial_ml[2 * at] = m[i];
        p.partial_ml[2 * at + 1] = l[i];
      }
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        if (c * 32 + lane < head_dim) p.partial_acc[at * head_dim + c * 32 + lane] = acc[i][c];
      }
      continue;
    }
    const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;  // a row that saw nothing gets zeros
    T* o = out + b * p.out_stride[0] + t * p.out_stride[1] + head * p.out_stride[2];
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      if (c * 32 + lane < head_dim) o[c * 32 + lane] = from_float<T>(acc[i][c] * inv);
    }
  }
}

// Combines the splits' partial sums: one warp per (request, token, q head) row.
template <typename T>
__global__ void combine_splits(const TreeAttentionParams p) {
  const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= int64_t(p.batch) * p.tokens * p.q_heads) return;
  const int b = int(row / (int64_t(p.tokens) * p.q_heads));
  const int t = int(row / p.q_heads % p.tokens), head = int(row % p.q_heads);
  float m = -INFINITY;
  for (int z = 0; z < p.splits; ++z) m = fmaxf(m, p.partial_ml[2 * partial_row(p, z, b, t, head)]);
  float l = 0.0f;
  for (int z = 0; z < p.splits; ++z) {
    const int64_t at = partial_row(p, z, b, t, head);
    if (p.partial_ml[2 * at] != -INFINITY)
      l += exp2f(p.partial_ml[2 * at] - m) * p.partial_ml[2 * at + 1];
  }
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;  // a row that saw nothing gets zeros
  T* o =
      static_cast<T*>(p.out) + b * p.out_stride[0] + t * p.out_stride[1] + head * p.out_stride[2];
  for (int d = lane; d < p.head_dim; d += 32) {
    float sum = 0.0f;
    for (int z = 0; z < p.splits; ++z) {
      const int64_t at = partial_row(p, z, b, t, head);
      if (p.partial_ml[2 * at] != -INFINITY) {
        sum += exp2f(p.partial_ml[2 * at] - m) * p.partial_acc[at * p.head_dim + d];
      }
    }
    o[d] = from_float<T>(sum * inv);
  }
}

template <int D>
constexpr size_t tree_attention_smem_bytes() {
  return sizeof(float) * (kRowsPerBlock * D + kKeyTile * (D + 1) + kKeyTile * D);
}

}  // namespace specinfer::cuda
