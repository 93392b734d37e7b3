"""The body of POST /v1/responses (OpenAI's Responses API), read into the chat route's request.

A Responses request says what a chat request says in other words, so it is translated and the
chat route's checks, prompt rendering, tools and sampling do the rest:
- `input`: a string (one user message) or a list of items: messages ({role, content}, content a
  string or input_text / output_text parts), `function_call` items (an assistant's tool call)
  and `function_call_output` items (the tool's answer); `reasoning` items are skipped;
- `instructions`: a system message before them (not carried over by previous_response_id);
- `max_output_tokens`, `temperature`, `top_p`; `text.format` -> response_format;
- `tools` (function tools, flat: {"type": "function", "name", "parameters", ...}), `tool_choice`
  ("auto", "none", "required" or {"type": "function", "name"}), `parallel_tool_calls`;
- logprobs when `include` has "message.output_text.logprobs" or `top_logprobs` is given;
- the chat route's sampling extensions (seed, top_k, stop, penalties, logit_bias, ...);
- `truncation: "auto"`: the oldest turns are dropped until the prompt fits (see
  responses.fitted).
An error names the Responses field (max_output_tokens, text.format, input), not the chat one.
"""

from __future__ import annotations

import uuid

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, ValidationError

from specinfer.server.errors import APIError, invalid
from specinfer.server.protocol import ChatCompletionRequest

LOGPROBS = "message.output_text.logprobs"
# Fields of a chat request a Responses request may set too (not OpenAI's; vLLM takes them).
EXTENSIONS = ("seed", "top_k", "min_p", "stop", "stop_token_ids", "min_tokens", "presence_penalty", "frequency_penalty",
              "repetition_penalty", "logit_bias", "ignore_eos", "structured_outputs")  # fmt: skip
# The chat request's names for what a Responses request calls otherwise (for error messages).
_RENAMED = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format",
            "messages": "input"}  # fmt: skip
