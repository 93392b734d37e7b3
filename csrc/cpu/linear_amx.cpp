// bf16 linear on AMX tiles (Intel Xeon from Sapphire Rapids on): one TDPBF16PS multiplies a
// 16 x 32 block of weight rows by 32 x 16 of x (16 rows) in ~16 cycles, where AVX512-BF16 needs 32
// instructions, so a tree of 16-64 nodes costs little more than one token.
//
// The product is computed transposed, y^T = w x^T: the weight is the A operand, whose tile rows
// are plain rows of w (no repacking), and x, small, is packed once per call into B tiles (pairs
// of columns interleaved, as TDPBF16PS reads them). Each output is one accumulator chain over k in
// order, whatever the other rows of the tile hold: a row's result does not depend on the rows that
// share the call, as speculation needs (every row count takes this path, one row included).
//
// The same tiles multiply 8-bit weights (linear_int8.cpp): TDPBUSD takes unsigned weight codes
// and signed x bytes, 64 of k per tile row instead of 32, into exact int32 sums.
#include <algorithm>
#include <array>
#include <cstring>

#include "cpu/cpu_features.h"
#include "cpu/linear.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#ifdef SPECINFER_HAVE_X86
#include "cpu/amx.h"
#define SPECINFER_HAVE_AMX 1
#endif

