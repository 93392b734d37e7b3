"""The serving engine: requests join and leave at every step (see llm_engine.Engine)."""

from specinfer.engine.async_engine import AsyncEngine
from specinfer.engine.llm_engine import Engine, Prompt, resolve_dtype
from specinfer.engine.sequence import Completion, RequestOutput

__all__ = ["AsyncEngine", "Completion", "Engine", "Prompt", "RequestOutput", "resolve_dtype"]
