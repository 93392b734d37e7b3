"""How a model writes its tool calls: the format its chat template teaches it.

- hermes: `<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>`, one block per call,
  anywhere in the answer (Hermes, Qwen2.5, and what our own system message asks for when the
  template does not describe tools);
- llama3_json: the whole answer is `{"name": N, "parameters": {...}}` (several joined by ";"),
  perhaps after `<|python_tag|>` (Llama 3.1-3.3's JSON tool calling);
- mistral: the whole answer is `[TOOL_CALLS] [{"name": N, "arguments": {...}}, ...]` (Mistral
  7B v0.3, Nemo, Small); its template takes call ids of 9 letters and digits only.
`template_format` reads which one a template teaches. Each format finds the calls in an answer
(`calls`), says how much of a streamed answer can be sent before the end (`sendable`: text that
may still become calls is held back) and writes the grammar of an answer made of calls only.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid


class Hermes:
    name, key = "hermes", "arguments"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)

    def calls(self, text: str) -> tuple[str, list] | None:
        """(the text around the calls, trailing whitespace cut; the calls' JSON values), or None
        when the answer has no call or one is not JSON."""
        blocks = list(self._BLOCK.finditer(text))
        try:
            found = [json.loads(block.group(1)) for block in blocks]
        except json.JSONDecodeError:
            return None
        return (self._BLOCK.sub("", text).rstrip(), found) if found else None

    def sendable(self, text: str, sent: int) -> int:
        """How much of `text` a stream may have sent: up to an opening tag (or what may begin
        one), whitespace before it held too (sent once text follows)."""
        hold = text.find(self.OPEN, sent)
        if hold < 0:
            hold = len(text)
            for k in range(min(len(self.OPEN) - 1, len(text) - sent), 0, -1):
                if self.OPEN.startswith(text[-k:]):
                    hold -= k
                    break
        while hold > sent and text[hold - 1].isspace():
            hold -= 1
        return max(sent, hold)

    def grammar(self, call: dict, parallel: bool) -> str:
        repeat = ' ("\\n" call)*' if parallel else ""
        return (f"start: call{repeat}\n"
                f'call: "{self.OPEN}\\n" body "\\n{self.CLOSE}"\n'
                f"body: %json {json.dumps(call)}\n")  # fmt: skip

    def call_id(self) -> str:
        return _openai_call_id()


class WholeAnswer:
    """A format where the whole answer is the calls: JSON objects between `open` and `close`,
    separated by `sep`, perhaps after a `tag` (a special token, shown or not in the text)."""

    def __init__(self, name: str, key: str, tag: str, open: str, close: str, sep: str,
                 short_ids: bool = False):  # fmt: skip
        self.name, self.key, self.tag = name, key, tag
        self.open, self.close, self.sep = open, close, sep
        self.short_ids = short_ids  # call ids of 9 letters and digits (its template checks)

    def calls(self, text: str) -> tuple[str, list] | None:
        body = text.strip().removeprefix(self.tag).strip()
        if not (body.startswith(self.open) and body.endswith(self.close)):
            return None
        body = body[len(self.open) : len(body) - len(self.close)].strip()
        decoder, found, at = json.JSONDecoder(), [], 0
        while body.startswith("{", at):
            try:
                value, end = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return None
            found.append(value)
            rest = body[end:].lstrip()
            if not rest:
                return "", found
            if not rest.startswith(self.sep):
                return None
            at = len(body) - len(rest[len(self.sep) :].lstrip())
        return None

    def sendable(self, text: str, sent: int) -> int:
        """Nothing while the answer may still be calls (it begins as they do, or is blank);
        all of it once it cannot."""
        if sent:
            return len(text)
        start = text.lstrip()
        first = self.open or "{"
        maybe = not start or start.startswith((first, self.tag)) or self.tag.startswith(start)
        return 0 if maybe else len(text)

    def grammar(self, call: dict, parallel: bool) -> str:
        repeat = f' ("{self.sep} " call)*' if parallel else ""
        return (f'start: "{self.open}" call{repeat} "{self.close}"\n'
                f"call: %json {json.dumps(call)}\n")  # fmt: skip

    def call_id(self) -> str:
        if self.short_ids:
            return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
        return _openai_call_id()


def _openai_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


HERMES = Hermes()
LLAMA3_JSON = WholeAnswer("llama3_json", "parameters", "<|python_tag|>", "", "", ";")
MISTRAL = WholeAnswer("mistral", "arguments", "[TOOL_CALLS]", "[", "]", ",", short_ids=True)


def template_format(template: str):
    """The format a tool-aware chat template teaches (Hermes when it names none we know)."""
    if Hermes.OPEN in template:
        return HERMES
    if MISTRAL.tag in template:
        return MISTRAL
    if LLAMA3_JSON.tag in template or '"parameters"' in template:
        return LLAMA3_JSON
    return HERMES
