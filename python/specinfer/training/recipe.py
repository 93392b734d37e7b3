"""How to make one SSM: select layers of the target, distil, export, and load the export back.

An SSM whose export directory exists is loaded instead of trained again (after checking it was
made the same way), so boosting stages and interrupted runs never redo finished work.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from specinfer.loader import load_model
from specinfer.tokenizer import TokenizerWrapper
from specinfer.training.distill import TrainSettings, distill
from specinfer.training.export import export_student
from specinfer.training.student import build_student


@dataclass
class SSMRecipe:
    target: nn.Module  # float32
    tokenizer: TokenizerWrapper
    layers: list[int]
    settings: TrainSettings
    head: list[int]  # token ids by frequency (head_tokens.json)
    mlp_keep: float = 1.0
    compact: bool = False

    def untrained(self) -> nn.Module:
        return build_student(self.target, self.layers, self.mlp_keep)

    def train(
        self, examples: list[dict], out_dir: Path, checkpoint: Path, seed: int = 0
    ) -> nn.Module:
        """The SSM trained on `examples`, exported to `out_dir` and loaded from there (float32),
        so a reused export and a fresh one behave the same."""
        settings = replace(self.settings, seed=seed)
        info = {"source_layers": self.layers, "mlp_keep": self.mlp_keep,
                "train": asdict(settings), "examples": len(examples)}  # fmt: skip
        config_file = out_dir / "config.json"
        if config_file.exists():
            made = json.loads(config_file.read_text()).get("specinfer", {})
            if {k: made.get(k) for k in info} != info:
                raise ValueError(
                    f"{out_dir} holds an SSM made with other settings or data; use another "
                    "--out directory or delete it"
                )
            tqdm.write(f"{out_dir.name}: already trained, loading it", file=sys.stderr)
        else:
            student = self.untrained()
            distill(student, examples, settings, checkpoint, desc=f"training {out_dir.name}")
            export_student(student, out_dir, self.tokenizer, self.head, info, self.compact)
            checkpoint.unlink(missing_ok=True)  # the export is the finished work now
        return load_model(out_dir, torch.float32, shared_embeddings_from=self.target)
