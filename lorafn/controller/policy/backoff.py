"""Exponential backoff after failed worker starts: deterministic, no jitter.

After n consecutive failures the next start is due ``min(cap, base * 2**(n-1))`` seconds after the
last failure (n = 1: base; then 2x each time; capped). No jitter: one controller decides every start,
so there is no herd to spread, and a deterministic schedule is what the tests and status can show.
"""

from __future__ import annotations

from lorafn.controller.policy.model import Function


def backoff_delay_s(failures: int, base_s: float, cap_s: float) -> float:
    """Seconds to wait after the last of ``failures`` consecutive failed starts (0 when none)."""
    if isinstance(failures, bool) or not isinstance(failures, int) or failures < 0:
        raise ValueError(f"failures must be an integer >= 0, got {failures!r}")
    if not base_s >= 0 or not cap_s >= 0:
        raise ValueError(f"base_s and cap_s must be >= 0, got base_s={base_s!r} cap_s={cap_s!r}")
    if failures == 0:
        return 0.0
    # 2**(n-1) overflows float for huge n; past 64 doublings every realistic cap has been reached.
    return min(cap_s, base_s * 2.0 ** min(failures - 1, 64))


def backoff_remaining_s(function: Function, base_s: float, cap_s: float) -> float:
    """Seconds until ``function`` may be started again (0 = now).

    A failure count without a time (``last_failure_s`` None) is treated as just now: the driver
    lost the time, so waiting the full delay is the safe side.
    """
    delay = backoff_delay_s(function.start_failures, base_s, cap_s)
    if delay == 0.0:
        return 0.0
    since = 0.0 if function.last_failure_s is None else function.last_failure_s
    return max(0.0, delay - since)


def backoff_reason(function: Function, remaining_s: float) -> str:
    detail = f": {function.last_failure}" if function.last_failure else ""
    plural = "s" if function.start_failures != 1 else ""
    return (
        f"backing off after {function.start_failures} failed start{plural}{detail} "
        f"(next try in {remaining_s:.1f} s)"
    )
