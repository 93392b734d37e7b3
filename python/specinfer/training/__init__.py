"""Training SSMs for a target: layer selection, distillation on the target's own outputs,
adaptive boosting, export (see pipeline.py for the whole flow)."""

from specinfer.training.distill import TrainSettings
from specinfer.training.pipeline import train_ssm

__all__ = ["TrainSettings", "train_ssm"]
