// Tree attention on tensor cores, for float16 and bfloat16 with head_dim <= 128: the same blocks,
// splits and partial sums as tree_attention_kernel (tree_attention.cuh), with the two products
// on mma.sync m16n8k16 (fp32 accumulation). Four warps; warp w owns query rows 16w .. 16w + 15 of
// the block. Per 32-key tile: S = Q K^T (four 16x8 tiles), the online softmax in registers (base
// 2, scale applied in fp32), then O += P V with P rounded to the input type, as FlashAttention-2
// does. The fragment layouts are the PTX ISA's for m16n8k16: lane = 4 g + t holds rows g and
// g + 8, columns 2t and 2t + 1 of each 8-column tile; V's B fragments come from its row-major
// tile by ldmatrix.trans. K/V tiles are double-buffered: cp.async fetches tile i + 1 while tile i
// is computed (16-byte copies; zero-filled for absent keys).
#pragma once

#include "cuda/tree_attention.cuh"

namespace specinfer::cuda {

constexpr int kMmaWarps = kRowsPerBlock / 16;
constexpr int kPad = 8;  // elements added to each shared row: conflict-free fragment loads

template <int D>
constexpr size_t tree_attention_mma_smem_bytes() {
  // Q [rows, D + pad] and two buffers of K and V [keys, D + pad], all 16-bit.
  return 2 * (kRowsPerBlock + 4 * kKeyTile) * (D + kPad);
}

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes from global to shared memory without registers; bytes = 0 writes zeros.
__device__ __forceinline__ void copy_async_16(void* dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)),
               "l"(src), "r"(bytes));
}

__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int Pending>
__device__ __forceinline__ void copy_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending));
}

