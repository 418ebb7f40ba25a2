"""The worker registry: heartbeats (expiring), liveness per function, and per-worker control streams."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lorafn.store.client import Op, eval_script
from lorafn.store.keys import Keys
from lorafn.store.streams import entries_by_stream, stream_entries


def heartbeat(
    keys: Keys,
    worker_id: str,
    function: str | None,
    ttl_ms: int,
    fields: dict[str, Any],
    only_if_alone: bool = False,
    also: Sequence[str] = (),
) -> Op[int]:
    """Register or refresh a worker (lua/heartbeat.lua); returns the server time written (ms).

    `also`: the other functions it serves (a worker with adapter slots, docs/runtime.md#adapter-slots): it is
    registered under each of them too, and its hash lists them all in `functions` (`function` first).

    `only_if_alone`: register under `function` only while it has no other live worker, atomically; 0 (and
    nothing written) when it has one. A pre-loaded standby takes its function's first request so: of
    several racing for one function, one wins, and none joins a function that has a worker already."""
    if only_if_alone and not function:
        raise ValueError("an only-if-alone heartbeat needs the function it registers under")
    worker_keys = [keys.worker(worker_id), keys.workers()]
    if function:
        worker_keys.append(keys.function_workers(function))
    if also and not function:
        raise ValueError("a heartbeat naming other functions needs its first one")
    worker_keys += [keys.function_workers(f) for f in also if f != function]
    served = ",".join([function, *(f for f in also if f != function)]) if function else ""
    args: list[Any] = [worker_id, int(ttl_ms), "1" if only_if_alone else "0"]
    for k, v in {**fields, "function": function or "", "functions": served}.items():
        args += [k, str(v)]
    return Op(lambda pipe: eval_script(pipe, "heartbeat", worker_keys, args), lambda r: int(r[0]))


def deregister(keys: Keys, worker_id: str, function: str | None) -> Op[None]:
    """A worker that exits removes itself, so the gateway sees at once that none is left."""

    def build(pipe: Any) -> None:
        pipe.delete(keys.worker(worker_id))
        pipe.zrem(keys.workers(), worker_id)
        if function:
            pipe.zrem(keys.function_workers(function), worker_id)

    return Op(build, lambda r: None)


def leave(keys: Keys, worker_id: str, function: str) -> Op[None]:
    """A worker stops serving one of its functions (a slot emptied, keep-alive): the gateway and the
    controller no longer count it as that function's worker; its next heartbeat leaves it out of
    `functions`."""
    return Op(lambda pipe: pipe.zrem(keys.function_workers(function), worker_id), lambda r: None)


def server_time_ms() -> Op[int]:
    return Op(lambda pipe: pipe.time(), lambda r: int(r[0][0]) * 1000 + int(r[0][1]) // 1000)


def live_workers(keys: Keys, function: str, ttl_ms: int, now_ms: int) -> Op[list[str]]:
    """Workers of `function` whose last heartbeat is younger than `ttl_ms` at server time `now_ms`."""
    return Op(
        lambda pipe: pipe.zrangebyscore(keys.function_workers(function), now_ms - ttl_ms, "+inf"),
        lambda r: list(r[0]),
    )


def count_live_workers(keys: Keys, function: str, ttl_ms: int) -> Op[int]:
    """Live workers of `function`, judged on the server's clock (one round trip)."""

    def build(pipe: Any) -> None:
        eval_script(pipe, "count_live", [keys.function_workers(function)], [int(ttl_ms)])

    return Op(build, lambda r: int(r[0]))


def worker_ids(keys: Keys) -> Op[list[str]]:
    """Ids of the workers that heartbeated recently (silent ones drop out after ten periods)."""
    return Op(lambda pipe: pipe.zrange(keys.workers(), 0, -1), lambda r: list(r[0]))


def worker_info(keys: Keys, ids: list[str]) -> Op[dict[str, dict[str, str]]]:
    """Each worker's self-description (for `lorafn status`); expired workers are left out."""

    def build(pipe: Any) -> None:
        for wid in ids:
            pipe.hgetall(keys.worker(wid))

    return Op(build, lambda r: {wid: h for wid, h in zip(ids, r, strict=True) if h})


def send_control(keys: Keys, worker_id: str, command: str, **fields: Any) -> Op[str]:
    """Append a command (`stop`, `drain`) to a worker's control stream."""
    body = {"cmd": command, **{k: str(v) for k, v in fields.items()}}

    def build(pipe: Any) -> None:
        pipe.xadd(keys.control(worker_id), body, maxlen=100, approximate=True)
        pipe.pexpire(keys.control(worker_id), 24 * 3600 * 1000)

    return Op(build, lambda r: r[0])


def read_control(
    keys: Keys, worker_id: str, last_id: str, block_ms: int | None = None
) -> Op[list[tuple[str, dict[str, str]]]]:
    """Commands after `last_id`, waiting up to `block_ms` for one (a standby waits for its bind here)."""
    return Op(
        lambda pipe: pipe.xread({keys.control(worker_id): last_id}, count=16, block=block_ms),
        lambda r: stream_entries(r[0]),
    )


def read_control_or_requests(
    keys: Keys, worker_id: str, last_id: str, function: str, last_request_id: str, block_ms: int | None
) -> Op[tuple[list[tuple[str, dict[str, str]]], str | None]]:
    """What a standby pre-loaded for `function` waits on: its control commands after `last_id` and the
    function's requests after `last_request_id`, in one blocking read (a request wakes it as fast as it
    wakes a bound worker). Returns (commands, the newest request id, or None when none arrived); the
    requests themselves are read later with the consumer group, by whoever serves them."""
    control, requests = keys.control(worker_id), keys.requests(function)

    def parse(r: list[Any]) -> tuple[list[tuple[str, dict[str, str]]], str | None]:
        by_stream = entries_by_stream(r[0])
        arrived = by_stream.get(requests, [])
        return by_stream.get(control, []), (arrived[-1][0] if arrived else None)

    return Op(
        lambda pipe: pipe.xread({control: last_id, requests: last_request_id}, count=16, block=block_ms),
        parse,
    )


def last_control_id(keys: Keys, worker_id: str) -> Op[str]:
    """Where a (re)started worker begins reading its control stream: after what is there already, so a
    restarted container with the same id never replays an old `stop` or `bind`."""
    return Op(
        lambda pipe: pipe.xrevrange(keys.control(worker_id), count=1),
        lambda r: r[0][0][0] if r[0] else "0-0",
    )
