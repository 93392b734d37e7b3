// Tree attention on tensor cores, for float16 and bfloat16 with head_dim <= 128: the same blocks,
// splits and partial sums as tree_attention_kernel (tree_attention.cuh), with the two products
// on mma.sync m16n8k16 (fp32 accumulation). Four warps; warp w owns query rows 16w .. 16w + 15 of
// the block. Per 32-key tile: S = Q K^T (four 16x8 tiles), the online softmax in registers (base
// 2, scale applied in fp32), then O += P V with P rounded to the input type, as FlashAttention-2
// does. The fragment layouts are the PTX ISA's for m16n8k16: lane = 4 g + t holds rows g and
// g + 8, columns 2t and 2t + 1 of each 8-column tile.
#pragma once

#include "cuda/tree_attention.cuh"

namespace specinfer::cuda {

constexpr int kMmaWarps = kRowsPerBlock / 16;
constexpr int kPad = 8;  // elements added to each shared row: conflict-free fragment loads

template <int D>
constexpr size_t tree_attention_mma_smem_bytes() {
  // Q [rows, D + pad], K [keys, D + pad], V transposed [D, keys + pad], all 16-bit.
  return 2 * (kRowsPerBlock * (D + kPad) + kKeyTile * (D + kPad) + D * (kKeyTile + kPad));
}

template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4],
                                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&c)[4], const uint32_t (&a)[4],
                                                  uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two adjacent 16-bit elements as one register (the lower address in the low half).
template <typename T>
__device__ __forceinline__ uint32_t pair_at(const T* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

template <typename T>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  const T l = from_float<T>(lo), h = from_float<T>(hi);
  const uint16_t lb = *reinterpret_cast<const uint16_t*>(&l);
  const uint16_t hb = *reinterpret_cast<const uint16_t*>(&h);
  return uint32_t(lb) | (uint32_t(hb) << 16);
}

template <typename T, int D>
__global__ void __launch_bounds__(kMmaWarps * 32)
    tree_attention_mma_kernel(const TreeAttentionParams p) {
  static_assert(D % 16 == 0 && D <= 128, "D / 8 accumulator tiles per warp");
  constexpr int kQs = D + kPad, kKs = D + kPad, kVs = kKeyTile + kPad;  // shared row strides
  constexpr int kVec = 8;                                                 // 16-bit elements in 16 B
  const int head_dim = p.head_dim;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* qs = reinterpret_cast<T*>(smem_raw);  // [kRowsPerBlock, kQs]
  T* ks = qs + kRowsPerBlock * kQs;        // [kKeyTile, kKs]
  T* vts = ks + kKeyTile * kKs;            // [D, kVs]: V transposed
  __shared__ int64_t k_offset[kKeyTile], v_offset[kKeyTile];

  const int b = blockIdx.x / p.kv_heads, h = blockIdx.x % p.kv_heads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
  const int row0 = blockIdx.y * kRowsPerBlock;
  const int rows = min(kRowsPerBlock, p.tokens * p.group - row0);
  const T zero = from_float<T>(0.0f);

  const T* q = static_cast<const T*>(p.q);
  for (int i = threadIdx.x; i < kRowsPerBlock * D; i += blockDim.x) {
    const int r = i / D, d = i % D, rr = row0 + r;
    qs[r * kQs + d] = r < rows && d < head_dim
                          ? q[b * p.q_stride[0] + (rr / p.group) * p.q_stride[1] +
                              (h * p.group + rr % p.group) * p.q_stride[2] + d]
                          : zero;
  }

  const int64_t prefix = load_index(p.prefix_lens, b * p.prefix_lens_stride, p.prefix_lens_64);
  const int64_t n = prefix + p.tokens - p.mask_cols, key_end = prefix + p.tokens;
  const int64_t tiles = key_end > 0 ? (key_end + kKeyTile - 1) / kKeyTile : 0;
  const int64_t tile_begin = tiles * blockIdx.z / p.splits;
  const int64_t tile_end = tiles * (blockIdx.z + 1) / p.splits;
  const T* kbase = static_cast<const T*>(p.k) + h * p.k_stride[1];
  const T* vbase = static_cast<const T*>(p.v) + h * p.v_stride[1];
  const uint8_t* mask_b = p.mask + b * p.mask_stride[0];

  // This lane's two rows (g and g + 8 of the warp's 16), their tokens, and whether they exist.
  const int wr = warp * 16;
  const bool warp_active = wr < rows;  // warp-uniform
  int token[2];
  bool live[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = wr + g + 8 * i;
    live[i] = r < rows;
    token[i] = live[i] ? (row0 + r) / p.group : 0;
  }
  float o[D / 8][4];
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // l: this lane's columns only
  uint32_t qa[D / 16][4];                                      // the warp's Q as A fragments

  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    const int64_t k0 = tile * kKeyTile;
    __syncthreads();  // the previous tile is no longer read (and Q is stored)
    if (tile == tile_begin && warp_active) {
#pragma unroll
      for (int ks16 = 0; ks16 < D / 16; ++ks16) {
        const T* base = qs + (wr + g) * kQs + ks16 * 16 + 2 * t4;
        qa[ks16][0] = pair_at(base);
        qa[ks16][1] = pair_at(base + 8 * kQs);
        qa[ks16][2] = pair_at(base + 8);
        qa[ks16][3] = pair_at(base + 8 * kQs + 8);
      }
    }
    if (threadIdx.x < kKeyTile) {
      const int64_t pos = k0 + threadIdx.x, block = pos / p.seq_len, slot = pos % p.seq_len;
      int64_t row = -1;
      if (pos >= 0 && pos < key_end && block < p.blocks) {
        row = load_index(p.cache_rows,
                         b * p.cache_rows_stride[0] + block * p.cache_rows_stride[1],
                         p.cache_rows_64);
      }
      const bool ok = row >= 0 && row < p.rows_count;
      k_offset[threadIdx.x] = ok ? row * p.k_stride[0] + slot * p.k_stride[2] : -1;
      v_offset[threadIdx.x] = ok ? row * p.v_stride[0] + slot * p.v_stride[2] : -1;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < kKeyTile * (D / kVec); i += blockDim.x) {
      const int j = i / (D / kVec), d = (i % (D / kVec)) * kVec;
      uint4 kraw, vraw;
      T* kv = reinterpret_cast<T*>(&kraw);
      T* vv = reinterpret_cast<T*>(&vraw);
      if (p.vector_loads && k_offset[j] >= 0 && d < head_dim) {
        kraw = *reinterpret_cast<const uint4*>(kbase + k_offset[j] + d);
        vraw = *reinterpret_cast<const uint4*>(vbase + v_offset[j] + d);
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          const bool in = k_offset[j] >= 0 && d + e < head_dim;
          kv[e] = in ? kbase[k_offset[j] + d + e] : zero;
          vv[e] = in ? vbase[v_offset[j] + d + e] : zero;
        }
      }
      *reinterpret_cast<uint4*>(ks + j * kKs + d) = kraw;
#pragma unroll
      for (int e = 0; e < kVec; ++e) vts[(d + e) * kVs + j] = vv[e];
    }
    __syncthreads();
    if (!warp_active) continue;

    // S = Q K^T for the warp's 16 rows and the tile's 32 keys: four 16x8 tiles.
    float s[kKeyTile / 8][4];