namespace specinfer::cpu {

#ifdef SPECINFER_HAVE_AMX
namespace {

constexpr int kTile = 16;                   // tile rows, and fp32 or bf16-pair columns
constexpr int kTileBytes = 64;              // per tile row: 32 bf16 of k, or 64 bytes
constexpr int kTileFloats = kTile * kTile;  // one accumulator tile, also one packed x tile
constexpr int kGatherMaxRows = 4;  // outputs of up to this many x rows are gathered, not transposed
constexpr int kBlockRows = 32;     // weight rows per block: two A tiles share each x tile

// Tiles 6-7 hold weight rows (64 bytes a row); 0-5 accumulate or hold x (run_block says which).
// An x tile (and so an accumulator) is `width` columns wide: 16, or M when M < 16, so few rows
// neither pack nor multiply padding (one row reads x as it is). One config per width (static,
// see TileConfig).
SPECINFER_TARGET(SPECINFER_AMX) void load_tile_config(int width) {
  static const std::array<TileConfig, kTile + 1> configs = [] {
    std::array<TileConfig, kTile + 1> all;
    for (int w = 1; w <= kTile; ++w) {
      for (int t = 0; t < 8; ++t) {
        all[w].colsb[t] = uint16_t(t >= 6 ? 64 : 4 * w);
        all[w].rows[t] = kTile;
      }
    }
    return all;
  }();
  _tile_loadconfig(&configs[width]);
}

SPECINFER_TARGET(SPECINFER_AMX) void release_tiles() { _tile_release(); }

// x packed as B tiles (pack_x).
struct XTiles {
  const uint32_t* data;
  int64_t m_tiles, k_tiles;
  int width;  // columns (x rows) per tile
  int64_t tile_dwords() const { return kTile * width; }
};

// x as B tiles, [m_tiles][k_tiles][16][width] 4-byte groups (bf16 pairs, or 4 int8): tile (mt, kb)
// row r, column c holds x[width mt + c][32 kb + 2r + {0, 1}] (int8: [64 kb + 4r + {0..3}]), zeros
// for rows past M: groups transposed, 16 x 16 at a time. (One row needs no packing: its tiles are
// x itself, rows 4 bytes apart.)
SPECINFER_TARGET(SPECINFER_AVX512)
void pack_x(const LinearProblem& p, int elem_bytes, uint32_t* packed, int64_t m_tiles,
            int64_t k_tiles, int width) {
  const char* x = static_cast<const char*>(p.x);
  const int64_t row_bytes = p.x_stride * elem_bytes;
  const __mmask16 columns = __mmask16((1u << width) - 1u);
  for (int64_t mt = 0; mt < m_tiles; ++mt) {
    const int64_t rows = std::min<int64_t>(width, p.M - mt * width);
    for (int64_t kb = 0; kb < k_tiles; ++kb) {
      __m512i r[kTile];
      SPECINFER_UNROLL for (int c = 0; c < kTile; ++c) {
        r[c] = c < rows ? _mm512_loadu_si512(x + (mt * width + c) * row_bytes + kb * kTileBytes)
                        : _mm512_setzero_si512();
      }
      transpose16x16(r);
      uint32_t* tile = packed + (mt * k_tiles + kb) * kTile * width;
      SPECINFER_UNROLL for (int i = 0; i < kTile; ++i) {
        _mm512_mask_storeu_epi32(tile + i * width, columns, r[i]);
      }
    }
  }
}

// A staged block's outputs into y: accumulator tiles [m_tiles][2][16 weight rows][16 x rows]
// transposed to x rows; bf16: the bias added, rounded to bf16 as from_float does; int8: the int32
// sums as they are.
template <bool kInt8>
SPECINFER_TARGET(SPECINFER_AVX512)
void write_block(const LinearProblem& p, const float* staged, int64_t n0, int64_t n_rows,
                 int64_t m_tiles) {
  for (int t = 0; t * kTile < n_rows; ++t) {
    const int64_t n = n0 + t * kTile, width = std::min<int64_t>(kTile, n_rows - t * kTile);
    const __mmask16 columns = __mmask16((1u << width) - 1u);
    alignas(64) float bias[kTile] = {};
    for (int64_t j = 0; p.bias != nullptr && j < width; ++j) {
      bias[j] = to_float(static_cast<const bf16*>(p.bias)[(n + j) * p.bias_stride]);
    }
    const __m512 bias_v = _mm512_load_ps(bias);
    for (int64_t mt = 0; mt < m_tiles; ++mt) {
      const float* acc = staged + (mt * 2 + t) * kTileFloats;
      const int64_t rows = std::min<int64_t>(kTile, p.M - mt * kTile);
      __m512i r[kTile];
      if (rows <= kGatherMaxRows) {  // a few columns, each gathered
        const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176,
                                                 192, 208, 224, 240);  // i x kTile
        for (int64_t m = 0; m < rows; ++m) r[m] = _mm512_i32gather_epi32(column, acc + m, 4);
      } else {
        SPECINFER_UNROLL for (int i = 0; i < kTile; ++i) {
          r[i] = _mm512_load_si512(acc + i * kTile);
        }
        transpose16x16(r);
      }
      for (int64_t m = 0; m < rows; ++m) {
        const int64_t at = (mt * kTile + m) * p.y_stride + n;
        if constexpr (kInt8) {
          _mm512_mask_storeu_epi32(static_cast<int32_t*>(p.y) + at, columns, r[m]);
        } else {
          const __m512 v = _mm512_add_ps(_mm512_castsi512_ps(r[m]), bias_v);
          _mm256_mask_storeu_epi16(static_cast<bf16*>(p.y) + at, columns, to_bf16x16(v));
        }
      }
    }
  }
}

// Tile acc += tile a (weight rows) x tile b (x): bf16 pairs, or unsigned x signed bytes. A macro:
// GCC's tile intrinsics paste their tile numbers into the assembly, so they must be literals.
#define SPECINFER_TILE_DOT(acc, a, b) \
  if constexpr (kInt8) {              \
    _tile_dpbusd(acc, a, b);          \
  } else {                            \
    _tile_dpbf16ps(acc, a, b);        \
  }

// The 32 weight rows at w (w_stride elements apart) against every x row; the accumulators go to
// `staged`, [x tile][weight tile][16][16]. Each output is one chain of tile products in k order,
// whichever tiles hold it, so a row's result does not depend on the rows beside it.
//
// 17-32 rows (two x tiles) take one pass over the block: both x tiles share each pair of weight
// tiles (four accumulators), and the rows two blocks on are prefetched into L2, as the AVX-512
// linear does (linear.cpp), since the hardware prefetcher keeps too few of a block's 32 row
// streams in flight for the loads to overlap the four products a k step. The 120 projections of
// SmolLM2-135M at 17 / 32 rows, 2 threads, alternated in one process: 11.25 / 12.10 ms with a
// pass per x tile and no prefetch, 10.90 / 11.56 so; a target forward of 32 rows 19.8-20.4 ->
// 18.4-20.3 ms (bench_spec.py --sections rows, three runs each). Elsewhere neither paid: the
// prefetch made 1-16 rows up to 10% slower, and 48-64 rows in pairs of x tiles made forwards 2-3 ms
// slower than a pass per x tile.
//
// Otherwise each x tile takes its own pass (the block read again from L1/L2 after the first).
// With one x tile, a k step loads two weight tiles (6-7) and the x tile (2). With more, two k steps
// an iteration with their own tiles (4-5 and 3 for the second): tiles are not renamed, so with
// one set a step's loads wait for the previous step's products, which left memory idle long
// enough that 17 rows cost 1.4x 16; with one x tile the second set made forwards slower (0.3-0.5
// ms at 1-16 rows).
constexpr int64_t kBlocksAhead = 2;

template <bool kInt8, typename W>
SPECINFER_TARGET(SPECINFER_AMX)
void run_block(const W* w, int64_t w_stride, const XTiles& x, float* staged, const W* ahead) {
  constexpr int64_t kK = kTileBytes / sizeof(W);  // k per tile row
  const int64_t w_bytes = w_stride * sizeof(W), x_bytes = 4 * x.width, step = x.tile_dwords();
  const W* w1 = w + kTile * w_stride;
  if (x.m_tiles == 2) {
    const uint32_t* b0 = x.data;
    const uint32_t* b1 = x.data + x.k_tiles * step;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < x.k_tiles; ++kb) {
      const char* next = reinterpret_cast<const char*>(ahead + kb * kK);
      SPECINFER_UNROLL for (int r = 0; r < kBlockRows; ++r) {
        _mm_prefetch(next + r * w_bytes, _MM_HINT_T1);  // never faults: no bounds check
      }
      _tile_loadd(6, w + kb * kK, w_bytes);
      _tile_loadd(7, w1 + kb * kK, w_bytes);
      _tile_loadd(4, b0 + kb * step, x_bytes);
      _tile_loadd(5, b1 + kb * step, x_bytes);
      SPECINFER_TILE_DOT(0, 6, 4)
      SPECINFER_TILE_DOT(1, 7, 4)
      SPECINFER_TILE_DOT(2, 6, 5)
      SPECINFER_TILE_DOT(3, 7, 5)
    }
    _tile_stored(0, staged, 64);
    _tile_stored(1, staged + kTileFloats, 64);
    _tile_stored(2, staged + 2 * kTileFloats, 64);
    _tile_stored(3, staged + 3 * kTileFloats, 64);
    return;
  }
  const int64_t paired = x.m_tiles == 1 ? 0 : x.k_tiles & ~int64_t(1);  // k steps taken two by two
  for (int64_t mt = 0; mt < x.m_tiles; ++mt) {
    const uint32_t* b = x.data + mt * x.k_tiles * step;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t kb = 0; kb < paired; kb += 2) {
      _tile_loadd(6, w + kb * kK, w_bytes);
      _tile_loadd(7, w1 + kb * kK, w_bytes);
      _tile_loadd(2, b + kb * step, x_bytes);
      _tile_loadd(4, w + (kb + 1) * kK, w_bytes);
      _tile_loadd(5, w1 + (kb + 1) * kK, w_bytes);
      _tile_loadd(3, b + (kb + 1) * step, x_bytes);
      SPECINFER_TILE_DOT(0, 6, 2)
      SPECINFER_TILE_DOT(1, 7, 2)
      SPECINFER_TILE_DOT(0, 4, 3)
      SPECINFER_TILE_DOT(1, 5, 3)
    }
    for (int64_t kb = paired; kb < x.k_tiles; ++kb) {
      _tile_loadd(6, w + kb * kK, w_bytes);
      _tile_loadd(7, w1 + kb * kK, w_bytes);
      _tile_loadd(2, b + kb * step, x_bytes);
      SPECINFER_TILE_DOT(0, 6, 2)
      SPECINFER_TILE_DOT(1, 7, 2)
    }
    float* out = staged + mt * 2 * kTileFloats;
    _tile_stored(0, out, 64);
    _tile_stored(1, out + kTileFloats, 64);
  }
}

