#include "cpu/tree_attention.h"

#include <vector>

#include "cpu/cpu_features.h"
#include "ops.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include "cpu/tree_attention_avx512.h"
#define SPECINFER_HAS_AVX512_TILES 1
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

namespace specinfer {
namespace cpu {
namespace {

// Tiles: the inner loops for the head dims known at compile time (any other runs generic ones).
template <typename T, typename Tiles = GenericTiles>
SPECINFER_INLINE void dispatch_head_dim(const TreeAttentionProblem<T>& p, int64_t b, int64_t h,
                                        int64_t r0, int64_t r1, int64_t keys, float* w) {
  switch (p.head_dim) {
    case 64:
      return attend_block<T, 64, Tiles>(p, b, h, r0, r1, keys, w);
    case 128:
      return attend_block<T, 128, Tiles>(p, b, h, r0, r1, keys, w);
    default:
      return attend_block<T, 0>(p, b, h, r0, r1, keys, w);
  }
}

// One copy of the kernel per instruction set; the always-inline kernel is vectorised for the
// caller's target, and the choice is made once at run time.
template <typename T>
SPECINFER_TARGET(SPECINFER_AVX512)
void block_avx512(const TreeAttentionProblem<T>& p, int64_t b, int64_t h, int64_t r0, int64_t r1,
                  int64_t keys, float* w) {
#ifdef SPECINFER_HAS_AVX512_TILES
  dispatch_head_dim<T, Avx512Tiles>(p, b, h, r0, r1, keys, w);
#else
  dispatch_head_dim(p, b, h, r0, r1, keys, w);
#endif
}

template <typename T>
SPECINFER_TARGET(SPECINFER_AVX2)
void block_avx2(const TreeAttentionProblem<T>& p, int64_t b, int64_t h, int64_t r0, int64_t r1,
                int64_t keys, float* w) {
  dispatch_head_dim(p, b, h, r0, r1, keys, w);
}

template <typename T>
void block_generic(const TreeAttentionProblem<T>& p, int64_t b, int64_t h, int64_t r0, int64_t r1,
                   int64_t keys, float* w) {
  dispatch_head_dim(p, b, h, r0, r1, keys, w);
}

template <typename T>
void run(const TreeAttentionArgs& a, const std::vector<int64_t>& rows,
         const std::vector<int64_t>& prefix) {
  TreeAttentionProblem<T> p;
  p.q = a.q.ptr<const T>();
  p.k = a.k_cache.ptr<const T>();
  p.v = a.v_cache.ptr<const T>();
  p.mask = a.tree_mask.ptr<const uint8_t>();
  p.out = a.out.ptr<T>();
  for (int i = 0; i < 3; ++i) {
    p.q_stride[i] = a.q.strides[i];
    p.k_stride[i] = a.k_cache.strides[i];
    p.v_stride[i] = a.v_cache.strides[i];
    p.mask_stride[i] = a.tree_mask.strides[i];
    p.out_stride[i] = a.out.strides[i];
  }
  p.cache_rows = rows.data();
  p.prefix_lens = prefix.data();
  p.blocks_per_request = a.blocks_per_request();
  p.block_len = a.seq_len();
  p.tokens = a.tokens();
  p.mask_cols = a.mask_cols();
  p.group = a.group();
  p.head_dim = a.head_dim();
  p.scale = a.scale;

  const int64_t B = a.batch(), T_ = a.tokens(), Hkv = a.kv_heads();
  int threads = 1;
#ifdef _OPENMP
  threads = omp_get_max_threads();
#endif
  auto block = block_generic<T>;
  if (has_avx512()) {
    block = block_avx512<T>;
  } else if (has_avx2_fma()) {
    block = block_avx2<T>;
  }

  // Forking threads costs more than it saves on the smallest calls: they stay serial. Measured
  // (bf16, 2 threads, 9 query heads of 64 over 3 KV heads, 300 keys): 1 query token 35 -> 31 us
  // a call, 4 tokens 97 -> 71, 8 tokens 128 -> 120, with the threshold down from 2^20 and the
  // rows split as below.
  int64_t work = 0, max_keys = 0;
  for (int64_t b = 0; b < B; ++b) {
    work += (prefix[b] + T_) * T_;
    max_keys = std::max(max_keys, prefix[b] + T_);
  }
  const int64_t keys = tree_attention_key_capacity(max_keys);
  const bool parallel = work * a.q_heads() * a.head_dim() >= (int64_t(1) << 17);

  // Work items: (request, KV head, a range of its T x group query rows). In parallel, long
  // blocks (prefill) are split into chunks of 16 tokens or more, about 4 items a thread, so every
  // core has work even when B * Hkv is small; short ones (decode, small trees) into about 2 items
  // a thread only while each keeps kShortItemRows query rows: an item converts all the K/V it
  // reads, most of a small item's work. (1 token, 3 KV heads, 270 keys, 2 threads: 3 items
  // rather than 6 took a decode forward of SmolLM2-135M from 11.4 to 10.9 ms; 3-8 tokens alike
  // either way, 16 tokens 0.4 ms faster in 6.)
  constexpr int64_t kShortItemRows = 16;
  const int64_t q_rows = T_ * p.group, long_block = T_ >= 32;
  const int64_t want = parallel ? ((long_block ? 4 : 2) * threads + B * Hkv - 1) / (B * Hkv) : 1;
  const int64_t split = std::max<int64_t>(
      1, long_block ? std::min((T_ + 15) / 16, want) : std::min(q_rows / kShortItemRows, want));
  const int64_t chunk = (q_rows + split - 1) / split;
  const int64_t chunks = (q_rows + chunk - 1) / chunk;
  const int64_t items = B * Hkv * chunks;

#pragma omp parallel if (parallel)
  {
    std::vector<float> scratch(tree_attention_scratch(chunk, p.head_dim, keys));
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < items; ++i) {
      const int64_t c = i % chunks, h = (i / chunks) % Hkv, b = i / (chunks * Hkv);
      block(p, b, h, c * chunk, std::min(q_rows, (c + 1) * chunk), keys, scratch.data());
    }
  }
}

}  // namespace
}  // namespace cpu

void tree_attention_cpu(const TreeAttentionArgs& a) {
  const std::string op = "tree_attention";
  if (a.q.dtype != DType::kFloat32 && a.q.dtype != DType::kBFloat16) {
    fail(op,
         std::string(dtype_name(a.q.dtype)) + " is not supported on cpu (use float32 or bfloat16)");
  }
  const int64_t B = a.batch();
  const std::vector<int64_t> rows = host_indices(a.cache_rows);
  std::vector<int64_t> prefix(B);
  for (int64_t b = 0; b < B; ++b) prefix[b] = index_at(a.prefix_lens, b);
  check_tree_attention_indices(a, rows, prefix);
  if (B == 0 || a.tokens() == 0 || a.q_heads() == 0) return;
  if (a.q.dtype == DType::kFloat32) {
    cpu::run<float>(a, rows, prefix);
  } else {
    cpu::run<bf16>(a, rows, prefix);
  }
}

}  // namespace specinfer
