// Token-tree verifiers (semantics: the references in python/specinfer/verify.py). One request per
// call on the host: a walk down one root-to-node path, O(path length x vocabulary).
#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "ops.h"

namespace specinfer {
namespace {

std::string at(const char* name, int64_t i) {
  return std::string(name) + "[" + std::to_string(i) + "]";
}

void check_on_cpu(const TensorView& v, const std::string& op, const char* name) {
  if (v.device != Device::kCPU) {
    fail(op, std::string(name) + " must be on cpu, got " + device_name(v.device));
  }
}

// A 1-D int32/int64 host tensor as int64 values.
std::vector<int64_t> read_indices(const TensorView& v, const std::string& op, const char* name) {
  check_ndim(v, 1, op, name, "[n]");
  check_dtype_is(v, DType::kInt32, DType::kInt64, op, name);
  check_on_cpu(v, op, name);
  std::vector<int64_t> out(v.shape[0]);
  for (int64_t i = 0; i < v.shape[0]; ++i) out[i] = index_at(v, i);
  return out;
}

// Nodes 0..T-1 with parents before children; node 0 is the root.
struct Tree {
  std::vector<int64_t> parents, tokens;
  std::vector<std::vector<int64_t>> children;  // in node order
};

Tree read_tree(const TensorView& parents, const TensorView& tokens, const std::string& op) {
  Tree t{read_indices(parents, op, "parents"), read_indices(tokens, op, "tokens"), {}};
  const int64_t T = int64_t(t.parents.size());
  if (T == 0) fail(op, "parents is empty (node 0, the root, is required)");
  check_size(tokens, 0, T, op, "tokens", "nodes in parents");
  if (t.parents[0] != -1) {
    fail(op, "parents[0] = " + std::to_string(t.parents[0]) + " must be -1 (node 0 is the root)");
  }
  t.children.resize(T);
  for (int64_t u = 1; u < T; ++u) {
    const int64_t p = t.parents[u];
    if (p < 0 || p >= u) {
      fail(op, at("parents", u) + " = " + std::to_string(p) + " must be in [0, " +
                   std::to_string(u) + ") (parents come before children)");
    }
    t.children[p].push_back(u);
  }
  return t;
}

// A [rows, vocab] float32 host table of distributions.
void check_table(const TensorView& v, const std::string& op, const char* name) {
  check_ndim(v, 2, op, name, "[rows, vocab]");
  if (v.dtype != DType::kFloat32) {
    fail(op, std::string(name) + " must be float32, got " + dtype_name(v.dtype));
  }
  check_on_cpu(v, op, name);
  check_last_dim_contiguous(v, op, name);
}

// Row `row` of a checked table, normalised in double (float inputs sum to 1 only roughly).
void load_distribution(const TensorView& table, int64_t row, const std::string& op,
                       const char* name, std::vector<double>& out) {
  const float* src = table.ptr<const float>() + row * table.strides[0];
  const int64_t V = table.shape[1];
  double sum = 0.0;
  for (int64_t v = 0; v < V; ++v) {
    if (!(src[v] >= 0.0f) || std::isinf(src[v])) {
      fail(op, at(name, row) + "[" + std::to_string(v) + "] = " + std::to_string(src[v]) +
                   " is not a probability");
    }
    sum += src[v];
  }
  if (!(sum > 0.0)) fail(op, at(name, row) + " sums to 0");
  out.resize(V);
  for (int64_t v = 0; v < V; ++v) out[v] = src[v] / sum;
}

// A seeded stream, so a request's verification is reproducible from its generator.
class Rng {
 public:
  explicit Rng(uint64_t seed) : engine_(seed) {}
  double uniform() { return double(engine_() >> 11) * 0x1.0p-53; }  // [0, 1), 53 random bits
  // Modulo bias is n / 2^64: nothing for tree widths.
  uint64_t below(uint64_t n) { return engine_() % n; }

 private:
  std::mt19937_64 engine_;
};

void shuffle(std::vector<int64_t>& v, Rng& rng) {
  for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[rng.below(i)]);
}

// A draw from r (non-negative, positive total).
int64_t sample(const std::vector<double>& r, Rng& rng) {
  double total = 0.0;
  for (double x : r) total += x;
  const double target = rng.uniform() * total;
  double cumulative = 0.0;
  int64_t last = -1;
  for (size_t i = 0; i < r.size(); ++i) {
    if (r[i] <= 0.0) continue;
    last = int64_t(i);
    cumulative += r[i];
    if (target < cumulative) return last;
  }
  return last;  // rounding left the target at the very end
}

// r <- norm(residual). The chance of the rejection that led here equals the residual's mass, so
// a residual without mass means the rejection happened only through rounding (r equals the
// proposal distribution up to it); r is then kept, the closest valid distribution.
void adopt_residual(const std::vector<double>& residual, std::vector<double>& r) {
  double total = 0.0;
  for (double x : residual) total += x;
  if (!(total > 0.0)) return;
  for (size_t i = 0; i < r.size(); ++i) r[i] = residual[i] / total;
}

}  // namespace

std::pair<std::vector<int64_t>, int64_t> verify_greedy_cpu(const TensorView& parents,
                                                           const TensorView& tokens,
                                                           const TensorView& target_argmax) {
  const std::string op = "verify_greedy";
  const Tree tree = read_tree(parents, tokens, op);
  const std::vector<int64_t> argmax = read_indices(target_argmax, op, "target_argmax");
  check_size(target_argmax, 0, int64_t(tree.parents.size()), op, "target_argmax",
             "nodes in parents");
  std::vector<int64_t> path{0};
  while (true) {
    const int64_t u = path.back(), want = argmax[u];
    if (want < 0) fail(op, at("target_argmax", u) + " = " + std::to_string(want) + " is negative");
    const auto& kids = tree.children[u];
    const auto hit =
        std::find_if(kids.begin(), kids.end(), [&](int64_t c) { return tree.tokens[c] == want; });
    if (hit == kids.end()) return {path, want};
    path.push_back(*hit);
  }
}

