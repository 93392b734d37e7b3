// Arguments of kv_commit (see kv_commit_reference in python/specinfer/ops.py) and the checks
// shared by the CPU and CUDA paths. The index tensors are read on the host, so they must be on cpu;
// what the kernels get is the list of slot moves they imply.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor_view.h"

namespace specinfer {

// Copy cache[src_row, :, src] to cache[dst_row, :, dst] in every cache. Moves run in list order:
// a move's source may be a later move's destination, never an earlier one's (accepted[b, a] >= a
// and both increase), so copying in order reads every source before it is overwritten.
struct KvMove {
  int64_t src_row, src, dst_row, dst;
};

struct KvCommitArgs {
  std::vector<TensorView> caches;  // each [N, Hkv, S, D], one shape, dtype and device
  TensorView cache_rows;           // [B] int32/int64, or a block table [B, MB]
  TensorView prefix_lens;          // [B] int32/int64
  TensorView accepted;             // [B, A] int32/int64, -1 padded
};

inline std::string list_item(const char* name, size_t i) {
  return std::string(name) + "[" + std::to_string(i) + "]";
}

// Shapes, dtypes, devices and strides; no tensor data is read.
inline void check_kv_commit_args(const KvCommitArgs& a) {
  const std::string op = "kv_commit";
  if (a.caches.empty()) fail(op, "caches is empty (pass the K and V caches of every layer)");
  const TensorView& first = a.caches[0];
  check_ndim(first, 4, op, "caches[0]", "[rows, kv_heads, seq, head_dim]");
  if (first.dtype != DType::kFloat32 && first.dtype != DType::kBFloat16 &&
      first.dtype != DType::kFloat16) {
    fail(op, std::string("caches must be float32, bfloat16 or float16, got ") +
                 dtype_name(first.dtype));
  }
  if (first.device == Device::kOther)
    fail(op, "caches[0] is on a device that is neither cpu nor cuda");
  for (size_t i = 0; i < a.caches.size(); ++i) {
    const TensorView& c = a.caches[i];
    const std::string name = list_item("caches", i);
    check_ndim(c, 4, op, name.c_str(), "[rows, kv_heads, seq, head_dim]");
    for (int d = 0; d < 4; ++d) {
      if (c.shape[d] != first.shape[d]) {
        fail(op, name + " must have the shape of caches[0] " + first.shape_str() + ", got " +
                     c.shape_str());
      }
    }
    check_same_dtype(c, first, op, name.c_str(), "caches[0]");
    check_same_device(c, first, op, name.c_str(), "caches[0]");
    check_last_dim_contiguous(c, op, name.c_str());
  }
  check_cache_rows(a.cache_rows, op);
  check_ndim(a.prefix_lens, 1, op, "prefix_lens", "[batch]");
  check_ndim(a.accepted, 2, op, "accepted", "[batch, max_accepted]");
  const int64_t B = a.cache_rows.shape[0];
  check_size(a.prefix_lens, 0, B, op, "prefix_lens", "batch of cache_rows");
  check_size(a.accepted, 0, B, op, "accepted", "batch of cache_rows");
  const TensorView* indices[] = {&a.cache_rows, &a.prefix_lens, &a.accepted};
  const char* names[] = {"cache_rows", "prefix_lens", "accepted"};
  for (int i = 0; i < 3; ++i) {
    check_dtype_is(*indices[i], DType::kInt32, DType::kInt64, op, names[i]);
    if (indices[i]->device != Device::kCPU) {
      fail(op, std::string(names[i]) +
                   " must be on cpu (its values are checked on the host), got " +
                   device_name(indices[i]->device));
    }
  }
}

// The moves the (checked) index values imply, in commit order; throws on values that do not
// describe accepted paths inside the cache.
inline std::vector<KvMove> plan_kv_commit(const KvCommitArgs& a) {
  const std::string op = "kv_commit";
  const int64_t B = a.cache_rows.shape[0], A = a.accepted.shape[1];
  const int64_t N = a.caches[0].shape[0], S = a.caches[0].shape[2];
  const TensorView& acc = a.accepted;
  auto accepted_at = [&](int64_t b, int64_t i) -> int64_t {
    const int64_t off = b * acc.strides[0] + i * acc.strides[1];
    return acc.dtype == DType::kInt32 ? acc.ptr<const int32_t>()[off]
                                      : acc.ptr<const int64_t>()[off];
  };
  const int64_t MB = a.cache_rows.ndim == 2 ? a.cache_rows.shape[1] : 1;
  const std::vector<int64_t> table = host_indices(a.cache_rows);
  std::vector<int64_t> rows;  // every row a request's commit reads or writes
  std::vector<KvMove> moves;
  for (int64_t b = 0; b < B; ++b) {
    const std::string at = "[" + std::to_string(b) + "]";
    const int64_t prefix = index_at(a.prefix_lens, b);
    if (prefix < 0) fail(op, "prefix_lens" + at + " = " + std::to_string(prefix) + " is negative");
    // Position p of request b: row table[b * MB + p / S], slot p % S.
    const auto row_of = [&](int64_t p) {
      const int64_t row = table[b * MB + p / S];
      if (row < 0 || row >= N) {
        fail(op, "cache_rows" + at + (MB > 1 ? "[" + std::to_string(p / S) + "]" : "") + " = " +
                     std::to_string(row) + " is out of range [0, " + std::to_string(N) + ")");
      }
      return row;
    };
    int64_t previous = -1;
    bool padding = false;
    for (int64_t i = 0; i < A; ++i) {
      const int64_t node = accepted_at(b, i);
      const std::string where = "accepted[" + std::to_string(b) + ", " + std::to_string(i) + "]";
      if (node < -1) fail(op, where + " = " + std::to_string(node) + " (padding must be -1)");
      if (node == -1) {
        padding = true;
        continue;
      }
      if (padding) fail(op, where + " = " + std::to_string(node) + " follows -1 padding");
      if (node <= previous) {
        fail(op, where + " = " + std::to_string(node) +
                     " must be greater than the previous node (a root-to-node path in tree order)");
      }
      if (prefix + node >= MB * S) {
        fail(op, "prefix_lens" + at + " + " + where + " = " + std::to_string(prefix) + " + " +
                     std::to_string(node) + " must be < " + std::to_string(MB * S) +
                     " (the positions its cache rows hold)");
      }
      previous = node;
      if (node != i) {
        const int64_t src = prefix + node, dst = prefix + i;
        moves.push_back({row_of(src), src % S, row_of(dst), dst % S});
      }
    }
    // The rows its moves touch: from its first moved slot to its last.
    if (previous >= 0) {
      for (int64_t blk = prefix / S; blk <= (prefix + previous) / S; ++blk) {
        rows.push_back(row_of(blk * S < prefix ? prefix : blk * S));
      }
    }
  }
  // Two requests on one row (or block) would overwrite each other's slots.
  std::sort(rows.begin(), rows.end());
  const auto dup = std::adjacent_find(rows.begin(), rows.end());
  if (dup != rows.end()) fail(op, "cache_rows holds row " + std::to_string(*dup) + " twice");
  return moves;
}

}  // namespace specinfer
