import pytest

from specinfer.streaming import TextStream

TEXT = "Hello world! 12345 def f(x):\n    return x**2  # héllo 日本 and more, to slide the window. END 日本語 tail"


def _run(tokenizer, ids, stop):
    stream = TextStream(tokenizer, stop)
    pieces = [stream.add(i) for i in ids]
    pieces.append(stream.finish())
    return pieces, stream


def test_streamed_text_equals_full_decode(default_tokenizer):
    ids = default_tokenizer.encode(TEXT)
    pieces, _ = _run(default_tokenizer, ids, [])
    assert "".join(pieces) == default_tokenizer.decode(ids) == TEXT
    assert all("\ufffd" not in p for p in pieces)  # never half a UTF-8 character


@pytest.mark.parametrize("stop", [["END"], ["nd more", "END"], ["日本語"]])
def test_stop_string_cuts_the_text_before_it(default_tokenizer, stop):
    ids = default_tokenizer.encode(TEXT)
    pieces, stream = _run(default_tokenizer, ids, stop)
    first = min(TEXT.find(s) for s in stop)
    assert "".join(pieces) == TEXT[:first]
    assert stream.stopped


def test_absent_stop_string_releases_everything(default_tokenizer):
    ids = default_tokenizer.encode(TEXT)
    pieces, stream = _run(default_tokenizer, ids, ["NOT THERE"])
    assert "".join(pieces) == TEXT and not stream.stopped
