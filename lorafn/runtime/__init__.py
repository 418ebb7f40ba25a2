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
    from lorafn.runtime.engine import Engine
    from lorafn.runtime.outputs import RequestOutput, StreamDelta

__all__ = ["Engine", "EngineConfig", "RequestOutput", "SamplingParams", "StreamDelta"]


def __getattr__(name: str) -> Any:
    if name == "EngineConfig":
        from lorafn.runtime.config import EngineConfig

        return EngineConfig
    if name == "Engine":
        from lorafn.runtime.engine import Engine

        return Engine
    if name in ("RequestOutput", "StreamDelta"):
        from lorafn.runtime import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'lorafn.runtime' has no attribute {name!r}")
