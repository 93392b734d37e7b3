#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/tree_attention.cuh"
#include "cuda/tree_attention_mma.cuh"
#include "ops.h"

namespace specinfer {
namespace cuda {
namespace {

constexpr const char* kOp = "tree_attention";
constexpr int64_t kMaxHeadDim = 256;  // the widest kernel: 129 KB of shared memory

// Copies a strided [B] or [B, MB] index tensor from the device into a row-major host vector;
// the binding validates the values on the host.
std::vector<int64_t> indices_to_host(const TensorView& v, cudaStream_t stream) {
  const int64_t rows = v.shape[0], cols = v.ndim == 2 ? v.shape[1] : 1;
  const int64_t row_stride = v.strides[0], col_stride = v.ndim == 2 ? v.strides[1] : 1;
  const size_t elem = v.dtype == DType::kInt64 ? 8 : 4;
  std::vector<unsigned char> raw(rows * cols * elem);
  const auto* src = static_cast<const unsigned char*>(v.data);
  const char* what = "copying indices to the host";
  if (rows * cols == 0) return {};
  if (cols == 1 || col_stride == 1) {
    if (rows == 1 || row_stride >= cols) {  // each row contiguous: one 2-D copy
      check(cudaMemcpy2DAsync(raw.data(), cols * elem, src,
                              std::max<int64_t>(row_stride, cols) * elem, cols * elem, rows,
                              cudaMemcpyDeviceToHost, stream),
            kOp, what);
    } else {  // broadcast (stride 0) or reversed rows: row by row
      for (int64_t r = 0; r < rows; ++r) {
        check(cudaMemcpyAsync(raw.data() + r * cols * elem, src + r * row_stride * int64_t(elem),
                              cols * elem, cudaMemcpyDeviceToHost, stream),
              kOp, what);
      }
    }
  } else {  // strided columns: element by element
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        check(cudaMemcpyAsync(raw.data() + (r * cols + c) * elem,
                              src + (r * row_stride + c * col_stride) * int64_t(elem), elem,
                              cudaMemcpyDeviceToHost, stream),
              kOp, what);
      }
    }
  }
  check(cudaStreamSynchronize(stream), kOp, "cudaStreamSynchronize");
  std::vector<int64_t> out(rows * cols);
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = elem == 8 ? reinterpret_cast<const int64_t*>(raw.data())[i]
                       : reinterpret_cast<const int32_t*>(raw.data())[i];
  }
  return out;
}

// Key splits per request: enough blocks for about two waves over the GPU's multiprocessors,
// each split at least kMinSplitTiles tiles of the longest prefix the caches can hold.
constexpr int kMinSplitTiles = 4;
constexpr int kMaxSplits = 32;

int choose_splits(const TreeAttentionParams& p, int64_t blocks, int device) {
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), kOp,
        "cudaDeviceGetAttribute");
  const int64_t capacity_tiles = (p.blocks * p.seq_len + kKeyTile - 1) / kKeyTile;
  const int64_t wanted = (2 * int64_t(sms) + blocks - 1) / blocks;
  return int(std::max<int64_t>(
      1, std::min({wanted, capacity_tiles / kMinSplitTiles, int64_t(kMaxSplits)})));
}

template <int Warps, size_t Smem, typename Kernel>
void launch_kernel(Kernel kernel, const TreeAttentionParams& p, cudaStream_t stream) {
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(Smem)), kOp,
        "cudaFuncSetAttribute");
  const int row_blocks = (p.tokens * p.group + kRowsPerBlock - 1) / kRowsPerBlock;
  dim3 grid(unsigned(p.batch) * unsigned(p.kv_heads), unsigned(row_blocks), unsigned(p.splits));
  kernel<<<grid, Warps * 32, Smem, stream>>>(p);
  check(cudaGetLastError(), kOp, "kernel launch");
}

// Tensor cores for 16-bit inputs up to head_dim 128; fp32 (exact to 1e-4) and wider heads run
// on the CUDA cores.
template <typename T, int D>
void launch(const TreeAttentionParams& p, cudaStream_t stream) {
  if constexpr (!std::is_same_v<T, float> && D <= 128) {
    launch_kernel<kMmaWarps, tree_attention_mma_smem_bytes<D>()>(tree_attention_mma_kernel<T, D>, p,
                                                                 stream);
  } else {
    launch_kernel<kWarps, tree_attention_smem_bytes<D>()>(tree_attention_kernel<T, D>, p, stream);
  }
  if (p.splits > 1) {
    const int64_t threads = int64_t(p.batch) * p.tokens * p.q_heads * 32;
    combine_splits<T><<<unsigned((threads + 255) / 256), 256, 0, stream>>>(p);
    check(cudaGetLastError(), kOp, "combine launch");
  }
}

// The kernel's padded width: head_dim rounded up to 32, 64, 128 or 256.
template <typename T>
void launch_dtype(const TreeAttentionParams& p, cudaStream_t stream) {
  if (p.head_dim <= 32) {
    launch<T, 32>(p, stream);
  } else if (p.head_dim <= 64) {
    launch<T, 64>(p, stream);
  } else if (p.head_dim <= 128) {
    launch<T, 128>(p, stream);
  } else {
    launch<T, 256>(p, stream);
  }
}

