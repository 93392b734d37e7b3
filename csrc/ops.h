// Entry points of the compiled ops; bindings.cpp turns Python arguments into these calls.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tree_attention_args.h"

namespace specinfer {

void tree_attention_cpu(const TreeAttentionArgs& args);

// out[M, N] = x[M, K] @ weight[N, K]^T (+ bias[N]); float32 or bfloat16, fp32 accumulation.
void linear_cpu(const TensorView& x, const TensorView& weight, const TensorView* bias,
                const TensorView& out);

// The same with the weight packed in panels of 16 output features, [N / 16, K, 16]
// (pack_linear_panels_cpu); linear_cpu takes this path for a 3-d weight.
void linear_panels_cpu(const TensorView& x, const TensorView& weight, const TensorView* bias,
                       const TensorView& out);
void pack_linear_panels_cpu(const TensorView& weight, const TensorView& out);
// Whether the panel kernel is this CPU's fastest linear for `dtype` ("float32" or "bfloat16").
bool linear_panels_preferred(const std::string& dtype);
// Where output feature n % 16 sits among a panel's 16 values, per column, for `dtype`.
std::vector<int> linear_panel_slots(const std::string& dtype);

// The size and layout checks both linears share (after their ndim, device and dtype checks).
void check_linear_sizes(const std::string& op, const TensorView& x, const TensorView& weight,
                        const TensorView* bias, const TensorView& out);

// The same with int8 weights, each output row scaled: out[m, n] = scale[n] * (x[m] . weight[n])
// (+ bias[n]); x, bias and out float32 or bfloat16, scale float32.
void linear_int8_cpu(const TensorView& x, const TensorView& weight, const TensorView& scale,
                     const TensorView* bias, const TensorView& out);

#ifdef SPECINFER_WITH_CUDA
// stream: a cudaStream_t as an integer (0 = the legacy default stream).
void tree_attention_cuda(const TreeAttentionArgs& args, uintptr_t stream);
int cuda_device_count();
#endif

}  // namespace specinfer

// --- kv_commit (see kv_commit_reference in python/specinfer/ops.py) ---
#include "core/kv_commit_args.h"

namespace specinfer {

// Applies the moves (from plan_kv_commit) to every cache, in order.
void kv_commit_cpu(const std::vector<TensorView>& caches, const std::vector<KvMove>& moves);
#ifdef SPECINFER_WITH_CUDA
void kv_commit_cuda(const std::vector<TensorView>& caches, const std::vector<KvMove>& moves,
                    uintptr_t stream);
#endif

}  // namespace specinfer

// --- topk_expand (see topk_expand_reference in python/specinfer/ops.py) ---
namespace specinfer {

// out[N] int64: the index of each row's first maximum, a NaN counting as the maximum (torch.max).
void argmax_cpu(const TensorView& logits, const TensorView& out);
// tokens[N, k] int64 and probs[N, k] float32: the k most likely tokens of softmax(logits / t).
void topk_expand_cpu(const TensorView& logits, int64_t k, float temperature,
                     const TensorView& tokens, const TensorView& probs);
#ifdef SPECINFER_WITH_CUDA
// float32, bfloat16 or float16 logits; k at most 64. Syncs `stream` to check every row.
void topk_expand_cuda(const TensorView& logits, int64_t k, float temperature,
                      const TensorView& tokens, const TensorView& probs, uintptr_t stream);
#endif

}  // namespace specinfer

// --- fused decoder-layer ops (see rms_norm_reference etc. in python/specinfer/ops.py) ---
namespace specinfer {

// out = rms_norm(x) * weight over the last dim; with residual, first residual += x and then
// out = rms_norm(residual) * weight. float32 or bfloat16 on cpu, rounded like HF Llama.
void rms_norm_cpu(const TensorView& x, const TensorView& weight, const TensorView* residual,
                  const TensorView& out, float eps);
// Rotates q [..., heads, D] and k [..., kv_heads, D] in place by cos/sin[positions] (tables
// [max_positions, D] in float32 or q's dtype, rotate_half layout); positions has q's leading dims.
void rotary_cpu(const TensorView& q, const TensorView& k, const TensorView& cos,
                const TensorView& sin, const TensorView& positions);
// out[..., I] = silu(x[..., :I]) * x[..., I:] (the fused gate/up projection's output).
void silu_mul_cpu(const TensorView& x, const TensorView& out);
// k/v_cache[cache_rows[b], :, slots[b, t]] = k/v[b, t]; indices are checked before any write.
void kv_write_cpu(const TensorView& k_cache, const TensorView& v_cache, const TensorView& k,
                  const TensorView& v, const TensorView& cache_rows, const TensorView& slots);

}  // namespace specinfer

// --- verifiers (see the references in python/specinfer/verify.py) ---
#include <utility>

namespace specinfer {

// Each returns (path, next_token): the accepted nodes from the root 0 and the target's token
// after the last of them. Trees: parents [T] (parents[0] = -1, parents before children), tokens
// [T]; all on cpu.
std::pair<std::vector<int64_t>, int64_t> verify_greedy_cpu(const TensorView& parents,
                                                           const TensorView& tokens,
                                                           const TensorView& target_argmax);
// Multi-step speculative sampling; proposal i drew child prop_child[i] of prop_parent[i] from
// q[prop_q[i]], or deterministically when prop_q[i] = -1 (q may then be null).
std::pair<std::vector<int64_t>, int64_t> verify_stochastic_cpu(
    const TensorView& parents, const TensorView& tokens, const TensorView& p_target,
    const TensorView& prop_parent, const TensorView& prop_child, const TensorView& prop_q,
    const TensorView* q, uint64_t seed);
std::pair<std::vector<int64_t>, int64_t> verify_naive_cpu(const TensorView& parents,
                                                          const TensorView& tokens,
                                                          const TensorView& p_target,
                                                          uint64_t seed);

}  // namespace specinfer

// --- penalties (see Penalties.apply in python/specinfer/sampling.py) ---
namespace specinfer {

// Penalises logits [rows, columns] float32 in place: column j is token vocab_ids[j] (all
// vocab_size tokens in order when null); row r holds the prompt's tokens (prompt_tokens, int64),
// the output's (counted) and branches[r]'s (counted; branches empty: none).
void apply_penalties_cpu(const TensorView& logits, const TensorView& prompt_tokens,
                         const std::vector<int64_t>& output_ids,
                         const std::vector<std::vector<int64_t>>& branches,
                         const TensorView* vocab_ids, int64_t vocab_size, float repetition,
                         float presence, float frequency);

}  // namespace specinfer
