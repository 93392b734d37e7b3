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

from specinfer.default_model import default_model_path
from specinfer.loader import load_model
from specinfer.sampling import SamplingParams, make_generator, next_token
from specinfer.streaming import TextStream
from specinfer.tokenizer import TokenizerWrapper

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
    def __init__(
        self, index: int, prompt_ids: list[int], params: SamplingParams, stream: TextStream
    ):
        self.index, self.prompt_ids, self.params, self.stream = index, prompt_ids, params, stream
        self.generator = make_generator(params.seed)
        self.output_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.row = -1
        self.max_len = 0  # prompt + generated tokens allowed
        self.prefill_s = self.decode_s = 0.0

    def completion(self) -> Completion:
        return Completion(
            self.text,
            self.output_ids,
            self.finish_reason or "length",
            len(self.prompt_ids),
            {
                "prefill_s": self.prefill_s,
                "decode_s": self.decode_s,
                "generated_tokens": len(self.output_ids),
            },
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
    ):
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
        self.config = self.model.config
        self.tokenizer = TokenizerWrapper.from_path(path)
        self.max_batch_size = max_batch_size
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

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> Completion:
        return self.generate([messages], params)[0]

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
            _Request(i, self._prompt_ids(i, p), sp, TextStream(self.tokenizer, sp.stop))
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

    @torch.inference_mode()
    def _run(self, requests: list[_Request]) -> Iterator[tuple[_Request, str]]:
        context = self.config.max_position_embeddings
        for r in requests:
            r.max_len = min(len(r.prompt_ids) + r.params.max_tokens, context)
        rows = min(self.max_batch_size, len(requests))
        kv = self.model.make_kv_cache(rows, max(r.max_len for r in requests))
        free_rows, waiting, active = list(range(rows)), list(requests), []
        while waiting or active:
            while waiting and free_rows:  # admit and prefill
                r = waiting.pop(0)
                r.row = free_rows.pop()
                t0 = time.perf_counter()
                logits = self._forward(kv, [r], [r.prompt_ids])
                r.prefill_s = time.perf_counter() - t0
                yield from self._append(r, logits[0])
                if r.finish_reason is None:
                    active.append(r)
                else:
                    free_rows.append(r.row)
            if not active:
                continue
            t0 = time.perf_counter()
            logits = self._forward(kv, active, [[r.output_ids[-1]] for r in active])
            step_s = time.perf_counter() - t0
            for r, row_logits in zip(active, logits):
                r.decode_s += step_s
                yield from self._append(r, row_logits)
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
        hidden = self.model(
            torch.tensor(new_ids, device=dev),
            positions,
            kv,
            torch.tensor([r.row for r in batch], device=dev),
            prefix,
            torch.ones(T, T, dtype=torch.bool, device=dev).tril().expand(len(batch), T, T),
        )
        return self.model.compute_logits(hidden[:, -1])

    def _append(self, r: _Request, logits: torch.Tensor) -> Iterator[tuple[_Request, str]]:
        token = next_token(logits, r.params, r.generator)
        r.output_ids.append(token)
        is_eos = token in self.eos_ids and not r.params.ignore_eos
        delta = "" if is_eos else r.stream.add(token)
        if r.stream.stopped or is_eos:
            r.finish_reason = "stop"
        elif len(r.prompt_ids) + len(r.output_ids) >= r.max_len:
            r.finish_reason = "length"
        if r.finish_reason is not None:
            delta += r.stream.finish()
        r.text += delta
        if delta:
            yield r, delta


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """ "auto" picks bfloat16 where the hardware computes it natively, else float32."""
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


def _is_token_ids(x) -> bool:
    return isinstance(x, list) and len(x) > 0 and all(isinstance(t, int) for t in x)


def _is_messages(x) -> bool:
    return isinstance(x, list) and len(x) > 0 and all(isinstance(m, dict) for m in x)
