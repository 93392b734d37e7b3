"""Engine: load a model, admit requests, run the decode loop, stream results.

Requests share one KV cache with a row per running request (continuous batching: a finished
request's row goes to the next waiting prompt). Each prompt is prefilled on its own; decode steps
run every active request in one batched forward.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specinfer import ops, verify
from specinfer.budget import TreeBudget
from specinfer.default_model import default_model_path
from specinfer.drafting import build_drafter
from specinfer.graphs import GraphRunner
from specinfer.kv_cache import kept_capacity
from specinfer.loader import load_model
from specinfer.sampling import (
    Penalties,
    SamplingParams,
    make_generator,
    next_token,
    probabilities,
)
from specinfer.streaming import TextStream
from specinfer.tokenizer import TokenizerWrapper
from specinfer.tree import TokenTree, TreeConfig

Prompt = str | list[int] | list[dict]  # text, token ids, or chat messages


@dataclass
class Completion:
    """The result of one request. finish_reason: "stop" (EOS or a stop string) or "length"."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    metrics: dict = field(default_factory=dict)


class _Request:
    def __init__(self, index: int, prompt_ids: list[int], params: SamplingParams,
                 stream: TextStream, vocab_size: int, device: torch.device):  # fmt: skip
        self.index, self.prompt_ids, self.params, self.stream = index, prompt_ids, params, stream
        # On the device the logits live on: torch draws with a generator of the tensor's device.
        self.generator = make_generator(params.seed, device)
        self.penalties = Penalties(params, prompt_ids, vocab_size)
        self.output_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.row = -1
        self.max_len = 0  # prompt + generated tokens allowed
        # Decode steps (target forwards after prefill), time per phase, and how often a node
        # at each tree depth was accepted.
        self.metrics = {"prefill_s": 0.0, "steps": 0, "ssm_s": 0.0, "target_s": 0.0, "verify_s": 0.0,
                        "commit_s": 0.0, "tree_nodes": 0, "accepted_per_depth": [], "per_ssm": []}  # fmt: skip

    def completion(self) -> Completion:
        m = dict(self.metrics)
        m["per_ssm"] = [dict(s) for s in m["per_ssm"]]
        m["generated_tokens"] = len(self.output_ids)
        m["decode_s"] = m["ssm_s"] + m["target_s"] + m["verify_s"] + m["commit_s"]
        # The prefill yields the first token; each decode step yields the rest.
        m["tokens_per_step"] = (len(self.output_ids) - 1) / m["steps"] if m["steps"] else 0.0
        return Completion(
            self.text, self.output_ids, self.finish_reason or "length", len(self.prompt_ids), m
        )


