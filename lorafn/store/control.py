"""What the controller reads and writes in Redis, and what workers tell it.

- Lease (`<p>:controller:lease`): one active controller per deployment; the holder renews it, another
  takes over when it expires.
- Lifecycle stream (`<p>:lifecycle`): workers report `bound` (a standby took a function: how long it
  took and how) and `bind_failed`; the local supervisor reports `start_failed` (a process died before
  serving). The controller turns them into function status and start-failure backoff.
- Function status (`<p>:fn:<f>:status`): `wait_reason` (why no worker serves it right now; the gateway
  tells waiting clients), `last_cold_start_ms`, `last_cold_path` (standby | fresh), `start_failures`,
  `last_failure`, `last_failure_at_ms`.
- Pool (`<p>:pool`): the standby workers wanted per GPU, backbone and adapter shape (the operator
  creates standby pods from it; `lorafn status` shows it).
- GPU inventory (`<p>:gpus`): GPU id -> {node, total_bytes, backbones: {name: bytes}}.
- Queue depth: entries in a function's request stream not yet delivered to a worker.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from lorafn.store.client import Op
from lorafn.store.keys import GROUP, Keys
from lorafn.store.streams import stream_entries

BOUND, BIND_FAILED, START_FAILED = "bound", "bind_failed", "start_failed"
PATH_STANDBY, PATH_FRESH = "standby", "fresh"

_RENEW = """
local holder = redis.call('GET', KEYS[1])
if holder == false or holder == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""


def acquire_lease(keys: Keys, holder: str, ttl_ms: int) -> Op[bool]:
    """Take or renew the controller lease; True when `holder` has it for the next `ttl_ms`."""
    return Op(
        lambda pipe: pipe.eval(_RENEW, 1, keys.controller_lease(), holder, int(ttl_ms)), lambda r: bool(r[0])
    )


def lease_holder(keys: Keys) -> Op[str | None]:
    return Op(lambda pipe: pipe.get(keys.controller_lease()), lambda r: r[0] or None)


def post_event(keys: Keys, kind: str, **fields: Any) -> Op[str]:
    """Append a lifecycle event (kept to the last 10 000)."""
    body = {"kind": kind, **{k: str(v) for k, v in fields.items()}}
    return Op(lambda pipe: pipe.xadd(keys.lifecycle(), body, maxlen=10_000, approximate=True), lambda r: r[0])


def read_events(keys: Keys, last_id: str, count: int = 1000) -> Op[list[tuple[str, dict[str, str]]]]:
    """Lifecycle events after `last_id` (non-blocking)."""
    return Op(
        lambda pipe: pipe.xread({keys.lifecycle(): last_id}, count=count), lambda r: stream_entries(r[0])
    )


def last_event_id(keys: Keys) -> Op[str]:
    """The id to read new events from (`0-0` when the stream is empty)."""
    return Op(
        lambda pipe: pipe.xrevrange(keys.lifecycle(), count=1),
        lambda r: r[0][0][0] if r[0] else "0-0",
    )


def set_status(keys: Keys, function: str, **fields: Any) -> Op[None]:
    """HSET status fields of a function; a field set to None is removed."""
    put = {k: str(v) for k, v in fields.items() if v is not None}
    drop = [k for k, v in fields.items() if v is None]

    def build(pipe: Any) -> None:
        if put:
            pipe.hset(keys.function_status(function), mapping=put)
        if drop:
            pipe.hdel(keys.function_status(function), *drop)

    return Op(build, lambda r: None)


def add_status_count(keys: Keys, function: str, field: str, by: int = 1) -> Op[int]:
    return Op(lambda pipe: pipe.hincrby(keys.function_status(function), field, by), lambda r: int(r[0]))


def statuses(keys: Keys, functions: list[str]) -> Op[dict[str, dict[str, str]]]:
    def build(pipe: Any) -> None:
        for f in functions:
            pipe.hgetall(keys.function_status(f))

    return Op(build, lambda r: dict(zip(functions, (h or {} for h in r), strict=True)))


@dataclass(frozen=True)
class QueueDepth:
    """A request stream: `length` entries, of which `pending` were delivered to a worker and not acked."""

    length: int
    pending: int

    @property
    def queued(self) -> int:
        return max(0, self.length - self.pending)


_DEPTHS = """
local out = {}
for i, key in ipairs(KEYS) do
  local length = redis.call('XLEN', key)
  local pending = 0
  if length > 0 then
    local ok, summary = pcall(redis.call, 'XPENDING', key, ARGV[1])
    if ok then pending = summary[1] end
  end
  out[2 * i - 1] = length
  out[2 * i] = pending
end
return out
"""


def queue_depths(keys: Keys, functions: list[str]) -> Op[dict[str, QueueDepth]]:
    """Length and pending count of each function's request stream, in one round trip (a missing stream or
    group counts as empty)."""

    def parse(r: list[Any]) -> dict[str, QueueDepth]:
        flat = r[0] or []
        return {f: QueueDepth(int(flat[2 * i]), int(flat[2 * i + 1])) for i, f in enumerate(functions)}

    if not functions:
        return Op(lambda pipe: None, lambda r: {})
    return Op(
        lambda pipe: pipe.eval(_DEPTHS, len(functions), *[keys.requests(f) for f in functions], GROUP), parse
    )


def set_pool(keys: Keys, targets: dict[str, int]) -> Op[None]:
    """Replace the pool targets (`<gpu>|<backbone>|<shape>` -> count)."""

    def build(pipe: Any) -> None:
        pipe.delete(keys.pool())
        if targets:
            pipe.hset(keys.pool(), mapping={k: str(v) for k, v in targets.items()})

    return Op(build, lambda r: None)


def pool(keys: Keys) -> Op[dict[str, int]]:
    return Op(lambda pipe: pipe.hgetall(keys.pool()), lambda r: {k: int(v) for k, v in (r[0] or {}).items()})


def pool_key(gpu: str, backbone: str, shape: str | None) -> str:
    return f"{gpu}|{backbone}|{shape or '*'}"


def put_gpu(keys: Keys, gpu_id: str, node: str, total_bytes: int, backbones: dict[str, int]) -> Op[None]:
    body = json.dumps({"node": node, "total_bytes": int(total_bytes), "backbones": backbones})
    return Op(lambda pipe: pipe.hset(keys.gpus(), gpu_id, body), lambda r: None)


def gpus(keys: Keys) -> Op[dict[str, dict[str, Any]]]:
    return Op(
        lambda pipe: pipe.hgetall(keys.gpus()),
        lambda r: {k: json.loads(v) for k, v in (r[0] or {}).items()},
    )
