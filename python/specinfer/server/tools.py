"""Tool (function) calling on /v1/chat/completions (and /v1/responses, read as a chat request):
OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`.

Where the model's chat template describes tools itself (it reads `tools`, as HF's tool-aware
templates do), it is given them, and the earlier turns' calls and tool answers as structured
messages, and its answer is read in the format that template teaches (tool_formats.py: Hermes
blocks, Llama 3's JSON, Mistral's [TOOL_CALLS]). Otherwise the tools are described in a system
message that asks for Hermes blocks,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and earlier calls are written into their turns' text in that format. tool_choice:
- "none": the tools are neither described nor called;
- "auto" (the default with tools): the answer is free, and is returned as tool_calls when it
  consists of calls, each naming a declared tool with an arguments object;
- "required", or {"type": "function", "function": {"name": N}}: a grammar holds the answer to
  calls (N's alone), their arguments to the tool's `parameters` schema; like every structured
  output, exact under speculation.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from specinfer.server.errors import APIError
from specinfer.server.tool_formats import HERMES, template_format

OPEN, CLOSE = HERMES.OPEN, HERMES.CLOSE
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
    format: object = HERMES  # how the model writes calls (tool_formats.py); set by prompt()

    def prompt(self, tokenizer, messages: list[dict]) -> tuple[list[dict], list[dict] | None]:
        """The messages (as `conversation` made them for this tokenizer) and the tools to render
        them with: where the model's template describes tools itself, the request's, answered in
        the format the template teaches; else none, and our system message."""
        if not tokenizer.renders_tools:
            return self.messages(messages), None
        self.format = template_format(tokenizer.tool_template)
        return messages, self.declared

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
        """A Lark grammar (llguidance's dialect) for an answer of tool calls only."""
        names = [self.only] if self.only else list(self.functions)
        key = self.format.key
        call = {"anyOf": [{
            "type": "object",
            "properties": {"name": {"const": name}, key: self.functions[name][1]},
            "required": ["name", key],
            "additionalProperties": False,
        } for name in names]}  # fmt: skip
        return self.format.grammar(call, self.parallel)

    def parse(self, text: str, finish_reason: str | None) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of an answer: its calls as OpenAI tool_calls, when it ended
        ("stop"), has some, and every one names a declared tool with an arguments object (the
        text around them, trailing whitespace cut, is the content: None if blank); else
        (text, [])."""
        found = self.format.calls(text) if finish_reason == "stop" else None
        if found is None or (len(found[1]) > 1 and not self.parallel):
            return text, []
        content, calls = found
        out = []
        for call in calls:
            arguments = _arguments(call, self.format.key)
            if not isinstance(arguments, dict) or call.get("name") not in self.functions:
                return text, []
            out.append({"id": self.format.call_id(), "type": "function",
                        "function": {"name": call["name"], "arguments": json.dumps(arguments)}})  # fmt: skip
        return content or None, out


def _arguments(call, key: str):
    """A call's arguments: under the format's key, or the other one models use ("arguments" /
    "parameters"), or {} for a call that names its function alone; None for anything else."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    for name in (key, "arguments", "parameters"):
        if name in call:
            return call[name]
    return {} if set(call) == {"name"} else None


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
        hold = self.tools.format.sendable(self.text, self.sent)
        out, self.sent = self.text[self.sent : hold], hold
        return out

    def finish(self, finish_reason: str | None) -> tuple[str, list[dict]]:
        """At the end of the answer: (content not sent yet, tool_calls)."""
        content, calls = self.tools.parse(self.text, finish_reason)
        if not calls:
            return self.text[self.sent :], []
        # What was sent precedes the first call, so it begins the text around the calls.
        return (content or "")[self.sent :], calls


def checked_tool_calls(tool_calls, where: str) -> list[dict]:
    """An assistant message's OpenAI tool_calls, each {"id", "type": "function", "function":
    {"name", "arguments"}}, the arguments the object their JSON string holds (what chat
    templates take); ValueError naming `where` for a malformed call."""
    if not isinstance(tool_calls, list):
        raise ValueError(f"{where}.tool_calls must be a list")
    out = []
    for j, call in enumerate(tool_calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{where}.tool_calls[{j}] needs a function with a name")
        arguments = fn.get("arguments") or "{}"
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            pass  # kept as the text it is
        out.append({"id": str(call.get("id") or ""), "type": "function",
                    "function": {"name": fn["name"], "arguments": arguments}})  # fmt: skip
    return out


def conversation(messages: list[dict], structured: bool) -> list[dict]:
    """Checked chat messages as a chat template is given them: `structured` (a template that
    renders tools, and so calls and their answers: each turn's tool_calls, each tool message's
    tool_call_id), or with a turn's calls written after its text in Hermes blocks, the format our
    system message asks for."""
    out = []
    for m in messages:
        content, calls = m["content"], m.get("tool_calls")
        if structured:
            out.append({**m, "content": content or ""})
            continue
        blocks = [content] if content else []
        for call in calls or []:
            fn = call["function"]
            call_json = json.dumps({"name": fn["name"], "arguments": fn["arguments"]})
            blocks.append(f"{OPEN}\n{call_json}\n{CLOSE}")
        out.append({"role": m["role"], "content": "\n".join(blocks)})
    return out


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
        if not isinstance(only, str) or only not in functions:
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
