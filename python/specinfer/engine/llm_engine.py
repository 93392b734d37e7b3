"""Engine: requests join and leave at every step; each step decodes every running request (one
target forward for all their token trees) and prefills prompts in chunks.

`add_request` / `step` / `abort` are the serving API (AsyncEngine runs them on a thread);
`generate`, `stream` and `chat` are thin loops over them. The jobs live in their own modules:
sequence (a request's state), scheduler (admission, chunked prefill), kv_manager (cache rows),
model_runner (the target's forwards), spec_step (draft, cut, verify, commit), output (text, stops).
"""

from __future__ import annotations

import copy
import itertools
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

from specinfer.budget import TreeBudget
from specinfer.default_model import DEFAULT_DRAFTING, default_model_path, ships_an_ssm
from specinfer.distributed import load_target, ssm_view
from specinfer.drafting import build_drafter, selected_layers
from specinfer.engine.kv_manager import BLOCK_LEN, KVManager
from specinfer.engine.model_runner import ModelRunner
from specinfer.engine.output import append_tokens
from specinfer.engine.scheduler import Scheduler
from specinfer.engine.sequence import Completion, RequestOutput
from specinfer.engine.sequence import Sequence as Seq
from specinfer.engine.spec_step import logprobs_of, sample, sample_all, speculative_step
from specinfer.layers import pack_linears
from specinfer.offload import check_mode, offload_model
from specinfer.sampling import SamplingParams, token_logprobs
from specinfer.streaming import TextStream
from specinfer.structured import GrammarCompiler
from specinfer.tokenizer import TokenizerWrapper
from specinfer.tree import TreeConfig

