"""What the controller reads and writes in Redis, and what workers tell it.

- Lease (`<p>:controller:lease`): one active controller per deployment; the holder renews it, another
  takes over when it expires.
- Lifecycle stream (`<p>:lifecycle`): workers report `bound` (a standby took a function: how long it
  took, how, and whether its adapter was pre-loaded) and `bind_failed`; the local supervisor reports
  `start_failed` (a process died before serving); on Kubernetes the operator reports `pod_exited` (a worker
  pod's container terminated with a non-zero code: `PodExit`), which the Kubernetes executor turns into
  worker exits. The controller turns them into function status and start-failure backoff. Parking
  (`PolicyConfig.park_idle`, docs/architecture.md): a worker answers a `park` command with `parked`
  (`released_bytes`) or `park_refused` (`reason`: it had requests), an `unpark` with `unparked` (`kv_bytes`).
  A `kv_budget` command (more KV for an offline batch, or its return: docs/batch.md) is answered with
  `kv_resized` (`kv_bytes`, `budget_bytes`) or `kv_resize_refused` (`reason`, `budget_bytes`).
- Function status (`<p>:fn:<f>:status`): `wait_reason` (why no worker serves it right now; the gateway
  tells waiting clients), `last_cold_start_ms`, `last_cold_path` (standby | fresh),
  `last_cold_preloaded` (1: the standby had pre-loaded the adapter), `last_cold_claimed` (1: that standby
  took the request itself, without a bind command), `start_failures`, `last_failure`,
  `last_failure_at_ms`.
- Pool (`<p>:pool`): the standby workers wanted per GPU, backbone and adapter shape (the operator
  creates standby pods from it; `lorafn status` shows it).
- GPU inventory (`<p>:gpus`): GPU id -> {node, total_bytes, backbones: {name: bytes}}.
- Queue depth: entries in a function's request stream not yet delivered to a worker.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from lorafn.store.client import Op, eval_script
from lorafn.store.keys import GROUP, Keys
from lorafn.store.streams import stream_entries

BOUND, BIND_FAILED, START_FAILED, POD_EXITED = "bound", "bind_failed", "start_failed", "pod_exited"
PARKED, PARK_REFUSED, UNPARKED = "parked", "park_refused", "unparked"
KV_RESIZED, KV_RESIZE_REFUSED = "kv_resized", "kv_resize_refused"
# how a function's worker came: a standby bound, a fresh process, or a worker with adapter slots that took
# it into a free slot beside its other functions (docs/runtime.md#adapter-slots)
PATH_STANDBY, PATH_FRESH, PATH_JOIN = "standby", "fresh", "join"

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


@dataclass(frozen=True)
class PodExit:
    """A worker pod's container that terminated (what the operator sees in the pod's status).

    ``worker_id``: the pod's name (its worker runs under it); ``function``: the function of a worker pod
    ("" for a pool pod); ``code``: the exit code (None: the pod failed without one, e.g. evicted);
    ``marker``: which termination (restart count and finish time): the same one is reported at every
    reconcile, and counted once."""

    worker_id: str
    function: str
    code: int | None
    reason: str
    marker: str

    def fields(self) -> dict[str, Any]:
        code = "" if self.code is None else self.code
        return {"worker": self.worker_id, "function": self.function, "code": code, "reason": self.reason,
                "marker": self.marker}  # fmt: skip

    @classmethod
    def from_event(cls, event: dict[str, str]) -> PodExit:
        raw = event.get("code", "")
        code = int(raw) if raw.lstrip("-").isdigit() else None
        return cls(event.get("worker", ""), event.get("function", ""), code, event.get("reason", ""),
                   event.get("marker", ""))  # fmt: skip


def report_pod_exit(keys: Keys, exit: PodExit) -> Op[str]:
    """The operator's report of a terminated worker container (a `pod_exited` lifecycle event)."""
    return post_event(keys, POD_EXITED, **exit.fields())


