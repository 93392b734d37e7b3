// CPU kv_commit: every layer's K and V caches of a batch, each request committing the deepest path
// of its tree; reports bytes copied (read + written) per second.
#include <benchmark/benchmark.h>

#include "bench_util.h"
#include "ops.h"

namespace specinfer::bench {
namespace {

constexpr int64_t kPrefix = 8;  // only addresses depend on it

// Args: kv_heads, head_dim, layers, tree nodes, batch.
void BM_KvCommit(benchmark::State& state) {
  const int64_t hkv = state.range(0), d = state.range(1), layers = state.range(2);
  const int64_t tokens = state.range(3), batch = state.range(4);
  std::vector<HostTensor<bf16>> caches;
  std::vector<TensorView> views;
  caches.reserve(2 * layers);  // the views point into the buffers
  for (int64_t i = 0; i < 2 * layers; ++i) {
    caches.emplace_back(std::vector<int64_t>{batch, hkv, kPrefix + tokens, d}, DType::kBFloat16);
  }
  for (auto& c : caches) views.push_back(c.view);
  const std::vector<KvMove> moves = commit_moves(batch, kPrefix, tokens);
  for (auto _ : state) {
    kv_commit_cpu(views, moves);
    benchmark::ClobberMemory();
  }
  const double bytes = 2.0 * moves.size() * views.size() * hkv * d * sizeof(bf16);
  state.counters["bytes_per_s"] =
      benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate);
}

void Shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"hkv", "d", "layers", "tree", "batch"});
  for (const HeadConfig& h : kHeadConfigs) {
    for (int tree : {8, 64}) {
      for (int batch : {1, 4}) b->Args({h.kv_heads, h.head_dim, h.layers, tree, batch});
    }
  }
  b->Unit(benchmark::kMicrosecond)->UseRealTime();
}

BENCHMARK(BM_KvCommit)->Apply(Shapes);

}  // namespace
}  // namespace specinfer::bench
