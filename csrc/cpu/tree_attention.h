// CPU tree attention: the templated kernel for one work item (request b, KV head h, query rows
// [r0, r1) of its T x group rows: row r is token r / group, query head h * group + r % group).
// The item's query rows are processed together, so each K/V row is loaded once per item and
// reused for every one of them.
//
// Softmax in two passes over key tiles: scores and each row's maximum, then exp, sum and values
// accumulated key by key. Unlike an online softmax, nothing depends on where tiles start: a tree
// node sees its ancestors at gapped slots, incremental decoding sees the same keys at consecutive
// slots after the commit, and keys a row cannot see add exact zeros, so both give the same bits.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "core/numeric.h"

namespace specinfer::cpu {

// Raw pointers and element strides, so the kernel knows nothing about views or Python.
template <typename T>
struct TreeAttentionProblem {
  const T* q;  // [B, T, Hq, D]
  int64_t q_stride[3];
  const T* k;  // [N, Hkv, S, D]
  const T* v;
  int64_t k_stride[3];
  int64_t v_stride[3];
  const uint8_t* mask;  // [B, T, M], nonzero = visible
  int64_t mask_stride[3];
  T* out;  // [B, T, Hq, D]
  int64_t out_stride[3];
  const int64_t* cache_rows;   // [B, blocks_per_request]: position p at row [b, p / block_len]
  const int64_t* prefix_lens;  // [B]
  int64_t blocks_per_request, block_len;  // 1 and S for a row per request
  int64_t tokens, mask_cols, group, head_dim;
  float scale;
};

constexpr int64_t kKeyTile = 32;

// Keys a work item's score rows hold: the longest key range, in whole tiles (dot4 writes a
// tile's last group of four in full).
inline int64_t tree_attention_key_capacity(int64_t max_keys) {
  return (max_keys + kKeyTile - 1) / kKeyTile * kKeyTile;
}

// Floats of the AMX scores' buffers (tree_attention_amx.h) for `rows` query rows: the rows as B
// tiles (whole tiles of 16), 16 keys copied out of the cache, one accumulator tile.
inline int64_t amx_scores_scratch(int64_t rows, int64_t head_dim) {
  return (rows + 15) / 16 * 16 * head_dim / 2 + 8 * head_dim + 256;
}

// Floats of scratch one work item with `rows` query rows and `key_capacity` keys needs.
inline int64_t tree_attention_scratch(int64_t rows, int64_t head_dim, int64_t key_capacity) {
  return 2 * rows * head_dim + 2 * rows + rows * key_capacity + kKeyTile * head_dim +
         amx_scores_scratch(rows, head_dim);
}

// Four dot products of q with consecutive rows of k: four independent accumulator chains instead
// of one, so the FMA latency is hidden.
SPECINFER_INLINE void dot4(const float* q, const float* k, int64_t n, float* out) {
  float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (int64_t i = 0; i < n; ++i) {
    s0 += q[i] * k[i];
    s1 += q[i] * k[n + i];
    s2 += q[i] * k[2 * n + i];
    s3 += q[i] * k[3 * n + i];
  }
  out[0] = s0;
  out[1] = s1;
  out[2] = s2;
  out[3] = s3;
}

// acc[0:D] += sum_j p[j] * v[j, 0:D]. With D known at compile time the accumulator is a local
// array the compiler keeps in registers across the whole tile.
template <int kD>
SPECINFER_INLINE void accumulate_values(float* acc, const float* p, const float* v, int64_t kn,
                                        int64_t D) {
  if constexpr (kD > 0) {
    float a[kD];
    for (int d = 0; d < kD; ++d) a[d] = acc[d];
    for (int64_t j = 0; j < kn; ++j) {
      const float pj = p[j];
#pragma omp simd
      for (int d = 0; d < kD; ++d) a[d] += pj * v[j * kD + d];
    }
    for (int d = 0; d < kD; ++d) acc[d] = a[d];
  } else {
    for (int64_t j = 0; j < kn; ++j) {
      const float pj = p[j];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) acc[d] += pj * v[j * D + d];
    }
  }
}

// The cache rows of one request's KV head: position pos at block rows[pos / block_len], slot
// pos % block_len. each() walks a range with one division, not two a position (those divisions
// were a tenth of a decode step's attention).
template <typename T>
struct CacheRows {
  const T* base;  // the KV head's first slot in block 0 of the cache
  const int64_t* rows;
  int64_t row_stride, slot_stride, block_len;

