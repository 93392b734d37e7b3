"""Request bodies of /v1/completions and /v1/chat/completions, and their SamplingParams.

Types are checked strictly (a string is not a number, 1.5 is not an integer); values are checked
by SamplingParams, whose ValueError names the field. Unknown fields are ignored, except OpenAI
features this server does not implement (suffix, functions, ...), which are refused when set.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, field_validator

from specinfer.sampling import MAX_LOGPROBS, STRUCTURED, SamplingParams
from specinfer.server.errors import APIError
from specinfer.server.tools import Tools, checked_tool_calls, conversation, parse_tools

MAX_N = 8  # choices per request (each one an engine request)
MAX_PROMPTS = 8  # prompts in one /v1/completions request
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

# Set to anything but these, an unimplemented feature is an error rather than silently ignored.
_UNSUPPORTED = ("suffix", "tools", "functions", "best_of")
_PARAM_FIELDS = ("max_tokens", "min_tokens", "temperature", "top_k", "top_p", "min_p", "seed",
                 "stop", "repetition_penalty", "presence_penalty", "frequency_penalty")  # fmt: skip


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")
    unsupported: ClassVar[tuple[str, ...]] = _UNSUPPORTED

    model: str
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    n: StrictInt = 1
    temperature: StrictFloat | None = None  # OpenAI's default: 1
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None  # extension (vLLM's): 0 or -1 = off
    min_p: StrictFloat | None = None  # extension (vLLM's): 0 = off
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None  # extension (vLLM's)
    min_tokens: StrictInt | None = None  # extension (vLLM's): EOS and stop ids masked until then
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None  # extension (HF's definition)
    ignore_eos: StrictBool = False  # extension
    logit_bias: dict[str, StrictFloat | StrictInt] | None = None  # token id (a string) -> bias
    response_format: dict | None = None  # {"type": "text" | "json_object" | "json_schema", ...}
    structured_outputs: dict | None = None  # extension (vLLM's): {"json" | "regex" | ...: ...}
    user: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v):
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list) and all(isinstance(s, str) for s in v):
            return v
        raise ValueError("stop must be a string or a list of strings")

    def check(self) -> None:
        """Errors pydantic cannot see: unimplemented features, n, stream_options."""
        extra = self.model_extra or {}
        for name in self.unsupported:
            value = extra.get(name)
            if value in (None, False, [], {}):
                continue
            if name == "best_of" and value in (1, self.n):
                continue
            raise APIError(400, f"{name} is not supported by this server", name)
        if not 1 <= self.n <= MAX_N:
            raise APIError(400, f"n must be between 1 and {MAX_N}, got {self.n}", "n")
        if self.stream_options is not None and not self.stream:
            raise APIError(
                400, "stream_options is only allowed when stream is true", "stream_options"
            )
        self.requested_logprobs()
        self.structured()

    @property
    def structured_param(self) -> str:
        """The field a structured-output error names."""
        return "response_format" if self.response_format else "structured_outputs"

    def structured_error(self, message: str) -> APIError:
        """The 400 for a schema, regex or grammar the engine cannot compile."""
        return APIError(400, message, self.structured_param)

    def structured(self) -> dict:
        """The SamplingParams fields of response_format or structured_outputs (one of them)."""
        if self.response_format is not None and self.structured_outputs is not None:
            raise APIError(400, "give response_format or structured_outputs, not both",
                           "response_format")  # fmt: skip
        if self.structured_outputs is not None:
            fields = {"json": "json_schema", "regex": "regex", "choice": "choice",
                      "grammar": "grammar"}  # fmt: skip
            given = {k: v for k, v in self.structured_outputs.items() if v is not None}
            if len(given) != 1 or next(iter(given)) not in fields:
                raise APIError(400, "structured_outputs must set one of json, regex, choice "
                               f"and grammar, got {sorted(given)}", "structured_outputs")  # fmt: skip
            ((key, value),) = given.items()
            return {fields[key]: value}
        kind = (self.response_format or {"type": "text"}).get("type")
        if kind == "text":
            return {}
        if kind == "json_object":
            return {"json_schema": {"type": "object"}}
        if kind == "json_schema":
            spec = self.response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise APIError(400, "response_format json_schema needs a 'json_schema' object "
                               "with a 'schema'", "response_format")  # fmt: skip
            return {"json_schema": spec["schema"]}
        raise APIError(400, "response_format type must be text, json_object or json_schema, "
                       f"got {kind!r}", "response_format")  # fmt: skip

    def token_bias(self) -> dict[int, float] | None:
        """logit_bias with integer token ids; APIError 400 for a key that is not one."""
        if not self.logit_bias:
            return None
        bad = [k for k in self.logit_bias if not (k.isascii() and k.isdigit())]
        if bad:
            raise APIError(400, f"logit_bias keys must be token ids, got {bad[0]!r}", "logit_bias")
        return {int(k): float(v) for k, v in self.logit_bias.items()}

    def requested_logprobs(self) -> int | None:
        """None (no logprobs), or how many most likely tokens each step reports."""
        raise NotImplementedError

    def requested_prompt_logprobs(self) -> int | None:
        """As requested_logprobs, for the prompt's tokens."""
        return None

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """max_completion_tokens if given, else max_tokens (None: the endpoint's default), and the
        name of the field it came from (for error messages)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def sampling_params(self, max_tokens: int, choice: int) -> SamplingParams:
        """SamplingParams for choice `choice` (0..n-1): with a seed, choice i draws with seed + i."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        top_k = self.top_k if self.top_k is not None else 0
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_k=0 if top_k == -1 else top_k,
                top_p=1.0 if self.top_p is None else self.top_p,
                min_p=self.min_p or 0.0,
                seed=None if self.seed is None else self.seed + choice,
                stop=stop,
                stop_token_ids=self.stop_token_ids or [],
                min_tokens=self.min_tokens or 0,
                ignore_eos=self.ignore_eos,
                repetition_penalty=(
                    1.0 if self.repetition_penalty is None else self.repetition_penalty
                ),
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                logprobs=self.requested_logprobs(),
                prompt_logprobs=self.requested_prompt_logprobs(),
                logit_bias=self.token_bias(),
                **self.structured(),
            )
        except ValueError as e:
            message = str(e)
            param = next((f for f in _PARAM_FIELDS if message.startswith(f)), None)
            if param == "max_tokens":
                param = self.requested_max_tokens()[1]
                message = param + message[len("max_tokens") :]
            if message.startswith("stop strings"):
                param = "stop"
            if message.startswith("stop_token_ids"):
                param = "stop_token_ids"
            if message.startswith("logit_bias"):
                param = "logit_bias"
            if message.split(" ", 1)[0] in STRUCTURED or message.startswith("give at most one"):
                param = self.structured_param
            raise APIError(400, message, param) from e


