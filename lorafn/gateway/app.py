"""The gateway app: wiring only. `create_app` builds the parts (`deps.Gateway`), mounts the routes
(`routes`: every HTTP route), turns errors into OpenAI-shaped answers, adds the body-size and metrics
middleware, completes the OpenAPI document and closes Redis on shutdown.

Where a request goes (docs/gateway.md): `routes` -> `admission` (auth, `prepare`, `submit`) -> `relay`
(the reply stream) -> `responses` (OpenAI JSON / SSE, native invoke).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from lorafn import __version__
from lorafn.gateway.batch_runner import BatchRunner
from lorafn.gateway.deps import Gateway
from lorafn.gateway.errors import APIError
from lorafn.gateway.metrics import BodyLimitMiddleware, MetricsMiddleware
from lorafn.gateway.relay import client_gone, redis_unavailable
from lorafn.gateway.routes import OPENAPI_BODIES, router
from lorafn.gateway.settings import GatewaySettings
from lorafn.gateway.warmup import warm_response_paths
from lorafn.store import UNAVAILABLE_ERRORS, AsyncStore

log = logging.getLogger("lorafn.gateway")


def create_app(settings: GatewaySettings | None = None, store: AsyncStore | None = None) -> FastAPI:
    settings = settings or GatewaySettings()
    gw = Gateway.create(settings, store)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # the batch runner (docs/batch.md): active in one gateway of the deployment (a Redis lease)
        batch_runner = BatchRunner(gw)
        runner = asyncio.create_task(batch_runner.run()) if settings.batch_runner else None
        # what a first request would pay inside its latency (lazy imports, first-run code): see warmup.py
        await warm_response_paths()
        # tokenizers and the key salt loaded before a function's first request needs them
        warm = None
        if settings.keep_warm_s:
            warm = asyncio.create_task(gw.admitter.keep_warm(settings.keep_warm_s))
        yield
        if warm is not None:
            warm.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await warm
        if runner is not None:
            runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await runner
            await batch_runner.release()
        await gw.store.close()
        await gw.health.close()

    app = FastAPI(
        title="lorafn gateway",
        version=__version__,
        description="Serverless LoRA functions, OpenAI-compatible and native. See docs/gateway.md.",
        lifespan=lifespan,
    )
    app.state.gateway = gw
    app.include_router(router)
    _add_error_handlers(app, gw)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=settings.max_body_bytes,
        timeout_s=settings.body_timeout_s,
        path_limits={"/v1/files": (settings.max_file_bytes, "max_file_bytes")},
    )
    app.add_middleware(MetricsMiddleware, metrics=gw.metrics)
    return app


def _add_error_handlers(app: FastAPI, gw: Gateway) -> None:
    """Every error answer is `{"error": {...}}` (docs/gateway.md#errors-and-limits), counted by code."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        gw.count_error(exc)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def redis_down(request: Request, _: Exception) -> JSONResponse:
        return await api_error(request, redis_unavailable())

    async def disconnected(request: Request, _: Exception) -> JSONResponse:
        # the client left while sending its body: nobody reads this answer, and it is no server fault
        return await api_error(request, client_gone())

    async def http_error(_: Request, exc: Exception) -> JSONResponse:
        status = getattr(exc, "status_code", 500)
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(status, "invalid_request_error")
        err = APIError(status, str(getattr(exc, "detail", "error")), type=kind, code=f"http_{status}")
        return JSONResponse(err.body(), status_code=status, headers=getattr(exc, "headers", None) or {})

    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error", exc_info=exc)
        err = APIError(
            500, f"internal error ({exc.__class__.__name__})", type="server_error", code="internal"
        )
        gw.metrics.errors.labels("internal").inc()
        return JSONResponse(err.body(), status_code=500)

    for error_type in UNAVAILABLE_ERRORS:
        app.add_exception_handler(error_type, redis_down)
    app.add_exception_handler(ClientDisconnect, disconnected)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document plus the request bodies the routes read by hand, and bearer auth."""
    if app.openapi_schema:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    for name, model in OPENAPI_BODIES.items():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="validation")
        components.update(schema.pop("$defs", {}))
        components[name] = schema
    doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    doc["security"] = [{"bearer": []}]
    app.openapi_schema = doc
    return doc
