// A small typed view of a tensor that crossed the boundary via DLPack, and the argument checks
// every op runs before touching memory. Checks throw std::invalid_argument (ValueError in Python)
// with a message naming the op, the argument and the problem.
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/dlpack.h"

namespace specinfer {

enum class DType { kFloat32, kFloat16, kBFloat16, kInt32, kInt64, kUInt8, kBool, kOther };
enum class Device { kCPU, kCUDA, kOther };

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
    case DType::kUInt8:
      return "uint8";
    case DType::kBool:
      return "bool";
    default:
      return "an unsupported dtype";
  }
}

inline const char* device_name(Device d) {
  switch (d) {
    case Device::kCPU:
      return "cpu";
    case Device::kCUDA:
      return "cuda";
    default:
      return "an unsupported device";
  }
}

struct TensorView {
  static constexpr int kMaxDims = 8;

  void* data = nullptr;
  DType dtype = DType::kOther;
  Device device = Device::kOther;
  int device_id = 0;
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};  // in elements

  template <typename T>
  T* ptr() const {
    return static_cast<T*>(data);
  }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
  std::string shape_str() const {
    std::ostringstream s;
    s << "[";
    for (int i = 0; i < ndim; ++i) s << (i ? ", " : "") << shape[i];
    s << "]";
    return s.str();
  }
};

[[noreturn]] inline void fail(const std::string& op, const std::string& what) {
  throw std::invalid_argument(op + ": " + what);
}

inline DType dtype_from_dlpack(dlpack::DataType t) {
  if (t.lanes != 1) return DType::kOther;
  switch (t.code) {
    case dlpack::kFloat:
      return t.bits == 32 ? DType::kFloat32 : t.bits == 16 ? DType::kFloat16 : DType::kOther;
    case dlpack::kBfloat:
      return t.bits == 16 ? DType::kBFloat16 : DType::kOther;
    case dlpack::kInt:
      return t.bits == 32 ? DType::kInt32 : t.bits == 64 ? DType::kInt64 : DType::kOther;
    case dlpack::kUInt:
      return t.bits == 8 ? DType::kUInt8 : DType::kOther;
    case dlpack::kBool:
      return t.bits == 8 ? DType::kBool : DType::kOther;
    default:
      return DType::kOther;
  }
}

inline TensorView view_from_dlpack(const dlpack::Tensor& t, const std::string& op,
                                   const char* name) {
  if (t.ndim < 0 || t.ndim > TensorView::kMaxDims) {
    fail(op, std::string(name) + " has " + std::to_string(t.ndim) + " dims, at most " +
                 std::to_string(TensorView::kMaxDims) + " are supported");
  }
  TensorView v;
  v.data = static_cast<char*>(t.data) + t.byte_offset;
  v.dtype = dtype_from_dlpack(t.dtype);
  switch (t.device.device_type) {
    case dlpack::kCPU:
    case dlpack::kCUDAHost:
      v.device = Device::kCPU;
      break;
    case dlpack::kCUDA:
    case dlpack::kCUDAManaged:
      v.device = Device::kCUDA;
      break;
    default:
      v.device = Device::kOther;
  }
  v.device_id = t.device.device_id;
  v.ndim = t.ndim;
  int64_t compact = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    v.shape[i] = t.shape[i];
    v.strides[i] = t.strides ? t.strides[i] : compact;
    compact *= t.shape[i];
  }
  return v;
}

// --- checks ---

inline void check_ndim(const TensorView& v, int ndim, const std::string& op, const char* name,
                       const char* layout) {
  if (v.ndim != ndim) {
    fail(op, std::string(name) + " must have " + std::to_string(ndim) + " dims " + layout +
                 ", got " + std::to_string(v.ndim));
  }
}

inline void check_size(const TensorView& v, int dim, int64_t expected, const std::string& op,
                       const char* name, const char* why) {
  if (v.shape[dim] != expected) {
    fail(op, std::string(name) + ".shape[" + std::to_string(dim) + "] must be " +
                 std::to_string(expected) + " (" + why + "), got " + std::to_string(v.shape[dim]));
  }
}

inline void check_dtype_is(const TensorView& v, DType a, DType b, const std::string& op,
                           const char* name) {
  if (v.dtype != a && v.dtype != b) {
    fail(op, std::string(name) + " must be " + dtype_name(a) + " or " + dtype_name(b) + ", got " +
                 dtype_name(v.dtype));
  }
}

inline void check_same_dtype(const TensorView& v, const TensorView& ref, const std::string& op,
                             const char* name, const char* ref_name) {
  if (v.dtype != ref.dtype) {
    fail(op, std::string(name) + " must have the dtype of " + ref_name + " (" +
                 dtype_name(ref.dtype) + "), got " + dtype_name(v.dtype));
  }
}

inline void check_same_device(const TensorView& v, const TensorView& ref, const std::string& op,
                              const char* name, const char* ref_name) {
  if (v.device != ref.device || v.device_id != ref.device_id) {
    fail(op, std::string(name) + " is on " + device_name(v.device) + ":" +
                 std::to_string(v.device_id) + " but " + ref_name + " is on " +
                 device_name(ref.device) + ":" + std::to_string(ref.device_id) +
                 "; all tensors must be on one device");
  }
}

// Kernels vectorise over the last dim, so it must be unit-stride; other strides are free.
inline void check_last_dim_contiguous(const TensorView& v, const std::string& op,
                                      const char* name) {
  if (v.ndim > 0 && v.shape[v.ndim - 1] > 1 && v.strides[v.ndim - 1] != 1) {
    fail(op, std::string(name) + " must be contiguous in its last dim (stride 1), got stride " +
                 std::to_string(v.strides[v.ndim - 1]));
  }
}

// Reads element i of a 1-D int32/int64 host tensor as int64.
inline int64_t index_at(const TensorView& v, int64_t i) {
  return v.dtype == DType::kInt32 ? v.ptr<const int32_t>()[i * v.strides[0]]
                                  : v.ptr<const int64_t>()[i * v.strides[0]];
}

// A KV op's cache_rows: a row per request [B], or a block table [B, MB] (see kv_locations).
inline void check_cache_rows(const TensorView& v, const std::string& op) {
  if (v.ndim != 1 && v.ndim != 2) {
    fail(op, "cache_rows must be [batch] (rows) or [batch, blocks] (a block table), got " +
                 v.shape_str());
  }
}

// Every element of a 1-D or 2-D int32/int64 host tensor, row-major, as int64.
inline std::vector<int64_t> host_indices(const TensorView& v) {
  const int64_t rows = v.ndim > 0 ? v.shape[0] : 1, cols = v.ndim == 2 ? v.shape[1] : 1;
  const int64_t s0 = v.ndim > 0 ? v.strides[0] : 0, s1 = v.ndim == 2 ? v.strides[1] : 0;
  std::vector<int64_t> out(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t off = r * s0 + c * s1;
      out[r * cols + c] =
          v.dtype == DType::kInt32 ? v.ptr<const int32_t>()[off] : v.ptr<const int64_t>()[off];
    }
  }
  return out;
}

}  // namespace specinfer
