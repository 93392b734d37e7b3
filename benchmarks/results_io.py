"""What every benchmark does with its result: write the JSON, then draw the plot beside it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def save(result: dict, out: str | Path, draw: Callable) -> None:
    """Write `result` to `out` (JSON) and `draw(result, plt)` into the same name with .png. The
    JSON says which CPU kernel family ran (`cpu_isa`): timings differ widely between them."""
    try:
        from specinfer import _C

        result.setdefault("cpu_isa", _C.cpu_isa())
    except ImportError:  # no compiled core: the pure-torch references ran
        result.setdefault("cpu_isa", None)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib)")
        return
    fig = draw(result, plt)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print(f"wrote {out.with_suffix('.png')}")
