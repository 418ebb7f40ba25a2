"""`lorafn status` and `lorafn get`: what the running local platform holds, read from Redis.

Everything shown is what the processes themselves wrote: worker heartbeats (state standby | binding |
serving | draining, parked or not, device, backbone, adapter shape, memory, idle time), the controller's
function status (why a function waits, its last cold start and the path it took, failed starts) and pool
targets, the gateway's counters and the request streams' depth. Collecting is one pass over Redis; rendering
is pure.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from lorafn.api.adapters import shared_adapter_dirs
from lorafn.local.config import PlatformState
from lorafn.store import Keys, Store, control
from lorafn.store.backbones import get_backbone, list_backbones
from lorafn.store.registry import get_function, list_functions
from lorafn.store.stats import COLD_REQUESTS, ERRORS, REQUESTS, counters
from lorafn.store.workers import worker_ids, worker_info

BOUND_STATES = ("binding", "serving", "draining")
STANDBY = "standby"


@dataclass
class WorkerView:
    id: str
    function: str
    state: str
    gpu: str
    backbone: str
    shape: str
    mem_mib: int
    idle_s: str
    pid: str
    parked: bool = False  # released its KV cache, process kept (PolicyConfig.park_idle); serves once unparked
    running: int = 0  # requests in flight in it (its last heartbeat)


@dataclass
class FunctionView:
    name: str
    backbone: str
    rank: str
    targets: str
    auth: str
    phase: str
    workers: list[str]
    queued: int
    requests: int
    cold_starts: int
    errors: int
    last_cold_start_ms: float | None
    last_cold_path: str
    wait_reason: str
    start_failures: int
    last_failure: str
    problem: str = ""  # the controller cannot start a worker until the function changes
    adapter_warning: str = ""
    oldest_wait_ms: int = 0  # how long the oldest queued request (not yet read by a worker) has waited

    @property
    def adapter_failed(self) -> str:
        """Why the adapter checked at apply no longer loads, when no worker serves: the controller's
        problem with it (it no longer reads), else the last failed start (the loader refused it, or the
        process died before serving). Empty when nothing says so."""
        if self.workers:
            return ""
        if self.problem:
            return self.problem
        return self.last_failure if self.start_failures > 0 else ""

    @property
    def conditions(self) -> list[dict[str, str]]:
        """`AdapterReady` and `Ready` in the operator's vocabulary (docs/operator.md)."""
        if self.adapter_failed:
            adapter = {"status": "False", "reason": "LoadFailed", "message": self.adapter_failed}
        else:
            adapter = {"status": "True", "reason": "Validated", "message": self.adapter_warning}
        if self.phase == "Ready" or (not self.not_ready_because and self.phase == "Idle"):
            ready = {"status": "True", "reason": "Invocable", "message": ""}
        else:
            ready = {"status": "False", "reason": "LoadFailed" if self.adapter_failed else "Waiting",
                     "message": self.not_ready_because}  # fmt: skip
        return [{"type": "AdapterReady", **adapter}, {"type": "Ready", **ready}]

    @property
    def not_ready_because(self) -> str:
        """Why no worker serves it now: the controller's wait reason, else its last failed start."""
        if self.wait_reason:
            return self.wait_reason
        if self.start_failures and not self.workers:
            return f"{self.start_failures} failed start(s); last: {self.last_failure}"
        return ""


@dataclass
class PoolView:
    gpu: str
    backbone: str
    shape: str
    target: int
    standby: int


@dataclass
class BackboneView:
    name: str
    dtype: str
    model_dir: str
    functions: int
    standby: int


@dataclass
class PlatformStatus:
    gateway_url: str
    redis_url: str
    backbones: list[BackboneView] = field(default_factory=list)
    functions: list[FunctionView] = field(default_factory=list)
    workers: list[WorkerView] = field(default_factory=list)
    pool: list[PoolView] = field(default_factory=list)

    def function(self, name: str) -> FunctionView | None:
        return next((f for f in self.functions if f.name == name), None)


def _int(value: Any) -> int:
    try:
        return int(float(value))
    except (TypeError, ValueError):
        return 0


def phase(workers: list[WorkerView], queued: int, wait_reason: str) -> str:
    """The operator's vocabulary: Ready (a worker serves), Scaling (requests wait for a start), Idle."""
    if any(w.state == "serving" for w in workers):
        return "Ready"
    if queued or wait_reason or workers:
        return "Scaling"
    return "Idle"


