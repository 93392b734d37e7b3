// Arguments of tree attention (see tree_attention_reference in python/specinfer/ops.py) and the
// checks shared by the CPU and CUDA paths.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor_view.h"

namespace specinfer {

struct TreeAttentionArgs {
  TensorView q;            // [B, T, Hq, D]
  TensorView k_cache;      // [N, Hkv, S, D]
  TensorView v_cache;      // [N, Hkv, S, D]
  TensorView cache_rows;   // [B] int32/int64, or a block table [B, MB] (see kv_locations)
  TensorView prefix_lens;  // [B] int32/int64
  TensorView tree_mask;    // [B, T, M] bool/uint8, M >= T
  TensorView out;          // [B, T, Hq, D]
  float scale = 1.0f;
  // On cuda, checking cache_rows and prefix_lens copies them to the host and waits for the
  // stream; a caller that built them itself (the models) skips that. Unchecked, a key at an
  // out-of-range row or block is skipped, never read. The cpu path always checks (no copy).
  bool check_indices = true;

  int64_t batch() const { return q.shape[0]; }
  int64_t tokens() const { return q.shape[1]; }
  // The mask covers the last mask_cols() cache slots ending at prefix_lens[b] + tokens().
  int64_t mask_cols() const { return tree_mask.shape[2]; }
  int64_t q_heads() const { return q.shape[2]; }
  int64_t head_dim() const { return q.shape[3]; }
  int64_t cache_rows_count() const { return k_cache.shape[0]; }
  int64_t kv_heads() const { return k_cache.shape[1]; }
  int64_t seq_len() const { return k_cache.shape[2]; }
  int64_t group() const { return q_heads() / kv_heads(); }
  // Cache rows per request: 1 (its row), or MB blocks of seq_len() positions each.
  int64_t blocks_per_request() const { return cache_rows.ndim == 2 ? cache_rows.shape[1] : 1; }
};

// Shapes, dtypes, devices and strides; no tensor data is read.
inline void check_tree_attention_args(const TreeAttentionArgs& a) {
  const std::string op = "tree_attention";
  check_ndim(a.q, 4, op, "q", "[batch, tokens, q_heads, head_dim]");
  check_ndim(a.k_cache, 4, op, "k_cache", "[rows, kv_heads, seq, head_dim]");
  check_ndim(a.v_cache, 4, op, "v_cache", "[rows, kv_heads, seq, head_dim]");
  check_cache_rows(a.cache_rows, op);
  check_ndim(a.prefix_lens, 1, op, "prefix_lens", "[batch]");
  check_ndim(a.tree_mask, 3, op, "tree_mask", "[batch, tokens, mask_cols]");
  check_ndim(a.out, 4, op, "out", "[batch, tokens, q_heads, head_dim]");

  const TensorView* all[] = {&a.k_cache,     &a.v_cache,   &a.cache_rows,
                             &a.prefix_lens, &a.tree_mask, &a.out};
  const char* names[] = {"k_cache", "v_cache", "cache_rows", "prefix_lens", "tree_mask", "out"};
  if (a.q.device == Device::kOther) fail(op, "q is on a device that is neither cpu nor cuda");
  for (int i = 0; i < 6; ++i) check_same_device(*all[i], a.q, op, names[i], "q");

  check_same_dtype(a.k_cache, a.q, op, "k_cache", "q");
  check_same_dtype(a.v_cache, a.q, op, "v_cache", "q");
  check_same_dtype(a.out, a.q, op, "out", "q");
  check_dtype_is(a.cache_rows, DType::kInt32, DType::kInt64, op, "cache_rows");
  check_dtype_is(a.prefix_lens, DType::kInt32, DType::kInt64, op, "prefix_lens");
  check_dtype_is(a.tree_mask, DType::kBool, DType::kUInt8, op, "tree_mask");

  const int64_t B = a.batch(), T = a.tokens(), D = a.head_dim();
  const int64_t Hkv = a.kv_heads();
  for (int i = 0; i < 4; ++i) {
    if (a.out.shape[i] != a.q.shape[i]) {
      fail(op, "out must have the shape of q " + a.q.shape_str() + ", got " + a.out.shape_str());
    }
  }
  for (int i = 0; i < 4; ++i) {
    if (a.v_cache.shape[i] != a.k_cache.shape[i]) {
      fail(op, "v_cache must have the shape of k_cache " + a.k_cache.shape_str() + ", got " +
                   a.v_cache.shape_str());
    }
  }
  check_size(a.k_cache, 3, D, op, "k_cache", "head_dim of q");
  if (Hkv < 1 || a.q_heads() % Hkv != 0) {
    fail(op, "q_heads (" + std::to_string(a.q_heads()) + ") must be a multiple of kv_heads (" +
                 std::to_string(Hkv) + ")");
  }
  check_size(a.cache_rows, 0, B, op, "cache_rows", "batch of q");
  check_size(a.prefix_lens, 0, B, op, "prefix_lens", "batch of q");
  check_size(a.tree_mask, 0, B, op, "tree_mask", "batch of q");
  check_size(a.tree_mask, 1, T, op, "tree_mask", "tokens of q");
  if (a.mask_cols() < T) {
    fail(op, "tree_mask.shape[2] must be >= " + std::to_string(T) + " (tokens of q), got " +
                 std::to_string(a.mask_cols()));
  }
  check_last_dim_contiguous(a.q, op, "q");
  check_last_dim_contiguous(a.k_cache, op, "k_cache");
  check_last_dim_contiguous(a.v_cache, op, "v_cache");
  check_last_dim_contiguous(a.out, op, "out");
}

// Cache rows (host copies, row-major [B, blocks_per_request]) and prefix lengths must address
// stored positions, and the mask must not reach before the start of the cache. Block table
// entries past a request's last position are not read, so they may hold anything.
inline void check_tree_attention_indices(const TreeAttentionArgs& a,
                                         const std::vector<int64_t>& rows,
                                         const std::vector<int64_t>& prefix) {
  const std::string op = "tree_attention";
  const int64_t T = a.tokens(), M = a.mask_cols(), S = a.seq_len(), N = a.cache_rows_count();
  const int64_t MB = a.blocks_per_request();
  for (size_t b = 0; b < prefix.size(); ++b) {
    const std::string at = "[" + std::to_string(b) + "]";
    if (prefix[b] < 0 || prefix[b] + T > MB * S) {
      fail(op, "prefix_lens" + at + " + tokens = " + std::to_string(prefix[b]) + " + " +
                   std::to_string(T) + " must be in [0, " + std::to_string(MB * S) +
                   "] (the positions its cache rows hold)");
    }
    for (int64_t i = 0; i * S < prefix[b] + T; ++i) {
      const int64_t row = rows[b * MB + i];
      if (row < 0 || row >= N) {
        fail(op, "cache_rows" + at + (MB > 1 ? "[" + std::to_string(i) + "]" : "") + " = " +
                     std::to_string(row) + " is out of range [0, " + std::to_string(N) + ")");
      }
    }
    if (prefix[b] + T - M < 0) {
      fail(op, "prefix_lens" + at + " + tokens - mask_cols = " + std::to_string(prefix[b]) + " + " +
                   std::to_string(T) + " - " + std::to_string(M) +
                   " must be >= 0 (the mask would cover slots before the cache start)");
    }
  }
}

}  // namespace specinfer
