"""A Llama with random weights in the default model's shape (SmolLM2-135M: 30 layers, hidden 576,
GQA 9/3 heads, vocabulary 49152, tied embeddings), saved as an HF directory with a word-level
tokenizer ("t0" .. "t49151") and a chat template that joins the messages. For timing where the real weights are not at hand (an offline GPU
machine): a decode step's cost does not depend on the weights' values.

    python benchmarks/random_model.py --out /tmp/smollm2-random
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

SMOLLM2 = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
)  # fmt: skip


def write_random_model(out: Path, seed: int = 0) -> Path:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**SMOLLM2, bos_token_id=None, eos_token_id=None)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(out / "tokenizer.json"))
    # Chat prompts become their messages' words (unknown words are "t0"): timing needs no more.
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory to write")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"wrote {write_random_model(Path(args.out), args.seed)}")


if __name__ == "__main__":
    main()