// The B fragments of two adjacent 8-column tiles of P V from a row-major [keys, dims] tile:
// four 8x8 matrices, transposed on the way (keys kk*16 + 0..7 / 8..15, dims n0 / n0 + 8).
__device__ __forceinline__ void load_v_fragments(const void* row_address, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row_address)));
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
  constexpr int kStride = D + kPad;  // of every shared row
  constexpr int kVec = 8;            // 16-bit elements in 16 bytes
  const int head_dim = p.head_dim;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* qs = reinterpret_cast<T*>(smem_raw);  // [kRowsPerBlock, kStride]
  T* kv_tiles =
      qs + kRowsPerBlock * kStride;     // buffer u: K at 2u, V at 2u + 1, [kKeyTile, kStride]
  __shared__ bool key_ok[2][kKeyTile];  // per buffer: the key exists (its row is in range)

  const int b = blockIdx.x / p.kv_heads, h = blockIdx.x % p.kv_heads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
  const int row0 = blockIdx.y * kRowsPerBlock;
  const int rows = min(kRowsPerBlock, p.tokens * p.group - row0);
  const T zero = from_float<T>(0.0f);

  const T* q = static_cast<const T*>(p.q);
  for (int i = threadIdx.x; i < kRowsPerBlock * D; i += blockDim.x) {
    const int r = i / D, d = i % D, rr = row0 + r;
    qs[r * kStride + d] = r < rows && d < head_dim
                              ? q[b * p.q_stride[0] + (rr / p.group) * p.q_stride[1] +
                                  (h * p.group + rr % p.group) * p.q_stride[2] + d]
                              : zero;
  }

  const BlockKeys keys = block_keys(p, b);
  const int64_t n = keys.n, tile_begin = keys.begin, tile_end = keys.stop;
  const T* kbase = static_cast<const T*>(p.k) + h * p.k_stride[1];
  const T* vbase = static_cast<const T*>(p.v) + h * p.v_stride[1];
  const uint8_t* mask_b = p.mask + b * p.mask_stride[0];

  // Starts fetching a tile's K and V into buffer u (synchronous element loads where the rows are
  // not 16-byte aligned); absent keys read as zeros.
  auto fetch = [&](int64_t tile, int u) {
    T* kt = kv_tiles + 2 * u * kKeyTile * kStride;
    T* vt = kt + kKeyTile * kStride;
    for (int i = threadIdx.x; i < kKeyTile * (D / kVec); i += blockDim.x) {
      const int j = i / (D / kVec), d = (i % (D / kVec)) * kVec;
      const int64_t pos = tile * kKeyTile + j, slot = pos % p.seq_len;
      const int64_t row = key_row(p, b, pos, keys.end);
      const bool ok = row >= 0;
      if (d == 0) key_ok[u][j] = ok;
      const T* ksrc = ok ? kbase + row * p.k_stride[0] + slot * p.k_stride[2] + d : kbase;
      const T* vsrc = ok ? vbase + row * p.v_stride[0] + slot * p.v_stride[2] + d : vbase;
      if (p.vector_loads) {
        const int bytes = ok && d < head_dim ? 16 : 0;
        copy_async_16(kt + j * kStride + d, ksrc, bytes);
        copy_async_16(vt + j * kStride + d, vsrc, bytes);
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          const bool in = ok && d + e < head_dim;
          kt[j * kStride + d + e] = in ? ksrc[e] : zero;
          vt[j * kStride + d + e] = in ? vsrc[e] : zero;
        }
      }
    }
    copy_async_commit();
  };

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
  uint32_t qa[D / 16][4];                                    // the warp's Q as A fragments

  if (tile_begin < tile_end) fetch(tile_begin, 0);
  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    const int64_t k0 = tile * kKeyTile;
    const int u = int(tile - tile_begin) & 1;
    if (tile + 1 < tile_end) {
      fetch(tile + 1, u ^ 1);  // its buffer was last read before the previous iteration's end
    } else {
      copy_async_commit();  // an empty group: the wait below always leaves one pending
    }
    copy_async_wait<1>();  // this thread's copies of `tile` have landed
    __syncthreads();       // and everyone's (Q too, on the first tile)
    const T* ks = kv_tiles + 2 * u * kKeyTile * kStride;
    const T* vs = ks + kKeyTile * kStride;
    if (tile == tile_begin && warp_active) {
#pragma unroll
      for (int ks16 = 0; ks16 < D / 16; ++ks16) {
        const T* base = qs + (wr + g) * kStride + ks16 * 16 + 2 * t4;
        qa[ks16][0] = pair_at(base);
        qa[ks16][1] = pair_at(base + 8 * kStride);
        qa[ks16][2] = pair_at(base + 8);
        qa[ks16][3] = pair_at(base + 8 * kStride + 8);
      }
    }
    if (warp_active) {
      // S = Q K^T for the warp's 16 rows and the tile's 32 keys: four 16x8 tiles.
      float s[kKeyTile / 8][4];
#pragma unroll
      for (int nt = 0; nt < kKeyTile / 8; ++nt) {
        s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
        for (int ks16 = 0; ks16 < D / 16; ++ks16) {
          const T* kb = ks + (nt * 8 + g) * kStride + ks16 * 16 + 2 * t4;
          mma_16816<T>(s[nt], qa[ks16], pair_at(kb), pair_at(kb + 8));
        }
      }
      // Visibility and online softmax. Tile element e: row g + 8 (e / 2), key 2 t4 + e % 2.
      float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int nt = 0; nt < kKeyTile / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = e / 2, j = nt * 8 + 2 * t4 + e % 2;
          const int64_t key = k0 + j;
          const bool visible =
              live[i] && key_ok[u][j] && (key < n || mask_allows(p, mask_b, token[i], key - n));
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
        for (int nt = 0; nt < D / 8; nt += 2) {
          uint32_t vb[4];
          load_v_fragments(
              vs + (kk * 16 + (lane & 7) + (lane & 8)) * kStride + nt * 8 + (lane >> 4) * 8, vb);
          mma_16816<T>(o[nt], pa, vb[0], vb[1]);
          mma_16816<T>(o[nt + 1], pa, vb[2], vb[3]);
        }
      }
    }
    __syncthreads();  // buffer u is read: the next iteration may fetch into it
  }
  if (!warp_active) return;

  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    if (!live[i]) continue;
    const int rr = row0 + wr + g + 8 * i, head = h * p.group + rr % p.group;
    if (p.splits > 1) {
      const int64_t at = partial_row(p, blockIdx.z, b, token[i], head);
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