// 16-byte loads need every K/V row start (and the cache base) 16-byte aligned.
bool allows_vector_loads(const TensorView& cache, int64_t head_dim) {
  const int64_t vec = cache.dtype == DType::kFloat32 ? 4 : 8;  // elements in 16 bytes
  if (head_dim % vec != 0 || reinterpret_cast<uintptr_t>(cache.data) % 16 != 0) return false;
  for (int i = 0; i < 3; ++i) {
    if (cache.shape[i] > 1 && cache.strides[i] % vec != 0) return false;
  }
  return true;
}

}  // namespace
}  // namespace cuda

void tree_attention_cuda(const TreeAttentionArgs& a, uintptr_t stream_handle) {
  using namespace cuda;
  if (a.q.dtype != DType::kFloat32 && a.q.dtype != DType::kFloat16 &&
      a.q.dtype != DType::kBFloat16) {
    fail(kOp, std::string(dtype_name(a.q.dtype)) +
                  " is not supported on cuda (use float16, bfloat16 or float32)");
  }
  if (a.head_dim() > kMaxHeadDim) {
    fail(kOp, "head_dim " + std::to_string(a.head_dim()) + " is not supported on cuda (at most " +
                  std::to_string(kMaxHeadDim) + ")");
  }
  // Grid limits: x = batch * kv_heads, y = query-row blocks (at most 65535); rows are int.
  if (a.batch() * a.kv_heads() >= (int64_t(1) << 31) ||
      a.tokens() * a.group() > int64_t(65535) * kRowsPerBlock ||
      a.batch() * a.tokens() * a.q_heads() >= (int64_t(1) << 31)) {
    fail(kOp, "batch " + std::to_string(a.batch()) + " x tokens " + std::to_string(a.tokens()) +
                  " is too large for one launch");
  }
  DeviceGuard guard(a.q.device_id, kOp);
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  if (a.check_indices) {  // a copy to the host and a wait for it: opt out on hot paths
    check_tree_attention_indices(a, indices_to_host(a.cache_rows, stream),
                                 indices_to_host(a.prefix_lens, stream));
  }
  const int B = int(a.batch()), T = int(a.tokens());
  if (B == 0 || T == 0 || a.q_heads() == 0) return;

  TreeAttentionParams p;
  p.q = a.q.data;
  p.k = a.k_cache.data;
  p.v = a.v_cache.data;
  p.out = a.out.data;
  for (int i = 0; i < 3; ++i) {
    p.q_stride[i] = a.q.strides[i];
    p.k_stride[i] = a.k_cache.strides[i];
    p.v_stride[i] = a.v_cache.strides[i];
    p.out_stride[i] = a.out.strides[i];
    p.mask_stride[i] = a.tree_mask.strides[i];
  }
  p.cache_rows = a.cache_rows.data;
  p.cache_rows_stride[0] = a.cache_rows.strides[0];
  p.cache_rows_stride[1] = a.cache_rows.ndim == 2 ? a.cache_rows.strides[1] : 0;
  p.cache_rows_64 = a.cache_rows.dtype == DType::kInt64;
  p.seq_len = a.seq_len();
  p.rows_count = a.cache_rows_count();
  p.blocks = a.blocks_per_request();
  p.prefix_lens = a.prefix_lens.data;
  p.prefix_lens_stride = a.prefix_lens.strides[0];
  p.prefix_lens_64 = a.prefix_lens.dtype == DType::kInt64;
  p.mask = a.tree_mask.ptr<const uint8_t>();
  p.batch = B;
  p.tokens = T;
  p.mask_cols = int(a.mask_cols());
  p.group = int(a.group());
  p.kv_heads = int(a.kv_heads());
  p.q_heads = int(a.q_heads());
  p.head_dim = int(a.head_dim());
  p.vector_loads =
      allows_vector_loads(a.k_cache, p.head_dim) && allows_vector_loads(a.v_cache, p.head_dim);
  p.scale_log2 = a.scale * 1.4426950408889634f;
  const int row_blocks = (T * p.group + kRowsPerBlock - 1) / kRowsPerBlock;
  p.splits = choose_splits(p, int64_t(B) * p.kv_heads * row_blocks, a.q.device_id);

  // The splits' partial sums: stream-ordered scratch from the pool (no synchronisation).
  void* scratch = nullptr;
  if (p.splits > 1) {
    const size_t rows = size_t(p.splits) * B * T * p.q_heads;
    check(cudaMallocAsync(&scratch, rows * (2 + p.head_dim) * sizeof(float), stream), kOp,
          "cudaMallocAsync");
    p.partial_ml = static_cast<float*>(scratch);
    p.partial_acc = p.partial_ml + 2 * rows;
  } else {
    p.partial_ml = p.partial_acc = nullptr;
  }

  switch (a.q.dtype) {
    case DType::kFloat32:
      launch_dtype<float>(p, stream);
      break;
    case DType::kFloat16:
      launch_dtype<__half>(p, stream);
      break;
    default:
      launch_dtype<__nv_bfloat16>(p, stream);
      break;
  }
  if (scratch != nullptr) check(cudaFreeAsync(scratch, stream), kOp, "cudaFreeAsync");
}

}  // namespace specinfer
