// Entry points of the compiled ops; bindings.cpp turns Python arguments into these calls.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tree_attention_args.h"

namespace specinfer {

void tree_attention_cpu(const TreeAttentionArgs& args);

#ifdef SPECINFER_WITH_CUDA
// stream: a cudaStream_t as an integer (0 = the legacy default stream).
void tree_attention_cuda(const TreeAttentionArgs& args, uintptr_t stream);
int cuda_device_count();
#endif

}  // namespace specinfer
