import pytest

from specinfer.tokenizer import TokenizerWrapper

TEXTS = [
    "Hello world!",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Numbers 1234567 and 3.14159, dates 2026-11-30.",
    "  leading spaces, trailing tabs\t\t",
    "Unicode: héllo naïve café 日本語 😀 Ελληνικά",
    "To be, or not to be, that is the question:",
]


@pytest.fixture(scope="module")
def hf_tokenizer(smollm_gguf):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        str(smollm_gguf.parent), gguf_file=smollm_gguf.name
    )


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_matches_transformers(default_tokenizer, hf_tokenizer, text):
    ids = default_tokenizer.encode(text)
    assert ids == hf_tokenizer(text)["input_ids"]
    assert default_tokenizer.decode(ids) == text


def test_chat_template_matches_transformers(default_tokenizer, hf_tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ]
    ours = default_tokenizer.apply_chat_template(messages)
    theirs = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    ids = default_tokenizer.encode(ours, add_special_tokens=False)
    assert (
        ids.count(default_tokenizer.tokenizer.token_to_id("<|im_start|>")) == 5
    )  # 4 turns + the generation prompt, each kept whole


CONTINUED = [{"role": "user", "content": "A JSON person, please."},
             {"role": "assistant", "content": '{"name": "'}]  # fmt: skip


def test_a_final_message_is_continued(smollm_gguf):
    """continue_final: the prompt ends where the last message's content does, so the model goes
    on with it; a template that does not write the content cannot continue it."""
    tok = TokenizerWrapper.from_path(smollm_gguf)
    ours = tok.apply_chat_template(CONTINUED, continue_final=True)
    closed = tok.apply_chat_template(CONTINUED, add_generation_prompt=False)
    assert ours.endswith('<|im_start|>assistant\n{"name": "') and closed.startswith(ours)
    assert closed[len(ours) :] == "<|im_end|>\n"
    assert tok.chat_ids(CONTINUED, continue_final=True) == tok.encode(
        ours, add_special_tokens=False
    )
    tok.use_template("{% for m in messages %}<{{ m.role }}>{% endfor %}")
    with pytest.raises(ValueError, match="cannot be continued"):
        tok.apply_chat_template(CONTINUED, continue_final=True)


def test_a_continued_message_matches_transformers(default_tokenizer, hf_tokenizer):
    theirs = hf_tokenizer.apply_chat_template(CONTINUED, tokenize=False,
                                              continue_final_message=True)  # fmt: skip
    assert default_tokenizer.apply_chat_template(CONTINUED, continue_final=True) == theirs


def test_special_tokens_are_skipped_when_decoding(default_tokenizer):
    ids = default_tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert default_tokenizer.decode(ids) == "user\nhi"
    assert default_tokenizer.eos_token == "<|im_end|>"


def test_bad_chat_messages_are_rejected(default_tokenizer):
    with pytest.raises(ValueError, match="chat message 0"):
        default_tokenizer.apply_chat_template([{"content": "no role"}])


def test_missing_tokenizer_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        TokenizerWrapper.from_path(tmp_path)
    with pytest.raises(FileNotFoundError, match="GGUF"):
        TokenizerWrapper.from_path(tmp_path / "missing.gguf")


def test_a_gguf_tokenizer_reads_the_same_from_the_file_and_from_its_conversion(
    smollm_gguf, monkeypatch
):
    from specinfer.loader import converted_gguf

    monkeypatch.setenv("SPECINFER_GGUF_CACHE", "0")
    direct = TokenizerWrapper.from_path(smollm_gguf)
    monkeypatch.undo()  # the session's cache
    assert converted_gguf(smollm_gguf) is not None

    def read_again(*args):
        raise AssertionError("the GGUF file's tokenizer was read again")

    monkeypatch.setattr(TokenizerWrapper, "_read_gguf", read_again)
    converted = TokenizerWrapper.from_path(smollm_gguf)
    for text in TEXTS + ["<|im_start|>user\nhi<|im_end|>", "  tabs\tand\r\nnewlines 12345"]:
        assert converted.encode(text) == direct.encode(text)
        ids = direct.encode(text)
        assert converted.decode(ids) == direct.decode(ids)
        assert converted.decode(ids, False) == direct.decode(ids, False)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert converted.apply_chat_template(chat) == direct.apply_chat_template(chat)
    for name in ("vocab_size", "bos_token_id", "eos_token_id", "add_bos", "chat_template"):
        assert getattr(converted, name) == getattr(direct, name), name


def test_named_chat_templates(default_tokenizer):
    """tokenizer_config.json's list of named templates: "default" renders chats, "tool_use"
    the chats that come with tools (and makes the tokenizer one that renders tools)."""
    named = [{"name": "tool_use", "template": "{% for t in tools %}{{ t.name }} {% endfor %}"},
             {"name": "default", "template": "{% for m in messages %}{{ m.content }}{% endfor %}"}]  # fmt: skip
    tok = TokenizerWrapper(default_tokenizer.tokenizer, bos_token=None, eos_token=None,
                           add_bos=False, chat_template=named)  # fmt: skip
    messages = [{"role": "user", "content": "hi"}]
    assert tok.renders_tools and tok.apply_chat_template(messages) == "hi"
    assert tok.apply_chat_template(messages, tools=[{"name": "f"}, {"name": "g"}]) == "f g "
    plain = TokenizerWrapper(default_tokenizer.tokenizer, bos_token=None, eos_token=None,
                             add_bos=False, chat_template=named[1:])  # fmt: skip
    assert not plain.renders_tools and plain.tool_template == plain.chat_template


def test_gguf_named_chat_templates():
    """A GGUF file's named templates (tokenizer.chat_templates lists the names, each stored as
    tokenizer.chat_template.<name>) are read as tokenizer_config.json's list."""
    from types import SimpleNamespace

    def reader(extra: dict):
        fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
                  "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.token_type": [1, 1, 1],
                  "tokenizer.chat_template": "{{ messages[0].content }}", **extra}  # fmt: skip
        return SimpleNamespace(
            fields={k: SimpleNamespace(contents=lambda v=v: v) for k, v in fields.items()}
        )

    tool_use = "{% for t in tools %}{{ t }}{% endfor %}"
    named = {"tokenizer.chat_templates": ["tool_use"], "tokenizer.chat_template.tool_use": tool_use}
    tok = TokenizerWrapper._read_gguf(reader(named), "m.gguf")
    assert tok.chat_template == "{{ messages[0].content }}" and tok.tool_template == tool_use
    assert tok.renders_tools and tok.encode("ab") == [2]
    plain = TokenizerWrapper._read_gguf(reader({}), "m.gguf")
    assert plain.named_templates == {} and not plain.renders_tools