  SPECINFER_INLINE const T* at(int64_t block, int64_t slot) const {
    return base + rows[block] * row_stride + slot * slot_stride;
  }
  SPECINFER_INLINE const T* operator()(int64_t pos) const {
    return at(pos / block_len, pos % block_len);
  }
  // f(pos, address) for pos in [begin, end).
  template <typename F>
  SPECINFER_INLINE void each(int64_t begin, int64_t end, F f) const {
    int64_t block = begin / block_len, slot = begin % block_len;
    for (int64_t pos = begin; pos < end; ++pos) {
      f(pos, at(block, slot));
      if (++slot == block_len) {
        slot = 0;
        ++block;
      }
    }
  }
};

// Asks for cache rows [begin, end) ahead of their use: the next tile's keys or values while this
// one's are converted (a tree forward of SmolLM2-135M 0.16 ms faster at 5-8 tokens; the loads of
// the converting loop were its largest stall).
template <typename T>
SPECINFER_INLINE void prefetch_rows(const CacheRows<T>& rows, int64_t begin, int64_t end,
                                    int64_t bytes) {
  rows.each(begin, end, [&](int64_t, const T* row) {
    const char* at = reinterpret_cast<const char*>(row);
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(at + b);
  });
}

template <typename T>
SPECINFER_INLINE void load_scaled(const T* src, float* dst, int64_t n, float scale) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]) * scale;
}

// The two inner loops of a work item, over one tile of keys (or values) converted to float
// rows kv [kn, D]: its scores for every query row, and its values weighted by the probabilities.
// A row's result must not depend on which other rows share the item, or on where its keys sit in
// a tile (both differ between a tree and incremental decoding): every score, sum and accumulator
// is computed the same way at every position.
struct GenericTiles {
  static constexpr bool kRawKeys = false;  // scores take keys converted to float32 rows

  // s[r * cap + j] = q[r] . kv[j] for j < kn (and up to the next multiple of 4: dot4 writes a
  // tile's last group of four in full, from stale rows never read).
  template <int kD>
  SPECINFER_INLINE static void scores(const float* q, int64_t R, int64_t D, const float* kv,
                                      int64_t kn, float* s, int64_t cap) {
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t j = 0; j < kn; j += 4) dot4(q + r * D, kv + j * D, D, s + r * cap + j);
    }
  }

  // acc[r] += sum_j p[r * cap + j] * kv[j] and l[r] += sum_j p[r * cap + j], in key order.
  template <int kD>
  SPECINFER_INLINE static void values(const float* p, int64_t R, int64_t D, const float* kv,
                                      int64_t kn, int64_t cap, float* acc, float* l) {
    for (int64_t r = 0; r < R; ++r) {
      const float* pr = p + r * cap;
      float sum = l[r];
      for (int64_t j = 0; j < kn; ++j) sum += pr[j];
      l[r] = sum;
      accumulate_values<kD>(acc + r * D, pr, kv, kn, D);
    }
  }
};

