"""Tool (function) calling on /v1/chat/completions: OpenAI's `tools`, `tool_choice` and
`parallel_tool_calls`.

The model is told the tools in a system message and calls one by answering

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

(the Hermes format, which many chat models are trained on), one block per call. tool_choice:
- "none": the tools are neither described nor called;
- "auto" (the default with tools): the answer is free, and is returned as tool_calls when it
  consists of such blocks, each naming a declared tool with an arguments object;
- "required", or {"type": "function", "function": {"name": N}}: a grammar holds the answer to
  such blocks (N's alone), their arguments to the tool's `parameters` schema; like every
  structured output, exact under speculation.
Earlier turns come back as messages: an assistant message's tool_calls are rendered in the same
format, a "tool" message's content as the tool's answer.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from specinfer.server.errors import APIError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass
class Tools:
    """A request's declared functions ({name: (description, parameters schema)}), how it lets
    the model use them, and whether several calls may come in one answer."""

    functions: dict[str, tuple[str, dict]]
    declared: list[dict]  # the request's `tools`, as given (for a template that renders them)
    forced: bool = False  # the answer must be tool calls (a grammar holds it to them)
    only: str | None = None  # the one function it must call
    parallel: bool = True

    def prompt(self, tokenizer, messages: list[dict]) -> list[dict] | list[int]:
        """The chat prompt: where the model's template describes tools itself (HF's templates
        take `tools`; Hermes-style ones, Qwen2.5's among them, ask for these very blocks), the
        conversation it renders with them, as token ids; else the conversation with our
        system message (`messages`)."""
        if not tokenizer.renders_tools:
            return self.messages(messages)
        return tokenizer.chat_ids(messages, tools=self.declared)

    def system_prompt(self) -> str:
        listed = "\n".join(
            json.dumps({"name": name, "description": description, "parameters": schema})
            for name, (description, schema) in self.functions.items()
        )
        how = "one call" if not self.parallel else "one block per call"
        return (
            "You may call these functions to answer:\n"
            f"{listed}\n"
            f"To call one, answer with {how}, and nothing else, in this form:\n"
            f'{OPEN}\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n{CLOSE}'
        )

    def messages(self, messages: list[dict]) -> list[dict]:
        """The conversation with the tools described in its system message (a first one if it
        has none)."""
        if messages and messages[0]["role"] == "system":
            first = messages[0]["content"] + "\n\n" + self.system_prompt()
            return [{"role": "system", "content": first}, *messages[1:]]
        return [{"role": "system", "content": self.system_prompt()}, *messages]

    def grammar(self) -> str:
        """A Lark grammar (llguidance's dialect) for an answer of tool-call blocks only."""
        names = [self.only] if self.only else list(self.functions)
        call = {"anyOf": [{
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": self.functions[name][1]},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        } for name in names]}  # fmt: skip
        repeat = ' ("\\n" call)*' if self.parallel else ""
        return (
            f"start: call{repeat}\n"
            f'call: "{OPEN}\\n" body "\\n{CLOSE}"\n'
            f"body: %json {json.dumps(call)}\n"
        )

    def parse(self, text: str, finish_reason: str | None) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of an answer: its tool-call blocks as OpenAI tool_calls, when
        it ended ("stop"), has some, and every one names a declared tool with an arguments
        object (the text around them, trailing whitespace cut, is the content: None if blank);
        else (text, [])."""
        blocks = list(_BLOCK.finditer(text)) if finish_reason == "stop" else []
        calls = []
        for block in blocks:
            try:
                call = json.loads(block.group(1))
            except json.JSONDecodeError:
                return text, []
            if (not isinstance(call, dict) or call.get("name") not in self.functions
                    or not isinstance(call.get("arguments", {}), dict)):  # fmt: skip
                return text, []
            calls.append({
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": call["name"],
                             "arguments": json.dumps(call.get("arguments", {}))},
            })  # fmt: skip
        if not calls or (len(calls) > 1 and not self.parallel):
            return text, []
        content = _BLOCK.sub("", text).rstrip()
        return content or None, calls


class ToolStream:
    """A streamed choice's content while the answer may turn into tool calls: text is sent as
    it comes, but from a tool-call opening (or what may be the start of one, or whitespace) it
    is held back until the end, when `finish` says whether it was calls or content. The content
    sent then adds up to the unstreamed answer's."""

    def __init__(self, tools: Tools):
        self.tools, self.text, self.sent = tools, "", 0

    def feed(self, text: str) -> str:
        """The new text that may be sent now."""
        self.text += text
        if self.tools.forced:
            return ""
        hold = self.text.find(OPEN, self.sent)
        if hold < 0:  # keep back a tail that may begin the opening tag
            hold = len(self.text)
            for k in range(min(len(OPEN) - 1, len(self.text) - self.sent), 0, -1):
                if OPEN.startswith(self.text[-k:]):
                    hold -= k
                    break
        while hold > self.sent and self.text[hold - 1].isspace():  # sent once text follows
            hold -= 1
        out, self.sent = self.text[self.sent : hold], max(self.sent, hold)
        return out

    def finish(self, finish_reason: str | None) -> tuple[str, list[dict]]:
        """At the end of the answer: (content not sent yet, tool_calls)."""
        calls = self.tools.parse(self.text, finish_reason)[1]
        if not calls:
            return self.text[self.sent :], []
        # What was sent precedes the first block, so it begins the text around the blocks.
        return _BLOCK.sub("", self.text)[self.sent :].rstrip(), calls


def render_tool_calls(content: str | None, tool_calls, where: str) -> str:
    """An earlier assistant turn's content with its OpenAI tool_calls written after it, in the
    format the model is asked to answer in; ValueError naming `where` for a malformed call."""
    if not isinstance(tool_calls, list):
        raise ValueError(f"{where}.tool_calls must be a list")
    blocks = [content] if content else []
    for j, call in enumerate(tool_calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{where}.tool_calls[{j}] needs a function with a name")
        arguments = fn.get("arguments") or "{}"
        try:  # a JSON string in OpenAI's messages; written back as the object it holds
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            pass
        call_json = json.dumps({"name": fn["name"], "arguments": arguments})
        blocks.append(f"{OPEN}\n{call_json}\n{CLOSE}")
    return "\n".join(blocks)


def parse_tools(tools, tool_choice, parallel_tool_calls) -> Tools | None:
    """The request's Tools (None: no tools, or tool_choice "none"); APIError 400 naming the
    field for a malformed tool or choice."""
    if tool_choice is not None and not tools:
        raise APIError(400, "tool_choice needs tools", "tool_choice")
    if not tools:
        return None
    if not isinstance(tools, list):
        raise APIError(400, "tools must be a list of functions", "tools")
    functions = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise APIError(400, f'tools[{i}] must be {{"type": "function", "function": {{...}}}}',
                           "tools")  # fmt: skip
        name, schema = fn.get("name"), fn.get("parameters", {"type": "object"})
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise APIError(400, f"tools[{i}].function.name must be 1-64 letters, digits, _ or -, "
                           f"got {name!r}", "tools")  # fmt: skip
        if name in functions:
            raise APIError(400, f"tools: two functions are named {name!r}", "tools")
        if not isinstance(schema, dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object",
                           "tools")  # fmt: skip
        functions[name] = (str(fn.get("description") or ""), schema)
    choice, only = "auto" if tool_choice is None else tool_choice, None
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        only = fn.get("name") if isinstance(fn, dict) else None
        if only not in functions:
            raise APIError(400, "tool_choice must name one of the tools "
                           '({"type": "function", "function": {"name": ...}})', "tool_choice")  # fmt: skip
    elif choice not in ("none", "auto", "required"):
        raise APIError(400, "tool_choice must be none, auto, required or a named function, "
                       f"got {choice!r}", "tool_choice")  # fmt: skip
    if choice == "none":
        return None
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise APIError(400, "parallel_tool_calls must be a boolean", "parallel_tool_calls")
    return Tools(functions, tools, choice != "auto", only, parallel_tool_calls is not False)
