"""The open-loop client: each planned request is sent at its time over real HTTP (streamed OpenAI
completions through the gateway), whether or not earlier ones were answered; a sampler reads the
workers' heartbeat records from Redis meanwhile; the controller's `bound` events are read at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

from lorafn.replay.stats import BoundEvent, RequestResult, Sample, WorkerSample
from lorafn.replay.trace import PlannedRequest
from lorafn.store import AsyncStore, Keys
from lorafn.store import control as ctl
from lorafn.store import workers as wk


@dataclass
class Target:
    """Where the replay sends: a gateway, a key per function ('' for a public one), and optionally the
    platform's Redis (for GPU-seconds, worker counts and cold-start paths)."""

    gateway_url: str
    api_keys: dict[str, str]
    redis_url: str | None = None
    key_prefix: str = "lorafn"


@dataclass
class DriveOptions:
    request_timeout_s: float = 600.0  # one request, send to last byte
    drain_timeout_s: float = 300.0  # after the last arrival, how long to wait for answers still running
    sample_interval_s: float = 0.5
    temperature: float = 0.0


@dataclass
class Drive:
    """What one configuration's replay recorded."""

    results: list[RequestResult]
    samples: list[Sample] = field(default_factory=list)
    events: list[BoundEvent] = field(default_factory=list)
    # from the measured window's start (the first arrival's time without a warm-up) to the last answer (or
    # the drain's end)
    duration_s: float = 0.0


def _error_message(body: bytes) -> str:
    try:
        err = json.loads(body).get("error", {})
        return str(err.get("message") or err)[:300]
    except (ValueError, AttributeError):
        return body[:300].decode(errors="replace")


async def send_one(
    client: httpx.AsyncClient,
    target: Target,
    req: PlannedRequest,
    result: RequestResult,
    t0: float,
    options: DriveOptions,
) -> None:
    """Send one streamed completion and fill `result`; every way it can end sets `e2e_ms` and either a
    complete answer or `error`."""
    body = {
        "model": req.function,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": options.temperature,
        "seed": req.index,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    key = target.api_keys.get(req.function, "")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    started = time.perf_counter()
    result.sent_s = time.perf_counter() - t0
    done = False
    try:
        async with client.stream(
            "POST", f"{target.gateway_url}/v1/completions", json=body, headers=headers
        ) as resp:
            result.status = resp.status_code
            cold = resp.headers.get("x-lorafn-cold-start")
            result.cold = None if cold is None else cold == "1"
            result.request_id = resp.headers.get("x-lorafn-request-id")
            if resp.status_code != 200:
                result.error = f"http {resp.status_code}: {_error_message(await resp.aread())}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {_error_message(data.encode())}"
                    break
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"].get("prompt_tokens")
                    result.completion_tokens = chunk["usage"].get("completion_tokens")
                for choice in chunk.get("choices") or []:
                    # the first text, or the end when the answer had none (a random model may emit no text)
                    if result.ttft_ms is None and (choice.get("text") or choice.get("finish_reason")):
                        result.ttft_ms = (time.perf_counter() - started) * 1000
            if not done and result.error is None:
                result.error = "incomplete: the stream ended without [DONE]"
    except httpx.HTTPError as exc:
        result.error = f"transport: {type(exc).__name__}: {exc}"[:300]
    except ValueError as exc:  # a chunk that is not JSON
        result.error = f"protocol: {exc}"[:300]
    finally:
        result.e2e_ms = (time.perf_counter() - started) * 1000


async def _sample_workers(store: AsyncStore, keys: Keys) -> list[WorkerSample]:
    ids = await store.run(wk.worker_ids(keys))
    info = await store.run(wk.worker_info(keys, ids)) if ids else {}
    out = []
    for wid, h in info.items():
        try:
            mem = int(h.get("mem_bytes") or 0)
        except ValueError:
            mem = 0
        out.append(
            WorkerSample(
                wid,
                h.get("state", ""),
                h.get("function", ""),
                h.get("gpu", ""),
                h.get("backbone", ""),
                mem,
                whole_process=h.get("mem_source") == "driver",
            )
        )
    return out


async def _sampler(
    store: AsyncStore, keys: Keys, t0: float, interval_s: float, out: list[Sample], stop: asyncio.Event
) -> None:
    while not stop.is_set():
        try:
            workers = await _sample_workers(store, keys)
            out.append(Sample(time.perf_counter() - t0, workers))
        except Exception:  # a missed sample is a gap in the series, not a failed run
            pass
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval_s)


