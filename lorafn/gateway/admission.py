"""Admission: who may invoke a function (auth), what the worker is sent (`prepare`, pure), and the
enqueueing step (`admit.lua`: rate limit, queue cap, cold-start demand) that turns a request into a `Job`.

The order of checks, and why, is in docs/gateway.md#auth; the limits in docs/gateway.md#errors-and-limits.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from lorafn.api import GenerationDefaults, LoRAFunctionSpec
from lorafn.gateway import schemas
from lorafn.gateway.errors import APIError, bad_request, unavailable
from lorafn.gateway.metrics import Metrics
from lorafn.gateway.settings import GatewaySettings
from lorafn.gateway.tokenizer import ChatTemplateError, GatewayTokenizer, load_tokenizer
from lorafn.store import AsyncStore, Keys, combine, streams
from lorafn.store import registry as reg
from lorafn.store.protocol import RequestBody, SamplingWire
from lorafn.store.registry import FunctionRecord

log = logging.getLogger("lorafn.gateway")

SEED_MASK = 2**63 - 1
# API-key lookups remembered at most (a flood of random keys must not grow the cache without bound)
_MAX_CACHED_KEYS = 10_000


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
    submitted_at_ms: int = 0  # unix ms of the enqueue: a start failure after it was this request's
    # non-streamed requests: polled while waiting (a streamed response is cancelled by the server instead)
    disconnected: Callable[[], Awaitable[bool]] | None = None
    # where the request's time went (time.monotonic() per stage: received, authorized, prepared,
    # enqueued, then the relay's accepted, first_delta, first_text, done); see Relay.finished
    marks: dict[str, float] = field(default_factory=dict)


def bearer(authorization: str | None) -> str | None:
    """The API key of an `Authorization: Bearer <key>` header; None when absent or malformed."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


class Admitter:
    """Auth against the registry (function records and key lookups cached), and enqueueing."""

    def __init__(self, settings: GatewaySettings, store: AsyncStore, keys: Keys, metrics: Metrics) -> None:
        self.settings, self.store, self.keys, self.metrics = settings, store, keys, metrics
        self._functions: dict[str, FunctionInfo] = {}
        self._salt: str | None = None
        # API-key hash -> (the function it opens or None, when read); reused for registry_cache_s
        self._owners: dict[str, tuple[str | None, float]] = {}

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

    async def authorize(self, api_key: str | None, function: str) -> FunctionInfo:
        """The function's info when `api_key` may invoke it; else APIError (see docs/gateway.md#auth).

        401: no key, or a key that opens nothing. 403: a valid key of another function, whether or not
        the target exists (so a key cannot probe which functions exist). 404: the key's own function is
        gone. Public functions (registered without auth) take any request.
        """
        now = time.monotonic()
        ttl = self.settings.registry_cache_s
        cached = self._functions.get(function)
        info = cached if cached is not None and now - cached.fetched < ttl else None
        key_hash = await self._key_hash(api_key) if api_key else None
        owner: str | None = None
        known = self._owners.get(key_hash) if key_hash else None
        key_fresh = known is not None and now - known[1] < ttl
        if known is not None and key_fresh:
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
                if len(self._owners) >= _MAX_CACHED_KEYS:
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

    async def visible_functions(self, api_key: str | None) -> list[str]:
        """The functions `api_key` opens, plus the public ones (`GET /v1/models`)."""
        ops: list[Any] = [reg.list_functions(self.keys)]
        if api_key:
            ops.append(reg.lookup_api_key(self.keys, await self._key_hash(api_key)))
        results = await self.store.run(combine(*ops))
        names = results[0]
        owner = results[1] if api_key else None
        public = await self.store.run(reg.public_functions(self.keys, names)) if names else []
        return sorted({*public, *([owner] if owner in names else [])})

    async def keep_warm(self, interval_s: float) -> None:
        """What a function's first request would otherwise pay inside its TTFT, done ahead: the key salt,
        and the tokenizer of every registered backbone (tokenizer.json + chat template: 50-130 ms for a
        32k-token vocabulary, measured; a cold start's request was the first to need it). Every
        `interval_s`, so backbones registered later are found too; `load_tokenizer` is cached per model
        directory, so a known one costs nothing. Runs as a task of the app until cancelled."""
        from lorafn.store.backbones import get_backbone, list_backbones

        settled = False
        while True:
            loaded = load_tokenizer.cache_info().currsize
            try:
                if self._salt is None:
                    self._salt = await self.store.run(reg.ensure_salt(self.keys))
                names = await self.store.run(list_backbones(self.keys))
                if names:
                    records = await self.store.run(combine(*(get_backbone(self.keys, n) for n in names)))
                    for record in records:
                        if record is not None and record.model_dir:
                            await asyncio.to_thread(_warm_tokenizer, record.model_dir)
                # What is alive now (the app, the tokenizers) out of later full collections, which would
                # otherwise walk it inside some request (runtime.standby.settle_heap): one collection at
                # start, then `gc.freeze()` (O(1)) whenever a tokenizer was added.
                if self.settings.freeze_heap:
                    if not settled:
                        gc.collect()
                        settled = True
                    if load_tokenizer.cache_info().currsize != loaded or not gc.get_freeze_count():
                        gc.freeze()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis away, a broken backbone: the requests see it, not this task
                log.debug("keeping warm: %s", e)
            await asyncio.sleep(interval_s)

    async def submit(
        self, info: FunctionInfo, body: RequestBody, prompt_tokens: int, marks: dict[str, float] | None = None
    ) -> Job:
        """Enqueue the request (admit.lua, one round trip): 429 over the rate limit, 503 on a full queue;
        with no live worker, record demand for one (a cold start). `marks`: the request's stage times so
        far (Job.marks); `enqueued` is added."""
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
                body,
                # no worker starts it after this: the longest the relay waits for an accept (a warm
                # request whose worker died waits for a cold start too, see Relay.events)
                deadline_ms=int(
                    (now + s.queue_timeout_s + s.heartbeat_ttl_s + s.cold_start_timeout_s) * 1000
                ),
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
            self.metrics.cold_starts.labels(self.metrics.function(fn)).inc()
            await self.store.run(streams.record_demand(self.keys, fn, "request", s.demand_guard_ms))
        t0 = time.monotonic()
        return Job(
            fn,
            rid,
            admission.entry_id,
            cold,
            prompt_tokens,
            t0,
            submitted_at_ms=int(now * 1000),
            marks={**(marks or {}), "enqueued": t0},
        )


