"""Fixtures for the default model (SmolLM2-135M-Instruct GGUF); import them where needed."""

import os
from pathlib import Path

import pytest


def default_gguf_path() -> Path:
    override = os.environ.get("SPECINFER_TEST_GGUF")
    if override:
        return Path(override)
    from specinfer.default_model import default_model_path

    try:
        return default_model_path()
    except RuntimeError as e:  # offline machine without the cached file
        pytest.skip(f"default model unavailable: {e}")


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    return default_gguf_path()


@pytest.fixture(scope="session")
def default_tokenizer(default_gguf):
    from specinfer.tokenizer import TokenizerWrapper

    return TokenizerWrapper.from_path(default_gguf)