async def bound_events(store: AsyncStore, keys: Keys, since_id: str, wall_t0: float) -> list[BoundEvent]:
    """The `bound` and `unparked` lifecycle events after `since_id` (times relative to `wall_t0`, POSIX
    seconds; an unpark's path is `unparked`)."""
    out: list[BoundEvent] = []
    cursor = since_id
    while True:
        batch = await store.run(ctl.read_events(keys, cursor))
        if not batch:
            return out
        for entry_id, event in batch:
            cursor = entry_id
            kind = event.get("kind")
            if kind not in (ctl.BOUND, ctl.UNPARKED):
                continue
            try:
                ms: float | None = float(event.get("ms") or "")
            except ValueError:
                ms = None
            out.append(
                BoundEvent(
                    int(entry_id.split("-")[0]) / 1000 - wall_t0,
                    event.get("function", ""),
                    "unparked" if kind == ctl.UNPARKED else event.get("path", ""),
                    ms,
                )
            )


async def drive(
    plan: Sequence[PlannedRequest],
    target: Target,
    options: DriveOptions,
    on_sent: Callable[[], None] | None = None,
    on_done: Callable[[], None] | None = None,
    warmup_s: float = 0.0,
) -> Drive:
    """Replay `plan` open-loop against `target`; every planned request has a result (answer or error).

    The clock (every time recorded) starts at -`warmup_s`, so that 0 is the measured window's start: the
    warm-up's requests (planned at negative times) and samples lie before it."""
    if warmup_s < 0:
        raise ValueError(f"warmup_s: {warmup_s} s must be >= 0")
    early = [r.at_s for r in plan if r.at_s < -warmup_s]
    if early:
        raise ValueError(
            f"plan: a request at {min(early):g} s, before the warm-up's start at {-warmup_s:g} s"
        )
    results = [RequestResult(r.index, r.function, r.at_s, warmup=r.warmup) for r in plan]
    store = AsyncStore(target.redis_url, max_connections=8) if target.redis_url else None
    keys = Keys(target.key_prefix)
    since = await store.run(ctl.last_event_id(keys)) if store else "0-0"
    samples: list[Sample] = []
    stop = asyncio.Event()
    timeout = httpx.Timeout(options.request_timeout_s, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    tasks: list[asyncio.Task[None]] = []
    sampler: asyncio.Task[None] | None = None

    unfinished = (
        f"unfinished: no answer within --drain-timeout-s {options.drain_timeout_s:g} after the last arrival"
    )

    async def one(req: PlannedRequest, result: RequestResult) -> None:
        try:
            await send_one(client, target, req, result, t0, options)
        except asyncio.CancelledError:
            result.error = unfinished
            raise
        finally:
            if on_done:
                on_done()

    try:
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            # the clock starts once the client is built (its TLS context takes a moment), not before;
            # its 0 is the measured window's start, `warmup_s` from now
            wall_t0 = time.time() + warmup_s
            t0 = time.perf_counter() + warmup_s
            if store:
                sampler = asyncio.create_task(
                    _sampler(store, keys, t0, options.sample_interval_s, samples, stop)
                )
            for req, result in zip(plan, results, strict=True):
                delay = req.at_s - (time.perf_counter() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(req, result)))
                if on_sent:
                    on_sent()
            if tasks:
                _, pending = await asyncio.wait(tasks, timeout=options.drain_timeout_s)
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
        end = time.perf_counter() - t0
        for r in results:  # a request the loop never reached (an exception above) is accounted for too
            if r.error is None and r.e2e_ms is None:
                r.error = unfinished
        stop.set()
        if sampler:
            await sampler
        events = await bound_events(store, keys, since, wall_t0) if store else []
    finally:
        stop.set()
        if store:
            await store.close()
    return Drive(results, samples, events, end)