Prompt = str | list[int] | list[dict]  # text, token ids, or chat messages
DEFAULT_MAX_MODEL_LEN = 2048  # tokens per request unless the model's context is shorter
WARM_UP_REQUESTS = 2  # the second still records shapes the first did not reach


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
        max_model_len: int | None = None,
        max_tokens_per_step: int = 512,
        kv_budget: int | None = None,
        ssm: str | Path | int | list | None = None,
        tree: TreeConfig | str | list | None = None,
        mode: str | None = None,
        verifier: str = "mss",
        ssm_head: int | None = None,
        ssm_int8: bool | None = None,
        adaptive_tree: bool = True,
        max_tree_nodes: int | None = None,
        tensor_parallel: int = 1,
        pipeline_parallel: int = 1,
        offload: str | None = None,
        offload_dir: str | Path | None = None,
        resident_layers: int = 0,
        target_servers: int = 1,
        lookahead: int | None = None,
        prefix_caching: bool | None = None,
    ):
        """mode: "incremental" (no SSM), "sequence" (chains as deep as the trees) or "tree"
        (default when an SSM is given). ssm: a model path sharing the target's tokenizer, an
        int L / "layers:L" for the target's first L layers, "default" / "feature" for the SSM /
        feature head shipped for the default model ("feature:PATH" for another feature head),
        "ngram[:key=value,...]" for prompt lookup, "suffix[:key=value,...]" for continuations
        of earlier requests (corpus=default: the default model's shipped answers), or a list of
        these: their trees are merged into one; "auto": what `specinfer generate` drafts with
        (auto_drafting). tree: one config for all model SSMs or a list
        per SSM (None at n-gram and suffix entries). ssm_head: N restricts the model
        SSMs' LM head to N tokens (see drafting.head_token_ids; 0 = full head). ssm_int8: the
        model SSMs draft through 8-bit copies of their own weights and restricted LM head
        (ops.linear_int8): half the bytes each drafting call streams, and still lossless, since
        verification decides (default: on the CPU, off on CUDA and under tensor or pipeline
        parallelism; never for layer-selected SSMs, whose layers are the target's). verifier:
        "mss" (multi-step speculative sampling) or "naive" (the ablation) for sampling.
        adaptive_tree: verify only the part of each drafted tree that pays for its rows in the
        target forward (see budget.TreeBudget; lossless); False verifies the whole tree.
        max_tree_nodes: at most this many nodes (root included) of a request's merged tree are
        verified, the first in drafting order (default: no cap); trees with sampled children
        cannot be cut losslessly, so SSMs that sample children must fit whole.

        Serving: max_batch_size requests run at once; max_model_len caps a request's prompt +
        output (default: the model's context, at most 2048); kv_budget (tokens of the target's
        KV blocks, default: max_batch_size requests at max_model_len) caps what the running
        requests hold together: a request waits until its prompt fits, and a running one is
        preempted (recomputed later) when a block runs out (see scheduler.py).
        max_tokens_per_step caps the tokens a step runs (decoding requests count one each,
        prompts fill the rest in chunks). prefix_caching: full blocks of the target's KV cache
        are kept after their request (until the pool needs them) and a request beginning with
        the same tokens prefills only what follows them (see engine/prefix_cache.py); default
        on, except with mode "dsi" (its servers hold their own caches), where it is refused.

        tensor_parallel: N shards each layer over N processes; pipeline_parallel: M gives each
        of M stages a contiguous range of layers (a step's batch flows through them in
        micro-batches). N x M processes in all: N x M - 1 spawned workers (cores shared out
        as threads; gloo on CPU, NCCL for TP on CUDA), or under torchrun the processes it
        started (rank 0 builds the Engine, on the other ranks `Engine(...)` serves rank 0 and
        then exits). SSMs run on rank 0, whole. `close()` (or `with Engine(...)`) stops the
        workers; so does the interpreter's exit.

        offload: "disk" streams the target's layers from a file each forward (written once, in
        the engine's dtype, to offload_dir, default ~/.cache/specinfer/offload), "cpu" (CUDA)
        from pinned host memory; the first resident_layers layers (and those a layer-selected
        SSM uses) stay resident, as do embeddings, head, KV cache and SSMs (see offload.py).

        mode "dsi": speculation parallelism (DSI's Algorithm 1, see dsi/orchestrator.py): the
        SSMs draft ahead while target_servers processes, each with its own copy of the target
        (one thread each), verify lookahead blocks concurrently; lookahead defaults to the
        one with the lowest expected latency (at most Equation 1's) from the drafter's latency,
        a server's forward cost by rows and the acceptance rate, measured at start and as
        requests finish (see dsi/mode.py). Requests run one at a time; penalties are refused."""
        if threads is not None:
            torch.set_num_threads(threads)
        for name, value in (("max_batch_size", max_batch_size),
                            ("max_tokens_per_step", max_tokens_per_step)):  # fmt: skip
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        path = Path(model) if model is not None else default_model_path()
        if not path.exists():
            raise FileNotFoundError(
                f"model not found: {path} (a local HF directory or a .gguf file)"
            )
        if ssm == "auto":
            ssm = auto_drafting(model)
        self.mode = mode or ("tree" if ssm is not None else "incremental")
        if self.mode not in ("incremental", "sequence", "tree", "dsi"):
            raise ValueError(
                f"mode must be 'incremental', 'sequence', 'tree' or 'dsi', got {self.mode!r}"
            )
        if self.mode == "dsi" and (tensor_parallel, pipeline_parallel, offload) != (1, 1, None):
            raise ValueError("mode 'dsi' runs whole target copies: no tensor/pipeline parallelism "
                             "or offloading")  # fmt: skip
        if self.mode == "dsi":
            max_batch_size = 1  # one request at a time, overlapped within itself
        if ssm_int8 not in (None, True, False):
            raise ValueError(f"ssm_int8 must be True, False or None (auto), got {ssm_int8!r}")
        if verifier not in ("mss", "naive"):
            raise ValueError(f"verifier must be 'mss' or 'naive', got {verifier!r}")
        if self.mode != "incremental" and ssm is None:
            raise ValueError(f"mode {self.mode!r} needs an ssm (a model path, layers:L or ngram)")
        self.model_path = path
        _check_offload(offload, resident_layers, self.device, tensor_parallel, pipeline_parallel)
        # An offloaded model is loaded on the CPU: its layers never need to fit on the GPU.
        load_on = torch.device("cpu") if offload else self.device
        self.model, self.workers = load_target(
            path, self.dtype, load_on, tensor_parallel, threads, pipeline_parallel
        )
        try:
            if self.device.type == "cpu":  # before offloading: the layer file holds packed layers
                pack_linears(self.model, head=self.workers is None)
            if offload:
                resident = max(resident_layers, selected_layers(ssm) if ssm is not None else 0)
                offload_model(self.model, offload, self.device, path, offload_dir, resident)
                self.model.to(self.device)
            self._build(path, ssm, tree, ssm_head, ssm_int8, adaptive_tree, max_tree_nodes,
                        max_model_len, kv_budget, max_batch_size, max_tokens_per_step, verifier,
                        prefix_caching)  # fmt: skip
            self.dsi = None
            if self.mode == "dsi":
                from specinfer.dsi.mode import DSIMode

                self.dsi = DSIMode.start(self, target_servers, lookahead)
        except BaseException:
            self.close()
            raise

    def _build(self, path, ssm, tree, ssm_head, ssm_int8, adaptive_tree, max_tree_nodes,
               max_model_len, kv_budget, max_batch_size, max_tokens_per_step, verifier,
               prefix_caching) -> None:  # fmt: skip
        self.config = self.model.config
        self.tokenizer = TokenizerWrapper.from_path(path)
        self.verifier = verifier
        self.runner = ModelRunner(self.model, self.device, self.workers)
        self.run_model = self.runner.graphs
        self.drafter = None
        self.budget = None
        if self.mode != "incremental":
            target = ssm_view(self.runner, ssm) if self.workers else self.model
            if ssm_int8 is None:
                ssm_int8 = self.device.type == "cpu" and self.workers is None
            self.drafter = build_drafter(ssm, tree, target, path, self.dtype, self.device,
                                         ssm_head, chains=self.mode == "sequence",
                                         sized=adaptive_tree and self.mode != "dsi",
                                         int8=ssm_int8)  # fmt: skip
            if self.drafter.reads_features:
                if self.mode == "dsi" or (self.runner.par is not None and self.runner.par.pp > 1):
                    raise ValueError("a feature head drafts from the target's hidden states of "
                                     "every step: not with mode 'dsi' or pipeline_parallel")  # fmt: skip
                self.model.tap(self.drafter.feature_layers)
                self.runner.feature_sink = self.drafter.write_features
            # DSI verifies every drafted level (its servers' rows come at no cost to the step).
            self.budget = TreeBudget() if adaptive_tree and self.mode != "dsi" else None
        self.max_tree_nodes = _max_tree_nodes(max_tree_nodes, self.drafter)
        self.context = self.config.max_position_embeddings
        self.max_model_len = _max_model_len(max_model_len, self.context)
        # Room after the longest request for a tree (and the padding of batched levels).
        row_len = self.max_model_len + (2 * self.drafter.num_nodes if self.drafter else 0)
        default_budget = kv_budget is None
        if default_budget:
            kv_budget = max_batch_size * row_len
        elif not isinstance(kv_budget, int) or isinstance(kv_budget, bool) or kv_budget < row_len:
            raise ValueError(
                f"kv_budget must be an integer number of tokens >= {row_len} (one request "
                f"of max_model_len={self.max_model_len} and its tree), got {kv_budget!r}"
            )
        rows = max_batch_size
        # By default every request fits at its longest: nothing is ever preempted.
        per_request = -(-row_len // BLOCK_LEN)
        blocks = rows * per_request if default_budget else kv_budget // BLOCK_LEN
        self.max_batch_size = rows
        self.prefix_caching = self._prefix_caching(prefix_caching)
        self.kv = KVManager(self.runner, self.drafter, rows, row_len, blocks, BLOCK_LEN,
                            self.device, self.prefix_caching)  # fmt: skip
        # Positions a decode step may write: the widest tree it verifies.
        lookahead = self.drafter.num_nodes if self.drafter else 1
        lookahead = min(lookahead, self.max_tree_nodes or lookahead)
        self.scheduler = Scheduler(self.kv, max_tokens_per_step, lookahead)
        self._ids = itertools.count()
        self._deltas: dict[str, list[str]] = {}  # request id -> text not yet taken by stream()
        self.driver: int | None = None  # the thread that alone may change the batch, if set
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.counters["spec_accepted_per_depth"] = []
        eos = self.config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self.grammars = GrammarCompiler(self.tokenizer, self.config.vocab_size, self.eos_ids)

    # -- serving API ----------------------------------------------------------------------------

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:  # fmt: skip
        """Queue a request (it joins the running batch at the next step with a free row);
        returns its id. Raises ValueError for bad input before anything is queued."""
        seq = self.make_sequence(prompt, params, request_id)
        self.add_sequence(seq)
        return seq.request_id

    def make_sequence(self, prompt: Prompt, params: SamplingParams | None = None,
                      request_id: str | None = None, index: int = 0) -> Seq:  # fmt: skip
        """A validated request, not yet queued (AsyncEngine builds it on the caller's thread)."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        ids = self.prompt_ids(prompt, index)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        max_len = min(len(ids) + params.max_tokens, self.max_model_len)
        seq = Seq(request_id, ids, params, TextStream(self.tokenizer, params.stop), max_len,
                  self.config.vocab_size, self.device, frozenset(self.eos_ids))  # fmt: skip
        if self.mode == "dsi" and seq.penalties.active:
            raise ValueError("mode 'dsi' does not support repetition, presence or frequency "
                             "penalties, a logit bias or min_tokens")  # fmt: skip
        if self.mode == "dsi" and (params.logprobs, params.prompt_logprobs) != (None, None):
            raise ValueError("mode 'dsi' does not support logprobs (its target servers verify "
                             "in other processes and send back tokens only)")  # fmt: skip
        if self.mode == "dsi" and params.structured_fields:
            raise ValueError("mode 'dsi' does not support structured output (json_schema, "
                             "regex, choice, grammar)")  # fmt: skip
        seq.grammar = self.grammars.compile(params)
        return seq

    def add_sequence(self, seq: Seq) -> None:
        self._check_thread()
        if self.scheduler.find(seq.request_id) is not None:
            raise ValueError(f"request id {seq.request_id!r} is already running")
        self.scheduler.add(seq)
        self.counters["prompt_tokens_total"] += len(seq.prompt_ids)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV; False if it is not queued or running."""
        self._check_thread()
        seq = self.scheduler.find(request_id)
        if seq is None:
            return False
        seq.finish_reason = "abort"
        self.scheduler.finish(seq)
        self._deltas.pop(request_id, None)
        return True

    def _check_thread(self) -> None:
        """The batch is one thread's: an AsyncEngine's, while one runs this engine (a request
        added or a step taken beside it would corrupt the requests it holds)."""
        if self.driver is not None and threading.get_ident() != self.driver:
            raise RuntimeError("an AsyncEngine runs this engine on its own thread: send "
                               "requests through it (AsyncEngine.generate), not to the Engine")  # fmt: skip

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One iteration: decode every running request (speculatively when an SSM is set),
        prefill the next prompt chunks, finish what is done. Returns what each request gained."""
        self._check_thread()
        if self.dsi is not None:
            return self.dsi.step(self)
        plan = self.scheduler.schedule()
        for s in plan.admitted if self.prefix_caching else ():  # prefills after what it held
            self.counters["prefix_cache_queries_total"] += s.prefill_len
            self.counters["prefix_cache_hits_total"] += s.num_computed
            if not s.preemptions:
                s.cached_tokens = s.num_computed
        outputs = []
        streamed = self.runner.streamed()
        if plan.decode:
            if self.drafter is None:
                t0 = time.perf_counter()
                logits = self.runner.decode(self.kv, plan.decode)
                new = [[token] for token in sample_all(plan.decode, logits)]
                scores = [logprobs_of(s, logits[b : b + 1], tokens)
                          for b, (s, tokens) in enumerate(zip(plan.decode, new))]  # fmt: skip
                for s in plan.decode:
                    s.metrics["target_s"] += time.perf_counter() - t0
            else:
                new, trees, scores = speculative_step(plan.decode, self.kv, self.runner,
                                                      self.drafter, self.budget, self.verifier,
                                                      self.max_tree_nodes)  # fmt: skip
                self._count_speculation(trees, new)
            streamed = self.runner.charge_streaming(plan.decode, streamed)
            for s, tokens, logprobs in zip(plan.decode, new, scores):
                s.metrics["steps"] += 1
                outputs.append(self._append(s, tokens, logprobs))
        if plan.prefill:
            t0 = time.perf_counter()
            logits = self.runner.prefill(self.kv, plan.prefill)
            # A scoring prompt's chunk comes as all its rows [n, V]: its prompt logprobs.
            logits = [_score_prompt(s, lg) if lg is not None and lg.dim() == 2 else lg
                      for (s, _), lg in zip(plan.prefill, logits)]  # fmt: skip
            self.runner.charge_streaming([s for s, _ in plan.prefill], streamed)
            cached = [s for (s, _), lg in zip(plan.prefill, logits) if lg is not None]
            if self.drafter and cached:
                skip = self.budget.stopped() if self.budget else frozenset()
                self.drafter.prefill(cached, [s.prefill_ids for s in cached], skip)
            for (s, _), lg in zip(plan.prefill, logits):
                s.metrics["prefill_s"] += time.perf_counter() - t0
                if lg is not None and not s.output_ids:  # the prompt is cached: its first token
                    token = sample(s, lg)
                    outputs.append(self._append(s, [token], logprobs_of(s, lg[None], [token])))
        return outputs

    def stats(self) -> dict:
        """A snapshot for monitoring (see server/metrics.py for what each counter means)."""
        return {
            **self.counters,
            "spec_accepted_per_depth": list(self.counters["spec_accepted_per_depth"]),
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "preemptions_total": self.scheduler.preemptions,
            "kv_used_tokens": self.kv.used_tokens(),
            "kv_capacity_tokens": self.kv.num_blocks * self.kv.block_len,
        }

    @contextmanager
    def unrecorded(self) -> Iterator[None]:
        """What is served inside leaves no trace in what later requests meet: the suffix
        drafters' history (so a warm-up's or a benchmark's own answers are not drafted back)
        and the counters of stats(); the prefix cache is emptied. The op graphs recorded and
        the costs the cut learned stay: they are what a warm-up is for."""
        counters = copy.deepcopy(self.counters)
        try:
            with ExitStack() as stack:
                for s in self.drafter.ssms if self.drafter else []:
                    if hasattr(s, "unrecorded"):
                        stack.enter_context(s.unrecorded())
                yield
        finally:
            self.counters = counters
            self.kv.forget_prefixes()

    def warm_up(self, requests: int = WARM_UP_REQUESTS, tokens: int = 32) -> None:
        """Serve a few short greedy requests, one at a time, and forget them (`unrecorded`), so
        that the first real ones do not pay for first-use work: a step's op graphs are recorded
        the first time its shape comes (graphs.py), at about an eager forward's cost each."""
        text = "Write a few sentences about the sea."
        prompt = [{"role": "user", "content": text}] if self.tokenizer.chat_template else text
        try:
            room = self.max_model_len - len(self.prompt_ids(prompt))
        except ValueError:  # longer than max_model_len
            room = 0
        if room < 1:  # a context too short for it: nothing to warm up that requests would meet
            return
        params = SamplingParams(max_tokens=min(tokens, room), ignore_eos=True)
        with self.unrecorded():
            for _ in range(requests):
                self.kv.forget_prefixes()  # each prefills the whole prompt, as a new one would
                self.generate(prompt, params)

    # -- offline API: loops over the serving API ------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Complete every prompt (text, token ids, or a list of chat messages)."""
        seqs = self._make_sequences(prompts, params)
        for seq in seqs:
            self.add_sequence(seq)
        try:
            while not all(s.finished for s in seqs):
                self.step()
        finally:
            for seq in seqs:
                self.abort(seq.request_id)  # only what an exception left unfinished
                self._deltas.pop(seq.request_id, None)
        return [s.completion() for s in seqs]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one request as it is generated (other requests advance too)."""
        (seq,) = self._make_sequences([prompt], params)
        self.add_sequence(seq)
        self._deltas[seq.request_id] = []
        try:
            while True:
                pending = self._deltas.get(seq.request_id, [])
                while pending:
                    yield pending.pop(0)
                if seq.finished:
                    break
                self.step()
        finally:
            self.abort(seq.request_id)  # a stream closed early frees its rows
            self._deltas.pop(seq.request_id, None)
        self.last_metrics = seq.completion().metrics

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> Completion:
        return self.generate([messages], params)[0]

    @property
    def failure(self) -> str | None:
        """Why the engine can no longer step (a tensor-parallel worker died), else None."""
        return self.workers.failure if getattr(self, "workers", None) else None

    def close(self) -> None:
        """Stop the tensor-parallel workers and the offloading reader (if any); the engine
        cannot step afterwards."""
        if getattr(self, "workers", None) is not None:
            self.workers.close()
        if getattr(self, "dsi", None) is not None:
            self.dsi.close()
        streamer = getattr(getattr(self, "model", None), "layer_streamer", None)
        if streamer is not None:
            streamer.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def release(self) -> None:
        """Free the KV caches and recorded graphs; the next request allocates and records
        again. Refused while requests are queued or running."""
        self._check_thread()
        if self.has_unfinished():
            raise RuntimeError("cannot release while requests run (an unfinished stream()?)")
        self.kv.release()  # and the runner's cache and graphs

    # -- requests -------------------------------------------------------------------------------

    def _prefix_caching(self, asked: bool | None) -> bool:
        if asked not in (None, True, False):
            raise ValueError(f"prefix_caching must be True, False or None (auto), got {asked!r}")
        if asked and self.mode == "dsi":
            raise ValueError("prefix_caching is not available with mode 'dsi' (its servers "
                             "hold their own caches)")  # fmt: skip
        return asked is not False and self.mode != "dsi"

    def _make_sequences(self, prompts, params) -> list[Seq]:
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
            self.make_sequence(p, sp, index=i) for i, (p, sp) in enumerate(zip(prompts, params))
        ]

    def prompt_ids(self, prompt: Prompt, index: int = 0) -> list[int]:
        """The token ids of a prompt (text, token ids, or chat messages, rendered with the
        model's chat template); ValueError naming the problem."""
        if _is_messages(prompt):
            ids = self.tokenizer.chat_ids(prompt)
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
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt {index} has {len(ids)} tokens; this engine serves up to "
                f"max_model_len={self.max_model_len} tokens a request (the model's context is "
                f"{self.context})"
            )
        return ids

    # -- one step's pieces ----------------------------------------------------------------------

    def _append(self, seq: Seq, tokens: list[int], logprobs: list | None = None) -> RequestOutput:
        before = len(seq.output_ids)
        out = append_tokens(seq, tokens, self.eos_ids, logprobs)
        self.counters["generation_tokens_total"] += len(seq.output_ids) - before
        if out.text and seq.request_id in self._deltas:
            self._deltas[seq.request_id].append(out.text)
        if out.finished:
            self.scheduler.finish(seq)
        return out

    def _count_speculation(self, trees: list, new: list[list[int]]) -> None:
        """Counters for monitoring: verified drafts, their nodes, accepted nodes per depth."""
        c = self.counters
        c["spec_steps_total"] += 1
        for tree, tokens in zip(trees, new):
            c["spec_drafts_total"] += 1
            c["spec_draft_tokens_total"] += len(tree) - 1
            c["spec_emitted_tokens_total"] += len(tokens)
            c["spec_accepted_tokens_total"] += len(tokens) - 1
            by_depth = c["spec_accepted_per_depth"]
            by_depth += [0] * (len(tokens) - 1 - len(by_depth))
            for d in range(len(tokens) - 1):
                by_depth[d] += 1


def _score_prompt(seq: Seq, rows: torch.Tensor) -> torch.Tensor | None:
    """Keep the prompt logprobs of a chunk's logits rows [n, V] (row j follows the chunk's
    token j and scores the prompt token after it); the logits after the prompt if the chunk
    ended it, else None."""
    start = seq.num_computed - len(rows)
    scored = seq.prompt_ids[start + 1 : start + 1 + len(rows)]
    seq.prompt_logprobs += token_logprobs(rows[: len(scored)], scored, seq.params.prompt_logprobs)
    return rows[-1] if seq.prefilled else None


COUNTERS = ("prompt_tokens_total", "generation_tokens_total", "preemptions_total",
            "prefix_cache_queries_total", "prefix_cache_hits_total",
            "spec_steps_total", "spec_drafts_total", "spec_draft_tokens_total",
            "spec_accepted_tokens_total", "spec_emitted_tokens_total")  # fmt: skip


def _check_offload(offload, resident_layers, device: torch.device, tp: int, pp: int) -> None:
    if offload is None:
        if resident_layers != 0:
            raise ValueError(f"resident_layers applies with offload='cpu' or 'disk', got "
                             f"resident_layers={resident_layers!r} and no offload")  # fmt: skip
        return
    check_mode(offload, device)
    if (
        not isinstance(resident_layers, int)
        or isinstance(resident_layers, bool)
        or (resident_layers < 0)
    ):
        raise ValueError(f"resident_layers must be an integer >= 0, got {resident_layers!r}")
    if tp != 1 or pp != 1:
        raise ValueError(f"offload is not supported with tensor_parallel={tp} / "
                         f"pipeline_parallel={pp} yet: use one or the other")  # fmt: skip


def _max_model_len(value: int | None, context: int) -> int:
    if value is None:
        return min(context, DEFAULT_MAX_MODEL_LEN)
    if not isinstance(value, int) or isinstance(value, bool) or not 2 <= value <= context:
        raise ValueError(
            f"max_model_len must be an integer in [2, {context}] (the model's context), got {value!r}"
        )
    return value


def _max_tree_nodes(cap, drafter) -> int | None:
    if cap is None:
        return None
    if not isinstance(cap, int) or isinstance(cap, bool) or cap < 1:
        raise ValueError(f"max_tree_nodes must be an integer >= 1 (the root counts), got {cap!r}")
    sampling = [s.name for s in drafter.ssms if s.samples_children] if drafter else []
    if sampling and drafter.num_nodes > cap:
        raise ValueError(
            f"max_tree_nodes={cap} would cut trees with sampled children ({', '.join(sampling)}), "
            f"which cannot be cut losslessly: their merged trees have up to {drafter.num_nodes} "
            "nodes; give a smaller tree config or a larger max_tree_nodes"
        )
    return cap


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
        raise ValueError(
            f"unsupported dtype {chosen}; use dtype float32 or bfloat16 (float16 on CUDA)"
        )
    if chosen == torch.float16 and device.type == "cpu":
        raise ValueError("dtype float16 is not supported on the CPU; use dtype bfloat16 or float32")
    return chosen


def _is_token_ids(x) -> bool:
    return isinstance(x, list) and len(x) > 0 and all(isinstance(t, int) for t in x)


def auto_drafting(model: str | Path | None) -> list[str]:
    """The drafters `ssm="auto"` (and the CLI by default) uses for `model` (None: the default
    model). Measured on the 60 held-out prompts (bf16, 2 threads, Zen 3 VM): the shipped SSM +
    prompt lookup + the suffix drafter from the shipped corpus 1.31x incremental at batch 1
    against 1.22x without the suffix drafter (spec_paired_60_zen3_shipped_corpus_ea535c2.json);
    served at concurrency 1 / 4 / 16 1.26x / 0.99x / 1.13x against 1.17x / 0.92x / 0.96x
    (serve_zen3_default_candidates_d1ca7ab.json). Prompt lookup alone (the only drafter for
    other models): 1.06x on an older run (spec_paired.json)."""
    return list(DEFAULT_DRAFTING) if ships_an_ssm(model) else ["ngram"]


def _is_messages(x) -> bool:
    return isinstance(x, list) and len(x) > 0 and all(isinstance(m, dict) for m in x)
