// The only file that knows Python. Tensors arrive as any object with __dlpack__ and are handed to
// the ops as checked views; the ops never see Python objects.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/dlpack.h"
#include "core/tensor_view.h"
#include "core/topk_expand_args.h"
#include "cpu/cpu_features.h"
#include "ops.h"

namespace py = pybind11;
using namespace specinfer;

namespace {

// A tensor borrowed for one call. The capsule is held (keeping the producer's memory alive) and
// never renamed, so its own destructor releases the DLManagedTensor afterwards.
struct Borrowed {
  py::object capsule;
  TensorView view;
};

// torch.Tensor.__dlpack__ is Python code taking 3-5 us a tensor, longer than a small kernel runs
// at decode sizes; torch's C exporter makes the same capsule in well under 1 us (and does not
// refuse tensors that require grad, which no op differentiates). Looked up once torch is imported,
// which it is whenever a torch tensor arrives, and kept for the life of the process.
py::object dlpack_capsule(py::handle obj) {
  static PyObject* tensor_type = nullptr;
  static PyObject* to_dlpack = nullptr;
  if (tensor_type == nullptr && py::module_::import("sys").attr("modules").contains("torch")) {
    tensor_type = py::object(py::module_::import("torch").attr("Tensor")).release().ptr();
    to_dlpack =
        py::object(py::module_::import("torch.utils.dlpack").attr("to_dlpack")).release().ptr();
  }
  if (tensor_type != nullptr && py::isinstance(obj, py::handle(tensor_type))) {
    return py::handle(to_dlpack)(obj);
  }
  if (!py::hasattr(obj, "__dlpack__")) return py::object();
  return obj.attr("__dlpack__")();
}

Borrowed borrow(py::handle obj, const std::string& op, const char* name) {
  py::object capsule = dlpack_capsule(obj);
  if (!capsule) {
    fail(op, std::string(name) + " must be a tensor with __dlpack__ (e.g. torch.Tensor), got " +
                 std::string(py::str(py::type::of(obj).attr("__name__"))));
  }
  auto* managed =
      static_cast<dlpack::ManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
  if (managed == nullptr) {
    PyErr_Clear();
    fail(op, std::string(name) + ".__dlpack__() did not return a \"dltensor\" capsule");
  }
  return {capsule, view_from_dlpack(managed->dl_tensor, op, name)};
}

// A recorded sequence of op calls, replayed later in one call without Python: the CPU analogue of
// a CUDA graph. At decode sizes a model step is ~300 small ops whose Python glue costs as much as
// the arithmetic; a replay pays for none of it. Each step keeps its checked views and re-runs the
// op's checks (indices change between replays); the capsules keep every tensor alive.
class OpGraph {
 public:
  ~OpGraph() { end(); }
  void begin() {
    if (recording_ != nullptr)
      throw std::runtime_error("OpGraph: another graph is recording in this thread");
    steps_.clear();
    keep_alive_.clear();
    recording_ = this;
  }
  void end() {
    if (recording_ == this) recording_ = nullptr;
  }
  void replay() const {
    if (recording_ != nullptr) throw std::runtime_error("OpGraph: cannot replay while recording");
    py::gil_scoped_release release;
    for (const auto& step : steps_) step();
  }
  size_t size() const { return steps_.size(); }
  static bool recording() { return recording_ != nullptr; }

  // Runs `fn` (without the GIL) and, while a graph records, appends it to that graph.
  template <typename Fn>
  static void run(std::initializer_list<const Borrowed*> tensors, Fn fn) {
    {
      py::gil_scoped_release release;
      fn();
    }
    if (recording_ == nullptr) return;
    for (const Borrowed* b : tensors) {
      if (b->capsule) recording_->keep_alive_.push_back(b->capsule);
    }
    recording_->steps_.emplace_back(std::move(fn));
  }

  // For ops a graph cannot hold (host results, device work): refuse rather than drop them.
  static void refuse(const std::string& op) {
    if (recording_ != nullptr) fail(op, "cannot run while an OpGraph records");
  }

