// CPU tree attention over serving shapes; reports K/V bytes read per second.
#include <benchmark/benchmark.h>

#include "bench_util.h"
#include "ops.h"

namespace specinfer::bench {
namespace {

// Args: q_heads, kv_heads, head_dim, prefix, tree nodes, batch.
template <typename T>
void BM_TreeAttention(benchmark::State& state) {
  const int64_t hq = state.range(0), hkv = state.range(1), d = state.range(2);
  const int64_t prefix = state.range(3), tokens = state.range(4), batch = state.range(5);
  const int64_t seq = prefix + tokens;
  constexpr DType dt = dtype_of<T>();
  HostTensor<T> q({batch, tokens, hq, d}, dt), k({batch, hkv, seq, d}, dt),
      v({batch, hkv, seq, d}, dt), out({batch, tokens, hq, d}, dt);
  fill_random(q, 1);
  fill_random(k, 2);
  fill_random(v, 3);
  HostTensor<int64_t> rows({batch}, DType::kInt64), prefix_lens({batch}, DType::kInt64);
  HostTensor<uint8_t> mask({batch, tokens, tokens}, DType::kBool);
  for (int64_t b = 0; b < batch; ++b) {
    rows.data[b] = b;
    prefix_lens.data[b] = prefix;
  }
  fill_tree_mask(mask.data.data(), batch, tokens);
  TreeAttentionArgs args{q.view,           k.view,    v.view,   rows.view,
                         prefix_lens.view, mask.view, out.view, 0.125f};
  for (auto _ : state) {
    tree_attention_cpu(args);
    benchmark::DoNotOptimize(out.data.data());
  }
  const double kv_bytes = 2.0 * batch * hkv * seq * d * sizeof(T);
  state.counters["kv_bytes"] =
      benchmark::Counter(kv_bytes, benchmark::Counter::kIsIterationInvariantRate);
}

void Shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"hq", "hkv", "d", "prefix", "tree", "batch"});
  for (const HeadConfig& h : kHeadConfigs) {
    for (int prefix : {128, 512, 2048}) {
      for (int tree : {1, 8, 64}) {
        for (int batch : {1, 8}) b->Args({h.q_heads, h.kv_heads, h.head_dim, prefix, tree, batch});
      }
    }
  }
  b->Unit(benchmark::kMicrosecond)->UseRealTime();
}

BENCHMARK(BM_TreeAttention<float>)->Apply(Shapes);
BENCHMARK(BM_TreeAttention<bf16>)->Apply(Shapes);

}  // namespace
}  // namespace specinfer::bench
