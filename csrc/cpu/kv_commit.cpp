#include <cstring>

#include "ops.h"

namespace specinfer {

// A commit copies a few slots per request and layer (a few hundred KB in all): serial memmoves.
void kv_commit_cpu(const std::vector<TensorView>& caches, const std::vector<KvMove>& moves) {
  for (const TensorView& c : caches) {
    const int64_t heads = c.shape[1];
    const size_t elem = c.dtype == DType::kFloat32 ? 4 : 2;
    const size_t bytes = size_t(c.shape[3]) * elem;
    auto* base = static_cast<char*>(c.data);
    for (const KvMove& m : moves) {
      for (int64_t h = 0; h < heads; ++h) {
        const auto at = [&](int64_t row, int64_t slot) {
          return base +
                 (row * c.strides[0] + h * c.strides[1] + slot * c.strides[2]) * int64_t(elem);
        };
        std::memmove(at(m.dst_row, m.dst), at(m.src_row, m.src), bytes);
      }
    }
  }
}

}  // namespace specinfer