// A thread's blocks [begin, end), kGroupBlocks at a time: a group's blocks compute, then their
// outputs are written. Writing each block while the next computes (read back at once, the tile
// stores stall the loads) left memory idle once per block: the 120 projections of SmolLM2-135M
// took 0.9 ms longer at 5 x rows than at one, now 0.3 (2 threads, weights from DRAM).
constexpr int64_t kGroupBlocks = 16;  // 32 KB staged per x tile: stays in L1

template <bool kInt8, typename W>
void run_blocks(const LinearProblem& p, const XTiles& x, int64_t begin, int64_t end) {
  const int64_t stage_floats = x.m_tiles * 2 * kTileFloats;  // a block's accumulators
  float* stages = thread_scratch<float, 2>(kGroupBlocks * stage_floats);
  const W* w = static_cast<const W*>(p.w);
  for (int64_t group = begin; group < end; group += kGroupBlocks) {
    const int64_t group_end = std::min(end, group + kGroupBlocks);
    for (int64_t b = group; b < group_end; ++b) {
      const int64_t n0 = b * kBlockRows, n_rows = std::min<int64_t>(kBlockRows, p.N - n0);
      float* staged = stages + (b - group) * stage_floats;
      if (n_rows == kBlockRows) {
        const W* ahead = w + (n0 + kBlocksAhead * kBlockRows) * p.w_stride;  // only prefetched
        run_block<kInt8>(w + n0 * p.w_stride, p.w_stride, x, staged, ahead);
      } else {  // the last, partial block: its rows copied, zero-padded, so no tile reads past w
        W* rows = thread_scratch<W, 3>(kBlockRows * p.K);
        std::memset(rows, 0, size_t(kBlockRows * p.K) * sizeof(W));
        for (int64_t n = 0; n < n_rows; ++n) {
          std::memcpy(rows + n * p.K, w + (n0 + n) * p.w_stride, size_t(p.K) * sizeof(W));
        }
        run_block<kInt8>(rows, p.K, x, staged, rows);  // nothing follows: prefetches itself
      }
    }
    for (int64_t b = group; b < group_end; ++b) {
      write_block<kInt8>(p, stages + (b - group) * stage_floats, b * kBlockRows,
                         std::min<int64_t>(kBlockRows, p.N - b * kBlockRows), x.m_tiles);
    }
  }
}

