// Host tensors for the microbenchmarks: owned buffers seen through the kernels' TensorView.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "core/numeric.h"
#include "core/tensor_view.h"

namespace specinfer::bench {

template <typename T>
struct HostTensor {
  std::vector<T> data;
  TensorView view;

  HostTensor(std::vector<int64_t> shape, DType dtype) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    data.resize(n);
    view.data = data.data();
    view.dtype = dtype;
    view.device = Device::kCPU;
    view.ndim = int(shape.size());
    int64_t stride = 1;
    for (int i = view.ndim - 1; i >= 0; --i) {
      view.shape[i] = shape[i];
      view.strides[i] = stride;
      stride *= shape[i];
    }
  }
};

template <typename T>
void fill_random(HostTensor<T>& t, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal;
  for (auto& x : t.data) x = from_float<T>(normal(gen));
}

template <typename T>
constexpr DType dtype_of() {
  return sizeof(T) == 4 ? DType::kFloat32 : DType::kBFloat16;
}

}  // namespace specinfer::bench
