"""The HTTP routes (docs/gateway.md#http-api).

Every invocation — `POST /v1/completions`, `POST /v1/chat/completions` and the native
`POST /v1/functions/{namespace}/{name}:invoke` — takes one path: read the body and the function ->
`Admitter.authorize` (401/403/404) -> validate (400) -> `admission.prepare` (the worker's body, the
function's limits) -> `Admitter.submit` (429/503, cold start) -> `Relay` -> `responses` (JSON or SSE).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import secrets
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from lorafn.api import FunctionRef
from lorafn.gateway import schemas
from lorafn.gateway.admission import FunctionInfo, bearer, prepare
from lorafn.gateway.batch_routes import router as batch_router
from lorafn.gateway.deps import Gateway, gateway_of
from lorafn.gateway.errors import bad_request, from_validation_error
from lorafn.gateway.responses import Kind, event_stream, json_response
from lorafn.store import UNAVAILABLE_ERRORS

router = APIRouter()
# the Files and Batch API (docs/batch.md): its routes join this table as they are (no prefix)
router.routes.extend(batch_router.routes)

# Request bodies are read by hand (so that auth comes before validation, docs/gateway.md#auth); their
# schemas are added to the OpenAPI document from here (`app.openapi`).
OPENAPI_BODIES: dict[str, type[BaseModel]] = {}


def _body_doc(model: type[BaseModel]) -> dict[str, Any]:
    OPENAPI_BODIES[model.__name__] = model
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
        }
    }


_ERRORS_DOC: dict[int | str, dict[str, Any]] = {
    code: {"model": schemas.ErrorResponse, "description": what}
    for code, what in [
        (400, "invalid input (the error names the field)"),
        (401, "missing or invalid API key"),
        (403, "the key does not open this function"),
        (404, "no such function"),
        (413, "body too large"),
        (429, "rate limited (Retry-After)"),
        (503, "no worker, queue full or Redis unreachable (Retry-After)"),
    ]
}


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()  # a client gone mid-body: ClientDisconnect, answered 499 by the app
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise bad_request("the body is not valid JSON", None, code="invalid_json") from None
    except RecursionError:  # thousands of nested [ or {: the parser's own depth limit, before auth
        raise bad_request("the body is nested too deeply", None, code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object", None, code="invalid_json")
    return body


def _function_of(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request(
            "model: required, the function written namespace/name", "model", code="missing_required_parameter"
        )
    try:
        return str(FunctionRef.parse(model))
    except ValueError as e:
        raise bad_request(f"model: {e}", "model") from None


def _validate(model: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from None


async def _run(
    request: Request,
    gw: Gateway,
    info: FunctionInfo,
    req: schemas.SamplingRequest,
    prompt: str | list[int] | None,
    messages: list[schemas.ChatMessage] | None,
    kind: Kind,
    received: float,
) -> Response:
    """The one path of every invocation, once the function is authorized and the body validated.
    `received`: when the route began (time.monotonic()), the first of the request's stage marks."""
    marks = {"received": received, "authorized": time.monotonic()}
    # tokenizing and the chat template are CPU work: in a thread, so the event loop keeps serving
    body, num_prompt = await asyncio.to_thread(
        functools.partial(
            prepare,
            info,
            req,
            prompt,
            messages,
            max_tokens_limit=gw.settings.max_tokens_limit,
            seed=secrets.randbits(63),
            max_bytes_per_token=gw.settings.max_prompt_bytes_per_token,
        )
    )
    marks["prepared"] = time.monotonic()
    job = await gw.admitter.submit(info, body, num_prompt, marks)
    if req.stream:
        # the native form always reports usage; OpenAI clients ask for it with stream_options
        include_usage = kind == "invoke" or bool(req.stream_options and req.stream_options.include_usage)
        return event_stream(job, gw.relay.texts(job, streaming=True), kind, include_usage, gw.count_error)
    job.disconnected = request.is_disconnected
    text, done = await gw.relay.collect(job)
    return json_response(job, text, done, kind)


@router.post(
    "/v1/completions",
    openapi_extra=_body_doc(schemas.CompletionRequest),
    responses=_ERRORS_DOC,
    summary="OpenAI completions (stream: true for server-sent events)",
)
async def completions(request: Request) -> Response:
    received = time.monotonic()
    gw = gateway_of(request)
    body = await _json_body(request)
    info = await gw.admitter.authorize(bearer(request.headers.get("authorization")), _function_of(body))
    req = _validate(schemas.CompletionRequest, body)
    return await _run(request, gw, info, req, req.prompt, None, "completion", received)


@router.post(
    "/v1/chat/completions",
    openapi_extra=_body_doc(schemas.ChatCompletionRequest),
    responses=_ERRORS_DOC,
    summary="OpenAI chat completions (the backbone's chat template)",
)
async def chat_completions(request: Request) -> Response:
    received = time.monotonic()
    gw = gateway_of(request)
    body = await _json_body(request)
    info = await gw.admitter.authorize(bearer(request.headers.get("authorization")), _function_of(body))
    req = _validate(schemas.ChatCompletionRequest, body)
    return await _run(request, gw, info, req, None, req.messages, "chat", received)


@router.post(
    "/v1/functions/{namespace}/{name}:invoke",
    openapi_extra=_body_doc(schemas.InvokeRequest),
    responses={200: {"model": schemas.InvokeResponse}, **_ERRORS_DOC},
    summary="Native invocation: text, usage and timing (cold start or warm)",
)
async def invoke(namespace: str, name: str, request: Request) -> Response:
    received = time.monotonic()
    gw = gateway_of(request)
    try:
        function = str(FunctionRef(namespace=namespace, name=name))
    except ValidationError as e:
        raise bad_request(f"path: {e.errors()[0]['msg'].removeprefix('Value error, ')}", "path") from None
    info = await gw.admitter.authorize(bearer(request.headers.get("authorization")), function)
    req = _validate(schemas.InvokeRequest, await _json_body(request))
    return await _run(request, gw, info, req, req.prompt, req.messages, "invoke", received)


@router.get("/v1/models", response_model=schemas.ModelList, summary="Functions this key may invoke")
async def models(request: Request) -> schemas.ModelList:
    names = await gateway_of(request).admitter.visible_functions(bearer(request.headers.get("authorization")))
    return schemas.ModelList(data=[schemas.ModelCard(id=n, owned_by=n.split("/")[0]) for n in names])


# Who answers: `lorafn up` sets LORAFN_INSTANCE_ID and checks it, so another process on the port is
# never taken for its gateway.
INSTANCE_ID = os.environ.get("LORAFN_INSTANCE_ID") or secrets.token_hex(8)


@router.get("/healthz", summary="Liveness: the process answers (and which instance it is)")
async def healthz() -> dict[str, str]:
    return {"status": "ok", "instance": INSTANCE_ID}


@router.get("/readyz", summary="Readiness: Redis answers")
async def readyz(request: Request) -> Response:
    try:
        await asyncio.wait_for(gateway_of(request).health.ping(), timeout=1.0)
    except (*UNAVAILABLE_ERRORS, asyncio.TimeoutError, OSError) as e:
        return JSONResponse(
            {"status": "unavailable", "reason": f"Redis: {e.__class__.__name__}"}, status_code=503
        )
    return JSONResponse({"status": "ready"})


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    return Response(generate_latest(gateway_of(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)