 private:
  std::vector<std::function<void()>> steps_;
  std::vector<py::object> keep_alive_;
  static inline thread_local OpGraph* recording_ = nullptr;  // per thread: others run on
};

void tree_attention(py::handle q, py::handle k_cache, py::handle v_cache, py::handle cache_rows,
                    py::handle prefix_lens, py::handle tree_mask, py::handle out, float scale,
                    uintptr_t stream, bool check_indices) {
  const std::string op = "tree_attention";
  Borrowed bq = borrow(q, op, "q"), bk = borrow(k_cache, op, "k_cache"),
           bv = borrow(v_cache, op, "v_cache"), brows = borrow(cache_rows, op, "cache_rows"),
           bprefix = borrow(prefix_lens, op, "prefix_lens"),
           bmask = borrow(tree_mask, op, "tree_mask"), bout = borrow(out, op, "out");
  TreeAttentionArgs args{bq.view,    bk.view,   bv.view, brows.view,   bprefix.view,
                         bmask.view, bout.view, scale,   check_indices};
  check_tree_attention_args(args);
  if (args.q.device == Device::kCPU) {
    OpGraph::run({&bq, &bk, &bv, &brows, &bprefix, &bmask, &bout}, [args] {
      check_tree_attention_args(args);
      tree_attention_cpu(args);
    });
    return;
  }
  OpGraph::refuse(op);
  py::gil_scoped_release release;
#ifdef SPECINFER_WITH_CUDA
  tree_attention_cuda(args, stream);
#else
  (void)stream;
  fail(op, "q is a cuda tensor but specinfer._C was built without CUDA");
#endif
}

void linear(py::handle x, py::handle weight, py::handle bias, py::handle out) {
  const std::string op = "linear";
  Borrowed bx = borrow(x, op, "x"), bw = borrow(weight, op, "weight"),
           bout = borrow(out, op, "out");
  Borrowed bbias;
  const bool has_bias = !bias.is_none();
  if (has_bias) bbias = borrow(bias, op, "bias");
  OpGraph::run({&bx, &bw, &bout, &bbias},
               [x = bx.view, w = bw.view, b = bbias.view, out = bout.view, has_bias] {
                 linear_cpu(x, w, has_bias ? &b : nullptr, out);
               });
}

void pack_linear_panels(py::handle weight, py::handle out) {
  const std::string op = "pack_linear_panels";
  Borrowed bw = borrow(weight, op, "weight"), bout = borrow(out, op, "out");
  OpGraph::refuse(op);
  py::gil_scoped_release release;
  pack_linear_panels_cpu(bw.view, bout.view);
}

void linear_int8(py::handle x, py::handle weight, py::handle scale, py::handle bias,
                 py::handle out) {
  const std::string op = "linear_int8";
  Borrowed bx = borrow(x, op, "x"), bw = borrow(weight, op, "weight"),
           bs = borrow(scale, op, "scale"), bout = borrow(out, op, "out");
  Borrowed bbias;
  const bool has_bias = !bias.is_none();
  if (has_bias) bbias = borrow(bias, op, "bias");
  OpGraph::run({&bx, &bw, &bs, &bout, &bbias},
               [x = bx.view, w = bw.view, s = bs.view, b = bbias.view, out = bout.view, has_bias] {
                 linear_int8_cpu(x, w, s, has_bias ? &b : nullptr, out);
               });
}

std::vector<std::string> backends() {
#ifdef SPECINFER_WITH_CUDA
  return {"cpu", "cuda"};
#else
  return {"cpu"};
#endif
}

int device_count() {
#ifdef SPECINFER_WITH_CUDA
  return cuda_device_count();
#else
  return 0;
#endif
}

void kv_commit(const py::sequence& caches, py::handle cache_rows, py::handle prefix_lens,
               py::handle accepted, uintptr_t stream) {
  const std::string op = "kv_commit";
  OpGraph::refuse(op);
  std::vector<Borrowed> borrowed;
  KvCommitArgs args;
  for (size_t i = 0; i < caches.size(); ++i) {
    borrowed.push_back(borrow(caches[i], op, list_item("caches", i).c_str()));
    args.caches.push_back(borrowed.back().view);
  }
  Borrowed brows = borrow(cache_rows, op, "cache_rows"),
           bprefix = borrow(prefix_lens, op, "prefix_lens"),
           baccepted = borrow(accepted, op, "accepted");
  args.cache_rows = brows.view;
  args.prefix_lens = bprefix.view;
  args.accepted = baccepted.view;
  check_kv_commit_args(args);
  const std::vector<KvMove> moves = plan_kv_commit(args);
  py::gil_scoped_release release;
  if (args.caches[0].device == Device::kCPU) {
    kv_commit_cpu(args.caches, moves);
    return;
  }
#ifdef SPECINFER_WITH_CUDA
  kv_commit_cuda(args.caches, moves, stream);
#else
  (void)stream;
  fail(op, "caches are cuda tensors but specinfer._C was built without CUDA");
#endif
}

void topk_expand(py::handle logits, int64_t k, float temperature, py::handle tokens,
                 py::handle probs, uintptr_t stream) {
  const std::string op = "topk_expand";
  OpGraph::refuse(op);
  Borrowed blogits = borrow(logits, op, "logits"), btokens = borrow(tokens, op, "tokens"),
           bprobs = borrow(probs, op, "probs");
  check_topk_expand_args(blogits.view, k, temperature, btokens.view, bprobs.view);
  py::gil_scoped_release release;
  if (blogits.view.device == Device::kCPU) {
    topk_expand_cpu(blogits.view, k, temperature, btokens.view, bprobs.view);
    return;
  }
#ifdef SPECINFER_WITH_CUDA
  topk_expand_cuda(blogits.view, k, temperature, btokens.view, bprobs.view, stream);
#else
  (void)stream;
  fail(op, "logits is a cuda tensor but specinfer._C was built without CUDA");
#endif
}

void argmax(py::handle logits, py::handle out) {
  const std::string op = "argmax";
  OpGraph::refuse(op);
  Borrowed blogits = borrow(logits, op, "logits"), bout = borrow(out, op, "out");
  py::gil_scoped_release release;
  argmax_cpu(blogits.view, bout.view);
}

void rms_norm(py::handle x, py::handle weight, py::handle residual, py::handle out, float eps) {
  const std::string op = "rms_norm";
  Borrowed bx = borrow(x, op, "x"), bw = borrow(weight, op, "weight"),
           bout = borrow(out, op, "out");
  Borrowed bres;
  const bool has_residual = !residual.is_none();
  if (has_residual) bres = borrow(residual, op, "residual");
  OpGraph::run({&bx, &bw, &bout, &bres},
               [x = bx.view, w = bw.view, res = bres.view, out = bout.view, has_residual, eps] {
                 rms_norm_cpu(x, w, has_residual ? &res : nullptr, out, eps);
               });
}

void rotary(py::handle q, py::handle k, py::handle cos, py::handle sin, py::handle positions) {
  const std::string op = "rotary";
  Borrowed bq = borrow(q, op, "q"), bk = borrow(k, op, "k"), bcos = borrow(cos, op, "cos"),
           bsin = borrow(sin, op, "sin"), bpos = borrow(positions, op, "positions");
  OpGraph::run({&bq, &bk, &bcos, &bsin, &bpos},
               [q = bq.view, k = bk.view, c = bcos.view, s = bsin.view, pos = bpos.view] {
                 rotary_cpu(q, k, c, s, pos);
               });
}

void silu_mul(py::handle x, py::handle out) {
  const std::string op = "silu_mul";
  Borrowed bx = borrow(x, op, "x"), bout = borrow(out, op, "out");
  OpGraph::run({&bx, &bout}, [x = bx.view, out = bout.view] { silu_mul_cpu(x, out); });
}

void kv_write(py::handle k_cache, py::handle v_cache, py::handle k, py::handle v,
              py::handle cache_rows, py::handle slots) {
  const std::string op = "kv_write";
  Borrowed bkc = borrow(k_cache, op, "k_cache"), bvc = borrow(v_cache, op, "v_cache"),
           bk = borrow(k, op, "k"), bv = borrow(v, op, "v"),
           brows = borrow(cache_rows, op, "cache_rows"), bslots = borrow(slots, op, "slots");
  OpGraph::run({&bkc, &bvc, &bk, &bv, &brows, &bslots},
               [kc = bkc.view, vc = bvc.view, k = bk.view, v = bv.view, rows = brows.view,
                slots = bslots.view] { kv_write_cpu(kc, vc, k, v, rows, slots); });
}

using VerifyResult = std::pair<std::vector<int64_t>, int64_t>;

VerifyResult verify_greedy(py::handle parents, py::handle tokens, py::handle target_argmax) {
  const std::string op = "verify_greedy";
  OpGraph::refuse(op);
  Borrowed bp = borrow(parents, op, "parents"), bt = borrow(tokens, op, "tokens"),
           ba = borrow(target_argmax, op, "target_argmax");
  py::gil_scoped_release release;
  return verify_greedy_cpu(bp.view, bt.view, ba.view);
}

VerifyResult verify_stochastic(py::handle parents, py::handle tokens, py::handle p_target,
                               py::handle prop_parent, py::handle prop_child, py::handle prop_q,
                               py::handle q, uint64_t seed) {
  const std::string op = "verify_stochastic";
  OpGraph::refuse(op);
  Borrowed bp = borrow(parents, op, "parents"), bt = borrow(tokens, op, "tokens"),
           bprobs = borrow(p_target, op, "p_target"), bpp = borrow(prop_parent, op, "prop_parent"),
           bpc = borrow(prop_child, op, "prop_child"), bpq = borrow(prop_q, op, "prop_q");
  Borrowed bq;
  if (!q.is_none()) bq = borrow(q, op, "q");
  py::gil_scoped_release release;
  return verify_stochastic_cpu(bp.view, bt.view, bprobs.view, bpp.view, bpc.view, bpq.view,
                               q.is_none() ? nullptr : &bq.view, seed);
}

VerifyResult verify_naive(py::handle parents, py::handle tokens, py::handle p_target,
                          uint64_t seed) {
  const std::string op = "verify_naive";
  OpGraph::refuse(op);
  Borrowed bp = borrow(parents, op, "parents"), bt = borrow(tokens, op, "tokens"),
           bprobs = borrow(p_target, op, "p_target");
  py::gil_scoped_release release;
  return verify_naive_cpu(bp.view, bt.view, bprobs.view, seed);
}

void apply_penalties(py::handle logits, py::handle prompt_tokens,
                     const std::vector<int64_t>& output_ids,
                     const std::vector<std::vector<int64_t>>& branches, py::handle vocab_ids,
                     int64_t vocab_size, float repetition, float presence, float frequency) {
  const std::string op = "apply_penalties";
  OpGraph::refuse(op);
  Borrowed bl = borrow(logits, op, "logits"), bp = borrow(prompt_tokens, op, "prompt_tokens");
  Borrowed bv;
  if (!vocab_ids.is_none()) bv = borrow(vocab_ids, op, "vocab_ids");
  py::gil_scoped_release release;
  apply_penalties_cpu(bl.view, bp.view, output_ids, branches,
                      vocab_ids.is_none() ? nullptr : &bv.view, vocab_size, repetition, presence,
                      frequency);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "specinfer compiled core; see specinfer.ops for the Python-facing wrappers";
  m.def("tree_attention", &tree_attention, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("cache_rows"), py::arg("prefix_lens"), py::arg("tree_mask"), py::arg("out"),
        py::arg("scale"), py::arg("stream") = 0, py::arg("check_indices") = true,
        "Tree attention into `out` (semantics: specinfer.ops.tree_attention_reference). "
        "`stream` is the cudaStream_t (as int) for CUDA tensors; check_indices=False skips "
        "the host check of cache_rows and prefix_lens on CUDA (no copy, no wait).");
  m.def("linear", &linear, py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("out"),
        "out = x @ weight.T + bias on cpu (bias may be None); float32 or bfloat16.");
  m.def("pack_linear_panels", &pack_linear_panels, py::arg("weight"), py::arg("out"),
        "out[n // 16, k, slot(n % 16)] = weight[n, k]: the layout linear takes as a 3-d weight "
        "(out [out_features / 16, in_features, 16], same dtype).");
  m.def("linear_panel_slots", &linear_panel_slots, py::arg("dtype"),
        "Where each of a panel's 16 output features sits among its 16 values at a column.");
  m.def("linear_panels_preferred", &linear_panels_preferred, py::arg("dtype"),
        "Whether packed weights run this CPU's fastest linear for dtype ('float32' or "
        "'bfloat16').");
  m.def("linear_int8", &linear_int8, py::arg("x"), py::arg("weight"), py::arg("scale"),
        py::arg("bias"), py::arg("out"),
        "out = (x @ weight.T) * scale + bias on cpu: int8 weight, float32 scale per output "
        "feature, x/bias/out float32 or bfloat16 (bias may be None).");
  py::class_<OpGraph>(m, "OpGraph",
                      "Records the compiled cpu ops run between begin() and end(); replay() runs "
                      "them again on the same tensors (current contents) in one call. See "
                      "specinfer.graphs.")
      .def(py::init<>())
      .def("begin", &OpGraph::begin)
      .def("end", &OpGraph::end)
      .def("replay", &OpGraph::replay)
      .def("__len__", &OpGraph::size);
  m.def("is_recording", &OpGraph::recording, "Whether an OpGraph is recording.");
  m.def("backends", &backends, "Backends compiled in, e.g. ['cpu', 'cuda'].");
  m.def("cuda_device_count", &device_count, "Visible CUDA devices; 0 without CUDA or a driver.");
  m.def(
      "cpu_isa", [] { return std::string(specinfer::cpu::active_isa()); },
      "The CPU kernel family in use: avx512_bf16, avx512, avx2 or portable (SPECINFER_CPU_ISA "
      "caps it).");
  m.def("kv_commit", &kv_commit, py::arg("caches"), py::arg("cache_rows"), py::arg("prefix_lens"),
        py::arg("accepted"), py::arg("stream") = 0,
        "Moves each request's accepted tree nodes' K/V to consecutive slots in every cache "
        "(semantics: specinfer.ops.kv_commit_reference). Index tensors must be on cpu.");
  m.def("argmax", &argmax, py::arg("logits"), py::arg("out"),
        "Into `out` [rows] int64: the index of the first maximum of each row of `logits` "
        "[rows, vocab] (float32 or bfloat16, on cpu), a NaN counting as the maximum, as "
        "torch.max does.");
  m.def("topk_expand", &topk_expand, py::arg("logits"), py::arg("k"), py::arg("temperature"),
        py::arg("tokens"), py::arg("probs"), py::arg("stream") = 0,
        "The k most likely tokens of softmax(logits / temperature) and their probabilities into "
        "`tokens` and `probs` (semantics: specinfer.ops.topk_expand_reference); on cuda k <= 64 "
        "and `stream` is the cudaStream_t (as int).");
  m.def("verify_greedy", &verify_greedy, py::arg("parents"), py::arg("tokens"),
        py::arg("target_argmax"), "(path, next_token); see specinfer.verify.verify_greedy.");
  m.def("verify_stochastic", &verify_stochastic, py::arg("parents"), py::arg("tokens"),
        py::arg("p_target"), py::arg("prop_parent"), py::arg("prop_child"), py::arg("prop_q"),
        py::arg("q"), py::arg("seed"),
        "(path, next_token); see specinfer.verify.verify_stochastic.");
  m.def("verify_naive", &verify_naive, py::arg("parents"), py::arg("tokens"), py::arg("p_target"),
        py::arg("seed"), "(path, next_token); see specinfer.verify.verify_naive.");
  m.def("apply_penalties", &apply_penalties, py::arg("logits"), py::arg("prompt_tokens"),
        py::arg("output_ids"), py::arg("branches"), py::arg("vocab_ids"), py::arg("vocab_size"),
        py::arg("repetition"), py::arg("presence"), py::arg("frequency"),
        "Repetition, presence and frequency penalties on float32 logits in place on cpu "
        "(semantics: specinfer.sampling.Penalties.apply).");
  m.def("rms_norm", &rms_norm, py::arg("x"), py::arg("weight"), py::arg("residual"), py::arg("out"),
        py::arg("eps"),
        "out = rms_norm(x) * weight on cpu; with a residual (else None), residual += x first and "
        "residual is normalised (semantics: specinfer.ops.rms_norm_reference).");
  m.def("rotary", &rotary, py::arg("q"), py::arg("k"), py::arg("cos"), py::arg("sin"),
        py::arg("positions"),
        "Rotary embedding of q and k in place on cpu (semantics: specinfer.ops.rotary_reference).");
  m.def("silu_mul", &silu_mul, py::arg("x"), py::arg("out"),
        "out = silu(gate) * up of x = [gate, up] on cpu (semantics: "
        "specinfer.ops.silu_mul_reference).");
  m.def("kv_write", &kv_write, py::arg("k_cache"), py::arg("v_cache"), py::arg("k"), py::arg("v"),
        py::arg("cache_rows"), py::arg("slots"),
        "Stores new K/V in the cache slots on cpu (semantics: specinfer.ops.kv_write_reference).");
}
