"""Model architectures, looked up by `ModelConfig.architecture`."""

from __future__ import annotations

from torch import nn

from specinfer.models.config import ModelConfig
from specinfer.models.feature_head import FeatureHead
from specinfer.models.llama import LlamaForCausalLM
from specinfer.models.opt import OPTForCausalLM

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "opt": OPTForCausalLM,
    "feature": FeatureHead,  # a draft head over a Llama-family target's features
}


def build_model(config: ModelConfig) -> nn.Module:
    try:
        cls = ARCHITECTURES[config.architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {config.architecture!r}; "
            f"supported: {', '.join(ARCHITECTURES)}"
        ) from None
    return cls(config)


__all__ = ["ARCHITECTURES", "ModelConfig", "build_model"]
