"""A feature-level draft head (EAGLE-style): predicts the target's next hidden state.

The target's final hidden state f at slot s-1 (what its LM head reads to predict token s) and the
embedding of token s go through `fc` (2H -> H) and a few Llama decoder layers with their own KV
cache; the output, after the head's own final norm, is a guess of f at slot s, so the target's
LM head turns it into a guess of token s+1. Drafting deeper feeds each guess back in as the next
slot's feature. Embedding and LM head are the target's (shared, never stored with the head).

With `feature_layers` (EAGLE-3's fusion of low, middle and high layers), the feature of a slot
is wider: the normalised inputs of those target layers (what their attention reads) and the final
hidden state, side by side; `reduce` maps it to H. The head's own guesses stay H wide: a draft
feeds them back as they are, as EAGLE-3 does.

Slot 0 has no feature before it: it reads zeros, in training and in serving alike.
"""

from __future__ import annotations

import torch

from specinfer.layers import ReplicatedLinear
from specinfer.models.config import ModelConfig
from specinfer.models.llama import LlamaForCausalLM


def target_features(hidden: torch.Tensor, taps: list[torch.Tensor]) -> torch.Tensor:
    """What a feature head reads of the target at each slot: the inputs of the layers it taps
    (LlamaForCausalLM.tap), then the final hidden state, side by side."""
    return torch.cat([*taps, hidden], dim=-1) if taps else hidden


class FeatureHead(LlamaForCausalLM):
    def __init__(self, config: ModelConfig):
        super().__init__(config)
        H = config.hidden_size
        self.fc = ReplicatedLinear(2 * H, H, bias=True)
        if config.feature_layers:
            self.fc_layers = ReplicatedLinear((len(config.feature_layers) + 1) * H, H, bias=True)
        # Their inputs are the target's raw hidden states, whose few large channels would leave
        # the rest of a row little of int8's range (its scale is per row): they stay as loaded.
        # Quantized, fc cost the head ~5% of its accepted tokens on held-out prompts.
        for fc in (self.fc, getattr(self, "fc_layers", None)):
            if fc is not None:
                fc.quantizable = False

    @property
    def feature_size(self) -> int:
        """The width of a slot's feature as the target hands it over."""
        return (len(self.config.feature_layers) + 1) * self.config.hidden_size

    def reduce(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features [..., feature_size] as the H-wide feature `fuse` reads."""
        if not self.config.feature_layers:
            return features
        return self.fc_layers(features.to(self.fc_layers.weight.dtype))

    def fuse(self, input_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The first layer's input [B, T, H] from tokens [B, T] and the features before them
        [B, T, H]; `decode` (the layers and final norm) takes it from there."""
        x = torch.cat([self.embed(input_ids), features.to(self.fc.weight.dtype)], dim=-1)
        return self.fc(x)
