"""How the gateway runs under uvicorn, hardened against slow clients (slowloris).

uvicorn times out idle keep-alive connections but not a client that sends its request headers a byte at a
time: 400 such connections stayed open for minutes (issue 15). Here:
- `header_timeout_s`: a connection must complete each request's headers within it (from connect, or from
  the end of the previous response) or it is closed (`_protocol`);
- `body_timeout_s`: the body must arrive within it once the headers are in, else 408 (in
  `metrics.BodyLimitMiddleware`, which already watches the body);
- `max_http_connections`: uvicorn's `limit_concurrency`: beyond it new requests get 503 at once;
- `keep_alive_s`: idle keep-alive connections are closed after it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from lorafn.gateway.settings import GatewaySettings


def _protocol(header_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (h11 or httptools) with a deadline for each request's headers. Both set
    `cycle` when a request's headers are complete and call `on_response_complete` after each response."""
    base: Any = AutoHTTPProtocol

    class HeaderDeadlineProtocol(base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self._arm_header_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_deadline()

        def connection_lost(self, exc: Exception | None) -> None:
            timer = getattr(self, "_header_timer", None)
            if timer is not None:
                timer.cancel()
            super().connection_lost(exc)

        def _arm_header_deadline(self) -> None:
            cycle = self.cycle  # a new request replaces it once its headers are complete
            old = getattr(self, "_header_timer", None)
            if old is not None:
                old.cancel()

            def expire() -> None:
                if self.cycle is cycle and not self.transport.is_closing():
                    self.transport.close()

            self._header_timer = self.loop.call_later(header_timeout_s, expire)

    return HeaderDeadlineProtocol


def uvicorn_config(app: Any, settings: GatewaySettings, **overrides: Any) -> uvicorn.Config:
    """The uvicorn configuration of `lorafn gateway serve` (tests use it too)."""
    options: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "log_level": settings.log_level.lower(),
        "access_log": False,
        "timeout_graceful_shutdown": 5,
        "http": _protocol(settings.header_timeout_s),
        "limit_concurrency": settings.max_http_connections,
        "timeout_keep_alive": settings.keep_alive_s,
        **overrides,
    }
    return uvicorn.Config(app, **options)
