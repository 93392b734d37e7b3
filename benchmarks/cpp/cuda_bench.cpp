// CUDA microbenchmarks of tree attention, kv_commit and topk_expand. Each iteration is one call as
// Python makes it (argument checks, host index copies and syncs included), timed with CUDA events
// on the default stream. Counters: bytes_per_s (bytes the op must move / time) and peak_frac (that
// over the device's peak memory bandwidth, memory clock x bus width).
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "bench_util.h"
#include "ops.h"

namespace specinfer::bench {
namespace {

// Setup failures end the run: a benchmark without its buffers has nothing to measure.
void cuda_ok(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    std::fprintf(stderr, "bench_kernels_cuda: %s failed: %s\n", what, cudaGetErrorString(err));
    std::exit(1);
  }
}

double peak_bytes_per_s() {
  static const double peak = [] {
    int clock_khz = 0, bus_bits = 0;
    cuda_ok(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, 0), "memory clock");
    cuda_ok(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, 0), "bus width");
    return 2.0 * clock_khz * 1e3 * bus_bits / 8;  // two transfers a clock (DDR/HBM)
  }();
  return peak;
}

bool skip_without_device(benchmark::State& state) {
  if (cuda_device_count() > 0) return false;
  state.SkipWithError("no CUDA device visible");
  return true;
}

// A contiguous device tensor on device 0.
class DeviceTensor {
 public:
  DeviceTensor(std::vector<int64_t> shape, DType dtype, size_t elem_size)
      : bytes_(size_t(numel(shape)) * elem_size) {
    cuda_ok(cudaMalloc(&data_, std::max<size_t>(bytes_, 1)), "cudaMalloc");
    cuda_ok(cudaMemset(data_, 0, bytes_), "cudaMemset");
    view_ = contiguous_view(data_, shape, dtype, Device::kCUDA);
  }
  ~DeviceTensor() { cudaFree(data_); }
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;

  const TensorView& view() const { return view_; }

  template <typename T>
  void copy_from(const std::vector<T>& host) {
    cuda_ok(cudaMemcpy(data_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
            "cudaMemcpy");
  }

  // Normal noise: one random block from the host, then doubled on the device (filling GBs from
  // the host would take longer than the benchmark).
  template <typename T>
  void fill_random(uint32_t seed) {
    const int64_t n = int64_t(bytes_ / sizeof(T)), block = std::min<int64_t>(n, 1 << 20);
    std::vector<T> host(block);
    bench::fill_random(host.data(), block, seed);
    T* data = static_cast<T*>(data_);
    cuda_ok(cudaMemcpy(data, host.data(), block * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy");
    for (int64_t filled = block; filled < n; filled *= 2) {
      cuda_ok(cudaMemcpy(data + filled, data, std::min(filled, n - filled) * sizeof(T),
                         cudaMemcpyDeviceToDevice),
              "cudaMemcpy");
    }
  }

 private:
  void* data_ = nullptr;
  size_t bytes_;
  TensorView view_;
};

// Runs `op` once per iteration between two CUDA events; the elapsed time is the iteration's.
template <typename Op>
void time_with_events(benchmark::State& state, double bytes, Op op) {
  cudaEvent_t start, stop;
  cuda_ok(cudaEventCreate(&start), "cudaEventCreate");
  cuda_ok(cudaEventCreate(&stop), "cudaEventCreate");
  for (auto _ : state) {
    cuda_ok(cudaEventRecord(start, 0), "cudaEventRecord");
    op();
    cuda_ok(cudaEventRecord(stop, 0), "cudaEventRecord");
    cuda_ok(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0.0f;
    cuda_ok(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    state.SetIterationTime(ms * 1e-3);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  using benchmark::Counter;
  state.counters["bytes_per_s"] = Counter(bytes, Counter::kIsIterationInvariantRate);
  state.counters["peak_frac"] =
      Counter(bytes / peak_bytes_per_s(), Counter::kIsIterationInvariantRate);
}

void Timed(benchmark::internal::Benchmark* b) {
  b->Unit(benchmark::kMicrosecond)->UseManualTime()->MinTime(0.05);
}

// Args: q_heads, kv_heads, head_dim, prefix, tree nodes, batch. bfloat16.
void BM_TreeAttentionCuda(benchmark::State& state) {
  if (skip_without_device(state)) return;
  const int64_t hq = state.range(0), hkv = state.range(1), d = state.range(2);
  const int64_t prefix = state.range(3), tokens = state.range(4), batch = state.range(5);
  const int64_t seq = prefix + tokens;
  constexpr DType bf = DType::kBFloat16;
  DeviceTensor q({batch, tokens, hq, d}, bf, 2), k({batch, hkv, seq, d}, bf, 2),
      v({batch, hkv, seq, d}, bf, 2), out({batch, tokens, hq, d}, bf, 2);
  q.fill_random<bf16>(1);
  k.fill_random<bf16>(2);
  v.fill_random<bf16>(3);
  DeviceTensor rows({batch}, DType::kInt64, 8), prefix_lens({batch}, DType::kInt64, 8);
  DeviceTensor mask({batch, tokens, tokens}, DType::kBool, 1);
  std::vector<int64_t> host_rows(batch), host_prefix(batch, prefix);
  for (int64_t b = 0; b < batch; ++b) host_rows[b] = b;
  std::vector<uint8_t> host_mask(batch * tokens * tokens);
  fill_tree_mask(host_mask.data(), batch, tokens);
  rows.copy_from(host_rows);
  prefix_lens.copy_from(host_prefix);
  mask.copy_from(host_mask);
  const TreeAttentionArgs args{q.view(),
                               k.view(),
                               v.view(),
                               rows.view(),
                               prefix_lens.view(),
                               mask.view(),
                               out.view(),
                               0.125f,
                               /*check_indices=*/false};  // as the models call it
  check_tree_attention_args(args);
  const double bytes = 2.0 * (2 * batch * hkv * seq * d + 2 * batch * tokens * hq * d);
  time_with_events(state, bytes, [&] { tree_attention_cuda(args, 0); });
}

void TreeAttentionShapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"hq", "hkv", "d", "prefix", "tree", "batch"});
  for (const HeadConfig& h : kHeadConfigs) {
    for (int prefix : {128, 512, 2048, 4096}) {
      for (int tree : {8, 20, 64}) {
        for (int batch : {1, 4, 16}) {
          b->Args({h.q_heads, h.kv_heads, h.head_dim, prefix, tree, batch});
        }
      }
    }
  }
  Timed(b);
}

constexpr int64_t kCommitPrefix = 128;

// Args: kv_heads, head_dim, layers, tree nodes, batch. bfloat16 K and V caches of every layer.
void BM_KvCommitCuda(benchmark::State& state) {
  if (skip_without_device(state)) return;
  const int64_t hkv = state.range(0), d = state.range(1), layers = state.range(2);
  const int64_t tokens = state.range(3), batch = state.range(4);
  std::vector<std::unique_ptr<DeviceTensor>> caches;
  std::vector<TensorView> views;
  for (int64_t i = 0; i < 2 * layers; ++i) {
    caches.push_back(std::make_unique<DeviceTensor>(
        std::vector<int64_t>{batch, hkv, kCommitPrefix + tokens, d}, DType::kBFloat16, 2));
    views.push_back(caches.back()->view());
  }
  const std::vector<KvMove> moves = commit_moves(batch, kCommitPrefix, tokens);
  const double bytes = 2.0 * moves.size() * views.size() * hkv * d * 2;
  time_with_events(state, bytes, [&] { kv_commit_cuda(views, moves, 0); });
}

void KvCommitShapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"hkv", "d", "layers", "tree", "batch"});
  for (const HeadConfig& h : kHeadConfigs) {
    for (int tree : {8, 64}) {
      for (int batch : {1, 4, 16}) b->Args({h.kv_heads, h.head_dim, h.layers, tree, batch});
    }
  }
  Timed(b);
}

