"""What the Engine hands out (pure Python: no torch), so a serving loop and its test fakes share it.

`StreamDelta` is what one `Engine.step()` added to one request; `RequestOutput` is a whole request.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StreamDelta:
    """What one step added to one request: new token ids and text; `finished` with its reason.

    A finished delta also carries the request's token counts (`prompt_tokens`, `completion_tokens`),
    so a serving loop can report usage without keeping a table of its own; 0 while unfinished."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class RequestOutput:
    """A finished (or, while streaming, partial) request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


class ParkRefused(RuntimeError):
    """`Engine.park` will not park now; the message is the reason the worker reports (`park_refused`):
    the engine holds requests, or its decode state lives in a graph archive's arena."""