def _worker(wid: str, fields: dict[str, str]) -> WorkerView:
    return WorkerView(
        id=wid,
        # a worker with adapter slots serves several functions: all of them, the first first
        function=fields.get("functions") or fields.get("function", ""),
        state=fields.get("state", ""),
        gpu=fields.get("gpu", ""),
        backbone=fields.get("backbone", ""),
        shape=fields.get("shape", ""),
        mem_mib=_int(fields.get("mem_bytes")) // (1024 * 1024),
        idle_s=fields.get("idle_s", ""),
        pid=fields.get("pid", ""),
        parked=fields.get("parked") == "1",
        running=_int(fields.get("running")),
    )


def collect_status(state: PlatformState) -> PlatformStatus:
    store = Store(state.redis_url)
    try:
        return collect(store, Keys(state.key_prefix), state.gateway_url, state.shown_redis_url)
    finally:
        store.close()


def collect(store: Store, keys: Keys, gateway_url: str = "", redis_url: str = "") -> PlatformStatus:
    out = PlatformStatus(gateway_url, redis_url)
    ids = store.run(worker_ids(keys))
    info = store.run(worker_info(keys, ids)) if ids else {}
    out.workers = [_worker(wid, fields) for wid, fields in sorted(info.items())]
    standbys = [w for w in out.workers if w.state == STANDBY]

    names = store.run(list_functions(keys))
    status_of = store.run(control.statuses(keys, names))
    depths = store.run(control.queue_depths(keys, names))
    records = {name: store.run(get_function(keys, name)) for name in names}
    # a function whose adapter directory is another's, also through a symlink or `..` (issue 15)
    shared = shared_adapter_dirs({n: r.adapter_dir for n, r in records.items() if r and r.adapter_dir})
    for name in names:
        record = records[name]
        if record is None:
            continue
        stats = store.run(counters(keys, name))
        st = status_of.get(name, {})
        bound = [w for w in out.workers if name in w.function.split(",") and w.state in BOUND_STATES]
        depth = depths.get(name)
        queued = depth.queued if depth else 0
        cold_ms = st.get("last_cold_start_ms")
        out.functions.append(
            FunctionView(
                name=name,
                backbone=str(record.spec.get("backbone", "")),
                rank=record.extra.get("rank", "?"),
                targets=record.extra.get("targets", "?"),
                auth="public" if record.public else "api keys",
                phase=phase(bound, queued, st.get("wait_reason", "")),
                workers=[w.id for w in bound],
                queued=queued,
                requests=stats.get(REQUESTS, 0),
                cold_starts=stats.get(COLD_REQUESTS, 0),
                errors=stats.get(ERRORS, 0),
                last_cold_start_ms=float(cold_ms) if cold_ms else None,
                last_cold_path=st.get("last_cold_path", ""),
                wait_reason=st.get("wait_reason", ""),
                start_failures=_int(st.get("start_failures")),
                last_failure=st.get("last_failure", ""),
                problem=st.get("problem", ""),
                adapter_warning=shared.get(name, ""),
                oldest_wait_ms=depth.oldest_wait_ms if depth else 0,
            )
        )

    targets = store.run(control.pool(keys))
    seen: set[tuple[str, str, str]] = set()
    for key, want in sorted(targets.items()):
        gpu, _, rest = key.partition("|")
        backbone, _, shape = rest.partition("|")
        seen.add((gpu, backbone, shape))
        have = sum(1 for w in standbys if (w.gpu, w.backbone, w.shape or "*") == (gpu, backbone, shape))
        out.pool.append(PoolView(gpu, backbone, shape, want, have))
    for w in standbys:  # standby workers the targets no longer name (they are being stopped)
        where = (w.gpu, w.backbone, w.shape or "*")
        if where not in seen:
            seen.add(where)
            have = sum(1 for s in standbys if (s.gpu, s.backbone, s.shape or "*") == where)
            out.pool.append(PoolView(*where, target=0, standby=have))

    for name in store.run(list_backbones(keys)):
        bb = store.run(get_backbone(keys, name))
        if bb is not None:
            fns = sum(1 for f in out.functions if f.backbone == name)
            idle = sum(1 for w in standbys if w.backbone == name)
            out.backbones.append(BackboneView(name, bb.dtype, bb.model_dir, fns, idle))
    return out


def _cold(fn: FunctionView) -> str:
    if fn.last_cold_start_ms is None:
        return "-"
    return f"{fn.last_cold_start_ms:.0f} ms ({fn.last_cold_path or '?'})"


def _console() -> Console:
    # Piped output (scripts, grep) gets whole rows, not rows wrapped at rich's default 80 columns.
    return Console() if sys.stdout.isatty() else Console(width=200)


def _queued(f: FunctionView) -> str:
    """Requests no worker has read yet, with how long the oldest has waited."""
    return f"{f.queued} (oldest {f.oldest_wait_ms / 1000:.1f} s)" if f.queued else "0"


