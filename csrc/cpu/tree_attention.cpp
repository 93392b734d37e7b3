#include "cpu/tree_attention.h"

#include <type_traits>
#include <vector>

#include "cpu/cpu_features.h"
#include "ops.h"

#ifdef SPECINFER_HAVE_X86
#include "cpu/tree_attention_amx.h"
#include "cpu/tree_attention_avx2.h"
#include "cpu/tree_attention_avx512.h"
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
#ifdef SPECINFER_HAVE_X86
  dispatch_head_dim<T, Avx512Tiles>(p, b, h, r0, r1, keys, w);
#else
  dispatch_head_dim(p, b, h, r0, r1, keys, w);
#endif
}

#ifdef SPECINFER_HAVE_X86
// bf16 on AMX: the scores on tiles (head dims 64 and 128), the rest as block_avx512.
SPECINFER_TARGET(SPECINFER_AMX)
void block_amx(const TreeAttentionProblem<bf16>& p, int64_t b, int64_t h, int64_t r0, int64_t r1,
               int64_t keys, float* w) {
  dispatch_head_dim<bf16, AmxTiles>(p, b, h, r0, r1, keys, w);
}
#endif

template <typename T>
SPECINFER_TARGET(SPECINFER_AVX2)
void block_avx2(const TreeAttentionProblem<T>& p, int64_t b, int64_t h, int64_t r0, int64_t r1,
                int64_t keys, float* w) {
#ifdef SPECINFER_HAVE_X86
  dispatch_head_dim<T, Avx2Tiles>(p, b, h, r0, r1, keys, w);
#else
  dispatch_head_dim(p, b, h, r0, r1, keys, w);
#endif
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
#ifdef SPECINFER_HAVE_X86
  if constexpr (std::is_same_v<T, bf16>) {
    if (has_amx_bf16()) block = block_amx;
  }
#endif

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

  // Work items: ranges of the B x Hkv x (T x group) query rows, taken head by head (a block per
  // head a range touches, which converts that head's K/V: most of a small block's work). In
  // parallel, long blocks (prefill) make chunks of 16 tokens or more, about 4 items a thread, so
  // every core has work even when B * Hkv is small. Short ones (decode, trees) make an item per
  // head when there are 2 a thread; else, under 32 query rows a head, one range per thread cut
  // across heads (3 KV heads on 2 threads: 4 heads' K/V converted, 2 a thread, where an item per
  // head leaves one thread 2 and the other 1, and halves of heads make 6: a forward of
  // SmolLM2-135M 0.2-0.45 ms faster at 1-10 tokens, 270 keys), and from 32 rows halves of
  // heads or smaller chunks of 16 rows or more (as fast as ranges at 12 and 16 tokens).
  const int64_t q_rows = T_ * p.group, heads = B * Hkv, long_block = T_ >= 32;
  int64_t items = 1;
  if (parallel && long_block) {
    const int64_t want = (4 * threads + heads - 1) / heads;
    items = heads * std::max<int64_t>(1, std::min((T_ + 15) / 16, want));
  } else if (parallel) {
    const int64_t want = (2 * threads + heads - 1) / heads;
    items = heads >= 2 * threads ? heads
            : q_rows < 32        ? std::min<int64_t>(threads, heads * q_rows)
                                 : heads * std::min(q_rows / 16, want);
  }
  const int64_t total = heads * q_rows, most_rows = std::min(q_rows, (total + items - 1) / items);

#pragma omp parallel if (parallel)
  {
    std::vector<float> scratch(tree_attention_scratch(most_rows, p.head_dim, keys));
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < items; ++i) {
      const int64_t end = total * (i + 1) / items;
      for (int64_t at = total * i / items; at < end;) {
        const int64_t bh = at / q_rows, r0 = at % q_rows, r1 = std::min(q_rows, r0 + end - at);
        block(p, bh / Hkv, bh % Hkv, r0, r1, keys, scratch.data());
        at += r1 - r0;
      }
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
