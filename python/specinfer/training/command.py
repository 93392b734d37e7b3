"""The `specinfer train-ssm` subcommand: its arguments and entry point."""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", required=True, help=".txt (one prompt a line) or .jsonl "
                   '({"prompt": ...} or {"messages": [...]} a line)')  # fmt: skip
    p.add_argument("--out", required=True, help="output directory (re-run to resume)")
    p.add_argument("--model", default=None, help="target: HF directory or .gguf (default model)")
    p.add_argument("--kind", choices=["layers", "feature"], default="layers",
                   help="layers: a student of selected target layers; feature: a draft head "
                   "over the target's hidden states (EAGLE-style; --layers etc. do not apply)")  # fmt: skip
    p.add_argument("--start", default=None,
                   help="--kind feature: start the head from this SSM of the target (its "
                   "layers; e.g. python/specinfer/default_ssm), not the target's last layer, or "
                   "from a feature head to train further (e.g. "
                   "python/specinfer/default_feature_head)")  # fmt: skip
    p.add_argument("--feature-layers", default=None,
                   help="--kind feature: target layers whose inputs the head reads besides the "
                   "final hidden state (EAGLE-3's fusion), e.g. 3,16,28")  # fmt: skip
    p.add_argument("--completions-from", default=None, metavar="DIR",
                   help="re-score the teacher completions of an earlier run's --out (same "
                   "prompts and generation settings) instead of generating them again, e.g. "
                   "for other --feature-layers or --top-k-logits")  # fmt: skip
    p.add_argument("--layers", default="first:2", help="target layers: first:N or e.g. 0,1,5")
    p.add_argument("--mlp-keep", type=float, default=1.0,
                   help="fraction of MLP channels kept (largest weight norms)")  # fmt: skip
    p.add_argument("--held-out", default=None, help="prompt file for evaluation")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap text prompts in the chat template (default: if the model has one)")  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, default=128, help="teacher completion length")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of the teacher's training completions (0 = "
                   "greedy; held-out completions are always greedy)")  # fmt: skip
    p.add_argument("--top-k-logits", type=int, default=32, help="teacher logits kept a position")
    p.add_argument("--dtype", default="bfloat16",
                   help="dtype the target generates the teacher completions in (serve in the same; "
                   "the soft targets always come from a float32 forward)")  # fmt: skip
    p.add_argument("--gen-batch", type=int, default=16, help="teacher generation batch size")
    p.add_argument("--loss", choices=["kl", "ce"], default="kl",
                   help="kl: soft targets (teacher top-K); ce: teacher tokens")  # fmt: skip
    p.add_argument("--loss-vocab", type=int, default=0,
                   help="logits over the N most frequent tokens + the teacher's top K "
                   "(faster; 0 = full vocabulary)")  # fmt: skip
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--steps", type=int, default=None, help="training steps (overrides --epochs)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--boost", type=int, default=1, help="adaptive boosting: number of SSMs")
    p.add_argument("--match", default="identical",
                   help="prompt covered when: identical | prefix:N | agree:X")  # fmt: skip
    p.add_argument("--independent", choices=["split", "seeds"], default=None,
                   help="also train --boost SSMs independently, for comparison")  # fmt: skip
    p.add_argument("--compact", action="store_true",
                   help="export without embeddings (shared with the target), layers in bf16")  # fmt: skip
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")


def run(args: argparse.Namespace) -> int:
    import os

    import torch

    from specinfer.training import TrainSettings, train_ssm

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    try:
        settings = TrainSettings(loss=args.loss, epochs=args.epochs, steps=args.steps, lr=args.lr,
                                 batch_size=args.batch_size,
                                 checkpoint_every=args.checkpoint_every,
                                 loss_vocab=args.loss_vocab)  # fmt: skip
        train_ssm(
            args.prompts, args.out, model=args.model, layers=args.layers, mlp_keep=args.mlp_keep,
            held_out=args.held_out, chat=args.chat, max_new_tokens=args.max_new_tokens,
            temperature=args.temperature, top_k_logits=args.top_k_logits, dtype=args.dtype,
            gen_batch=args.gen_batch, settings=settings,
            compact=args.compact, boost_stages=args.boost, match=args.match,
            independent_mode=args.independent, kind=args.kind, start=args.start,
            feature_layers=args.feature_layers, completions_from=args.completions_from,
        )  # fmt: skip
    except (ValueError, FileNotFoundError) as e:
        print(f"specinfer: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"specinfer: interrupted; run the same command to resume from {args.out}",
              file=sys.stderr)  # fmt: skip
        return 130
    return 0
