// Launches the CUDA topk_expand kernel (cuda/topk_expand.cuh) with the smallest per-thread list
// that holds k.
#include <climits>
#include <string>

#include "core/topk_expand_args.h"
#include "cuda/cuda_check.h"
#include "cuda/topk_expand.cuh"
#include "ops.h"

namespace specinfer {
namespace cuda {
namespace {

constexpr const char* kOp = "topk_expand";
constexpr int kNoBadRow = 0x7f7f7f7f;  // what a memset of 0x7f bytes writes: above any row

template <typename T, int K>
void launch(const TopkParams& p, int rows, cudaStream_t stream) {
  topk_expand_kernel<T, K><<<rows, kTopkThreads, 0, stream>>>(p);
  check(cudaGetLastError(), kOp, "kernel launch");
}

// Small lists insert faster: tree expansion mostly asks for a handful of children.
template <typename T>
void launch_k(const TopkParams& p, int rows, cudaStream_t stream) {
  if (p.k <= 4) {
    launch<T, 4>(p, rows, stream);
  } else if (p.k <= 16) {
    launch<T, 16>(p, rows, stream);
  } else {
    launch<T, kTopkMaxK>(p, rows, stream);
  }
}

}  // namespace
}  // namespace cuda

void topk_expand_cuda(const TensorView& logits, int64_t k, float temperature,
                      const TensorView& tokens, const TensorView& probs, uintptr_t stream_handle) {
  using namespace cuda;
  check_topk_expand_args(logits, k, temperature, tokens, probs);
  if (logits.dtype != DType::kFloat32 && logits.dtype != DType::kBFloat16 &&
      logits.dtype != DType::kFloat16) {
    fail(kOp, std::string("logits must be float32, bfloat16 or float16 on cuda, got ") +
                  dtype_name(logits.dtype));
  }
  if (k > kTopkMaxK) {
    fail(kOp,
         "k = " + std::to_string(k) + " is above the cuda limit of " + std::to_string(kTopkMaxK));
  }
  const int64_t N = logits.shape[0], V = logits.shape[1];
  if (N >= INT_MAX || V >= INT_MAX) {
    fail(kOp, "logits " + logits.shape_str() + " is too large for one launch");
  }
  if (N == 0 || k == 0) return;
  DeviceGuard guard(logits.device_id, kOp);
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);

  TopkParams p;
  p.logits = logits.data;
  p.logits_stride = logits.strides[0];
  p.tokens = tokens.ptr<int64_t>();
  p.probs = probs.ptr<float>();
  for (int i = 0; i < 2; ++i) {
    p.tokens_stride[i] = tokens.strides[i];
    p.probs_stride[i] = probs.strides[i];
  }
  p.vocab = int(V);
  p.k = int(k);
  p.inv_t = topk_inverse_temperature(temperature);
  // The cpu op raises on a row without a softmax, so this one does too: one 4-byte copy back and
  // a stream sync (the caller reads the tokens on the host next anyway).
  check(cudaMallocAsync(reinterpret_cast<void**>(&p.bad_row), sizeof(int), stream), kOp,
        "cudaMallocAsync");
  check(cudaMemsetAsync(p.bad_row, kNoBadRow & 0xff, sizeof(int), stream), kOp, "cudaMemsetAsync");
  switch (logits.dtype) {
    case DType::kFloat32:
      launch_k<float>(p, int(N), stream);
      break;
    case DType::kFloat16:
      launch_k<__half>(p, int(N), stream);
      break;
    default:
      launch_k<__nv_bfloat16>(p, int(N), stream);
      break;
  }
  int bad_row = 0;
  check(cudaMemcpyAsync(&bad_row, p.bad_row, sizeof(int), cudaMemcpyDeviceToHost, stream), kOp,
        "copying the row check to the host");
  check(cudaFreeAsync(p.bad_row, stream), kOp, "cudaFreeAsync");
  check(cudaStreamSynchronize(stream), kOp, "cudaStreamSynchronize");
  if (bad_row != kNoBadRow) {
    fail(kOp, "logits row " + std::to_string(bad_row) +
                  " has no softmax (it holds NaN or +inf, or every logit is -inf)");
  }
}

}  // namespace specinfer
