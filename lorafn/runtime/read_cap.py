"""How many requests a worker holds at once: no more than its KV cache is expected to serve together (pure).

A worker reads requests from its function's stream up to its free batch slots (`max_running`, 64). With a
small KV cache (the replay's 512 MiB on a 7B: ~1000 tokens, four or five requests) a burst then sits inside
the one worker that read it, waiting for KV blocks: the stream looks empty, so the controller sees no queue
and scales nothing up (measured on the H100: one function took 21% of the trace's requests, its worker held
them, and 20 of them were late by 2.6-9.8 s of TTFT while the function stayed at one of its four replicas),
and another worker of the function cannot take them either. So a worker holds at most
``capacity_tokens / expected_tokens`` requests (at least one), ``expected_tokens`` being what a request of
this function holds in KV on average over its life (prompt + half its completion: requests in a batch are at
all stages of their output; a moving average from a prior); the rest stay queued in the stream, where the
controller counts them and any worker of the function can read them.

Why the average and not the final size: a first version divided by prompt + completion. On the H100's batch
bench (7B, KV 4 GiB, 48 online requests in flight, docs/batch.md) it held ~23 requests where the cache serves
~36 at once on average (with preemption), and the online phase took 42.6 s instead of 34 s (1141 instead of
~1420 tokens/s). The average holds ~36 there (8192 tokens / (~100 + 254 / 2)), and about twice a small
cache's final-size count in the replay's case (8 on ~1000 tokens), still bounded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# the KV tokens a request is expected to hold before any of the worker's requests has finished
DEFAULT_EXPECTED_TOKENS = 256.0


@dataclass
class ExpectedTokens:
    """A moving average of the KV tokens the function's finished requests held over their life (`add`)."""

    value: float = DEFAULT_EXPECTED_TOKENS
    weight: float = 0.1  # of each new request

    def __post_init__(self) -> None:
        if not self.value > 0:
            raise ValueError(f"expected tokens must be > 0, got {self.value!r}")
        if not 0 < self.weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {self.weight!r}")

    def add(self, prompt_tokens: int, completion_tokens: int) -> None:
        """One finished request: it held its prompt and, on average over its decode, half its completion."""
        tokens = prompt_tokens + completion_tokens / 2
        if tokens > 0:
            self.value += self.weight * (tokens - self.value)


def held_cap(capacity_tokens: int, expected_tokens: float) -> int:
    """The most requests a worker whose KV cache holds ``capacity_tokens`` should hold at once (>= 1; a
    parked or unknown cache, 0 tokens, gives 1: the caller decides whether it reads at all)."""
    if capacity_tokens <= 0 or expected_tokens <= 0:
        return 1
    return max(1, math.floor(capacity_tokens / expected_tokens))