std::pair<std::vector<int64_t>, int64_t> verify_stochastic_cpu(
    const TensorView& parents, const TensorView& tokens, const TensorView& p_target,
    const TensorView& prop_parent, const TensorView& prop_child, const TensorView& prop_q,
    const TensorView* q, uint64_t seed) {
  const std::string op = "verify_stochastic";
  const Tree tree = read_tree(parents, tokens, op);
  const int64_t T = int64_t(tree.parents.size());
  check_table(p_target, op, "p_target");
  check_size(p_target, 0, T, op, "p_target", "nodes in parents");
  const int64_t V = p_target.shape[1];
  int64_t R = 0;
  if (q != nullptr) {
    check_table(*q, op, "q");
    check_size(*q, 1, V, op, "q", "vocab of p_target");
    R = q->shape[0];
  }
  const std::vector<int64_t> pp = read_indices(prop_parent, op, "prop_parent"),
                             pc = read_indices(prop_child, op, "prop_child"),
                             pq = read_indices(prop_q, op, "prop_q");
  const int64_t P = int64_t(pp.size());
  check_size(prop_child, 0, P, op, "prop_child", "proposals in prop_parent");
  check_size(prop_q, 0, P, op, "prop_q", "proposals in prop_parent");

  std::vector<std::vector<int64_t>> proposals_of(T);
  std::vector<bool> proposed(T, false);
  for (int64_t p = 0; p < P; ++p) {
    const int64_t c = pc[p];
    if (c < 1 || c >= T) {
      fail(op, at("prop_child", p) + " = " + std::to_string(c) +
                   " must be a non-root node in [1, " + std::to_string(T) + ")");
    }
    if (pp[p] != tree.parents[c]) {
      fail(op, at("prop_parent", p) + " = " + std::to_string(pp[p]) + " but node " +
                   std::to_string(c) + "'s parent is " + std::to_string(tree.parents[c]));
    }
    if (pq[p] < -1 || pq[p] >= R) {
      fail(op, at("prop_q", p) + " = " + std::to_string(pq[p]) +
                   " must be -1 (a deterministic proposal) or a row of q in [0, " +
                   std::to_string(R) + ")" + (q == nullptr ? " (q is None)" : ""));
    }
    proposals_of[pp[p]].push_back(p);
    proposed[c] = true;
  }
  for (int64_t u = 1; u < T; ++u) {
    if (!proposed[u]) {
      fail(op, "node " + std::to_string(u) + " has no proposal (each child records its draws)");
    }
    if (tree.tokens[u] < 0 || tree.tokens[u] >= V) {
      fail(op, at("tokens", u) + " = " + std::to_string(tree.tokens[u]) + " is out of range [0, " +
                   std::to_string(V) + ")");
    }
  }

  Rng rng(seed);
  std::vector<int64_t> path{0};
  std::vector<double> r, d;
  while (true) {
    const int64_t u = path.back();
    load_distribution(p_target, u, op, "p_target", r);
    std::vector<int64_t> order = proposals_of[u];
    shuffle(order, rng);
    int64_t accepted = -1;
    for (const int64_t p : order) {
      const int64_t child = pc[p], x = tree.tokens[child];
      if (pq[p] < 0) {  // a point mass at x: accept with probability r[x]
        if (rng.uniform() < r[x]) {
          accepted = child;
          break;
        }
        d = r;
        d[x] = 0.0;
      } else {  // drawn from d: accept with probability min(1, r[x] / d[x])
        load_distribution(*q, pq[p], op, "q", d);
        if (d[x] == 0.0) {
          fail(op, at("q", pq[p]) + "[" + std::to_string(x) + "] = 0, but proposal " +
                       std::to_string(p) + " drew token " + std::to_string(x) + " from it");
        }
        if (rng.uniform() * d[x] < r[x]) {
          accepted = child;
          break;
        }
        for (int64_t v = 0; v < V; ++v) d[v] = std::max(0.0, r[v] - d[v]);
      }
      adopt_residual(d, r);
    }
    if (accepted < 0) return {path, sample(r, rng)};
    path.push_back(accepted);
  }
}

std::pair<std::vector<int64_t>, int64_t> verify_naive_cpu(const TensorView& parents,
                                                          const TensorView& tokens,
                                                          const TensorView& p_target,
                                                          uint64_t seed) {
  const std::string op = "verify_naive";
  const Tree tree = read_tree(parents, tokens, op);
  check_table(p_target, op, "p_target");
  check_size(p_target, 0, int64_t(tree.parents.size()), op, "p_target", "nodes in parents");
  Rng rng(seed);
  std::vector<int64_t> path{0};
  std::vector<double> r;
  while (true) {
    const int64_t u = path.back();
    load_distribution(p_target, u, op, "p_target", r);
    const int64_t x = sample(r, rng);
    const auto& kids = tree.children[u];
    const auto hit =
        std::find_if(kids.begin(), kids.end(), [&](int64_t c) { return tree.tokens[c] == x; });
    if (hit == kids.end()) return {path, x};
    path.push_back(*hit);
  }
}

}  // namespace specinfer