// Args: rows, vocab, k.
template <typename T>
void BM_TopkExpandCuda(benchmark::State& state) {
  if (skip_without_device(state)) return;
  const int64_t rows = state.range(0), vocab = state.range(1), k = state.range(2);
  DeviceTensor logits({rows, vocab}, dtype_of<T>(), sizeof(T));
  logits.fill_random<T>(1);
  DeviceTensor tokens({rows, k}, DType::kInt64, 8), probs({rows, k}, DType::kFloat32, 4);
  const double bytes = double(rows) * vocab * sizeof(T) + double(rows) * k * 12;
  time_with_events(state, bytes, [&] {
    topk_expand_cuda(logits.view(), k, 0.8f, tokens.view(), probs.view(), 0);
  });
}

void TopkShapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"rows", "vocab", "k"});
  for (int rows : {1, 16, 128}) {
    for (int vocab : {32000, 49152}) {
      for (int k : {4, 16, 64}) b->Args({rows, vocab, k});
    }
  }
  Timed(b);
}

BENCHMARK(BM_TreeAttentionCuda)->Apply(TreeAttentionShapes);
BENCHMARK(BM_KvCommitCuda)->Apply(KvCommitShapes);
BENCHMARK(BM_TopkExpandCuda<float>)->Apply(TopkShapes);
BENCHMARK(BM_TopkExpandCuda<bf16>)->Apply(TopkShapes);

// The device and its peak bandwidth go into the report's context (and its JSON).
void add_device_context() {
  if (cuda_device_count() == 0) {
    benchmark::AddCustomContext("cuda_device", "none visible");
    return;
  }
  cudaDeviceProp prop;
  cuda_ok(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  benchmark::AddCustomContext("cuda_device", prop.name);
  benchmark::AddCustomContext("peak_bytes_per_s", std::to_string(peak_bytes_per_s()));
}

}  // namespace
}  // namespace specinfer::bench

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  specinfer::bench::add_device_context();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
