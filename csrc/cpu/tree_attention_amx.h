// AMX scores of CPU tree attention (bf16 caches, head dims 64 and 128, though any multiple of 32
// would do; see attend_block in tree_attention.h), where the AVX-512 loop converted every key to
// float32 and spent 4 FMAs and a share of a 16-way horizontal sum per query row and key: at 6
// query tokens the scores were a third of the kernel's time, growing with the rows. Here 16 keys
// x 16 rows take D / 32 TDPBF16PS, computed transposed, s^T = k q^T: the keys are the A operand,
// 16 cache slots read as they are (no conversion), and the item's query rows, transposed once
// into B tiles, stay put while the keys stream past. The values stay on AVX-512: a tile would sum
// two keys' terms inside one instruction, pairs set by slot parity, which differs between a tree
// (a node's ancestors at gapped slots) and incremental decoding, so the bits would too.
//
// Each score is one chain of D / 32 tile products over the same dims in the same order, whatever
// the other rows and keys of its tiles hold, so a row's scores do not depend on the rows beside it
// or on where its keys sit in a tile (a tree and incremental decoding give the same bits). The
// scale multiplies the sum (the float32 kernels scale q first: each kernel family is consistent
// with itself, as the linear's are).
//
// Include only under __x86_64__ with GCC or Clang.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "core/numeric.h"
#include "cpu/amx.h"
#include "cpu/tree_attention_avx512.h"

namespace specinfer::cpu {

struct AmxTiles : Avx512Tiles {
  static constexpr bool kRawKeys = true;  // scores read bf16 keys from the cache
  static constexpr int kTile = 16;        // keys, and query rows, per tile

  // Tile 0 accumulates, 1 holds keys, 2 query rows: 16 rows of 64 bytes each.
  SPECINFER_TARGET(SPECINFER_AMX) static void begin() {
    static constexpr TileConfig config = [] {
      TileConfig c;
      for (int t = 0; t < 3; ++t) c.colsb[t] = 64, c.rows[t] = kTile;
      return c;
    }();
    _tile_loadconfig(&config);
  }

  SPECINFER_TARGET(SPECINFER_AMX) static void end() { _tile_release(); }

  // The item's R query rows (query(r): row r's bf16 values) as B tiles, [R / 16][kD / 32][16][16]
  // 32-bit pairs: tile (t, i) row p, column n holds row 16 t + n's dims 32 i + 2p, 32 i + 2p + 1
  // (zeros past R).
  template <int kD, typename Query>
  SPECINFER_TARGET(SPECINFER_AVX512)
  static void prepare_queries(const Query& query, int64_t R, uint32_t* tiles) {
    for (int64_t t = 0; t * kTile < R; ++t) {
      SPECINFER_UNROLL for (int i = 0; i < kD / 32; ++i) {
        __m512i rows[16];
        SPECINFER_UNROLL for (int n = 0; n < 16; ++n) {
          rows[n] = t * kTile + n < R ? _mm512_loadu_si512(query(t * kTile + n) + 32 * i)
                                      : _mm512_setzero_si512();
        }
        transpose16x16(rows);
        uint32_t* tile = tiles + (t * (kD / 32) + i) * 256;
        SPECINFER_UNROLL for (int p = 0; p < 16; ++p) _mm512_storeu_si512(tile + 16 * p, rows[p]);
      }
    }
  }

  // s[r * cap + k0 + j] = scale * q[r] . key(k0 + j) for j < kn (<= 16), and up to 16 (from
  // zeros, never read). `slot_bytes`: the distance between two slots of one cache block; keys
  // that are not 16 slots of one block (a short last tile, a block boundary) are copied into
  // `keys` first. `acc` holds one accumulator tile.
  template <int kD, typename Key>
  SPECINFER_TARGET(SPECINFER_AMX)
  static void scores(const uint32_t* queries, int64_t R, const Key& key, int64_t k0, int64_t kn,
                     int64_t slot_bytes, float scale, float* s, int64_t cap, uint16_t* keys,
                     float* acc) {
    constexpr int kSteps = kD / 32;
    const char* a = reinterpret_cast<const char*>(key(k0));
    int64_t a_stride = slot_bytes;
    if (kn < kTile || reinterpret_cast<const char*>(key(k0 + kTile - 1)) != a + 15 * slot_bytes) {
      for (int64_t j = 0; j < kTile; ++j) {
        if (j < kn) {
          std::memcpy(keys + j * kD, key(k0 + j), kD * 2);
        } else {
          std::memset(keys + j * kD, 0, kD * 2);
        }
      }
      a = reinterpret_cast<const char*>(keys);
      a_stride = kD * 2;
    }
    const __m512 scale_v = _mm512_set1_ps(scale);
    for (int64_t r0 = 0; r0 < R; r0 += kTile) {
      const uint32_t* b = queries + (r0 / kTile) * kSteps * 256;
      _tile_zero(0);
      SPECINFER_UNROLL for (int i = 0; i < kSteps; ++i) {
        _tile_loadd(1, a + 64 * i, a_stride);
        _tile_loadd(2, b + 256 * i, 64);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, acc, 64);  // acc[j * 16 + n]: key j, query row r0 + n
      __m512i t[16];
      SPECINFER_UNROLL for (int j = 0; j < 16; ++j) t[j] = _mm512_loadu_si512(acc + 16 * j);
      transpose16x16(t);  // t[n]: query row r0 + n's 16 keys
      const int64_t rows = std::min<int64_t>(kTile, R - r0);
      for (int64_t n = 0; n < rows; ++n) {
        _mm512_storeu_ps(s + (r0 + n) * cap + k0,
                         _mm512_mul_ps(_mm512_castsi512_ps(t[n]), scale_v));
      }
    }
  }
};

}  // namespace specinfer::cpu
