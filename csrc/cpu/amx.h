// What the AMX kernels share (linear_amx.cpp, tree_attention_amx.h): their target and the tile
// configuration LDTILECFG reads. Include only under __x86_64__ with GCC or Clang.
#pragma once

#include <cstdint>

#include "cpu/avx512.h"

#define SPECINFER_AMX SPECINFER_AVX512 ",amx-tile,amx-bf16,amx-int8"

namespace specinfer::cpu {

// Palette 1: per tile register its rows and bytes per row. Users keep theirs in static memory:
// GCC 12 dropped the stores into a local config, as if LDTILECFG did not read it.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace specinfer::cpu