def _warm_tokenizer(model_dir: str) -> None:
    try:
        load_tokenizer(model_dir)
    except Exception as e:  # no tokenizer files: the function's requests count bytes (see `_info`)
        log.debug("no tokenizer to keep warm in %s: %s", model_dir, e)


def prepare(
    info: FunctionInfo,
    req: schemas.SamplingRequest,
    prompt: str | list[int] | None,
    messages: list[schemas.ChatMessage] | None,
    *,
    max_tokens_limit: int,
    seed: int,
    max_bytes_per_token: int = 32,
) -> tuple[RequestBody, int]:
    """The worker's request body and the prompt's length in tokens, with the function's limits checked
    (400 naming the field). Pure: `seed` is the one used when the request gives none (the caller draws it,
    so that a request restarted on another worker draws the same tokens).

    CPU-bound (tokenizing, the chat template): the routes run it in a thread, off the event loop. A text
    longer than `max_context × max_bytes_per_token` bytes is refused before it is tokenized: it cannot
    fit (real text averages 3-5 bytes per token), and tokenizing a megabyte costs a second of CPU.
    """
    tok = info.tokenizer
    param = "messages" if messages is not None else "prompt"
    size = (
        sum(len(m.text().encode()) for m in messages)
        if messages is not None
        else len(prompt.encode())
        if isinstance(prompt, str)
        else 0
    )
    if size > info.max_context * max_bytes_per_token:
        raise bad_request(
            f"{param}: the prompt has {size} bytes, more than this function's context of "
            f"{info.max_context} tokens can hold (at most {max_bytes_per_token} bytes per token)",
            param,
            code="context_length_exceeded",
        )
    text: str | None
    ids: list[int] | None
    if messages is not None:
        dialog = [
            {"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in messages
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
            raise bad_request(f"prompt: token id {bad} is outside the vocabulary (size {limit})", "prompt")
    else:
        text = prompt or ""
        ids = tok.encode(text) if tok else None
    num_prompt = len(ids) if ids is not None else len((text or "").encode())
    if num_prompt == 0:
        raise bad_request(f"{param}: the prompt is empty", param)
    max_context = info.max_context
    if num_prompt >= max_context:
        raise bad_request(
            f"{param}: the prompt has {num_prompt} tokens; this function's context is {max_context} tokens",
            param,
            code="context_length_exceeded",
        )
    room = max_context - num_prompt
    gen = info.generation
    if req.max_tokens is not None:
        max_tokens = req.max_tokens
        if max_tokens > min(room, max_tokens_limit):
            raise bad_request(
                f"max_tokens: {max_tokens} exceeds what is left of the context ({max_context} - "
                f"{num_prompt} prompt tokens = {room}) or the limit ({max_tokens_limit})",
                "max_tokens",
                code="context_length_exceeded",
            )
    else:
        max_tokens = max(1, min(gen.max_tokens, room, max_tokens_limit))
    params = SamplingWire(
        max_tokens=max_tokens,
        temperature=float(req.temperature if req.temperature is not None else gen.temperature),
        top_p=float(req.top_p if req.top_p is not None else gen.top_p),
        top_k=req.top_k if req.top_k is not None else gen.top_k,
        stop=req.stop_list() if req.stop is not None else list(gen.stop),
        # a seed always: a request restarted on another worker then draws the same tokens
        seed=(req.seed if req.seed is not None else seed) & SEED_MASK,
    )
    # token ids when the gateway has the tokenizer (the worker does not tokenize again), else text
    body = RequestBody(prompt=None if ids is not None else text, prompt_token_ids=ids, params=params)
    return body, num_prompt
