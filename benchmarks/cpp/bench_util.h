// Tensors and serving shapes for the microbenchmarks: owned host buffers seen through the kernels'
// TensorView, the model head configs, and the trees and commits the ops are timed on.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "core/numeric.h"
#include "core/tensor_view.h"
#include "ops.h"

namespace specinfer::bench {

// A contiguous view of `shape` over `data`.
inline TensorView contiguous_view(void* data, const std::vector<int64_t>& shape, DType dtype,
                                  Device device) {
  TensorView view;
  view.data = data;
  view.dtype = dtype;
  view.device = device;
  view.ndim = int(shape.size());
  int64_t stride = 1;
  for (int i = view.ndim - 1; i >= 0; --i) {
    view.shape[i] = shape[i];
    view.strides[i] = stride;
    stride *= shape[i];
  }
  return view;
}

inline int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

template <typename T>
struct HostTensor {
  std::vector<T> data;
  TensorView view;

  HostTensor(std::vector<int64_t> shape, DType dtype) : data(numel(shape)) {
    view = contiguous_view(data.data(), shape, dtype, Device::kCPU);
  }
};

template <typename T>
void fill_random(T* data, int64_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal;
  for (int64_t i = 0; i < n; ++i) data[i] = from_float<T>(normal(gen));
}

template <typename T>
void fill_random(HostTensor<T>& t, uint32_t seed) {
  fill_random(t.data.data(), int64_t(t.data.size()), seed);
}

template <typename T>
constexpr DType dtype_of() {
  return sizeof(T) == 4 ? DType::kFloat32 : DType::kBFloat16;
}

// Attention heads of the two models the benchmarks are sized for.
struct HeadConfig {
  int q_heads, kv_heads, head_dim, layers;
};
constexpr HeadConfig kLlama7B{32, 32, 128, 32};
constexpr HeadConfig kSmolLM2{9, 3, 64, 30};
constexpr HeadConfig kHeadConfigs[] = {kSmolLM2, kLlama7B};

// Per request, the ancestor-or-self mask [tokens, tokens] of a binary tree (node i's parent is
// (i - 1) / 2).
inline void fill_tree_mask(uint8_t* mask, int64_t batch, int64_t tokens) {
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < tokens; ++i) {
      for (int64_t j = i;; j = (j - 1) / 2) {
        mask[(b * tokens + i) * tokens + j] = 1;
        if (j == 0) break;
      }
    }
  }
}

// The slot moves of committing, for each request, the deepest root-to-leaf path of that binary
// tree (nodes 0, 2, 6, 14, ...) stored after `prefix` slots in cache row b.
inline std::vector<KvMove> commit_moves(int64_t batch, int64_t prefix, int64_t tokens) {
  std::vector<KvMove> moves;
  for (int64_t b = 0; b < batch; ++b) {
    int64_t depth = 1;
    for (int64_t node = 2; node < tokens; node = 2 * node + 2, ++depth) {
      moves.push_back({b, prefix + node, b, prefix + depth});
    }
  }
  return moves;
}

}  // namespace specinfer::bench
