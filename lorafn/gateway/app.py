"""The HTTP gateway: OpenAI-compatible completions and chat, the native invoke form, /v1/models,
health, readiness, metrics and the OpenAPI document (docs/gateway.md describes the API).

A request: parse JSON -> read `model` -> authorize (401/403/404) -> validate against the function's
limits (400) -> admit.lua (rate limit 429, queue cap 503, enqueue) -> no live worker? record demand
(cold start) -> relay the reply stream as JSON or server-sent events.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from lorafn import __version__
from lorafn.api import FunctionRef, GenerationDefaults, LoRAFunctionSpec
from lorafn.gateway import schemas
from lorafn.gateway.errors import APIError, bad_request, from_validation_error, unavailable
from lorafn.gateway.metrics import BodyLimitMiddleware, Metrics, MetricsMiddleware
from lorafn.gateway.settings import GatewaySettings
from lorafn.gateway.tokenizer import ChatTemplateError, GatewayTokenizer, load_tokenizer
from lorafn.store import UNAVAILABLE_ERRORS, AsyncStore, Keys, cancel, combine, streams, workers
from lorafn.store import registry as reg
from lorafn.store.protocol import RequestBody
from lorafn.store.registry import FunctionRecord

log = logging.getLogger("lorafn.gateway")

_SEED_MASK = 2**63 - 1


@dataclass
class FunctionInfo:
    """A registered function as the gateway uses it (cached for `registry_cache_s`)."""

    record: FunctionRecord
    generation: GenerationDefaults
    tokenizer: GatewayTokenizer | None
    max_context: int
    fetched: float


@dataclass
class Job:
    """One admitted request: where its replies come from and what the client asked for."""

    function: str
    request_id: str
    entry_id: str
    cold: bool
    prompt_tokens: int
    t0: float
    first_text_at: float | None = None
    restarts: int = 0
    # non-streamed requests: polled while waiting (a streamed response is cancelled by the server instead)
    disconnected: Callable[[], Awaitable[bool]] | None = None


_DISCONNECT_POLL_S = 0.2


def _client_gone() -> APIError:
    return APIError(
        499, "the client closed the connection", type="invalid_request_error", code="client_closed"
    )


def _unavailable_redis() -> APIError:
    return unavailable("the data plane (Redis) is unreachable; retry shortly", code="redis_unavailable")


class Gateway:
    def __init__(self, settings: GatewaySettings, store: AsyncStore | None = None) -> None:
        self.settings = settings
        self.keys = Keys(settings.key_prefix)
        self.store = store or AsyncStore(settings.redis_url, max_connections=settings.max_connections)
        self.metrics = Metrics()
        self._functions: dict[str, FunctionInfo] = {}
        self._salt: str | None = None
        # API-key hash -> (the function it opens or None, when read); reused for registry_cache_s
        self._owners: dict[str, tuple[str | None, float]] = {}

    # -- registry, auth -------------------------------------------------------------------------
    async def _key_hash(self, api_key: str) -> str:
        if self._salt is None:
            self._salt = await self.store.run(reg.ensure_salt(self.keys))
        return reg.hash_api_key(self._salt, api_key)

    async def _info(self, function: str, record: FunctionRecord | None) -> FunctionInfo | None:
        if record is None:
            self._functions.pop(function, None)
            return None
        try:
            generation = LoRAFunctionSpec.model_validate(record.spec).generation
        except ValidationError:
            generation = GenerationDefaults()
        tokenizer = None
        if record.model_dir:
            try:
                tokenizer = await asyncio.to_thread(load_tokenizer, record.model_dir)
            except Exception as e:  # a broken tokenizer file must not take the function's API down
                log.warning(
                    "function %s: no tokenizer from %s (%s); counting bytes",
                    record.function,
                    record.model_dir,
                    e,
                )
        max_context = record.max_context or (tokenizer.max_context if tokenizer else 0)
        info = FunctionInfo(
            record, generation, tokenizer, max_context or self.settings.default_max_context, time.monotonic()
        )
        self._functions[record.function] = info
        return info

    async def authorize(self, request: Request, function: str) -> FunctionInfo:
        """The function's info when the request may invoke it; else APIError (see docs/gateway.md#auth).

        401: no key, or a key that opens nothing. 403: a valid key of another function, whether or not
        the target exists (so a key cannot probe which functions exist). 404: the key's own function is
        gone. Public functions (registered without auth) take any request.
        """
        api_key = _bearer(request)
        now = time.monotonic()
        ttl = self.settings.registry_cache_s
        cached = self._functions.get(function)
        info = cached if cached is not None and now - cached.fetched < ttl else None
        key_hash = await self._key_hash(api_key) if api_key else None
        owner: str | None = None
        known = self._owners.get(key_hash) if key_hash else None
        key_fresh = known is not None and now - known[1] < ttl
        if key_fresh:
            owner = known[0]
        ops: list[Any] = []
        if info is None:
            ops.append(reg.get_function(self.keys, function))
        if key_hash and not key_fresh:
            ops.append(reg.lookup_api_key(self.keys, key_hash))
        if ops:  # one round trip for what the caches do not hold (both are fresh on a warm path)
            results = list(await self.store.run(combine(*ops)))
            if info is None:
                info = await self._info(function, results.pop(0))
            if key_hash and not key_fresh:
                owner = results.pop(0)
                if len(self._owners) >= 10_000:
                    self._owners.clear()
                self._owners[key_hash] = (owner, now)
        if info is not None and info.record.public:
            return info
        if not api_key:
            raise APIError(
                401,
                f"missing API key (send Authorization: Bearer <key>); no public function is "
                f"named {function!r}",
                type="authentication_error",
                code="missing_api_key",
            )
        if owner is None:
            raise APIError(401, "invalid API key", type="authentication_error", code="invalid_api_key")
        if owner != function:
            raise APIError(
                403,
                f"this API key does not open function {function!r} (a key opens only its own function)",
                type="permission_error",
                code="forbidden",
            )
        if info is None:
            raise APIError(
                404,
                f"function {function!r} does not exist (any more)",
                type="not_found_error",
                code="function_not_found",
            )
        return info

    async def visible_functions(self, request: Request) -> list[str]:
        api_key = _bearer(request)
        ops: list[Any] = [reg.list_functions(self.keys)]
        if api_key:
            ops.append(reg.lookup_api_key(self.keys, await self._key_hash(api_key)))
        results = await self.store.run(combine(*ops))
        names = results[0]
        owner = results[1] if api_key else None
        public = await self.store.run(reg.public_functions(self.keys, names)) if names else []
        return sorted({*public, *([owner] if owner in names else [])})

    # -- building the worker's request ----------------------------------------------------------
    def prepare(
        self,
        info: FunctionInfo,
        body: schemas._Sampling,
        prompt: str | list[int] | None,
        messages: list[schemas.ChatMessage] | None,
    ) -> tuple[dict[str, Any], int]:
        """The request body for the worker and its prompt length, with the function's limits checked."""
        tok = info.tokenizer
        param = "messages" if messages is not None else "prompt"
        text: str | None
        ids: list[int] | None
        if messages is not None:
            dialog = [
                {"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                for m in messages
            ]
            if tok is None:
                raise bad_request(
                    "this function's backbone has no tokenizer files: use prompt, not messages",
                    "messages",
                    code="chat_unsupported",
                )
            try:
                text, ids = tok.encode_chat(dialog)
            except ChatTemplateError as e:
                raise bad_request(str(e), "messages") from None
        elif isinstance(prompt, list):
            text, ids = None, list(prompt)
            limit = tok.vocab_size if tok else 2**31
            bad = next((t for t in ids if t >= limit), None)
            if bad is not None:
                raise bad_request(
                    f"prompt: token id {bad} is outside the vocabulary (size {limit})", "prompt"
                )
        else:
            text = prompt or ""
            ids = tok.encode(text) if tok else None
        num_prompt = len(ids) if ids is not None else len((text or "").encode())
        if num_prompt == 0:
            raise bad_request(f"{param}: the prompt is empty", param)
        max_context = info.max_context
        if num_prompt >= max_context:
            raise bad_request(
                f"{param}: the prompt has {num_prompt} tokens; this function's context is "
                f"{max_context} tokens",
                param,
                code="context_length_exceeded",
            )
        room = max_context - num_prompt
        gen = info.generation
        if body.max_tokens is not None:
            max_tokens = body.max_tokens
            if max_tokens > min(room, self.settings.max_tokens_limit):
                raise bad_request(
                    f"max_tokens: {max_tokens} exceeds what is left of the context ({max_context} - "
                    f"{num_prompt} prompt tokens = {room}) or the limit ({self.settings.max_tokens_limit})",
                    "max_tokens",
                    code="context_length_exceeded",
                )
        else:
            max_tokens = max(1, min(gen.max_tokens, room, self.settings.max_tokens_limit))
        seed = body.seed if body.seed is not None else secrets.randbits(63)
        params = {
            "max_tokens": max_tokens,
            "temperature": body.temperature if body.temperature is not None else gen.temperature,
            "top_p": body.top_p if body.top_p is not None else gen.top_p,
            "top_k": body.top_k if body.top_k is not None else gen.top_k,
            "stop": body.stop_list() if body.stop is not None else list(gen.stop),
            # a seed always: a request restarted on another worker then draws the same tokens
            "seed": seed & _SEED_MASK,
        }
        # token ids when the gateway has the tokenizer (the worker does not tokenize again), else text
        payload = {"prompt": None if ids is not None else text, "prompt_token_ids": ids, "params": params}
        return payload, num_prompt

    async def submit(self, info: FunctionInfo, payload: dict[str, Any], prompt_tokens: int) -> Job:
        s = self.settings
        fn = info.record.function
        rid = uuid.uuid4().hex
        now = time.time()
        rps = info.record.rate_limit_rps if info.record.rate_limit_rps is not None else s.rate_limit_rps
        burst = info.record.rate_limit_burst or s.rate_limit_burst
        admission = await self.store.run(
            streams.admit(
                self.keys,
                fn,
                rid,
                RequestBody.model_validate(payload),
                deadline_ms=int((now + s.cold_start_timeout_s) * 1000),
                now_s=now,
                rate_limit_rps=rps,
                rate_limit_burst=burst,
                heartbeat_ttl_ms=int(s.heartbeat_ttl_s * 1000),
                max_queue=s.max_queue,
            )
        )
        if admission.status == "rate_limited":
            retry = max(1, math.ceil(admission.retry_after_ms / 1000))
            raise APIError(
                429,
                f"rate limit of function {fn!r} exceeded ({rps:g} requests/s, burst {burst}); "
                f"retry in {retry} s",
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(retry)},
            )
        if admission.status == "queue_full":
            raise unavailable(
                f"function {fn!r} has {admission.queue_length} queued requests (the limit); retry shortly",
                code="queue_full",
            )
        cold = admission.live_workers == 0
        if cold:
            self.metrics.cold_starts.labels(fn).inc()
            await self.store.run(streams.record_demand(self.keys, fn, "request", s.demand_guard_ms))
        return Job(fn, rid, admission.entry_id, cold, prompt_tokens, time.monotonic())

    # -- relaying the reply stream --------------------------------------------------------------
    async def events(self, job: Job) -> AsyncIterator[dict[str, str]]:
        """The request's reply events until `done` or `error`; timeouts become APIError."""
        s = self.settings
        last = "0"
        accepted = False
        owner: str | None = None  # the worker whose events count, once a restart named one
        accept_by = job.t0 + (s.cold_start_timeout_s if job.cold else s.queue_timeout_s)
        end_by = job.t0 + s.request_timeout_s
        ttl_ms = int(s.heartbeat_ttl_s * 1000)
        next_poll = job.t0
        while True:
            now = time.monotonic()
            if job.disconnected is not None and now >= next_poll:
                if await job.disconnected():
                    raise _client_gone()
                next_poll = now + _DISCONNECT_POLL_S
            if not accepted and now > accept_by:
                raise unavailable(
                    f"no worker of function {job.function!r} took the request within "
                    f"{accept_by - job.t0:.0f} s" + (" (cold start did not complete)" if job.cold else ""),
                    code="no_worker",
                    retry_after_s=5,
                )
            if now > end_by:
                raise APIError(
                    504,
                    f"the request did not finish within {s.request_timeout_s:.0f} s",
                    type="timeout_error",
                    code="request_timeout",
                )
            block = int(max(1, min(1000, (min(end_by, accept_by if not accepted else end_by) - now) * 1000)))
            if job.disconnected is not None:
                block = min(block, int(_DISCONNECT_POLL_S * 1000))
            batch = await self.store.run(streams.read_replies(self.keys, job.request_id, last, block))
            if not batch:
                # nobody answered for a while: is anyone left to? If not, ask for a worker (again).
                live = await self.store.run(workers.count_live_workers(self.keys, job.function, ttl_ms))
                if live == 0:
                    await self.store.run(
                        streams.record_demand(self.keys, job.function, "waiting", s.demand_guard_ms)
                    )
                continue
            for entry_id, writer, event in batch:
                last = entry_id
                kind = event.get("type")
                if kind == streams.RESTART:
                    # another worker took the request over: from now on only its events count (a
                    # presumed-dead worker that still writes is ignored)
                    owner = writer
                    job.restarts += 1
                    self.metrics.restarts.labels(job.function).inc()
                elif owner is not None and writer != owner:
                    continue
                if kind == streams.ACCEPTED:
                    accepted = True
                yield event
                if kind in (streams.DONE, streams.ERROR):
                    return

    async def forget(self, job: Job) -> None:
        """Drop a request nobody waits for any more (its client went away, a timeout, a divergence): its
        entry (if not yet taken) and its reply stream, and flag it cancelled so that the worker running it
        aborts it (docs/gateway.md#failure-behaviour). Shielded: it runs while the relay is cancelled."""
        ttl_ms = int(max(60.0, self.settings.request_timeout_s) * 1000)
        with anyio.CancelScope(shield=True), suppress(UNAVAILABLE_ERRORS):
            await self.store.run(
                cancel.cancel_request(self.keys, job.function, job.request_id, job.entry_id, ttl_ms)
            )

    def _worker_error(self, event: dict[str, str]) -> APIError:
        code = event.get("code", "worker_error")
        message = event.get("message", "the worker failed")
        self.metrics.errors.labels(code).inc()
        if code == "invalid_request":
            return bad_request(message, None, code=code)
        if code == "engine_error":
            return APIError(500, message, type="server_error", code=code)
        return unavailable(message, code=code)

    async def texts(
        self, job: Job, streaming: bool
    ) -> AsyncIterator[tuple[str | None, dict[str, str] | None]]:
        """(text delta, None) ... then ("", done event), restarts handled (see docs/gateway.md).

        Not streaming: a restart yields (None, None): the caller drops the text it collected.
        Streaming: after a restart the new text is held back until it passes what was already given
        out; if it reproduces that text (greedy, or the same seed) the relay continues seamlessly, else
        it ends with a `restart_diverged` error.
        """
        sent = ""  # text given to the caller
        replay: str | None = None  # text of the restarted attempt, while it is still behind `sent`
        ended = False  # the worker ended the request (done/error): nothing to clean up
        try:
            async for event in self.events(job):
                kind = event.get("type")
                if kind == streams.RESTART and not streaming:
                    sent = ""
                    yield None, None
                elif kind == streams.RESTART:
                    replay = "" if sent else None
                elif kind == streams.DELTA:
                    text = event.get("text", "")
                    if replay is None:
                        if text:
                            if job.first_text_at is None:
                                job.first_text_at = time.monotonic()
                                self.metrics.ttft.labels(job.function).observe(job.first_text_at - job.t0)
                            sent += text
                            yield text, None
                        continue
                    replay += text
                    if len(replay) <= len(sent):
                        if not sent.startswith(replay):
                            raise self._diverged()
                        continue
                    if not replay.startswith(sent):
                        raise self._diverged()
                    rest, replay = replay[len(sent) :], None
                    sent += rest
                    yield rest, None
                elif kind == streams.DONE:
                    ended = True
                    if replay is not None and replay != sent:
                        raise self._diverged()
                    yield "", event
                    return
                elif kind == streams.ERROR:
                    ended = True
                    raise self._worker_error(event)
        except UNAVAILABLE_ERRORS:
            self.metrics.errors.labels("redis_unavailable").inc()
            raise _unavailable_redis() from None
        finally:
            if not ended:  # the client went away, a timeout, a divergence: drop the entry and replies
                await self.forget(job)

    def _diverged(self) -> APIError:
        self.metrics.errors.labels("restart_diverged").inc()
        return unavailable(
            "the worker serving this request died after part of the answer was sent, and the "
            "retried answer differs; retry the request",
            code="restart_diverged",
        )

    async def collect(self, job: Job) -> tuple[str, dict[str, str]]:
        parts: list[str] = []
        async with aclosing(self.texts(job, streaming=False)) as texts:
            async for text, done in texts:
                if done is not None:
                    return "".join(parts), done
                if text is None:
                    parts.clear()
                else:
                    parts.append(text)
        raise APIError(500, "the reply stream ended without a result", type="server_error", code="no_result")


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise bad_request("the body is not valid JSON", None, code="invalid_json") from None
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


