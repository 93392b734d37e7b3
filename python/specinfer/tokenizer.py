"""Tokenizer and chat template, from an HF directory (tokenizer.json) or a GGUF file's metadata."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

# GGUF token types (llama.cpp's llama_token_type): 3 = control, 4 = user-defined.
_CONTROL, _USER_DEFINED = 3, 4
_GGUF_SAVED = "tokenizer_gguf.json"  # in a GGUF file's conversion: the wrapper's other fields

# Pre-tokenizer splits that differ from GPT-2's, keyed by the GGUF `tokenizer.ggml.pre` name.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact"):  # digits are split one by one
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("llama3", "llama-bpe", "llama-v3", "smaug-bpe", "dbrx"):
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    return byte_level  # "gpt2", "default" and other GPT-2-like vocabularies


class TokenizerWrapper:
    """Encodes prompts, decodes tokens, renders chat templates."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        bos_token: str | None,
        eos_token: str | None,
        add_bos: bool,
        chat_template: str | list[dict] | None,
    ):
        self.tokenizer = tokenizer
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_token_id = tokenizer.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = tokenizer.token_to_id(eos_token) if eos_token else None
        self.add_bos = add_bos and self.bos_token_id is not None
        # tokenizer_config.json may name several templates ([{"name", "template"}]): "default"
        # renders chats, "tool_use" (if there is one) chats that come with tools.
        self.named_templates = (
            {t["name"]: t["template"] for t in chat_template}
            if isinstance(chat_template, list) else {}
        )  # fmt: skip
        self.chat_template = (
            self.named_templates.get("default", next(iter(self.named_templates.values()), None))
            if self.named_templates else chat_template
        )  # fmt: skip

    def use_template(self, source: str) -> None:
        """Render chats (with tools too) by this template instead of the model's; ValueError
        for one that does not compile."""
        check_template(source)
        self.chat_template, self.named_templates = source, {}

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def tool_template(self) -> str | None:
        """The template a chat with tools is rendered by."""
        return self.named_templates.get("tool_use", self.chat_template)

    @property
    def renders_tools(self) -> bool:
        """Whether that template describes tools itself: it reads a `tools` variable (as HF's
        tool-aware templates do) in one of its tags, not merely says the word."""
        return _reads_tools(self.tool_template)

    @property
    def chat_renders_tools(self) -> bool:
        """renders_tools, for the template of chats without tools (with named templates, a
        "default" one may not know tool calls when "tool_use" does)."""
        return _reads_tools(self.chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None,
                            continue_final: bool = False) -> str:  # fmt: skip
        """The conversation as the model's chat template writes it; `tools`: OpenAI's function
        list, for a template that renders_tools. continue_final: the text ends where the last
        message's content does (no end of turn, no generation prompt), for the model to go on
        with it."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; pass a plain prompt instead")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(
                    f"chat message {i} must be a dict with 'role' and 'content', got {m!r}"
                )
        if continue_final:  # rendered with a mark after the content, cut there
            last = messages[-1]
            messages = [*messages[:-1], {**last, "content": (last["content"] or "") + _CUT}]
        template = _compile_template(self.tool_template if tools else self.chat_template)
        try:
            text = template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt and not continue_final,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **({"tools": tools} if tools else {}),
            )
        except jinja2.TemplateError as e:  # e.g. raise_exception("roles must alternate ...")
            raise ValueError(f"the model's chat template refused these messages: {e}") from e
        if continue_final:
            if _CUT not in text:
                raise ValueError("the chat template does not write the final message's content, "
                                 "so it cannot be continued")  # fmt: skip
            text = text[: text.index(_CUT)]
        return text

    def chat_ids(self, messages: list[dict], tools: list[dict] | None = None,
                 add_generation_prompt: bool = True, continue_final: bool = False) -> list[int]:  # fmt: skip
        """The rendered conversation's token ids (the template writes any BOS it wants)."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, continue_final)
        return self.encode(text, add_special_tokens=False)

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_path(cls, path: str | Path) -> TokenizerWrapper:
        path = Path(path)
        if path.suffix == ".gguf":
            return cls.from_gguf(path)
        return cls.from_hf_dir(path)

    @classmethod
    def from_hf_dir(cls, path: Path) -> TokenizerWrapper:
        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        config = _read_json(path / "tokenizer_config.json")
        template = config.get("chat_template")
        if template is None and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        # tokenizer.json's post-processor already adds BOS where the model wants it.
        return cls(
            Tokenizer.from_file(str(file)),
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            add_bos=False,
            chat_template=template,
        )

    @classmethod
    def from_gguf(cls, path: Path) -> TokenizerWrapper:
        from specinfer.loader import converted_gguf, open_gguf

        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        converted = converted_gguf(path)
        if converted is None:
            return cls._read_gguf(open_gguf(path), path.name)
        saved = json.loads((converted / _GGUF_SAVED).read_text())
        if "error" in saved:  # the file's tokenizer is not supported
            raise ValueError(saved["error"])
        return cls(Tokenizer.from_file(str(converted / "tokenizer.json")), **saved)

    @classmethod
    def save_gguf(cls, path: Path, out_dir: Path) -> None:
        """A GGUF file's tokenizer as from_gguf reads it from a conversion (loader.converted_gguf):
        tokenizer.json, and the rest or why the tokenizer is not supported."""
        from specinfer.loader import open_gguf

        try:
            tok = cls._read_gguf(open_gguf(path), path.name)
        except ValueError as e:
            saved = {"error": str(e)}
        else:
            tok.tokenizer.save(str(out_dir / "tokenizer.json"))
            templates = [{"name": n, "template": t} for n, t in tok.named_templates.items()]
            saved = {"bos_token": tok.bos_token, "eos_token": tok.eos_token,
                     "add_bos": tok.add_bos, "chat_template": templates or tok.chat_template}  # fmt: skip
        (out_dir / _GGUF_SAVED).write_text(json.dumps(saved))

    @classmethod
    def _read_gguf(cls, reader, name: str) -> TokenizerWrapper:
        def field(key, default=None):
            f = reader.fields.get(key)
            return default if f is None else f.contents()

        kind = field("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"{name}: tokenizer type {kind!r} is not supported (supported: 'gpt2' byte-level BPE)"
            )
        tokens = field("tokenizer.ggml.tokens")
        merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
        types = field("tokenizer.ggml.token_type", [])
        tok = Tokenizer(
            models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=False)
        )
        tok.pre_tokenizer = _gguf_pre_tokenizer(field("tokenizer.ggml.pre", "default"))
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(
            [
                AddedToken(t, special=True, normalized=False)
                for t, ty in zip(tokens, types)
                if ty == _CONTROL
            ]
        )
        tok.add_tokens(
            [AddedToken(t, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
        )
        bos, eos = field("tokenizer.ggml.bos_token_id"), field("tokenizer.ggml.eos_token_id")
        return cls(
            tok,
            bos_token=tokens[bos] if bos is not None else None,
            eos_token=tokens[eos] if eos is not None else None,
            add_bos=bool(field("tokenizer.ggml.add_bos_token", False)),
            chat_template=_gguf_templates(field),
        )


def _gguf_templates(field) -> str | list[dict] | None:
    """A GGUF file's chat template, or its named ones (`tokenizer.chat_template.<name>`, listed
    in `tokenizer.chat_templates`) with it as "default", as tokenizer_config.json names them."""
    default = field("tokenizer.chat_template")
    named = [{"name": n, "template": field(f"tokenizer.chat_template.{n}")}
             for n in field("tokenizer.chat_templates", [])]  # fmt: skip
    named = [t for t in named if t["template"] is not None]
    if not named:
        return default
    return ([{"name": "default", "template": default}] if default else []) + named


def _read_json(file: Path) -> dict:
    return json.loads(file.read_text()) if file.is_file() else {}


def _token_text(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _raise(message: str):
    raise jinja2.TemplateError(message)


_templates: dict[str, jinja2.Template] = {}
_CUT = "\x00specinfer:continue\x00"  # marks where a continued final message ends
_READS_TOOLS = re.compile(r"\{[{%][^}%]*\btools\b")  # `tools` inside a {{ }} or {% %} tag


def _reads_tools(template: str | None) -> bool:
    return bool(template) and bool(_READS_TOOLS.search(template))


def check_template(source: str) -> None:
    """ValueError, with jinja's reason, for a chat template that does not compile."""
    try:
        _compile_template(source)
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template does not compile: {e}") from e


def _compile_template(source: str) -> jinja2.Template:
    if source not in _templates:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = lambda x, indent=None: json.dumps(
            x, ensure_ascii=False, indent=indent
        )
        _templates[source] = env.from_string(source)
    return _templates[source]