// kD > 0 fixes head_dim at compile time (fully unrolled inner loops); 0 reads it from p.
template <typename T, int kD, typename Tiles = GenericTiles>
SPECINFER_INLINE void attend_block(const TreeAttentionProblem<T>& p, int64_t b, int64_t h,
                                   int64_t r0, int64_t r1, int64_t key_capacity, float* scratch) {
  const int64_t D = kD > 0 ? kD : p.head_dim, G = p.group, R = r1 - r0;
  float* q = scratch;                // [R, D], pre-scaled
  float* acc = q + R * D;            // [R, D]
  float* m = acc + R * D;            // [R] maximum score
  float* l = m + R;                  // [R] sum of exp
  float* s = l + R;                  // [R, key_capacity] scores, then probabilities
  float* kv = s + R * key_capacity;  // [kKeyTile, D] a tile of keys, then of values
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const auto query = [&](int64_t r) {  // local row r is the item's row r0 + r
    const int64_t t = (r0 + r) / G, head = h * G + (r0 + r) % G;
    return p.q + b * p.q_stride[0] + t * p.q_stride[1] + head * p.q_stride[2];
  };

  for (int64_t r = 0; r < R; ++r) {
    if constexpr (!Tiles::kRawKeys) load_scaled(query(r), q + r * D, D, p.scale);
    std::fill(acc + r * D, acc + (r + 1) * D, 0.0f);
    m[r] = neg_inf;
    l[r] = 0.0f;
  }

  // Slots before n are visible to every row; slot n + j is visible iff mask column j is set.
  // Keys past the last masked slot any row of this block sees are skipped (halves causal prefill).
  const int64_t n = p.prefix_lens[b] + p.tokens - p.mask_cols;
  const uint8_t* mask = p.mask + b * p.mask_stride[0];
  int64_t last_new = -1;
  for (int64_t t = r0 / G; t <= (r1 - 1) / G; ++t) {
    for (int64_t j = p.mask_cols - 1; j > last_new; --j) {
      if (mask[t * p.mask_stride[1] + j * p.mask_stride[2]]) {
        last_new = j;
        break;
      }
    }
  }
  const int64_t key_end = n + last_new + 1;

  // Position pos of request b: its row (or block) and slot there.
  const int64_t* rows = p.cache_rows + b * p.blocks_per_request;
  const CacheRows<T> key{p.k + h * p.k_stride[1], rows, p.k_stride[0], p.k_stride[2], p.block_len};
  const CacheRows<T> value{p.v + h * p.v_stride[1], rows, p.v_stride[0], p.v_stride[2],
                           p.block_len};
  // Pass 1: every score (invisible keys -inf) and each row's maximum.
  if constexpr (Tiles::kRawKeys) {  // bf16 rows and keys as they are, 16 keys at a time
    uint32_t* queries = reinterpret_cast<uint32_t*>(kv + kKeyTile * D);
    uint16_t* keys = reinterpret_cast<uint16_t*>(queries + (R + 15) / 16 * 16 * D / 2);
    float* acc_tile = reinterpret_cast<float*>(keys + 16 * D);
    Tiles::template prepare_queries<kD>(query, R, queries);
    Tiles::begin();
    for (int64_t k0 = 0; k0 < key_end; k0 += 16) {
      prefetch_rows(key, k0 + 16, std::min(key_end, k0 + 32), D * sizeof(T));
      Tiles::template scores<kD>(queries, R, key, k0, std::min<int64_t>(16, key_end - k0),
                                 p.k_stride[2] * int64_t(sizeof(T)), p.scale, s, key_capacity, keys,
                                 acc_tile);
    }
    Tiles::end();
  } else {
    for (int64_t k0 = 0; k0 < key_end; k0 += kKeyTile) {
      const int64_t kn = std::min(kKeyTile, key_end - k0);
      prefetch_rows(key, k0 + kKeyTile, std::min(key_end, k0 + 2 * kKeyTile), D * sizeof(T));
      key.each(k0, k0 + kn,
               [&](int64_t pos, const T* row) { load_scaled(row, kv + (pos - k0) * D, D, 1.0f); });
      Tiles::template scores<kD>(q, R, D, kv, kn, s + k0, key_capacity);
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    float* sr = s + r * key_capacity;
    const uint8_t* mrow = mask + ((r0 + r) / G) * p.mask_stride[1];
    for (int64_t j = n; j < key_end; ++j) {
      if (!mrow[(j - n) * p.mask_stride[2]]) sr[j] = neg_inf;
    }
    float mr = neg_inf;  // (a maximum is the same in any order, so lanes may take parts)
#pragma omp simd reduction(max : mr)
    for (int64_t j = 0; j < key_end; ++j) mr = sr[j] > mr ? sr[j] : mr;
    // A row that sees nothing: every probability exp(-inf - 0) = 0, so it gets zeros.
    m[r] = mr == neg_inf ? 0.0f : mr;
  }
  // Pass 2: probabilities, their sum and the values, in key order.
  for (int64_t k0 = 0; k0 < key_end; k0 += kKeyTile) {
    const int64_t kn = std::min(kKeyTile, key_end - k0);
    prefetch_rows(value, k0 + kKeyTile, std::min(key_end, k0 + 2 * kKeyTile), D * sizeof(T));
    value.each(k0, k0 + kn,
               [&](int64_t pos, const T* row) { load_scaled(row, kv + (pos - k0) * D, D, 1.0f); });
    for (int64_t r = 0; r < R; ++r) {
      float* sr = s + r * key_capacity + k0;
      const float mr = m[r];
#pragma omp simd
      for (int64_t j = 0; j < kn; ++j) sr[j] = fast_exp(sr[j] - mr);
    }
    Tiles::template values<kD>(s + k0, R, D, kv, kn, key_capacity, acc, l);
  }

  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = (r0 + r) / G, head = h * G + (r0 + r) % G;
    T* o = p.out + b * p.out_stride[0] + t * p.out_stride[1] + head * p.out_stride[2];
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;  // a row that saw nothing gets zeros
    const float* ar = acc + r * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) o[d] = from_float<T>(ar[d] * inv);
  }
}

}  // namespace specinfer::cpu
