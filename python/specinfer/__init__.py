"""specinfer: lossless LLM serving with tree-based speculative inference and verification."""

from specinfer.engine import Completion, Engine
from specinfer.sampling import SamplingParams
from specinfer.tree import TokenTree, TreeConfig

__all__ = ["Completion", "Engine", "SamplingParams", "TokenTree", "TreeConfig"]
__version__ = "0.1.0"