_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = ("user", "assistant", "system", "developer")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list
    instructions: str | None = None
    max_output_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_logprobs: StrictInt | None = None
    include: list[str] | None = None
    text: dict | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: StrictBool | None = None
    stream: StrictBool = False
    store: StrictBool = True
    previous_response_id: str | None = None
    metadata: dict | None = None
    truncation: str | None = None
    background: StrictBool | None = None

    def check(self) -> None:
        """Errors pydantic cannot see: what this server does not do."""
        if self.background:
            raise APIError(400, "background responses are not supported", "background")
        if self.truncation not in (None, "disabled", "auto"):
            raise APIError(400, "truncation must be 'auto' or 'disabled', got "
                           f"{self.truncation!r}", "truncation")  # fmt: skip
        for name in ("conversation", "prompt"):
            if (self.model_extra or {}).get(name) is not None:
                raise APIError(400, f"{name} is not supported by this server", name)

    @property
    def _items(self) -> list:
        """The input as a list of items (a string is one user message)."""
        return (
            [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        )

    def messages(self) -> list[dict]:
        """The input as chat messages (OpenAI's chat shape, tool calls included)."""
        out = []
        for i, item in enumerate(self._items):
            where = f"input[{i}]"
            if not isinstance(item, dict):
                raise APIError(400, f"{where} must be an object", "input")
            kind = item.get("type", "message")
            if kind == "message":
                if item.get("role") not in _ROLES:
                    raise APIError(400, f"{where}.role must be one of {', '.join(_ROLES)}, got "
                                   f"{item.get('role')!r}", "input")  # fmt: skip
                out.append({"role": item["role"], "content": _text(item.get("content"), where)})
            elif kind == "function_call":
                if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                    raise APIError(400, f"{where}: a function_call needs string call_id, name and "
                                   "arguments", "input")  # fmt: skip
                call = {"id": item["call_id"], "type": "function",
                        "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
                if out and out[-1]["role"] == "assistant":  # one turn: its text, then its calls
                    out[-1].setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                            "content": _text(item.get("output"), where)})  # fmt: skip
            elif kind != "reasoning":  # a reasoning model's summary: nothing for this model
                raise APIError(400, f"{where}: items of type {kind!r} are not supported "
                               "(messages, function_call and function_call_output are)", "input")  # fmt: skip
        return out

    def input_items(self) -> list[dict]:
        """The input as the API lists it back: items with ids and a status, a message's text
        as input_text parts (checked by `messages` already)."""
        out = []
        for item in self._items:
            kind = item.get("type", "message")
            if kind == "message":
                content = item["content"]
                parts = (
                    [{"type": "input_text", "text": content}]
                    if isinstance(content, str)
                    else content
                )
                item = {"type": "message", "role": item["role"], "content": parts,
                        "id": item.get("id")}  # fmt: skip
            prefix = {"message": "msg", "function_call": "fc"}.get(kind, "fco")
            out.append({**item, "id": item.get("id") or f"{prefix}_{uuid.uuid4().hex}",
                        "status": item.get("status") or "completed"})  # fmt: skip
        return out

    def chat_request(self, history: list[dict]) -> ChatCompletionRequest:
        """The chat request this one amounts to, after the conversation `history` (a previous
        response's, or [])."""
        messages = [*history, *self.messages()]
        if self.instructions:
            messages.insert(0, {"role": "system", "content": self.instructions})
        fields = {"model": self.model, "messages": messages,
                  "max_completion_tokens": self.max_output_tokens,
                  "temperature": self.temperature, "top_p": self.top_p,
                  "tools": _chat_tools(self.tools), "tool_choice": _chat_tool_choice(self.tool_choice),
                  "parallel_tool_calls": self.parallel_tool_calls,
                  "response_format": _response_format(self.text)}  # fmt: skip
        if LOGPROBS in (self.include or []) or self.top_logprobs is not None:
            fields.update(logprobs=True, top_logprobs=self.top_logprobs)
        extra = self.model_extra or {}
        fields.update({k: extra[k] for k in EXTENSIONS if k in extra})
        try:
            chat = ChatCompletionRequest.model_validate(fields)
        except ValidationError as e:
            raise renamed(invalid(e)) from e
        try:
            chat.check()
        except APIError as e:
            raise renamed(e) from e
        return chat


def renamed(error: APIError) -> APIError:
    """A chat request's error in the Responses API's names."""
    message, param = error.message, error.param
    for chat_name, name in _RENAMED.items():
        if chat_name != "messages":  # a word prose uses too ("refused these messages")
            message = message.replace(chat_name, name)
        param = name if param == chat_name else param
    return APIError(error.status, message, param, error.code)


def _text(content, where: str) -> str:
    """A message's or tool output's text: a string, or text parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("type"), str)
                                         for p in content):  # fmt: skip
        kinds = {p["type"] for p in content}
        if kinds <= set(_TEXT_PARTS) and all(isinstance(p.get("text"), str) for p in content):
            return "".join(p["text"] for p in content)
        if kinds - set(_TEXT_PARTS):
            raise APIError(400, f"{where}: only text content is supported, got "
                           f"{sorted(str(k) for k in kinds - set(_TEXT_PARTS))}", "input")  # fmt: skip
    raise APIError(400, f"{where} needs content: a string or a list of input_text parts", "input")


def _chat_tools(tools) -> list | None:
    """Function tools in the chat API's nested shape; other kinds (web search, files, ...) are
    refused."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise APIError(400, "tools must be a list of function tools", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise APIError(400, f"tools[{i}]: only function tools are supported, got {kind!r}",
                           "tools")  # fmt: skip
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(choice):
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: dict | None) -> dict | None:
    """text.format as the chat API's response_format."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise APIError(400, "text.format must be an object", "text.format")
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"),
                                                       "schema": fmt.get("schema")}}  # fmt: skip
    return fmt
