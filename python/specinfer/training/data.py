"""Training prompts: read from a .txt or .jsonl file and turned into token ids."""

from __future__ import annotations

import json
from pathlib import Path

from specinfer.tokenizer import TokenizerWrapper

Prompt = str | list[dict]  # raw text, or chat messages


def load_prompts(path: str | Path) -> list[Prompt]:
    """.txt: one prompt per line, blank lines skipped. .jsonl: one object per line with a
    "prompt" (text) or "messages" (a chat: [{"role", "content"}, ...]) field."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    if path.suffix not in (".txt", ".jsonl"):
        raise ValueError(f"prompt file {path} must be .txt (one prompt a line) or .jsonl")
    lines = path.read_text(encoding="utf-8").splitlines()
    if path.suffix == ".txt":
        prompts = [line for line in lines if line.strip()]
    else:
        prompts = [
            _parse_jsonl_line(path, n, line) for n, line in enumerate(lines, 1) if line.strip()
        ]
    if not prompts:
        raise ValueError(f"prompt file {path} has no prompts")
    return prompts


def _parse_jsonl_line(path: Path, number: int, line: str) -> Prompt:
    where = f"{path}, line {number}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if isinstance(obj.get("prompt"), str) and obj["prompt"].strip():
        return obj["prompt"]
    messages = obj.get("messages")
    if isinstance(messages, list) and messages:
        for m in messages:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)):  # fmt: skip
                raise ValueError(f"{where}: each message needs string 'role' and 'content'")
        return messages
    raise ValueError(f"{where}: needs a non-empty 'prompt' string or a 'messages' list")


def prompt_ids(tokenizer: TokenizerWrapper, prompt: Prompt, chat: bool) -> list[int]:
    """Token ids as `specinfer generate` would feed them: chat messages always go through the
    chat template; text does when `chat` is set (the model needs a template then)."""
    if isinstance(prompt, str) and not chat:
        return tokenizer.encode(prompt)
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return tokenizer.chat_ids(messages)
