"""lorafn.runtime: the worker's engine.

Model, unmerged LoRA, paged KV cache, scheduler, sampler, CUDA graphs.

Heavy imports (torch, transformers) happen on first use of an engine name, so `import lorafn.runtime`
stays cheap for the CLI and the pure scheduler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lorafn.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from lorafn.runtime.config import EngineConfig
    from lorafn.runtime.engine import Engine, RequestOutput, StreamDelta

__all__ = ["Engine", "EngineConfig", "RequestOutput", "SamplingParams", "StreamDelta"]


def __getattr__(name: str) -> Any:
    if name == "EngineConfig":
        from lorafn.runtime.config import EngineConfig

        return EngineConfig
    if name in ("Engine", "RequestOutput", "StreamDelta"):
        from lorafn.runtime import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'lorafn.runtime' has no attribute {name!r}")
