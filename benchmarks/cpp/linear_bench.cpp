// CPU linear for decode-sized M over SmolLM2-135M projection shapes; reports weight bytes/s.
#include <benchmark/benchmark.h>

#include "bench_util.h"
#include "ops.h"

namespace specinfer::bench {
namespace {

// Args: out_features N, in_features K, rows M.
template <typename T>
void BM_Linear(benchmark::State& state) {
  const int64_t n = state.range(0), k = state.range(1), m = state.range(2);
  constexpr DType dt = dtype_of<T>();
  HostTensor<T> x({m, k}, dt), w({n, k}, dt), out({m, n}, dt);
  fill_random(x, 1);
  fill_random(w, 2);
  for (auto _ : state) {
    linear_cpu(x.view, w.view, nullptr, out.view);
    benchmark::DoNotOptimize(out.data.data());
  }
  const double weight_bytes = double(n) * k * sizeof(T);
  state.counters["weight_bytes"] =
      benchmark::Counter(weight_bytes, benchmark::Counter::kIsIterationInvariantRate);
}

void Shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"n", "k", "m"});
  for (auto [n, k] : {std::pair{576, 576}, std::pair{192, 576}, std::pair{1536, 576},
                      std::pair{576, 1536}, std::pair{49152, 576}}) {
    for (int m : {1, 8, 64}) b->Args({n, k, m});
  }
  b->Unit(benchmark::kMicrosecond)->UseRealTime();
}

BENCHMARK(BM_Linear<float>)->Apply(Shapes);
BENCHMARK(BM_Linear<bf16>)->Apply(Shapes);

}  // namespace
}  // namespace specinfer::bench
