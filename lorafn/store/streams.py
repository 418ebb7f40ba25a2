"""The stream protocol between the gateway and the workers.

Request stream `<p>:fn:<ns/name>:requests` (consumer group `workers`), one entry per invocation:
    rid       the request id (also names the reply stream)
    body      JSON of `lorafn.store.protocol.RequestBody`: prompt or prompt_token_ids, and params
    deadline  unix ms after which no worker should start it (the client has given up)

Reply stream `<p>:reply:<rid>`, written by the worker that holds the entry, read by the gateway. Each
entry carries `w`, the writing worker, and `e`: a JSON list of the events one engine step produced for
the request (one XADD per request per step, so the gateway wakes once per step, not once per event),
each a `lorafn.store.protocol` model (Accepted, Delta, Restart, Done, Error; `encode_events`):
    type=accepted  worker                       a worker admitted the request into its batch
    type=delta     text, tokens                 new text and the number of new tokens
    type=restart   worker, reason               a worker claimed the entry again after the one that held
                                                it died: generation starts over; text sent before is void
    type=done      finish_reason, prompt_tokens, completion_tokens
    type=error     code, message                the request ended without an answer
A reply stream expires `ttl` after its request was accepted and a minute after it ended; the gateway
deletes it early only when its client went away.

Entries are acknowledged (XACK) and deleted (XDEL) when their request ends, so the request stream
holds only queued and running work.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lorafn.store.client import Op, eval_script
from lorafn.store.keys import GROUP, Keys, check_id
from lorafn.store.protocol import (
    FINAL,
    Accepted,
    ReplyEvent,
    RequestBody,
    Restart,
    decode_events,
    encode_events,
)


@dataclass(frozen=True)
class Admission:
    """The outcome of `admit`: enqueued (`ok`), `rate_limited` or `queue_full`."""

    status: str
    entry_id: str = ""
    live_workers: int = 0
    retry_after_ms: int = 0
    queue_length: int = 0


def _parse_admission(r: list[Any]) -> Admission:
    code, *rest = r[0]
    if int(code) == 1:
        return Admission("ok", entry_id=str(rest[0]), live_workers=int(rest[1]))
    if int(code) == 0:
        return Admission("rate_limited", retry_after_ms=int(rest[0]))
    return Admission("queue_full", queue_length=int(rest[0]))


def admit(
    keys: Keys,
    function: str,
    request_id: str,
    body: RequestBody,
    *,
    deadline_ms: int,
    now_s: float,
    rate_limit_rps: float,
    rate_limit_burst: int,
    heartbeat_ttl_ms: int,
    arrivals_bucket_s: int = 10,
    arrivals_ttl_s: int = 3600,
    max_queue: int = 0,
) -> Op[Admission]:
    """Rate-limit, count and enqueue one request in one round trip (lua/admit.lua).

    `body` is typed (`lorafn.store.protocol.RequestBody`), so what enters the stream is what workers
    decode."""
    bucket = int(now_s // arrivals_bucket_s)
    return Op(
        lambda pipe: eval_script(
            pipe,
            "admit",
            [
                keys.rate_limit(function),
                keys.stats(function),
                keys.arrivals(function, bucket),
                keys.function_workers(function),
                keys.requests(function),
            ],
            [
                repr(float(rate_limit_rps)),
                int(rate_limit_burst),
                int(arrivals_ttl_s),
                int(heartbeat_ttl_ms),
                check_id(request_id, "request id"),
                body.encode(),
                int(deadline_ms),
                int(max_queue),
            ],
        ),
        _parse_admission,
    )


def record_demand(keys: Keys, function: str, reason: str, guard_ms: int = 2000) -> Op[str | None]:
    """Ask the supervisor for a worker of `function` (deduplicated over `guard_ms`)."""
    return Op(
        lambda pipe: eval_script(
            pipe,
            "demand",
            [keys.demand_guard(function), keys.demand(), keys.stats(function)],
            [function, int(guard_ms), reason, 10_000],
        ),
        lambda r: r[0] or None,
    )


def read_demand(
    keys: Keys, last_id: str, block_ms: int | None, count: int = 100
) -> Op[list[tuple[str, dict]]]:
    """Demand entries after `last_id` (the supervisor's cursor; `$` for new ones only)."""
    return Op(
        lambda pipe: pipe.xread({keys.demand(): last_id}, count=count, block=block_ms),
        lambda r: stream_entries(r[0]),
    )


def stream_entries(reply: Any) -> list[tuple[str, dict[str, str]]]:
    """XREAD/XREADGROUP reply (RESP2 list or RESP3 dict) -> [(entry id, fields)] of every stream in it."""
    return [entry for entries in entries_by_stream(reply).values() for entry in entries]


def entries_by_stream(reply: Any) -> dict[str, list[tuple[str, dict[str, str]]]]:
    """XREAD/XREADGROUP reply (RESP2 list or RESP3 dict) -> {stream key: [(entry id, fields)]}."""
    if not reply:
        return {}
    streams = reply.items() if isinstance(reply, dict) else reply
    out: dict[str, list[tuple[str, dict[str, str]]]] = {}
    for name, entries in streams:
        if (
            isinstance(entries, list)
            and len(entries) == 1
            and isinstance(entries[0], list)
            and entries[0]
            and isinstance(entries[0][0], list | tuple)
        ):
            entries = entries[0]  # RESP3 wraps the entry list once more
        out.setdefault(name, []).extend((entry_id, fields or {}) for entry_id, fields in entries)
    return out


def entry_ms(entry_id: str) -> float:
    """The unix ms a stream entry id carries (`<ms>-<seq>`), the time Redis enqueued it."""
    head = entry_id.partition("-")[0]
    return float(head) if head.isdigit() else time.time() * 1000


def last_request_id(keys: Keys, function: str) -> Op[str]:
    """The id of the newest entry of a function's request stream ("0-0" when it has none): a pre-loaded
    standby watches for entries after it."""
    return Op(
        lambda pipe: pipe.xrevrange(keys.requests(function), count=1),
        lambda r: r[0][0][0] if r[0] else "0-0",
    )


# -- gateway side -------------------------------------------------------------------------------
def read_replies(
    keys: Keys, request_id: str, last_id: str, block_ms: int | None
) -> Op[list[tuple[str, str, ReplyEvent]]]:
    """Reply events after `last_id` ("0" for all), waiting up to `block_ms` for the first entry.

    Returns (entry id, worker id, event) in order, each event a `lorafn.store.protocol` model; the
    events of one entry share its id (the next cursor) and the worker that wrote them. An entry that
    does not follow the protocol raises `ProtocolError` naming the field."""
    return Op(
        lambda pipe: pipe.xread({keys.reply(request_id): last_id}, count=256, block=block_ms),
        lambda r: [
            (eid, fields.get("w", ""), event)
            for eid, fields in stream_entries(r[0])
            for event in decode_events(fields.get("e"))
        ],
    )


# -- worker side --------------------------------------------------------------------------------
def create_group(keys: Keys, function: str) -> Op[None]:
    """Create the request stream and its consumer group (from the start of the stream).

    Raises redis.ResponseError containing BUSYGROUP when it exists: callers ignore that one.
    """
    return Op(
        lambda pipe: pipe.xgroup_create(keys.requests(function), GROUP, id="0", mkstream=True),
        lambda r: None,
    )


def read_requests(
    keys: Keys, function: str, consumer: str, count: int, block_ms: int | None, history: bool = False
) -> Op[list[tuple[str, dict[str, str]]]]:
    """New entries for this consumer (or, with `history`, the ones it already holds but never acked)."""
    return Op(
        lambda pipe: pipe.xreadgroup(
            GROUP, consumer, {keys.requests(function): "0" if history else ">"}, count=count, block=block_ms
        ),
        lambda r: stream_entries(r[0]),
    )


def read_requests_of(
    keys: Keys, functions: Sequence[str], consumer: str, count: int, block_ms: int | None
) -> Op[list[tuple[str, str, dict[str, str]]]]:
    """New entries of several functions' request streams for this consumer, in one XREADGROUP: (function,
    entry id, fields), stream by stream (a worker with adapter slots serves them all, docs/runtime.md).
    `count` applies to each stream, as XREADGROUP's COUNT does."""
    by_key = {keys.requests(f): f for f in functions}
    if len(by_key) != len(functions) or not functions:
        raise ValueError(f"functions: a non-empty list without repeats, got {list(functions)!r}")

    def parse(r: list[Any]) -> list[tuple[str, str, dict[str, str]]]:
        return [
            (by_key[key], entry_id, fields)
            for key, entries in entries_by_stream(r[0]).items()
            for entry_id, fields in entries
        ]

    return Op(
        lambda pipe: pipe.xreadgroup(
            GROUP, consumer, dict.fromkeys(by_key, ">"), count=count, block=block_ms
        ),
        parse,
    )


def reply_events(
    keys: Keys,
    worker_id: str,
    events: list[tuple[str, ReplyEvent]],
    ttl_ms: int,
    finished_ttl_ms: int = 60_000,
) -> Op[None]:
    """Append (request id, protocol event) pairs to reply streams, one entry per request holding its
    events in order (`encode_events`) and the writing worker's id (`w`: after a restart the gateway
    ignores a presumed-dead worker that still writes). `Accepted`/`Restart` set the stream's expiry to
    `ttl_ms`; `Done`/`Error` shorten it to `finished_ttl_ms` (the gateway has read it by then, or never
    will)."""
    by_request: dict[str, list[ReplyEvent]] = {}
    for request_id, event in events:
        by_request.setdefault(request_id, []).append(event)

    def build(pipe: Any) -> None:
        for request_id, batch in by_request.items():
            key = keys.reply(request_id)
            pipe.xadd(key, {"e": encode_events(batch), "w": worker_id})
            if any(isinstance(event, FINAL) for event in batch):
                pipe.pexpire(key, finished_ttl_ms)
            elif any(isinstance(event, Accepted | Restart) for event in batch):
                pipe.pexpire(key, ttl_ms)

    return Op(build, lambda r: None)


def ack(keys: Keys, function: str, entry_ids: list[str]) -> Op[None]:
    """Acknowledge and delete finished entries."""

    def build(pipe: Any) -> None:
        if entry_ids:
            pipe.xack(keys.requests(function), GROUP, *entry_ids)
            pipe.xdel(keys.requests(function), *entry_ids)

    return Op(build, lambda r: None)


@dataclass(frozen=True)
class PendingEntry:
    entry_id: str
    consumer: str
    idle_ms: int
    deliveries: int


def pending(keys: Keys, function: str, min_idle_ms: int, count: int = 100) -> Op[list[PendingEntry]]:
    """Entries delivered but not acknowledged for at least `min_idle_ms`, with their holders."""
    return Op(
        lambda pipe: pipe.xpending_range(
            keys.requests(function), GROUP, min="-", max="+", count=count, idle=min_idle_ms
        ),
        lambda r: [
            PendingEntry(
                str(p["message_id"]),
                str(p["consumer"]),
                int(p["time_since_delivered"]),
                int(p["times_delivered"]),
            )
            for p in r[0]
        ],
    )


def claim(
    keys: Keys, function: str, consumer: str, min_idle_ms: int, entry_ids: list[str]
) -> Op[list[tuple[str, dict[str, str]]]]:
    """XCLAIM entries still idle for `min_idle_ms` (two claimers: one wins). Deleted entries come back
    with empty fields; the caller acks them."""
    return Op(
        lambda pipe: pipe.xclaim(keys.requests(function), GROUP, consumer, min_idle_ms, entry_ids),
        lambda r: [(eid, fields or {}) for eid, fields in (r[0] or []) if eid],
    )


def consumers(keys: Keys, function: str) -> Op[list[tuple[str, int, int]]]:
    """(name, pending entries, idle ms) of every consumer in the function's group."""
    return Op(
        lambda pipe: pipe.xinfo_consumers(keys.requests(function), GROUP),
        lambda r: [(str(c["name"]), int(c["pending"]), int(c["idle"])) for c in r[0]],
    )


def delete_consumer(keys: Keys, function: str, consumer: str) -> Op[None]:
    """XGROUP DELCONSUMER: also drops the consumer's pending entries, so only for one holding none."""
    return Op(lambda pipe: pipe.xgroup_delconsumer(keys.requests(function), GROUP, consumer), lambda r: None)