class Engine:
    """Serve one model. `Engine()` loads the embedded default (SmolLM2-135M-Instruct)."""

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "cpu",
        threads: int | None = None,
        max_batch_size: int = 16,
        ssm: str | Path | int | list | None = None,
        tree: TreeConfig | str | list | None = None,
        mode: str | None = None,
        verifier: str = "mss",
        ssm_head: int | None = None,
        adaptive_tree: bool = True,
    ):
        """mode: "incremental" (no SSM), "sequence" (chains as deep as the trees) or "tree"
        (default when an SSM is given). ssm: a model path sharing the target's tokenizer, an
        int L / "layers:L" for the target's first L layers, "ngram[:key=value,...]" for prompt
        lookup, or a list of these: their trees are merged into one. tree: one config for all
        model SSMs or a list per SSM (None at n-gram entries). ssm_head: N restricts the model
        SSMs' LM head to N tokens (see drafting.head_token_ids; 0 = full head). verifier:
        "mss" (multi-step speculative sampling) or "naive" (the ablation) for sampling.
        adaptive_tree: verify only the part of each drafted tree that pays for its rows in the
        target forward (see budget.TreeBudget; lossless); False verifies the whole tree."""
        if threads is not None:
            torch.set_num_threads(threads)
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        path = Path(model) if model is not None else default_model_path()
        if not path.exists():
            raise FileNotFoundError(
                f"model not found: {path} (a local HF directory or a .gguf file)"
            )
        self.model_path = path
        self.model = load_model(path, dtype=self.dtype, device=self.device)
        self.run_model = GraphRunner(self.model)
        self._kept_kv = None  # see _kv_cache
        self._running = 0  # batches in flight (an unfinished stream() holds one)
        self.config = self.model.config
        self.tokenizer = TokenizerWrapper.from_path(path)
        self.max_batch_size = max_batch_size
        self.mode = mode or ("tree" if ssm is not None else "incremental")
        if self.mode not in ("incremental", "sequence", "tree"):
            raise ValueError(f"mode must be 'incremental', 'sequence' or 'tree', got {self.mode!r}")
        if verifier not in ("mss", "naive"):
            raise ValueError(f"verifier must be 'mss' or 'naive', got {verifier!r}")
        self.verifier = verifier
        self.drafter = None
        self.budget = None
        if self.mode != "incremental":
            if ssm is None:
                raise ValueError(
                    f"mode {self.mode!r} needs an ssm (a model path, layers:L or ngram)"
                )
            self.drafter = build_drafter(ssm, tree, self.model, path, self.dtype, self.device,
                                         ssm_head, chains=self.mode == "sequence")  # fmt: skip
            self.budget = TreeBudget() if adaptive_tree else None
        eos = self.config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)

    # -- public API -----------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Complete every prompt (text, token ids, or a list of chat messages)."""
        requests = self._make_requests(prompts, params)
        for _ in self._run(requests):
            pass
        return [r.completion() for r in requests]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one request as it is generated."""
        (request,) = self._make_requests([prompt], params)
        for _, delta in self._run([request]):
            yield delta
        self.last_metrics = request.completion().metrics

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> Completion:
        return self.generate([messages], params)[0]

    def release(self) -> None:
        """Free the KV caches and recorded graphs kept for the next batch (the largest batch so
        far sized them); the next call allocates and records again."""
        if self._running:
            raise RuntimeError("cannot release while a batch runs (an unfinished stream())")
        self._kept_kv = None
        self.run_model.release()
        for ssm in self.drafter.ssms if self.drafter else []:
            if hasattr(ssm, "release"):
                ssm.release()

    # -- requests -------------------------------------------------------------------------------

    def _make_requests(self, prompts, params) -> list[_Request]:
        if isinstance(prompts, str) or _is_token_ids(prompts) or _is_messages(prompts):
            prompts = [prompts]
        if len(prompts) == 0:
            raise ValueError("no prompts given")
        params = params if params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        # Validate everything before any work starts, so one bad prompt costs no other its output.
        return [
            _Request(
                i,
                self._prompt_ids(i, p),
                sp,
                TextStream(self.tokenizer, sp.stop),
                self.config.vocab_size,
                self.device,
            )  # fmt: skip
            for i, (p, sp) in enumerate(zip(prompts, params))
        ]

    def _prompt_ids(self, index: int, prompt: Prompt) -> list[int]:
        if _is_messages(prompt):
            ids = self.tokenizer.encode(
                self.tokenizer.apply_chat_template(prompt), add_special_tokens=False
            )
        elif isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif _is_token_ids(prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise ValueError(
                    f"prompt {index}: token ids out of range [0, {self.config.vocab_size}): {bad[:5]}"
                )
        elif isinstance(prompt, list) and not prompt:
            ids = []
        else:
            raise ValueError(
                f"prompt {index}: expected text, token ids or chat messages, got {type(prompt).__name__}"
            )
        if not ids:
            raise ValueError(f"prompt {index} is empty")
        limit = self.config.max_position_embeddings
        if len(ids) >= limit:
            raise ValueError(
                f"prompt {index} has {len(ids)} tokens; the model's context is {limit}"
            )
        return ids

    # -- the decode loop ------------------------------------------------------------------------

    def _run(self, requests: list[_Request]) -> Iterator[tuple[_Request, str]]:
        if self._running and self.drafter:  # the SSMs' caches and state are single-batch
            raise RuntimeError(
                "this speculative engine is still running another batch (an unfinished "
                "stream()): exhaust or close that stream first"
            )
        self._running += 1
        try:
            yield from self._decode(requests)
        finally:
            self._running -= 1

    def _kv_cache(self, rows: int, max_seq_len: int):
        """The KV cache of the previous batch when it is large enough and free, so the graphs
        recorded over it replay in this batch too; else a new one, kept in its place. A batch
        fills its rows before reading them, so what the last batch left there does no harm."""
        kv = self._kept_kv
        if self._running > 1 or kv is None or not kv.holds(rows, max_seq_len):
            keep = self._running == 1
            kv = self.model.make_kv_cache(rows, kept_capacity(max_seq_len) if keep else max_seq_len)
            if keep:
                self._kept_kv = kv
        return kv

    @torch.inference_mode()
    def _decode(self, requests: list[_Request]) -> Iterator[tuple[_Request, str]]:
        context = self.config.max_position_embeddings
        for r in requests:
            r.max_len = min(len(r.prompt_ids) + r.params.max_tokens, context)
        rows = min(self.max_batch_size, len(requests))
        # Room for a tree after the longest sequence (and for padding of batched levels).
        room = 2 * self.drafter.num_nodes if self.drafter else 0
        kv = self._kv_cache(rows, max(r.max_len for r in requests) + room)
        if self.drafter:
            self.drafter.reset(rows, max(r.max_len for r in requests) + room)
        free_rows, waiting, active = list(range(rows)), list(requests), []
        while waiting or active:
            if waiting and free_rows:  # admit; prompts of equal length share one prefill
                admitted = [waiting.pop(0) for _ in range(min(len(waiting), len(free_rows)))]
                for length in dict.fromkeys(len(r.prompt_ids) for r in admitted):
                    group = [r for r in admitted if len(r.prompt_ids) == length]
                    for r in group:
                        r.row = free_rows.pop()
                        if self.drafter:
                            self.drafter.admit(r.row)
                    t0 = time.perf_counter()
                    logits = self._forward(kv, group, [r.prompt_ids for r in group])
                    for r, lg in zip(group, logits):
                        r.metrics["prefill_s"] = time.perf_counter() - t0
                        yield from self._append(r, [self._next_token(r, lg)])
                        if r.finish_reason is None:
                            active.append(r)
                        else:
                            free_rows.append(r.row)
            if not active:
                continue
            if self.drafter is None:
                t0 = time.perf_counter()
                logits = self._forward(kv, active, [[r.output_ids[-1]] for r in active])
                new_tokens = [[self._next_token(r, lg)] for r, lg in zip(active, logits)]
                for r in active:
                    r.metrics["target_s"] += time.perf_counter() - t0
            else:
                new_tokens = self._speculative_step(kv, active)
            for r, tokens in zip(active, new_tokens):
                r.metrics["steps"] += 1
                yield from self._append(r, tokens)
            free_rows += [r.row for r in active if r.finish_reason is not None]
            active = [r for r in active if r.finish_reason is None]

    def _forward(self, kv, batch: list[_Request], new_ids: list[list[int]]) -> torch.Tensor:
        """Run the new tokens of each request (same count per request); logits of the last one."""
        T = len(new_ids[0])
        dev = self.device
        prefix = torch.tensor(
            [len(r.prompt_ids) + len(r.output_ids) - len(ids) for r, ids in zip(batch, new_ids)],
            device=dev,
        )
        positions = prefix[:, None] + torch.arange(T, device=dev)
        hidden = self.run_model(
            torch.tensor(new_ids, device=dev),
            positions,
            kv,
            torch.tensor([r.row for r in batch], device=dev),
            prefix,
            torch.ones(T, T, dtype=torch.bool, device=dev).tril().expand(len(batch), T, T),
        )
        return self.model.compute_logits(hidden[:, -1])

    def _speculative_step(self, kv, batch: list[_Request]) -> list[list[int]]:
        """Draft a tree per request, verify all trees in one target forward, commit the
        accepted paths in both caches; returns each request's new tokens."""
        dev = self.device
        tokens = [r.prompt_ids + r.output_ids for r in batch]
        # No point speculating past what the request may still generate.
        max_depths = [r.max_len - len(seq) - 1 for r, seq in zip(batch, tokens)]
        t0 = time.perf_counter()
        trees = self.drafter.draft(batch, tokens, max_depths)
        if self.budget:
            trees = self.drafter.keep(self.budget.choose(trees, [r.params for r in batch]))
        t1 = time.perf_counter()
        T = max(len(tree) for tree in trees)
        prefix = [len(seq) - 1 for seq in tokens]
        rows = torch.tensor([r.row for r in batch], device=dev)
        mask = torch.zeros(len(batch), T, T, dtype=torch.bool)
        for b, tree in enumerate(trees):
            mask[b, : len(tree), : len(tree)] = tree.ancestor_mask()
        positions = [
            [p + d for d in tree.depths] + [p] * (T - len(tree)) for p, tree in zip(prefix, trees)
        ]
        hidden = self.run_model(
            _pad([tree.tokens for tree in trees], 0, dev), torch.tensor(positions, device=dev), kv, rows,
            torch.tensor(prefix, device=dev), mask.to(dev),
        )  # fmt: skip
        logits = self.model.compute_logits(hidden)
        t2 = time.perf_counter()
        verified = [
            self._verify(r, tree, logits[b, : len(tree)])
            for b, (r, tree) in enumerate(zip(batch, trees))
        ]
        paths = [path for path, _ in verified]
        t3 = time.perf_counter()
        ops.kv_commit(kv.k + kv.v, rows, torch.tensor(prefix, device=dev), _pad(paths, -1, dev))
        self.drafter.commit(batch, prefix, paths, max_depths)
        t4 = time.perf_counter()
        if self.budget:
            self.budget.observe(trees, paths)
            self.budget.time_step(len(batch), T, t2 - t1, (t1 - t0) + (t4 - t2))
        self.drafter.record([r.metrics for r in batch], paths)
        for r, path, tree in zip(batch, paths, trees):
            m = r.metrics
            m["ssm_s"] += t1 - t0
            m["target_s"] += t2 - t1
            m["verify_s"] += t3 - t2
            m["commit_s"] += t4 - t3
            m["tree_nodes"] += len(tree)
            accepted = m["accepted_per_depth"]
            accepted += [0] * (len(path) - 1 - len(accepted))
            for depth in range(len(path) - 1):
                accepted[depth] += 1
        return [tree.path_tokens(path[1:]) + [nxt] for tree, (path, nxt) in zip(trees, verified)]

    @staticmethod
    def _next_token(r: _Request, logits: torch.Tensor) -> int:
        """The request's next token from the logits [V] after all its tokens so far."""
        logits = r.penalties.apply(logits[None], r.output_ids)[0]
        return next_token(logits, r.params, r.generator)

    def _verify(self, r: _Request, tree: TokenTree, logits: torch.Tensor) -> tuple[list[int], int]:
        # Node u's logits are penalised as incremental decoding would after u's path.
        logits = r.penalties.apply(logits, r.output_ids, tree.branches())
        if r.params.greedy:
            return verify.verify_greedy(tree.parents, tree.tokens, logits.argmax(-1))
        p = probabilities(logits, r.params.temperature, r.params.top_k, r.params.top_p)
        gen = r.generator
        seed = int(torch.randint(0, 2**62, (1,), generator=gen, device=gen.device))
        if self.verifier == "naive":
            return verify.verify_naive(tree.parents, tree.tokens, p, seed)
        q = torch.stack(tree.q_rows) if tree.q_rows else None
        proposals = (tree.prop_parent, tree.prop_child, tree.prop_q)
        return verify.verify_stochastic(tree.parents, tree.tokens, p, proposals, q, seed)

    def _append(self, r: _Request, tokens: list[int]) -> Iterator[tuple[_Request, str]]:
        """Append tokens until one of them finishes the request (the rest are dropped)."""
        delta = ""
        for token in tokens:
            r.output_ids.append(token)
            is_eos = token in self.eos_ids and not r.params.ignore_eos
            if not is_eos:
                delta += r.stream.add(token)
            if r.stream.stopped or is_eos:
                r.finish_reason = "stop"
            elif len(r.prompt_ids) + len(r.output_ids) >= r.max_len:
                r.finish_reason = "length"
            if r.finish_reason is not None:
                delta += r.stream.finish()
                break
        r.text += delta
        if delta:
            yield r, delta


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """ "auto" is bfloat16: decode is memory-bound, and our CPU linear kernel reads bf16 weights
    (half the bytes of fp32) on any AVX2 machine; use float32 for bit-level comparisons."""
    if isinstance(dtype, torch.dtype):
        chosen = dtype
    elif dtype == "auto":
        chosen = torch.bfloat16
    else:
        names = {
            "float32": torch.float32,
            "fp32": torch.float32,
            "bfloat16": torch.bfloat16,
            "bf16": torch.bfloat16,
            "float16": torch.float16,
            "fp16": torch.float16,
        }
        if dtype not in names:
            raise ValueError(
                f"unknown dtype {dtype!r}; use one of 'auto', {', '.join(map(repr, names))}"
            )
        chosen = names[dtype]
    if chosen not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported dtype {chosen}; use float32 or bfloat16 (float16 on CUDA)")
    if chosen == torch.float16 and device.type == "cpu":
        raise ValueError("float16 is not supported on the CPU; use bfloat16 or float32")
    return chosen


def _pad(seqs: list[list[int]], value: int, device) -> torch.Tensor:
    width = max(len(s) for s in seqs)
    return torch.tensor([s + [value] * (width - len(s)) for s in seqs], device=device)


def _is_token_ids(x) -> bool:
    return isinstance(x, list) and len(x) > 0 and all(isinstance(t, int) for t in x)


def _is_messages(x) -> bool:
    return isinstance(x, list) and len(x) > 0 and all(isinstance(m, dict) for m in x)