def read_events(
    keys: Keys, last_id: str, count: int = 1000, block_ms: int | None = None
) -> Op[list[tuple[str, dict[str, str]]]]:
    """Lifecycle events after `last_id`, waiting up to `block_ms` for the first (None: no wait; the driver
    waits so for a worker's answer to a `park`)."""
    return Op(
        lambda pipe: pipe.xread({keys.lifecycle(): last_id}, count=count, block=block_ms),
        lambda r: stream_entries(r[0]),
    )


def read_demand_and_events(
    keys: Keys, demand_after: str, events_after: str, block_ms: int | None, count: int = 100
) -> Op[tuple[list[tuple[str, dict[str, str]]], list[tuple[str, dict[str, str]]]]]:
    """What wakes the controller between rounds: demand entries after `demand_after` and lifecycle events
    after `events_after` (a worker bound or failed: its status should not wait an interval), waiting up to
    `block_ms` for the first of either (None: no wait). Returns (demand entries, events)."""

    def parse(r: list[Any]) -> tuple[list[tuple[str, dict[str, str]]], list[tuple[str, dict[str, str]]]]:
        demand: list[tuple[str, dict[str, str]]] = []
        events: list[tuple[str, dict[str, str]]] = []
        if r[0]:
            for name, entries in r[0].items() if isinstance(r[0], dict) else r[0]:
                (demand if name == keys.demand() else events).extend(stream_entries({name: entries}))
        return demand, events

    return Op(
        lambda pipe: pipe.xread(
            {keys.demand(): demand_after, keys.lifecycle(): events_after}, count=count, block=block_ms
        ),
        parse,
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


def record_start_failure(keys: Keys, function: str, reason: str, at_ms: int) -> Op[int]:
    """A failed start of `function`: its `last_failure` and `last_failure_at_ms`, then `start_failures` + 1,
    in that order and one round trip, so a reader that sees the new count also sees why (the gateway's 503,
    `lorafn status`, the controller's backoff). Returns the new count."""

    def build(pipe: Any) -> None:
        status = keys.function_status(function)
        pipe.hset(status, mapping={"last_failure": reason, "last_failure_at_ms": str(at_ms)})
        pipe.hincrby(status, "start_failures", 1)

    return Op(build, lambda r: int(r[1]))


def statuses(keys: Keys, functions: list[str]) -> Op[dict[str, dict[str, str]]]:
    def build(pipe: Any) -> None:
        for f in functions:
            pipe.hgetall(keys.function_status(f))

    return Op(build, lambda r: dict(zip(functions, (h or {} for h in r), strict=True)))


@dataclass(frozen=True)
class QueueDepth:
    """A request stream: `length` entries, of which `pending` were delivered to a worker and not acked;
    `oldest_wait_ms`: how long the oldest entry not yet delivered has waited (Redis's clock: an entry's id
    is its admission time), 0 when none waits."""

    length: int
    pending: int
    oldest_wait_ms: int = 0

    @property
    def queued(self) -> int:
        return max(0, self.length - self.pending)


def queue_depths(keys: Keys, functions: list[str]) -> Op[dict[str, QueueDepth]]:
    """Length, pending count and oldest undelivered entry's wait of each function's request stream, in one
    round trip (`lua/queue_depths.lua`; a missing stream or group counts as empty / nothing delivered)."""

    def parse(r: list[Any]) -> dict[str, QueueDepth]:
        flat = r[0] or []
        return {
            f: QueueDepth(int(flat[3 * i]), int(flat[3 * i + 1]), max(0, int(flat[3 * i + 2])))
            for i, f in enumerate(functions)
        }

    if not functions:
        return Op(lambda pipe: None, lambda r: {})
    return Op(
        lambda pipe: eval_script(pipe, "queue_depths", [keys.requests(f) for f in functions], [GROUP]), parse
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


# -- desired pod counts (the Kubernetes executor writes them, the operator reads them) -----------------

_ADD_DESIRED = """
local raw
if ARGV[1] == '' then raw = redis.call('GET', KEYS[1]) else raw = redis.call('HGET', KEYS[1], ARGV[1]) end
local low, high = tonumber(ARGV[3]), tonumber(ARGV[4])
local current = tonumber(raw) or low
current = math.max(low, math.min(high, current))
local new = math.max(0, math.min(high, current + tonumber(ARGV[2])))
if ARGV[1] == '' then redis.call('SET', KEYS[1], new) else redis.call('HSET', KEYS[1], ARGV[1], new) end
return new
"""


def _int_or_none(raw: Any) -> int | None:
    try:
        return None if raw is None else int(raw)
    except (TypeError, ValueError):
        return None


def _check_bounds(low: int, high: int) -> None:
    if not 0 <= low <= high:
        raise ValueError(f"bounds: need 0 <= low ({low}) <= high ({high})")


def add_desired_replicas(keys: Keys, function: str, delta: int, low: int, high: int) -> Op[int]:
    """Move the function's desired replica count by `delta` from what the operator runs now (the stored
    count held within [low, high] = [minReplicas, maxReplicas], absent = low); returns the new count."""
    _check_bounds(low, high)
    return Op(
        lambda pipe: pipe.eval(_ADD_DESIRED, 1, keys.desired_replicas(function), "", int(delta), low, high),
        lambda r: int(r[0]),
    )


_ADD_STANDBY = """
local all = redis.call('HGETALL', KEYS[1])
local prefix = ARGV[1] .. '|'
local total, named = 0, false
for i = 1, #all, 2 do
  if string.sub(all[i], 1, #prefix) == prefix then
    named = true
    total = total + math.max(0, tonumber(all[i + 1]) or 0)
  end
end
local floor, cap, delta = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[3])
if not named then
  redis.call('HSET', KEYS[1], prefix .. '*', floor)
  total = floor
end
local field = prefix .. ARGV[2]
local current = math.max(0, tonumber(redis.call('HGET', KEYS[1], field)) or 0)
if delta > 0 then delta = math.min(delta, math.max(0, cap - total)) end
local new = math.max(0, current + delta)
redis.call('HSET', KEYS[1], field, new)
return new
"""

ANY_SHAPE = "*"


def standby_field(gpu: str, shape: str | None) -> str:
    """The field of `<bb>:desired_standby`: `<gpu>|<shape>` (`*`: shape-agnostic standby workers)."""
    if not gpu or "|" in gpu:
        raise ValueError(f"gpu: {gpu!r} must be a non-empty GPU id without '|'")
    return f"{gpu}|{shape or ANY_SHAPE}"


def add_desired_standby(
    keys: Keys, backbone: str, gpu: str, shape: str | None, delta: int, floor: int, cap: int
) -> Op[int]:
    """Move the backbone's pool pods of `shape` on `gpu` by `delta`; returns the new count. While nothing
    is stored for that GPU the operator runs `floor` (warmPool.minStandby) shape-agnostic ones, so that is
    written first; once anything is, the stored counts are what runs. The GPU's total stays <= `cap`
    (warmPool.maxStandby)."""
    _check_bounds(floor, cap)
    field = standby_field(gpu, shape)
    shape_part = field.split("|", 1)[1]
    return Op(
        lambda pipe: pipe.eval(
            _ADD_STANDBY, 1, keys.desired_standby(backbone), gpu, shape_part, int(delta), floor, cap
        ),
        lambda r: int(r[0]),
    )


def standby_counts(
    stored: dict[tuple[str, str | None], int], gpu: str, floor: int, cap: int
) -> dict[str | None, int]:
    """Pool pods per shape the operator runs on `gpu` (None: shape-agnostic): `floor` agnostic ones while
    nothing is stored for it, else the stored counts, agnostic first, the total cut at `cap`."""
    mine = {shape: n for (g, shape), n in stored.items() if g == gpu}
    if not mine:
        return {None: min(floor, cap)} if floor else {}
    out: dict[str | None, int] = {}
    left = cap
    for shape in sorted(mine, key=lambda s: (s is not None, s or "")):
        n = min(max(0, mine[shape]), left)
        left -= n
        if n:
            out[shape] = n
    return out


def desired_replicas(keys: Keys, functions: list[str]) -> Op[dict[str, int | None]]:
    """Each function's stored desired replica count (None: the controller has not said)."""

    def build(pipe: Any) -> None:
        for f in functions:
            pipe.get(keys.desired_replicas(f))

    return Op(build, lambda r: {f: _int_or_none(v) for f, v in zip(functions, r, strict=True)})


def _by_standby_field(raw: dict[str, str] | None) -> dict[tuple[str, str | None], int]:
    """A hash keyed by `standby_field` -> {(GPU id, shape or None): int}; unreadable entries are left out."""
    out: dict[tuple[str, str | None], int] = {}
    for name, value in (raw or {}).items():
        gpu, _, shape = name.rpartition("|")
        number = _int_or_none(value)
        if gpu and number is not None:
            out[(gpu, None if shape == ANY_SHAPE else shape)] = number
    return out


def desired_standby(keys: Keys, backbone: str) -> Op[dict[tuple[str, str | None], int]]:
    """(GPU id, shape or None) -> stored desired pool pods of the backbone there."""
    return Op(lambda pipe: pipe.hgetall(keys.desired_standby(backbone)), lambda r: _by_standby_field(r[0]))


def set_standby_kv(keys: Keys, backbone: str, gpu: str, shape: str | None, kv_mib: int) -> Op[None]:
    """Record the KV budget (MiB) the controller granted a standby of the backbone on `gpu` for `shape`: the
    operator starts that field's new pool pods with it. The last grant wins (the planner sizes every
    standby of a field alike, for the largest registered function of its shape: a smaller grant means
    that function went, and pods already running keep their size)."""
    if int(kv_mib) < 1:
        raise ValueError(f"kv_mib: {kv_mib} must be >= 1")
    field = standby_field(gpu, shape)
    return Op(lambda pipe: pipe.hset(keys.standby_kv(backbone), field, int(kv_mib)), lambda r: None)


def standby_kv(keys: Keys, backbone: str) -> Op[dict[tuple[str, str | None], int]]:
    """(GPU id, shape or None) -> the KV budget (MiB) recorded for the backbone's standbys there."""
    return Op(lambda pipe: pipe.hgetall(keys.standby_kv(backbone)), lambda r: _by_standby_field(r[0]))


def clear_desired_replicas(keys: Keys, function: str) -> Op[None]:
    return Op(lambda pipe: pipe.delete(keys.desired_replicas(function)), lambda r: None)


def clear_desired_standby(keys: Keys, backbone: str) -> Op[None]:
    return Op(lambda pipe: pipe.delete(keys.desired_standby(backbone)), lambda r: None)


def clear_standby_kv(keys: Keys, backbone: str) -> Op[None]:
    return Op(lambda pipe: pipe.delete(keys.standby_kv(backbone)), lambda r: None)


# -- retiring workers, pool workers --------------------------------------------------------------------


def retire(keys: Keys, worker_id: str, now_ms: int, keep_ms: int = 3_600_000) -> Op[None]:
    """Mark a stopped worker's pod as retiring (and forget marks older than `keep_ms`)."""

    def build(pipe: Any) -> None:
        pipe.zadd(keys.retiring(), {worker_id: int(now_ms)})
        pipe.zremrangebyscore(keys.retiring(), "-inf", int(now_ms) - int(keep_ms))

    return Op(build, lambda r: None)


def retiring(keys: Keys) -> Op[dict[str, int]]:
    """Retiring worker ids -> when they were stopped (ms)."""
    return Op(
        lambda pipe: pipe.zrange(keys.retiring(), 0, -1, withscores=True),
        lambda r: {wid: int(score) for wid, score in r[0] or []},
    )


def unretire(keys: Keys, worker_ids: list[str]) -> Op[None]:
    """Drop retiring marks (the pod is gone, or a new pod takes the name)."""
    if not worker_ids:
        return Op(lambda pipe: None, lambda r: None)
    return Op(lambda pipe: pipe.zrem(keys.retiring(), *worker_ids), lambda r: None)


def remember_pool_workers(keys: Keys, where: dict[str, tuple[str, str, str | None]]) -> Op[None]:
    """worker id -> (backbone, gpu, shape) of workers seen as standby: they run in pool pods."""
    if not where:
        return Op(lambda pipe: None, lambda r: None)
    mapping = {wid: f"{bb}|{standby_field(gpu, shape)}" for wid, (bb, gpu, shape) in where.items()}
    return Op(lambda pipe: pipe.hset(keys.pool_workers(), mapping=mapping), lambda r: None)


def pool_workers(keys: Keys) -> Op[dict[str, tuple[str, str, str | None]]]:
    def parse(r: list[Any]) -> dict[str, tuple[str, str, str | None]]:
        out = {}
        for wid, value in (r[0] or {}).items():
            bb, _, rest = value.partition("|")
            gpu, _, shape = rest.rpartition("|")
            out[wid] = (bb, gpu, None if shape == ANY_SHAPE else shape)
        return out

    return Op(lambda pipe: pipe.hgetall(keys.pool_workers()), parse)


def forget_pool_workers(keys: Keys, worker_ids: list[str]) -> Op[None]:
    if not worker_ids:
        return Op(lambda pipe: None, lambda r: None)
    return Op(lambda pipe: pipe.hdel(keys.pool_workers(), *worker_ids), lambda r: None)


# -- GPU inventory, one backbone at a time (the operator reconciles each Backbone on its own) -----------

_MERGE_GPU = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
local entry
if raw then entry = cjson.decode(raw) else entry = {backbones = {}} end
if type(entry.backbones) ~= 'table' then entry.backbones = {} end
entry.node = ARGV[2]
entry.total_bytes = tonumber(ARGV[3])
if ARGV[5] == '' then entry.backbones[ARGV[4]] = nil else entry.backbones[ARGV[4]] = tonumber(ARGV[5]) end
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(entry))
return 1
"""

_DROP_BACKBONE = """
local out = 0
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local entry = cjson.decode(all[i + 1])
  if type(entry.backbones) ~= 'table' then entry.backbones = {} end
  local had = entry.backbones[ARGV[1]] ~= nil
  entry.backbones[ARGV[1]] = nil
  if next(entry.backbones) == nil then
    redis.call('HDEL', KEYS[1], all[i])
    out = out + 1
  elseif had then
    redis.call('HSET', KEYS[1], all[i], cjson.encode(entry))
    out = out + 1
  end
end
return out
"""


def merge_gpu(
    keys: Keys, gpu_id: str, node: str, total_bytes: int, backbone: str, resident_bytes: int | None
) -> Op[None]:
    """Write a GPU's node and size and whether `backbone` is resident on it (None: not resident), keeping
    the other backbones of the entry (atomic: two Backbones on one GPU reconcile concurrently)."""
    if not gpu_id:
        raise ValueError("gpu_id: must be non-empty")
    resident = "" if resident_bytes is None else str(int(resident_bytes))
    args = (gpu_id, node, int(total_bytes), backbone, resident)
    return Op(lambda pipe: pipe.eval(_MERGE_GPU, 1, keys.gpus(), *args), lambda r: None)


def drop_backbone_from_gpus(keys: Keys, backbone: str) -> Op[int]:
    """Remove `backbone` from every GPU entry; entries left with no backbone go (another Backbone's
    reconcile writes its GPUs again within one interval). Returns the entries changed."""
    return Op(lambda pipe: pipe.eval(_DROP_BACKBONE, 1, keys.gpus(), backbone), lambda r: int(r[0]))
