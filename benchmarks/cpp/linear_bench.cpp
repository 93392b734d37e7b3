// CPU linear for decode-sized M over SmolLM2-135M projection shapes; reports weight bytes/s.
// Decode reads every weight once per token from memory (the model is far larger than the last
// level cache), so each iteration uses the next of enough weight copies to fill 64 MB: the
// weight comes from DRAM, as it does in the model, not from cache.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <vector>

#include "bench_util.h"
#include "ops.h"

namespace specinfer::bench {
namespace {

constexpr int64_t kColdBytes = int64_t(64) << 20;  // twice the largest L3 here

// Args: out_features N, in_features K, rows M.
template <typename T>
void BM_Linear(benchmark::State& state) {
  const int64_t n = state.range(0), k = state.range(1), m = state.range(2);
  constexpr DType dt = dtype_of<T>();
  const int64_t weight_bytes = n * k * int64_t(sizeof(T));
  const int64_t copies = (kColdBytes + weight_bytes - 1) / weight_bytes;
  HostTensor<T> x({m, k}, dt), out({m, n}, dt);
  std::vector<HostTensor<T>> w;
  for (int64_t c = 0; c < copies; ++c) w.emplace_back(std::vector<int64_t>{n, k}, dt);
  fill_random(w[0], 2);
  for (auto& copy : w) std::copy(w[0].data.begin(), w[0].data.end(), copy.data.begin());
  fill_random(x, 1);
  int64_t c = 0;
  for (auto _ : state) {
    linear_cpu(x.view, w[c].view, nullptr, out.view);
    benchmark::DoNotOptimize(out.data.data());
    c = (c + 1) % copies;
  }
  state.counters["weight_bytes"] =
      benchmark::Counter(double(weight_bytes), benchmark::Counter::kIsIterationInvariantRate);
}

// SmolLM2-135M: qkv, o, gate_up, down, LM head; decode (1 row), batches and tree blocks.
void Shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"n", "k", "m"});
  for (auto [n, k] : {std::pair{960, 576}, std::pair{576, 576}, std::pair{3072, 576},
                      std::pair{576, 1536}, std::pair{49152, 576}}) {
    for (int m : {1, 2, 3, 4, 6, 8, 13, 20, 64}) b->Args({n, k, m});
  }
  b->Unit(benchmark::kMicrosecond)->UseRealTime();
}

BENCHMARK(BM_Linear<float>)->Apply(Shapes);
BENCHMARK(BM_Linear<bf16>)->Apply(Shapes);

}  // namespace
}  // namespace specinfer::bench
