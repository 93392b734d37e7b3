"""Shared fixtures; `--runslow` enables tests marked slow."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", help="also run tests marked slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def gguf_cache():
    """GGUF conversions (loader.converted_gguf) go to a directory of this session's own, removed
    at its end: tests neither read nor fill the user's cache (a conversion of the default model is
    538 MB). Worker processes the tests spawn inherit it."""
    root = tempfile.mkdtemp(prefix="specinfer-gguf-")
    old = os.environ.get("SPECINFER_GGUF_CACHE")
    os.environ["SPECINFER_GGUF_CACHE"] = root
    yield Path(root)
    if old is None:
        del os.environ["SPECINFER_GGUF_CACHE"]
    else:
        os.environ["SPECINFER_GGUF_CACHE"] = old
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def smollm_gguf() -> Path:
    """The default SmolLM2-135M-Instruct GGUF: $SPECINFER_TEST_GGUF, else the packaged default."""
    env = os.environ.get("SPECINFER_TEST_GGUF")
    if env:
        if not Path(env).is_file():
            pytest.fail(f"SPECINFER_TEST_GGUF={env} is not a file")
        return Path(env)
    try:
        from specinfer.default_model import default_model_path
    except ImportError:
        _skip_unless_ci("no SPECINFER_TEST_GGUF and specinfer.default_model is not available")
    try:
        return Path(default_model_path())
    except Exception as e:  # e.g. not cached and no network: a skip, except on CI
        _skip_unless_ci(f"default model unavailable: {e!r}")


def _skip_unless_ci(reason: str):
    """Skip a test that needs the default model; on CI (CI=true) that is a failure: a CI run
    must not pass by skipping every model test."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def default_tokenizer(smollm_gguf):
    from specinfer.tokenizer import TokenizerWrapper

    return TokenizerWrapper.from_path(smollm_gguf)
