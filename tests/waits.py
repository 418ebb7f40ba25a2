"""Waiting in tests for something another thread or process does: poll until it holds, with a generous
bound (no test asserts on time)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

WAIT_S = 60.0  # generous bound of a wait (a loaded 2-core VM)


def until(what: str, probe: Callable[[], Any], timeout: float = WAIT_S, poll_s: float = 0.02) -> Any:
    """`probe()` once it returns something truthy; TimeoutError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = probe()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout} s")
        time.sleep(poll_s)
