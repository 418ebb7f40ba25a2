"""Prometheus metrics of one gateway process (its own registry: several apps may share a process)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

_LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ENDPOINTS = {
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat",
    "/v1/models": "models",
    "/healthz": "healthz",
    "/readyz": "readyz",
    "/metrics": "metrics",
    "/openapi.json": "openapi",
}


# The `function` label's value when per-function metrics are off (the default): /metrics needs no key,
# and a list of every function name would undo the 403-not-404 rule of docs/gateway.md#auth.
ALL_FUNCTIONS = "*"


class Metrics:
    def __init__(self, per_function: bool = False) -> None:
        self.per_function = per_function
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "lorafn_gateway_requests",
            "HTTP requests by endpoint and status code",
            ["endpoint", "code"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "lorafn_gateway_request_duration_seconds",
            "HTTP request duration (to the last byte)",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "lorafn_gateway_ttft_seconds",
            "time from request arrival to the first generated text",
            ["function"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.phases = Histogram(
            "lorafn_gateway_request_phase_seconds",
            "an invocation's stages: admission (received -> enqueued: auth, tokenizing, admit), accept "
            "(enqueued -> a worker's accepted), first_delta (accepted -> its first token); start: "
            "cold (no live worker at admission) or warm",
            ["phase", "start"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.errors = Counter(
            "lorafn_gateway_errors",
            "error answers by error code (also mid-stream errors)",
            ["code"],
            registry=self.registry,
        )
        self.cold_starts = Counter(
            "lorafn_gateway_cold_starts",
            "requests that found no live worker for their function",
            ["function"],
            registry=self.registry,
        )
        self.restarts = Counter(
            "lorafn_gateway_restarts",
            "requests restarted by another worker after theirs died",
            ["function"],
            registry=self.registry,
        )

    def function(self, name: str) -> str:
        """The `function` label of `name`: itself only when per-function metrics are enabled."""
        return name if self.per_function else ALL_FUNCTIONS


def endpoint_of(path: str) -> str:
    if path in ENDPOINTS:
        return ENDPOINTS[path]
    if path.startswith("/v1/functions/") and path.endswith(":invoke"):
        return "invoke"
    for collection, one in (("/v1/files", "file"), ("/v1/batches", "batch")):  # docs/batch.md
        if path == collection:
            return collection.removeprefix("/v1/")
        if path.startswith(collection + "/") and path.count("/") == 3:
            return one
        if path.startswith(collection + "/") and path.count("/") == 4:
            return f"{one}_{path.rsplit('/', 1)[1]}" if path.endswith(("/content", "/cancel")) else "other"
    return "other"


class MetricsMiddleware:
    """Pure ASGI: status and duration of every HTTP request (to the last body byte of a stream)."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = {"code": 500}

        async def send_wrapper(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            endpoint = endpoint_of(scope.get("path", ""))
            self.metrics.requests.labels(endpoint, str(status["code"])).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)


class BodyLimitMiddleware:
    """Pure ASGI: refuse bodies over `max_bytes` with 413 (by Content-Length, or while reading), and
    bodies that take longer than `timeout_s` to arrive with 408 (a slow client must not hold a
    connection and a task forever, docs/gateway.md)."""

    def __init__(
        self,
        app: Any,
        max_bytes: int,
        timeout_s: float | None = None,
        path_limits: dict[str, tuple[int, str]] | None = None,
    ) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s
        # other limits for some paths: path -> (bytes, the setting's name) (uploads: max_file_bytes)
        self.path_limits = path_limits or {}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        from lorafn.gateway.errors import APIError

        max_bytes, limit = self.path_limits.get(scope.get("path", ""), (self.max_bytes, "max_body_bytes"))
        too_large = APIError(
            413, f"the request body exceeds {max_bytes} bytes ({limit})", code="body_too_large"
        )
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    length = -1
                if length > max_bytes or length < 0:
                    await _send_json(
                        send,
                        413 if length > 0 else 400,
                        too_large.body()
                        if length > 0
                        else APIError(400, "bad Content-Length", code="bad_content_length").body(),
                    )
                    return
        seen = 0
        body_done = False
        deadline = time.monotonic() + self.timeout_s if self.timeout_s else None

        async def limited_receive() -> dict[str, Any]:
            nonlocal seen, body_done
            if body_done or deadline is None:  # after the body: waiting for a disconnect, no deadline
                message = await receive()
            else:
                try:
                    message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    raise _BodyTimeout from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > max_bytes:
                    raise _BodyTooLarge
                body_done = not message.get("more_body", False)
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge:
            await _send_json(send, 413, too_large.body())
        except _BodyTimeout:
            slow = APIError(
                408, f"the request body did not arrive within {self.timeout_s:g} s", code="body_timeout"
            )
            await _send_json(send, 408, slow.body())


class _BodyTooLarge(Exception):
    pass


class _BodyTimeout(Exception):
    pass


async def _send_json(send: Any, status: int, body: dict[str, Any]) -> None:
    import json

    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": data})