def _top_count(value: int, name: str) -> int:
    if not 0 <= value <= MAX_LOGPROBS:
        raise APIError(400, f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}", name)
    return value


class CompletionRequest(_Request):
    prompt: Any
    logprobs: StrictInt | None = None  # the most likely tokens reported a step (0: the chosen one)
    echo: StrictBool | None = False  # the prompt before the completion (and its logprobs, if asked)

    def requested_logprobs(self) -> int | None:
        return None if self.logprobs is None else _top_count(self.logprobs, "logprobs")

    def requested_prompt_logprobs(self) -> int | None:
        return self.requested_logprobs() if self.echo else None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v):
        """A string, a list of strings, a list of token ids, or a list of token-id lists."""
        if isinstance(v, str) or (isinstance(v, list) and v and _token_ids(v)):
            return v
        if isinstance(v, list) and v and all(isinstance(p, str) or _token_ids(p) for p in v):
            return v
        raise ValueError(
            "prompt must be a string, a list of strings, a list of token ids or a list of "
            "token-id lists"
        )

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or all(isinstance(t, int) for t in p):
            return [p]
        if len(p) > MAX_PROMPTS:
            raise APIError(
                400, f"at most {MAX_PROMPTS} prompts per request, got {len(p)}", "prompt"
            )
        return list(p)