// W: the weight's element (bf16 bits, or 8-bit codes); x has the same element size.
template <bool kInt8, typename W>
bool run_amx(const LinearProblem& p, bool parallel) {
  constexpr int64_t kK = kTileBytes / sizeof(W);
  if (!has_amx_bf16() || p.K % kK != 0) return false;
  XTiles x;
  x.width = int(std::min<int64_t>(kTile, p.M));
  x.m_tiles = (p.M + kTile - 1) / kTile;
  x.k_tiles = p.K / kK;
  if (p.M == 1) {
    x.data = static_cast<const uint32_t*>(p.x);
  } else {
    uint32_t* packed = thread_scratch<uint32_t, 4>(x.m_tiles * x.k_tiles * x.tile_dwords());
    pack_x(p, sizeof(W), packed, x.m_tiles, x.k_tiles, x.width);
    x.data = packed;
  }
  const int64_t blocks = (p.N + kBlockRows - 1) / kBlockRows;
#pragma omp parallel if (parallel)
  {
    load_tile_config(x.width);
    // The static schedule's split, by hand: each thread needs its range to overlap its blocks.
    int threads = 1, thread = 0;
#ifdef _OPENMP
    threads = omp_get_num_threads();
    thread = omp_get_thread_num();
#endif
    run_blocks<kInt8, W>(p, x, blocks * thread / threads, blocks * (thread + 1) / threads);
    release_tiles();
  }
  return true;
}

}  // namespace

bool run_linear_amx(const LinearProblem& p, bool parallel) {
  return run_amx<false, uint16_t>(p, parallel);
}

bool run_linear_amx_int8(const LinearProblem& p, bool parallel) {
  return run_amx<true, uint8_t>(p, parallel);
}

#else
bool run_linear_amx(const LinearProblem&, bool) { return false; }
bool run_linear_amx_int8(const LinearProblem&, bool) { return false; }
#endif

}  // namespace specinfer::cpu
