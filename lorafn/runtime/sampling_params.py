"""How one request is sampled and when it stops (pure Python: no torch).

Validated once, at construction: a bad value raises ValueError naming the field and the value, so
the gateway can turn it into a 4xx without knowing the rules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """Sampling and stopping of one request.

    - ``temperature`` 0 means greedy (argmax); ``top_k`` 0 means no top-k filter; ``top_p`` 1 means
      no nucleus filter. Order of filters: temperature, then top-k, then top-p.
    - ``seed``: the request draws from its own generator, so the same seed gives the same tokens
      whatever else is in the batch. ``None``: draws from a shared, unseeded generator.
    - ``stop``: strings that end the output; the stop string itself is not part of the text.
    - ``stop_token_ids``: tokens that end the output (the token id is kept in ``token_ids``, its
      text is not part of the text). EOS ends the output unless ``ignore_eos``.
    - ``max_tokens``: at most this many generated tokens (finish reason "length").
    - ``priority``: the request class the scheduler admits by (0 online, 1 offline batch: batch requests
      only fill what online ones leave; `lorafn.runtime.scheduler.rank`). Not a sampling setting, but it
      travels with them on the wire (`SamplingWire.priority`), so the serving loop passes it unchanged.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    priority: int = 0

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if (
            isinstance(self.temperature, bool)
            or not isinstance(self.temperature, (int, float))
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        self.temperature = float(self.temperature)
        if (
            isinstance(self.top_p, bool)
            or not isinstance(self.top_p, (int, float))
            or not (0.0 < self.top_p <= 1.0)
        ):
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        self.top_p = float(self.top_p)
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if isinstance(self.stop, str):  # a single string is a common client shape
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        self.stop = list(self.stop)
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids must be a list of integers >= 0, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not _is_int(self.priority) or self.priority not in (0, 1):
            raise ValueError(f"priority must be 0 (online) or 1 (batch), got {self.priority!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(f"skip_special_tokens must be a bool, got {self.skip_special_tokens!r}")

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax (temperature 0)."""
        return self.temperature == 0.0
