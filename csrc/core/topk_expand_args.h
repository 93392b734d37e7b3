// Argument checks of topk_expand (see topk_expand_reference in python/specinfer/ops.py) shared by
// the CPU and CUDA paths; each backend then checks the logits dtypes it supports.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "core/tensor_view.h"

namespace specinfer {

// Shapes, dtypes of the outputs, devices, k and temperature; no tensor data is read.
inline void check_topk_expand_args(const TensorView& logits, int64_t k, float temperature,
                                   const TensorView& tokens, const TensorView& probs) {
  const std::string op = "topk_expand";
  check_ndim(logits, 2, op, "logits", "[rows, vocab]");
  check_last_dim_contiguous(logits, op, "logits");
  const int64_t N = logits.shape[0], V = logits.shape[1];
  if (k < 0 || k > V) {
    fail(op, "k = " + std::to_string(k) + " must be in [0, " + std::to_string(V) +
                 "] (the vocabulary size, logits.shape[1])");
  }
  if (!std::isfinite(temperature) || temperature < 0.0f) {
    fail(op, "temperature must be finite and >= 0, got " + std::to_string(temperature));
  }
  check_ndim(tokens, 2, op, "tokens", "[rows, k]");
  check_ndim(probs, 2, op, "probs", "[rows, k]");
  if (tokens.dtype != DType::kInt64) {
    fail(op, std::string("tokens must be int64, got ") + dtype_name(tokens.dtype));
  }
  if (probs.dtype != DType::kFloat32) {
    fail(op, std::string("probs must be float32, got ") + dtype_name(probs.dtype));
  }
  check_size(tokens, 0, N, op, "tokens", "rows of logits");
  check_size(tokens, 1, k, op, "tokens", "k");
  check_size(probs, 0, N, op, "probs", "rows of logits");
  check_size(probs, 1, k, op, "probs", "k");
  if (logits.device == Device::kOther) {
    fail(op, "logits is on a device that is neither cpu nor cuda");
  }
  check_same_device(tokens, logits, op, "tokens", "logits");
  check_same_device(probs, logits, op, "probs", "logits");
}

// 1 / temperature; temperature 0 (greedy) still ranks by the plain softmax.
inline float topk_inverse_temperature(float temperature) {
  return temperature > 0.0f ? 1.0f / temperature : 1.0f;
}

}  // namespace specinfer
