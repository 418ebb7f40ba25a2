"""Cancellation: a request whose client went away stops generating.

The gateway, when its client disconnects (or it gives up on a request: a timeout, a divergence), runs
`cancel_request`: it deletes the reply stream and the queued entry (a worker never reads a deleted entry,
so a request still queued is skipped) and sets the expiring flag `<p>:cancel:<rid>`. A worker checks the
flags of the requests it runs once per engine step (`cancelled`, one MGET in the step's pipeline), aborts
the flagged ones in its engine, writes a final `done` event with `finish_reason` "abort", acks and deletes
the entry and counts it (stats counter `cancelled`). The flag expires on its own (`ttl_ms`).
"""

from __future__ import annotations

from typing import Any

from lorafn.store.client import Op
from lorafn.store.keys import Keys

# The finish_reason of the final `done` event of a request aborted because its client went away.
ABORT = "abort"


def cancel_request(
    keys: Keys, function: str, request_id: str, entry_id: str | None, ttl_ms: int = 600_000
) -> Op[None]:
    """Drop a request nobody waits for: its reply stream, its entry (if not yet read) and, last, flag it
    cancelled for the worker that may hold it (last: the worker's final event then lands after the DEL)."""

    def build(pipe: Any) -> None:
        pipe.delete(keys.reply(request_id))
        if entry_id:
            pipe.xdel(keys.requests(function), entry_id)
        pipe.set(keys.cancel(request_id), "1", px=max(1, int(ttl_ms)))

    return Op(build, lambda r: None)


def cancelled(keys: Keys, request_ids: list[str]) -> Op[set[str]]:
    """Which of `request_ids` are flagged cancelled (one MGET)."""
    ids = list(request_ids)

    def build(pipe: Any) -> None:
        if ids:
            pipe.mget([keys.cancel(rid) for rid in ids])

    return Op(build, lambda r: {rid for rid, flag in zip(ids, r[0], strict=True) if flag} if ids else set())