def _token_ids(x) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


class ChatCompletionRequest(_Request):
    unsupported: ClassVar[tuple[str, ...]] = tuple(n for n in _UNSUPPORTED if n != "tools")
    messages: list[dict]
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: StrictBool | None = None
    # Extensions (vLLM's): end the prompt without the assistant's turn opening, or continue the
    # last message (an answer's beginning, given) where its content ends.
    add_generation_prompt: StrictBool | None = None  # None: true, unless continuing
    continue_final_message: StrictBool = False

    @cached_property
    def tool_set(self) -> Tools | None:
        """The tools the model may call (None: none, or tool_choice "none"); read once, though
        the checks, the prompt and every choice's params ask."""
        return parse_tools(self.tools, self.tool_choice, self.parallel_tool_calls)

    def chat_prompt(self, tokenizer) -> list[int]:
        """The token ids the messages make (with tools, as Tools.prompt has them rendered);
        APIError 400 for messages the chat template refuses or a continuation it cannot make."""
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError(400, "continue_final_message and add_generation_prompt cannot both "
                           "be true", "continue_final_message")  # fmt: skip
        tools = self.tool_set  # with tools, the tool template renders; else the chat one
        structured = tokenizer.renders_tools if tools else tokenizer.chat_renders_tools
        messages = conversation(self.messages, structured=structured)
        messages, declared = tools.prompt(tokenizer, messages) if tools else (messages, None)
        try:
            return tokenizer.chat_ids(messages, tools=declared,
                                      add_generation_prompt=self.add_generation_prompt is not False,
                                      continue_final=self.continue_final_message)  # fmt: skip
        except ValueError as e:
            raise APIError(400, str(e), "messages") from e

    def structured_error(self, message: str) -> APIError:
        tools = self.tool_set
        if tools and tools.forced:  # the grammar is made of the tools' parameters schemas
            return APIError(400, f"a tool's parameters are not a valid JSON schema ({message})",
                            "tools")  # fmt: skip
        return super().structured_error(message)

    def structured(self) -> dict:
        """A forced tool call's grammar, or response_format's / structured_outputs' fields."""
        tools = self.tool_set
        if not (tools and tools.forced):
            return super().structured()
        if self.response_format is not None or self.structured_outputs is not None:
            raise APIError(400, "a required or named tool_choice cannot be combined with "
                           "response_format or structured_outputs", "tool_choice")  # fmt: skip
        return {"grammar": tools.grammar()}

    def requested_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs is not None:
                raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
            return None
        return 0 if self.top_logprobs is None else _top_count(self.top_logprobs, "top_logprobs")

    @field_validator("messages")
    @classmethod
    def _messages(cls, messages):
        """Each message {role, content}; content a string or a list of text parts (joined), or
        None in an assistant turn with tool_calls, which are checked and kept (as a tool
        message's tool_call_id): tools.conversation renders them for the template."""
        if not messages:
            raise ValueError("messages must not be empty")
        out = []
        for i, m in enumerate(messages):
            role, content = m.get("role"), m.get("content")
            if not isinstance(role, str):
                raise ValueError(f"messages[{i}] needs a string 'role'")
            if isinstance(content, list):
                parts = []
                for part in content:
                    if not (isinstance(part, dict) and part.get("type") == "text"
                            and isinstance(part.get("text"), str)):  # fmt: skip
                        raise ValueError(f"messages[{i}]: only text content parts are supported")
                    parts.append(part["text"])
                content = "".join(parts)
            calls = m.get("tool_calls") if role == "assistant" else None
            if not isinstance(content, str) and not (content is None and calls):
                raise ValueError(f"messages[{i}] needs 'content': a string or a list of text parts")
            message = {"role": role, "content": content}
            if calls:
                message["tool_calls"] = checked_tool_calls(calls, f"messages[{i}]")
            if role == "tool" and isinstance(m.get("tool_call_id"), str):
                message["tool_call_id"] = m["tool_call_id"]
            out.append(message)
        return out