def render_status(status: PlatformStatus, console: Console | None = None) -> None:
    console = console or _console()
    console.print(f"gateway [bold]{status.gateway_url}[/]   redis {status.redis_url}")
    backbones = Table("backbone", "dtype", "functions", "standby workers", "model dir", title="Backbones")
    for b in status.backbones:
        backbones.add_row(b.name, b.dtype, str(b.functions), str(b.standby), b.model_dir)
    console.print(backbones)
    functions = Table(
        "function", "phase", "bound workers", "queued", "requests", "cold starts", "errors",
        "last cold start", "not ready because", title="Functions",
    )  # fmt: skip
    for f in status.functions:
        functions.add_row(
            f.name, f.phase, str(len(f.workers)), _queued(f), str(f.requests), str(f.cold_starts),
            str(f.errors), _cold(f), f.not_ready_because,
        )  # fmt: skip
    console.print(functions)
    for f in status.functions:
        if f.adapter_warning:
            console.print(f"[yellow]warning: {f.name}: {f.adapter_warning}[/]")
    pool = Table(
        "device", "backbone", "adapter shape", "target", "standby", title="Warm pool (standby workers)"
    )
    for p in status.pool:
        pool.add_row(p.gpu, p.backbone, p.shape if p.shape != "*" else "any", str(p.target), str(p.standby))
    console.print(pool)
    workers = Table(
        "worker", "state", "function", "device", "shape", "MiB", "running", "idle s", "pid", title="Workers"
    )
    for w in status.workers:
        state = f"{w.state} (parked)" if w.parked else w.state
        workers.add_row(
            w.id, state, w.function, w.gpu, w.shape, str(w.mem_mib), str(w.running), w.idle_s, w.pid
        )
    busy = busy_per_device(status.workers)
    if busy:
        # each busy worker's decode step reads the whole backbone: each adds about a step to the others' TPOT
        workers.caption = "busy workers (requests in flight) per device: " + ", ".join(
            f"{gpu} {n}" for gpu, n in sorted(busy.items())
        )
        workers.caption_justify = "left"
    console.print(workers)


def busy_per_device(workers: list[WorkerView]) -> dict[str, int]:
    """Workers with requests in flight, per device (docs/architecture.md, "Decode cost across functions")."""
    busy: dict[str, int] = {}
    for w in workers:
        if w.running > 0 and not w.parked:
            busy[w.gpu] = busy.get(w.gpu, 0) + 1
    return busy


# -- `lorafn get` ----------------------------------------------------------------------------------


def function_rows(status: PlatformStatus) -> list[dict[str, Any]]:
    return [
        {
            "name": f.name, "backbone": f.backbone, "rank": f.rank, "targets": f.targets, "phase": f.phase,
            "workers": f.workers, "queued": f.queued, "oldestWaitMs": f.oldest_wait_ms if f.queued else None,
            "lastColdStartMs": f.last_cold_start_ms,
            "lastColdPath": f.last_cold_path or None, "waitReason": f.not_ready_because or None,
            "startFailures": f.start_failures, "requests": f.requests, "coldStarts": f.cold_starts,
            "conditions": f.conditions, "warnings": [f.adapter_warning] if f.adapter_warning else [],
        }
        for f in status.functions
    ]  # fmt: skip


def backbone_rows(status: PlatformStatus) -> list[dict[str, Any]]:
    return [
        {
            "name": b.name,
            "dtype": b.dtype,
            "modelDir": b.model_dir,
            "functions": b.functions,
            "standby": b.standby,
        }
        for b in status.backbones
    ]


def render_get(kind: str, status: PlatformStatus, output: str | None, console: Console | None = None) -> str:
    """`lorafn get functions|backbones [-o yaml|json]`: the text to print."""
    rows = function_rows(status) if kind == "functions" else backbone_rows(status)
    if output == "json":
        return json.dumps({"kind": "List", "items": rows}, indent=2)
    if output == "yaml":
        import yaml

        return yaml.safe_dump({"kind": "List", "items": rows}, sort_keys=False)
    if kind == "functions":
        table = Table("NAME", "BACKBONE", "RANK", "TARGETS", "PHASE", "WORKERS", "LAST COLD START", "WAITING",
                      box=None, pad_edge=False)  # fmt: skip
        for f in status.functions:
            table.add_row(
                f.name, f.backbone, f.rank, f.targets, f.phase, str(len(f.workers)), _cold(f),
                f.not_ready_because,
            )  # fmt: skip
    else:
        table = Table("NAME", "DTYPE", "FUNCTIONS", "STANDBY", "MODEL DIR", box=None, pad_edge=False)
        for b in status.backbones:
            table.add_row(b.name, b.dtype, str(b.functions), str(b.standby), b.model_dir)
    console = console or Console(width=200)
    with console.capture() as captured:
        console.print(table)
    return captured.get()