#pragma unroll
    for (int nt = 0; nt < kKeyTile / 8; ++nt) {
      s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
      for (int ks16 = 0; ks16 < D / 16; ++ks16) {
        const T* kb = ks + (nt * 8 + g) * kKs + ks16 * 16 + 2 * t4;
        mma_16816<T>(s[nt], qa[ks16], pair_at(kb), pair_at(kb + 8));
      }
    }
    // Visibility and the online softmax; element e of a tile is row g + 8 (e / 2), key 2 t4 + e % 2.
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < kKeyTile / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = e / 2, j = nt * 8 + 2 * t4 + e % 2;
        const int64_t key = k0 + j;
        bool visible = live[i] && k_offset[j] >= 0;
        if (visible && key >= n) {
          visible = mask_b[token[i] * p.mask_stride[1] + (key - n) * p.mask_stride[2]] != 0;
        }
        s[nt][e] = visible ? s[nt][e] * p.scale_log2 : -INFINITY;
        tile_max[i] = fmaxf(tile_max[i], s[nt][e]);
      }
    }
    float alpha[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {  // a row's four lanes are a quad: reduce over t4
      tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 1));
      tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 2));
      const float m_new = fmaxf(m[i], tile_max[i]);
      alpha[i] = m[i] == -INFINITY ? 0.0f : exp2f(m[i] - m_new);  // nothing to rescale yet
      m[i] = m_new;
      l[i] *= alpha[i];
    }
#pragma unroll
    for (int nt = 0; nt < kKeyTile / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = e / 2;
        s[nt][e] = s[nt][e] == -INFINITY ? 0.0f : exp2f(s[nt][e] - m[i]);
        l[i] += s[nt][e];
      }
    }
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
      o[nt][0] *= alpha[0];
      o[nt][1] *= alpha[0];
      o[nt][2] *= alpha[1];
      o[nt][3] *= alpha[1];
    }
    // O += P V: P's accumulator layout is the A fragment layout of 16 keys per step.
#pragma unroll
    for (int kk = 0; kk < kKeyTile / 16; ++kk) {
      const uint32_t pa[4] = {pack_pair<T>(s[2 * kk][0], s[2 * kk][1]),
                              pack_pair<T>(s[2 * kk][2], s[2 * kk][3]),
                              pack_pair<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack_pair<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int nt = 0; nt < D / 8; ++nt) {
        const T* vb = vts + (nt * 8 + g) * kVs + kk * 16 + 2 * t4;
        mma_16816<T>(o[nt], pa, pair_at(vb), pair_at(vb + 8));
      }
    }
  }
  if (!warp_active) return;

  T* out = static_cast<T*>(p.out);
  const int64_t partial_rows = int64_t(gridDim.x / p.kv_heads) * p.tokens * p.q_heads;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    if (!live[i]) continue;
    const int rr = row0 + wr + g + 8 * i, head = h * p.group + rr % p.group;
    if (p.splits > 1) {
      const int64_t at =
          blockIdx.z * partial_rows + (int64_t(b) * p.tokens + token[i]) * p.q_heads + head;
      if (t4 == 0) {
        p.partial_ml[2 * at] = m[i];
        p.partial_ml[2 * at + 1] = l[i];
      }
#pragma unroll
      for (int nt = 0; nt < D / 8; ++nt) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int d = nt * 8 + 2 * t4 + c;
          if (d < head_dim) p.partial_acc[at * head_dim + d] = o[nt][2 * i + c];
        }
      }
      continue;
    }
    const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;  // a row that saw nothing gets zeros
    T* dst = out + b * p.out_stride[0] + token[i] * p.out_stride[1] + head * p.out_stride[2];
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int d = nt * 8 + 2 * t4 + c;
        if (d < head_dim) dst[d] = from_float<T>(o[nt][2 * i + c] * inv);
      }
    }
  }
}

}  // namespace specinfer::cuda
