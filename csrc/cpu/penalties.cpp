// Repetition, presence and frequency penalties on one request's logits, in place (semantics:
// Penalties.apply in python/specinfer/sampling.py). Only the columns of tokens the request holds
// change: its prompt's, its output's and, per row, its branch's, a few hundred where a row has
// ~50k columns. So a call costs O(held tokens) a row, plus one pass over a restricted head's
// token ids to find their columns, where the torch path runs ~30 ops over the whole vocabulary.
#include <string>
#include <utility>
#include <vector>

#include "ops.h"

namespace specinfer {
namespace {

void check_token_ids(const TensorView& v, const std::string& op, const char* name) {
  check_ndim(v, 1, op, name, "[n]");
  check_dtype_is(v, DType::kInt32, DType::kInt64, op, name);
  if (v.device != Device::kCPU) fail(op, std::string(name) + " must be on cpu");
}

}  // namespace

void apply_penalties_cpu(const TensorView& logits, const TensorView& prompt_tokens,
                         const std::vector<int64_t>& output_ids,
                         const std::vector<std::vector<int64_t>>& branches,
                         const TensorView* vocab_ids, int64_t vocab_size, float repetition,
                         float presence, float frequency) {
  const std::string op = "apply_penalties";
  check_ndim(logits, 2, op, "logits", "[rows, columns]");
  if (logits.dtype != DType::kFloat32) {
    fail(op, std::string("logits must be float32, got ") + dtype_name(logits.dtype));
  }
  if (logits.device != Device::kCPU) fail(op, "logits must be on cpu");
  check_last_dim_contiguous(logits, op, "logits");
  const int64_t rows = logits.shape[0], columns = logits.shape[1];
  check_token_ids(prompt_tokens, op, "prompt_tokens");
  if (vocab_ids != nullptr) {
    check_token_ids(*vocab_ids, op, "vocab_ids");
    check_size(*vocab_ids, 0, columns, op, "vocab_ids", "a token id per column of logits");
  }
  if (!branches.empty() && int64_t(branches.size()) != rows) {
    fail(op, "branches has " + std::to_string(branches.size()) + " entries for " +
                 std::to_string(rows) + " rows (one a row, or none)");
  }
  if (vocab_ids == nullptr && columns != vocab_size) {
    fail(op, "logits has " + std::to_string(columns) + " columns for a vocabulary of " +
                 std::to_string(vocab_size) + " (a restricted head needs its vocab_ids)");
  }

  // The held tokens, each once: slot_of[token] is its index among them (-1: not held).
  std::vector<int32_t> slot_of(vocab_size, -1);
  std::vector<int64_t> held;
  std::vector<char> in_prompt;
  std::vector<int32_t> count;  // in the output
  auto hold = [&](int64_t token, const char* where) {
    if (token < 0 || token >= vocab_size) {
      fail(op, std::string("token ") + std::to_string(token) + " in " + where +
                   " is outside the vocabulary [0, " + std::to_string(vocab_size) + ")");
    }
    if (slot_of[token] < 0) {
      slot_of[token] = int32_t(held.size());
      held.push_back(token);
      in_prompt.push_back(0);
      count.push_back(0);
    }
    return slot_of[token];
  };
  for (int64_t i = 0; i < prompt_tokens.shape[0]; ++i) {
    in_prompt[hold(index_at(prompt_tokens, i), "the prompt")] = 1;
  }
  for (int64_t token : output_ids) ++count[hold(token, "the output")];
  for (const auto& branch : branches) {
    for (int64_t token : branch) hold(token, "a branch");
  }

  std::vector<std::pair<int64_t, int32_t>> columns_held;  // (column, slot)
  if (vocab_ids == nullptr) {
    for (size_t s = 0; s < held.size(); ++s) columns_held.emplace_back(held[s], int32_t(s));
  } else {
    for (int64_t j = 0; j < columns; ++j) {
      const int64_t token = index_at(*vocab_ids, j);
      if (token < 0 || token >= vocab_size) {
        fail(op, "vocab_ids[" + std::to_string(j) + "] = " + std::to_string(token) +
                     " is outside the vocabulary [0, " + std::to_string(vocab_size) + ")");
      }
      if (slot_of[token] >= 0) columns_held.emplace_back(j, slot_of[token]);
    }
  }

  std::vector<int32_t> in_branch(held.size(), 0);
  for (int64_t r = 0; r < rows; ++r) {
    const std::vector<int64_t>* branch = branches.empty() ? nullptr : &branches[r];
    if (branch != nullptr) {
      for (int64_t token : *branch) ++in_branch[slot_of[token]];
    }
    float* row = logits.ptr<float>() + r * logits.strides[0];
    for (const auto& [column, s] : columns_held) {
      const int32_t c = count[s] + in_branch[s];
      float x = row[column];
      if (repetition != 1.0f && (in_prompt[s] || c > 0)) {
        x = x > 0 ? x / repetition : x * repetition;
      }
      if (presence != 0.0f || frequency != 0.0f) {
        // Rounded as the torch path's separate ops: x - f * c, then - p * (c > 0).
        x = x - frequency * float(c);
        x = x - presence * (c > 0 ? 1.0f : 0.0f);
      }
      row[column] = x;
    }
    if (branch != nullptr) {
      for (int64_t token : *branch) --in_branch[slot_of[token]];
    }
  }
}

}  // namespace specinfer
