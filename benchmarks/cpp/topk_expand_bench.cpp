// CPU topk_expand over vocabulary rows (Llama's 32000, SmolLM2's 49152); reports logits bytes read
// per second.
#include <benchmark/benchmark.h>

#include "bench_util.h"
#include "ops.h"

namespace specinfer::bench {
namespace {

// Args: rows, vocab, k.
template <typename T>
void BM_TopkExpand(benchmark::State& state) {
  const int64_t rows = state.range(0), vocab = state.range(1), k = state.range(2);
  HostTensor<T> logits({rows, vocab}, dtype_of<T>());
  fill_random(logits, 1);
  HostTensor<int64_t> tokens({rows, k}, DType::kInt64);
  HostTensor<float> probs({rows, k}, DType::kFloat32);
  for (auto _ : state) {
    topk_expand_cpu(logits.view, k, 0.8f, tokens.view, probs.view);
    benchmark::DoNotOptimize(probs.data.data());
  }
  const double bytes = double(rows) * vocab * sizeof(T);
  state.counters["bytes_per_s"] =
      benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate);
}

void Shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"rows", "vocab", "k"});
  for (int rows : {1, 16}) {
    for (int vocab : {32000, 49152}) {
      for (int k : {4, 64}) b->Args({rows, vocab, k});
    }
  }
  b->Unit(benchmark::kMicrosecond)->UseRealTime();
}

BENCHMARK(BM_TopkExpand<float>)->Apply(Shapes);
BENCHMARK(BM_TopkExpand<bf16>)->Apply(Shapes);

}  // namespace
}  // namespace specinfer::bench
