"""Arrival statistics and counters per function: written by the gateway (admit.lua) and workers, read
by the controller (arrival rates for the pre-loading planner) and `lorafn status`."""

from __future__ import annotations

from typing import Any

from lorafn.store.client import Op
from lorafn.store.keys import Keys

ARRIVALS_BUCKET_S = 10  # the window of one arrivals counter (admit.lua writes them)

# Counter names of `<p>:fn:<f>:stats` that readers spell (admit.lua writes the first three).
REQUESTS = "requests"
COLD_REQUESTS = "cold_requests"  # admitted while no worker of the function was live: a cold start
RATE_LIMITED = "rate_limited"
ERRORS = "errors"


def add_counters(keys: Keys, function: str, **counters: int) -> Op[None]:
    """HINCRBY each counter (e.g. prompt_tokens, completion_tokens, errors)."""

    def build(pipe: Any) -> None:
        for name, value in counters.items():
            if value:
                pipe.hincrby(keys.stats(function), name, int(value))

    return Op(build, lambda r: None)


def counters(keys: Keys, function: str) -> Op[dict[str, int]]:
    return Op(lambda pipe: pipe.hgetall(keys.stats(function)), lambda r: {k: int(v) for k, v in r[0].items()})


def arrivals(
    keys: Keys, function: str, now_s: float, window_s: int, bucket_s: int = ARRIVALS_BUCKET_S
) -> Op[list[int]]:
    """Requests admitted per bucket over the last `window_s` (oldest first; the last bucket is partial)."""
    last = int(now_s // bucket_s)
    buckets = list(range(last - max(1, window_s // bucket_s) + 1, last + 1))
    return Op(
        lambda pipe: pipe.mget([keys.arrivals(function, b) for b in buckets]),
        lambda r: [int(v or 0) for v in r[0]],
    )


def arrival_rate(keys: Keys, function: str, now_s: float, window_s: int = 60) -> Op[float]:
    """Mean admitted requests per second over the last `window_s` complete seconds (approximately).

    No caller yet: the controller's pre-loading planner (issue 10) reads it.
    """
    return arrivals(keys, function, now_s, window_s).map(lambda counts: sum(counts) / float(max(window_s, 1)))