def _usage(job: Job, done: dict[str, str]) -> dict[str, int]:
    prompt = int(done.get("prompt_tokens") or 0) or job.prompt_tokens
    completion = int(done.get("completion_tokens") or 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _headers(job: Job) -> dict[str, str]:
    return {"x-lorafn-request-id": job.request_id, "x-lorafn-cold-start": "1" if job.cold else "0"}


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def create_app(settings: GatewaySettings | None = None, store: AsyncStore | None = None) -> FastAPI:
    settings = settings or GatewaySettings()
    gw = Gateway(settings, store)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await gw.store.close()

    app = FastAPI(
        title="lorafn gateway",
        version=__version__,
        description="Serverless LoRA functions, OpenAI-compatible and native. See docs/gateway.md.",
        lifespan=lifespan,
    )
    app.state.gateway = gw

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        gw.metrics.errors.labels(exc.code or str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def _redis_down(_: Request, exc: Exception) -> JSONResponse:
        return await _api_error(_, _unavailable_redis())

    for error_type in UNAVAILABLE_ERRORS:
        app.add_exception_handler(error_type, _redis_down)

    async def _http_error(_: Request, exc: Any) -> JSONResponse:
        status = getattr(exc, "status_code", 500)
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(status, "invalid_request_error")
        err = APIError(status, str(getattr(exc, "detail", "error")), type=kind, code=f"http_{status}")
        return JSONResponse(err.body(), status_code=status, headers=getattr(exc, "headers", None) or {})

    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error", exc_info=exc)
        err = APIError(
            500, f"internal error ({exc.__class__.__name__})", type="server_error", code="internal"
        )
        gw.metrics.errors.labels("internal").inc()
        return JSONResponse(err.body(), status_code=500)

    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)

    def respond(job: Job, text: str, done: dict[str, str], kind: str) -> JSONResponse:
        created = int(time.time())
        usage = _usage(job, done)
        finish = done.get("finish_reason", "stop")
        if kind == "chat":
            body = {
                "id": f"chatcmpl-{job.request_id}",
                "object": "chat.completion",
                "created": created,
                "model": job.function,
                "usage": usage,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": finish,
                        "logprobs": None,
                    }
                ],
            }
        else:
            body = {
                "id": f"cmpl-{job.request_id}",
                "object": "text_completion",
                "created": created,
                "model": job.function,
                "usage": usage,
                "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
            }
        return JSONResponse(body, headers=_headers(job))

    def stream(job: Job, kind: str, include_usage: bool) -> StreamingResponse:
        created = int(time.time())
        if kind == "chat":
            cid, obj = f"chatcmpl-{job.request_id}", "chat.completion.chunk"
        else:
            cid, obj = f"cmpl-{job.request_id}", "text_completion"

        def chunk(text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
            if kind == "chat":
                delta: dict[str, Any] = {"role": "assistant"} if role else {}
                if text:
                    delta["content"] = text
                choice: dict[str, Any] = {
                    "index": 0,
                    "delta": delta,
                    "finish_reason": finish,
                    "logprobs": None,
                }
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            return {"id": cid, "object": obj, "created": created, "model": job.function, "choices": [choice]}

        async def body() -> AsyncIterator[bytes]:
            if kind == "chat":
                first = chunk("", None, role=True)
                first["choices"][0]["delta"]["content"] = ""
                yield _sse(first)
            try:
                async with aclosing(gw.texts(job, streaming=True)) as texts:
                    async for text, done in texts:
                        if done is None:
                            yield _sse(chunk(text, None))
                            continue
                        yield _sse(chunk(None, done.get("finish_reason", "stop")))
                        if include_usage:
                            yield _sse(
                                {
                                    "id": cid,
                                    "object": obj,
                                    "created": created,
                                    "model": job.function,
                                    "choices": [],
                                    "usage": _usage(job, done),
                                }
                            )
                        yield b"data: [DONE]\n\n"
                        return
            except APIError as e:
                gw.metrics.errors.labels(e.code or str(e.status)).inc()
                yield e.sse()

        headers = {**_headers(job), "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(body(), media_type="text/event-stream", headers=headers)

    async def run(
        request: Request, info: FunctionInfo, req: schemas._Sampling, prompt: Any, messages: Any, kind: str
    ) -> Response:
        payload, num_prompt = gw.prepare(info, req, prompt, messages)
        job = await gw.submit(info, payload, num_prompt)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return stream(job, kind, include_usage)
        job.disconnected = request.is_disconnected
        text, done = await gw.collect(job)
        return respond(job, text, done, kind)

    _openapi_bodies: dict[str, type[BaseModel]] = {}

    def body_of(model: type[BaseModel]) -> dict[str, Any]:
        _openapi_bodies[model.__name__] = model
        return {
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}
                },
            }
        }

    errors_doc: dict[int | str, dict[str, Any]] = {
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

    @app.post(
        "/v1/completions",
        openapi_extra=body_of(schemas.CompletionRequest),
        responses=errors_doc,
        summary="OpenAI completions (stream: true for server-sent events)",
    )
    async def completions(request: Request) -> Response:
        body = await _json_body(request)
        info = await gw.authorize(request, _function_of(body))
        req = _validate(schemas.CompletionRequest, body)
        return await run(request, info, req, req.prompt, None, "completion")

    @app.post(
        "/v1/chat/completions",
        openapi_extra=body_of(schemas.ChatCompletionRequest),
        responses=errors_doc,
        summary="OpenAI chat completions (the backbone's chat template)",
    )
    async def chat_completions(request: Request) -> Response:
        body = await _json_body(request)
        info = await gw.authorize(request, _function_of(body))
        req = _validate(schemas.ChatCompletionRequest, body)
        return await run(request, info, req, None, req.messages, "chat")

    @app.post(
        "/v1/functions/{namespace}/{name}:invoke",
        openapi_extra=body_of(schemas.InvokeRequest),
        responses={200: {"model": schemas.InvokeResponse}, **errors_doc},
        summary="Native invocation: text, usage and timing (cold start or warm)",
    )
    async def invoke(namespace: str, name: str, request: Request) -> Response:
        try:
            function = str(FunctionRef(namespace=namespace, name=name))
        except ValidationError as e:
            raise bad_request(f"path: {e.errors()[0]['msg'].removeprefix('Value error, ')}", "path") from None
        info = await gw.authorize(request, function)
        req = _validate(schemas.InvokeRequest, await _json_body(request))
        payload, num_prompt = gw.prepare(info, req, req.prompt, req.messages)
        job = await gw.submit(info, payload, num_prompt)
        if req.stream:
            return stream(job, "completion", True)
        job.disconnected = request.is_disconnected
        text, done = await gw.collect(job)
        end = time.monotonic()
        out = schemas.InvokeResponse(
            id=job.request_id,
            function=function,
            text=text,
            finish_reason=done.get("finish_reason", "stop"),
            usage=schemas.Usage(**_usage(job, done)),
            timing=schemas.InvokeTiming(
                ttft_ms=None if job.first_text_at is None else (job.first_text_at - job.t0) * 1000,
                total_ms=(end - job.t0) * 1000,
                cold_start=job.cold,
            ),
        )
        return JSONResponse(out.model_dump(), headers=_headers(job))

    @app.get("/v1/models", response_model=schemas.ModelList, summary="Functions this key may invoke")
    async def models(request: Request) -> schemas.ModelList:
        names = await gw.visible_functions(request)
        return schemas.ModelList(data=[schemas.ModelCard(id=n, owned_by=n.split("/")[0]) for n in names])

    @app.get("/healthz", summary="Liveness: the process answers")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", summary="Readiness: Redis answers")
    async def readyz() -> Response:
        try:
            await asyncio.wait_for(gw.store.ping(), timeout=1.0)
        except (*UNAVAILABLE_ERRORS, asyncio.TimeoutError, OSError) as e:
            return JSONResponse(
                {"status": "unavailable", "reason": f"Redis: {e.__class__.__name__}"}, status_code=503
            )
        return JSONResponse({"status": "ready"})

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response)
    async def metrics() -> Response:
        return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        components = doc.setdefault("components", {}).setdefault("schemas", {})
        for name, model in _openapi_bodies.items():
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="validation")
            components.update(schema.pop("$defs", {}))
            components[name] = schema
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(MetricsMiddleware, metrics=gw.metrics)
    return app
