"""specinfer: lossless LLM serving with tree-based speculative inference and verification."""

from specinfer.engine import Completion, Engine
from specinfer.sampling import SamplingParams

__all__ = ["Completion", "Engine", "SamplingParams"]
__version__ = "0.1.0"
