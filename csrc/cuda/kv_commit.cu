// CUDA kv_commit: one thread per (cache, KV head, column) runs every move in order, so a source
// slot is always read before a later move overwrites it without any synchronisation.
#include <cstdint>
#include <vector>

#include "cuda/cuda_check.h"
#include "ops.h"

namespace specinfer {
namespace cuda {
namespace {

constexpr const char* kOp = "kv_commit";

// table: per cache {data pointer, 3 strides in elements}, then per move
// {src_row, src, dst_row, dst}.
template <typename E>
__global__ void kv_commit_kernel(const int64_t* table, int caches, int moves, int heads,
                                 int head_dim) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(caches) * heads * head_dim) return;
  const int64_t c = i / (int64_t(heads) * head_dim), h = (i / head_dim) % heads, d = i % head_dim;
  const int64_t* info = table + 4 * c;
  E* col = reinterpret_cast<E*>(info[0]) + h * info[2] + d;
  const int64_t* move = table + 4 * int64_t(caches);
  for (int m = 0; m < moves; ++m, move += 4) {
    col[move[2] * info[1] + move[3] * info[3]] = col[move[0] * info[1] + move[1] * info[3]];
  }
}

}  // namespace
}  // namespace cuda

void kv_commit_cuda(const std::vector<TensorView>& caches, const std::vector<KvMove>& moves,
                    uintptr_t stream_handle) {
  using namespace cuda;
  const TensorView& first = caches[0];
  const int64_t threads_total = int64_t(caches.size()) * first.shape[1] * first.shape[3];
  if (moves.empty() || threads_total == 0) return;
  if (threads_total >= (int64_t(1) << 31) || moves.size() >= (size_t(1) << 31)) {
    fail(kOp, "too many caches, heads or moves for one launch");
  }
  DeviceGuard guard(first.device_id, kOp);
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  std::vector<int64_t> table;
  table.reserve(4 * caches.size() + 4 * moves.size());
  for (const TensorView& c : caches) {
    table.insert(table.end(), {int64_t(reinterpret_cast<uintptr_t>(c.data)), c.strides[0],
                               c.strides[1], c.strides[2]});
  }
  for (const KvMove& m : moves) table.insert(table.end(), {m.src_row, m.src, m.dst_row, m.dst});

  void* device_table = nullptr;
  const size_t bytes = table.size() * sizeof(int64_t);
  check(cudaMallocAsync(&device_table, bytes, stream), kOp, "cudaMallocAsync");
  // From pageable memory the copy is staged before it returns, so `table` may go out of scope.
  check(cudaMemcpyAsync(device_table, table.data(), bytes, cudaMemcpyHostToDevice, stream), kOp,
        "copying the move table");
  const int block = 256, grid = int((threads_total + block - 1) / block);
  const auto* t = static_cast<const int64_t*>(device_table);
  const int n = int(caches.size()), m = int(moves.size());
  const int heads = int(first.shape[1]), head_dim = int(first.shape[3]);
  if (first.dtype == DType::kFloat32) {
    kv_commit_kernel<uint32_t><<<grid, block, 0, stream>>>(t, n, m, heads, head_dim);
  } else {
    kv_commit_kernel<uint16_t><<<grid, block, 0, stream>>>(t, n, m, heads, head_dim);
  }
  check(cudaGetLastError(), kOp, "kernel launch");
  check(cudaFreeAsync(device_table, stream), kOp, "cudaFreeAsync");
}

}  // namespace specinfer
