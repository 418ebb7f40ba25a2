"""Run the response paths once at start-up, so a function's first request does not pay for them.

Why: the gateway's first streamed request spent 14 ms (this 2-core VM) to 82 ms (the H100 host, whose
packages are installed without byte-code) between enqueueing and its first read of the reply stream:
Starlette's StreamingResponse creates an anyio task group, and the first one imports anyio's asyncio
backend (with its socket and stream modules); our own SSE chunk and reply-protocol code runs for the
first time too. That first request is usually a cold start, the
one latency the platform exists to make small (issue 10: a standby's cold start was 114 ms against a
warm 35 ms, 82 ms of it here). Nothing here touches Redis or a function: a made-up job is answered into
an ASGI sink.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

from lorafn.gateway.admission import Job
from lorafn.gateway.responses import event_stream, json_response
from lorafn.store.protocol import Accepted, Delta, Done, decode_events, encode_events

log = logging.getLogger("lorafn.gateway")


async def _texts(done: Done) -> AsyncGenerator[tuple[str | None, Done | None], None]:
    yield "warm", None
    yield "", done


async def warm_response_paths() -> int:
    """Answer a made-up request once as server-sent events (chat and completion) and once as JSON;
    returns the bytes the ASGI sink received (tests check it). Never raises: a failure only logs."""
    started = time.monotonic()
    sent = 0
    try:
        # the reply protocol both ways, as the relay decodes what a worker wrote
        done = Done(finish_reason="length", prompt_tokens=1, completion_tokens=1)
        wire = encode_events([Accepted(worker="warm-up"), Delta(text="warm", tokens=1), done])
        events = decode_events(wire)
        done = next(e for e in events if isinstance(e, Done))
        job = Job("warm/up", "warmup", "0-0", False, 1, started, marks={"received": started})
        disconnect = asyncio.Event()

        async def receive() -> dict[str, Any]:
            if not disconnect.is_set():
                disconnect.set()
                return {"type": "http.request", "body": b"", "more_body": False}
            await asyncio.Event().wait()  # the client never leaves: the response ends by itself
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            nonlocal sent
            sent += len(message.get("body", b""))

        # no spec_version: Starlette then streams beside a disconnect listener in an anyio task group, as
        # under uvicorn, whose first use imports anyio's asyncio backend (~10 ms here, more without .pyc)
        scope = {"type": "http", "asgi": {"version": "3.0"}, "method": "POST", "path": "/v1/chat/completions",
                 "headers": []}  # fmt: skip
        for kind in ("chat", "completion"):
            disconnect.clear()
            response = event_stream(job, _texts(done), kind, True, lambda _e: None)  # type: ignore[arg-type]
            await response(scope, receive, send)
        disconnect.clear()
        await json_response(job, "warm", done, "completion")(scope, receive, send)
    except Exception as e:  # a warm-up that fails must not keep the gateway from serving
        log.warning("warming the response paths failed (the first request pays for them): %r", e)
    else:
        log.info("response paths warmed in %.1f ms", (time.monotonic() - started) * 1000)
    return sent
