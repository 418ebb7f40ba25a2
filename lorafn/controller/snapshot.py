"""Build the policy's `Snapshot` from Redis: registered functions and backbones, live workers (their
heartbeats), queue depths, arrival rates, function status, and the GPU inventory.

Sizing a function (its adapter shape and one worker's reservation) reads its adapter's
`adapter_config.json` and safetensors header and the backbone's `config.json` (torch-free, shared with
the operator and `lorafn apply`); the result is cached per (adapter dir, backbone dir, mtimes).
A function whose adapter cannot be read is left out of the snapshot and reported in `problems`
(the driver writes the reason into its status, and the gateway answers its requests with it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorafn.api import LoRAFunctionSpec
from lorafn.api.adapters import AdapterProblem, validate_adapter
from lorafn.api.sizing import MiB, kv_budget_bytes, kv_bytes_per_token, lora_bytes, parse_shape_key
from lorafn.api.specs import BackboneSpec
from lorafn.controller.policy.charge import (
    OVERHEAD_MARGIN_BYTES,
    SizeReport,
    charge_bytes,
    learned_overhead,
    overhead_floor,
    park_sizes,
)
from lorafn.controller.policy.model import GPU, Backbone, Costs, Function, Snapshot, Worker
from lorafn.store import Keys, Store, batches, combine, control, stats, workers
from lorafn.store.backbones import BackboneRecord, get_backbone, list_backbones
from lorafn.store.registry import FunctionRecord, get_function, list_functions

log = logging.getLogger("lorafn.controller")

ARRIVAL_WINDOW_S = 60
# the horizon of `Function.long_arrival_rate` (offload victims' value, `offload.victim_rate`): its buckets
# before the last ARRIVAL_WINDOW_S change only when a bucket completes, so they are read once per bucket
LONG_ARRIVAL_WINDOW_S = 600


@dataclass(frozen=True)
class SizingConfig:
    """How big a worker is, before it reports its own size."""

    worker_overhead_bytes: int  # CUDA context + cuBLAS workspace + graph pool (docs/benchmarks.md)
    default_kv_bytes: int  # KV budget of a function whose spec names none
    fresh_start_s: float = 10.0  # measured spawn -> serving (updated from lifecycle events)
    bind_s: float = 0.1  # measured bind -> serving of a standby prepared for the shape
    capture_s: float = 0.0  # graph capture when a standby is not prepared for the shape
    adapter_load_s: float | None = None  # the adapter-load part of bind_s (None: all of it)
    # every worker loads its own copy of the backbone (no sharing, the replay's ablation): those weights
    # are part of each worker's size, and a GPU holds no shared copy
    private_weights: bool = False
    # a bound GPU worker whose decode graphs are captured is charged its own reported size
    # (`policy.charge.charge_bytes`); off: the learned overhead, as every other worker
    charge_own_reports: bool = True


@dataclass(frozen=True)
class FunctionSize:
    """One worker of a function: its adapter shape, KV budget and LoRA tensors, plus the per-worker
    overhead (context, kernels, workspaces, activations) as the controller knows it this round."""

    shape: str
    kv_bytes: int
    lora_bytes: int
    overhead_bytes: int = 0
    weights_bytes: int = 0  # its own copy of the backbone (SizingConfig.private_weights), else 0

    @property
    def mem_bytes(self) -> int:
        return self.overhead_bytes + self.kv_bytes + self.lora_bytes + self.weights_bytes


@dataclass
class LiveView:
    """What `SnapshotReader.live_workers` reads from the heartbeats besides the workers themselves."""

    workers: list[Worker]
    overhead_reports: list[int]  # the driver-counted overheads of standby and serving GPU workers
    kv_reports: dict[str, int]  # worker id -> its KV cache (or granted budget) bytes
    sizes: dict[str, SizeReport]  # worker id -> its size report (driver-counted GPU workers only)
    settled_overheads: list[int]  # overheads of those whose decode graphs are captured
    driver_free: dict[str, int]  # gpu -> the device's free bytes at the latest heartbeat that says
    # worker id -> what parking it frees now (parked: what unparking takes back), its `park_release_bytes`
    park_release: dict[str, int] = field(default_factory=dict)


@dataclass
class SnapshotReader:
    store: Store
    keys: Keys
    sizing: SizingConfig
    heartbeat_ttl_s: float
    _sizes: dict[tuple[Any, ...], FunctionSize] = field(default_factory=dict)
    _model_configs: dict[str, dict[str, Any]] = field(default_factory=dict)
    _weights_bytes: dict[str, int] = field(default_factory=dict)
    # function -> arrivals in the long horizon's buckets before the last minute's, as of bucket `_older_at`
    _older: dict[str, int] = field(default_factory=dict)
    _older_at: int = -1
    problems: dict[str, str] = field(default_factory=dict)
    records: dict[str, FunctionRecord] = field(default_factory=dict)
    backbone_records: dict[str, BackboneRecord] = field(default_factory=dict)
    sizes: dict[str, FunctionSize] = field(default_factory=dict)
    # this round's per-worker overhead: learned from the workers' reports, else the configured one
    overhead_bytes: int = 0
    # this round's least overhead a settled worker is charged (`charge.overhead_floor`)
    floor_overhead_bytes: int = 0

    def __post_init__(self) -> None:
        self.overhead_bytes = self.sizing.worker_overhead_bytes

    # -- sizing ----------------------------------------------------------------------------------
    def backbone_bytes(self, model_dir: str) -> int:
        """Bytes of a backbone's weights (its safetensors files), read once per directory."""
        if model_dir not in self._weights_bytes:
            self._weights_bytes[model_dir] = sum(
                p.stat().st_size for p in Path(model_dir).glob("*.safetensors")
            )
        return self._weights_bytes[model_dir]

    def model_config(self, model_dir: str) -> dict[str, Any]:
        if model_dir not in self._model_configs:
            self._model_configs[model_dir] = json.loads((Path(model_dir) / "config.json").read_text())
        return self._model_configs[model_dir]

    def size_function(self, record: FunctionRecord, backbone: BackboneRecord) -> FunctionSize:
        """The adapter shape and one worker's reservation (AdapterProblem/OSError when unreadable)."""
        adapter, model = Path(record.adapter_dir), Path(backbone.model_dir)
        weights = adapter / "adapter_model.safetensors"
        stamp = tuple(
            p.stat().st_mtime_ns if p.exists() else 0 for p in (weights, adapter / "adapter_config.json")
        )
        key = (str(adapter), str(model), backbone.dtype, json.dumps(record.spec, sort_keys=True), stamp)
        if key not in self._sizes:
            info = validate_adapter(adapter, model)
            cfg = self.model_config(backbone.model_dir)
            spec = LoRAFunctionSpec.model_validate(record.spec)
            kv = kv_budget_bytes(
                spec.resources, kv_bytes_per_token(cfg, backbone.dtype), self.sizing.default_kv_bytes
            )
            lora = lora_bytes(info.ranks, cfg, backbone.dtype)
            self._sizes[key] = FunctionSize(
                info.shape_key, kv, lora, weights_bytes=self.private_bytes(backbone)
            )
        return dataclasses.replace(self._sizes[key], overhead_bytes=self.overhead_bytes)

    def private_bytes(self, backbone: BackboneRecord | None) -> int:
        """The backbone weights a worker holds privately: all of them without sharing, else none."""
        if backbone is None or not self.sizing.private_weights:
            return 0
        return self.backbone_bytes(backbone.model_dir)

    def standby_bytes(self, shape: str | None, backbone: BackboneRecord) -> int:
        """A standby of `shape`: overhead + default KV budget + LoRA buffers of the shape (+ its own
        weights without sharing)."""
        lora = 0
        if shape:
            cfg = self.model_config(backbone.model_dir)
            lora = lora_bytes(parse_shape_key(shape), cfg, backbone.dtype)
        return self.overhead_bytes + self.sizing.default_kv_bytes + lora + self.private_bytes(backbone)

    def standby_kv_bytes(self, mem_bytes: int, shape: str | None, backbone: str) -> int:
        """The KV budget of a standby granted `mem_bytes`: the planner sizes a standby to take the largest
        registered function of its shape (planner.standby_bytes), so its KV cache is the grant less the
        overhead and the shape's LoRA buffers, never below the default, in whole MiB (what `--kv-budget-mib`
        carries; rounded up, so that the standby holds every function it was sized for)."""
        record = self.backbone_records.get(backbone)
        default = self.sizing.default_kv_bytes
        if record is None:
            return _whole_mib(default)
        rest = self.standby_bytes(shape, record) - default
        return _whole_mib(max(default, mem_bytes - rest))

    # -- the snapshot ----------------------------------------------------------------------------
    def read(self, gpus: list[GPU], starting: list[Worker], costs: Costs | None = None) -> Snapshot:
        """One round's view. `gpus`: the inventory (the caller knows its devices); `starting`: workers
        started but not yet heartbeating (only the starter knows them)."""
        store, keys = self.store, self.keys
        names: list[str] = store.run(list_functions(keys))
        bb_names: list[str] = store.run(list_backbones(keys))
        records = store.run(combine(*(get_function(keys, n) for n in names))) if names else ()
        bb_records = store.run(combine(*(get_backbone(keys, n) for n in bb_names))) if bb_names else ()
        self.records = {r.function: r for r in records if r is not None}
        self.backbone_records = {r.name: r for r in bb_records if r is not None}
        now_s = time.time()
        fn_names = sorted(self.records)
        depths, status, arrivals, backlogs = store.run(
            combine(
                control.queue_depths(keys, fn_names),
                control.statuses(keys, fn_names),
                combine(*(stats.arrivals(keys, f, now_s, ARRIVAL_WINDOW_S) for f in fn_names)),
                batches.backlogs(keys),  # the batch runner's unsubmitted requests (docs/batch.md)
            )
        )
        view = self.live_workers({g.id for g in gpus})
        self.overhead_bytes = learned_overhead(view.overhead_reports, self.sizing.worker_overhead_bytes)
        self.floor_overhead_bytes = overhead_floor(
            view.settled_overheads, self.overhead_bytes - OVERHEAD_MARGIN_BYTES
        )
        gpus = [
            dataclasses.replace(g, driver_free_bytes=view.driver_free[g.id])
            if g.driver_free_bytes is None and g.id in view.driver_free
            else g
            for g in gpus
        ]
        older = self.older_arrivals(fn_names, now_s)
        self.problems = {}
        self.sizes = {}
        functions: list[Function] = []
        for i, name in enumerate(fn_names):
            record = self.records[name]
            spec = LoRAFunctionSpec.model_validate(record.spec)
            backbone = self.backbone_records.get(spec.backbone)
            if backbone is None:
                self.problems[name] = f"backbone {spec.backbone!r} is not registered"
                continue
            try:
                size = self.size_function(record, backbone)
            except (AdapterProblem, OSError, ValueError) as e:
                self.problems[name] = f"adapter: {e}"
                continue
            self.sizes[name] = size
            st = status.get(name, {})
            failed_at = int(st.get("last_failure_at_ms") or 0)
            functions.append(
                Function(
                    name=name,
                    backbone=spec.backbone,
                    shape=size.shape,
                    mem_bytes=size.mem_bytes,
                    min_replicas=spec.scaling.min_replicas,
                    max_replicas=spec.scaling.max_replicas,
                    keep_alive_s=float(spec.scaling.keep_alive_seconds),
                    ttft_slo_ms=float(spec.slo.ttft_ms),
                    arrival_rate=sum(arrivals[i]) / float(ARRIVAL_WINDOW_S),
                    long_arrival_rate=(older.get(name, 0) + sum(arrivals[i])) / float(LONG_ARRIVAL_WINDOW_S),
                    queued=depths[name].queued,
                    oldest_wait_s=depths[name].oldest_wait_ms / 1000,
                    start_failures=int(st.get("start_failures") or 0),
                    last_failure_s=max(0.0, now_s - failed_at / 1000) if failed_at else None,
                    last_failure=st.get("last_failure", ""),
                    lora_bytes=size.lora_bytes,
                    batch_backlog=backlogs.get(name, 0),
                    kv_bytes=size.kv_bytes,
                )
            )
        backbones = []
        for name, rec in sorted(self.backbone_records.items()):
            spec = (
                BackboneSpec.model_validate(rec.spec)
                if rec.spec
                else BackboneSpec.model_validate({"model": {"uri": f"file://{rec.model_dir}"}})
            )
            size = self.backbone_bytes(rec.model_dir)
            backbones.append(
                Backbone(
                    name=name,
                    bytes=size,
                    min_standby_per_gpu=spec.warm_pool.min_standby,
                    max_standby_per_gpu=spec.warm_pool.max_standby,
                    adapter_slots=spec.adapter_slots,
                )
            )
        if costs is None:
            shapes = {f.shape for f in functions}
            standby: dict[str | None, int] = {}
            for s in shapes:
                bb = next(self.backbone_records[f.backbone] for f in functions if f.shape == s)
                standby[s] = self.standby_bytes(s, bb)
            # A shape-agnostic standby is sized to take any registered function: the largest LoRA.
            largest_lora = max((size.lora_bytes for size in self.sizes.values()), default=0)
            largest_weights = max((size.weights_bytes for size in self.sizes.values()), default=0)
            standby[None] = (
                self.overhead_bytes + self.sizing.default_kv_bytes + largest_lora + largest_weights
            )
            costs = Costs(
                fresh_start_s=self.sizing.fresh_start_s,
                bind_s=self.sizing.bind_s,
                capture_s=self.sizing.capture_s,
                adapter_load_s=self.sizing.adapter_load_s,
                default_standby_bytes=standby[None],
                standby_bytes=standby,
            )
        # A worker reports its own reservation once it knows it; until then (and if it reports less
        # than it was granted) the account uses what the controller granted it. A bound GPU worker whose
        # decode graphs are captured is charged by its own driver-counted size (`charge.charge_bytes`).
        live = []
        for w in view.workers:
            size = self.sizes.get(w.function or "")
            if size is not None:
                # a worker granted more KV for an offline batch (`PolicyConfig.batch_kv_bytes`) holds it too
                estimate = size.mem_bytes + (max(0, w.kv_bytes - size.kv_bytes) if w.kv_grant else 0)
                hb_release = view.park_release.get(w.id, 0)
                if w.state == "bound" and (w.parked or hb_release > 0):
                    # parking (`PolicyConfig.park_idle`): a parked worker is charged what it still holds, and
                    # each bound one says what a park (an unpark) gives back (takes back) in the account
                    own = self.sizing.charge_own_reports
                    charge, release = park_sizes(
                        view.sizes.get(w.id) if own else None,
                        estimate if own else max(w.mem_bytes, estimate),
                        self.floor_overhead_bytes,
                        hb_release,
                        w.parked,
                    )
                    live.append(dataclasses.replace(w, mem_bytes=charge, release_bytes=release))
                    continue
                if w.state == "bound" and self.sizing.charge_own_reports:
                    charge = charge_bytes(view.sizes.get(w.id), estimate, self.floor_overhead_bytes)
                    live.append(dataclasses.replace(w, mem_bytes=charge))
                    continue
            else:
                # a standby granted a larger KV budget than the default (sized for the largest registered
                # function of its shape) counts it, or it would never look big enough to take that function
                estimate = self.standby_estimate(costs, w.shape, _whole_mib(view.kv_reports.get(w.id, 0)))
            live.append(dataclasses.replace(w, mem_bytes=max(w.mem_bytes, estimate)))
        live = busy_since_heartbeat(live, {name: depths[name].pending for name in depths})
        seen = {w.id for w in live}
        all_workers = live + self.sized_starting([w for w in starting if w.id not in seen], costs)
        return Snapshot(
            now_s=now_s, gpus=tuple(gpus), backbones=tuple(backbones), workers=tuple(all_workers),
            functions=tuple(functions), costs=costs,
        )  # fmt: skip

    def older_arrivals(self, names: list[str], now_s: float) -> dict[str, int]:
        """Arrivals per function in the long horizon before the last `ARRIVAL_WINDOW_S` (complete buckets),
        read again only when a new bucket has begun (one read per bucket, not per round)."""
        bucket = int(now_s // stats.ARRIVALS_BUCKET_S)
        missing = [n for n in names if n not in self._older]
        if bucket != self._older_at:
            self._older, self._older_at, missing = {}, bucket, list(names)
        if missing:
            then, span = now_s - ARRIVAL_WINDOW_S, LONG_ARRIVAL_WINDOW_S - ARRIVAL_WINDOW_S
            counts = self.store.run(combine(*(stats.arrivals(self.keys, n, then, span) for n in missing)))
            self._older.update({n: sum(c) for n, c in zip(missing, counts, strict=True)})
        return self._older

    def standby_estimate(self, costs: Costs, shape: str | None, kv_bytes: int) -> int:
        """A standby of ``shape`` whose KV budget is ``kv_bytes``: the shape's standby size, plus what that
        budget has beyond the default (a standby sized for a function of a larger budget)."""
        return costs.standby_bytes_for(shape) + max(0, kv_bytes - self.sizing.default_kv_bytes)

    def sized_starting(self, starting: list[Worker], costs: Costs) -> list[Worker]:
        """Workers started and not yet heartbeating. A pool worker of size 0 is a pod asked for before this
        controller started (the Kubernetes executor's placeholder: it knows the pod's count, not its grant;
        a function's pods asked then are not shown at all, their GPU is not known); it gets the size this
        controller would ask for it: a standby of its shape with the KV budget recorded for its GPU and
        shape (`<bb>:standby_kv`, what the operator starts pool pods with; the default when none is
        recorded). Else a GPU full of starting pods looks free."""
        unknown = sorted({w.backbone for w in starting if w.mem_bytes == 0 and w.function is None})
        recorded: dict[str, dict[tuple[str, str | None], int]] = {}
        if unknown:
            budgets = self.store.run(combine(*(control.standby_kv(self.keys, b) for b in unknown)))
            recorded = dict(zip(unknown, budgets, strict=True))
        out = []
        for w in starting:
            if w.mem_bytes == 0 and w.function is None:
                kv_mib = recorded.get(w.backbone, {}).get((w.gpu, w.shape))
                mem = self.standby_estimate(costs, w.shape, kv_mib * MiB if kv_mib else 0)
                w = dataclasses.replace(w, mem_bytes=mem)
            out.append(w)
        return out

    def live_workers(self, gpu_ids: set[str]) -> LiveView:
        """Workers whose heartbeat is fresh, as the policy sees them (those on unknown GPUs are left out),
        the overheads the GPU workers among them report (whole process by the driver's count, minus
        their KV cache and LoRA tensors: `learned_overhead`'s input; those whose decode graphs are
        captured apart: `overhead_floor`'s), each one's KV cache bytes and size report, and each GPU's free
        memory by the driver at the latest heartbeat that carries it."""
        store, keys = self.store, self.keys
        ids = store.run(workers.worker_ids(keys))
        info = store.run(workers.worker_info(keys, ids)) if ids else {}
        now_ms = store.run(workers.server_time_ms())
        ttl_ms = self.heartbeat_ttl_s * 1000
        out = []
        overhead_reports: list[int] = []
        settled: list[int] = []
        kv_reports: dict[str, int] = {}
        sizes: dict[str, SizeReport] = {}
        driver_free: dict[str, tuple[int, int]] = {}  # gpu -> (heartbeat ms, free bytes)
        park_release: dict[str, int] = {}
        # GPUs with a live worker the driver does not count (a container hiding host pids): how much of its
        # charge the device's free bytes already show is not known there, so those GPUs get no guard
        unreported: set[str] = set()
        for wid, h in sorted(info.items()):
            if now_ms - int(h.get("heartbeat") or now_ms) > ttl_ms:
                continue
            gpu = h.get("gpu", "")
            if gpu not in gpu_ids:
                continue
            state = h.get("state", "serving")
            function = h.get("function") or None
            policy_state = {"standby": "standby", "draining": "draining", "starting": "starting"}.get(
                state, "bound"
            )
            running = int(h.get("running") or 0)
            # parked (`PolicyConfig.park_idle`): only a bound worker that runs nothing is (the policy's model
            # refuses anything else); its report holds no KV and no graph pools: not a peer's overhead
            parked = str(h.get("parked", "")) == "1" and policy_state == "bound" and running == 0
            with contextlib.suppress(ValueError):
                release = int(h.get("park_release_bytes") or 0)
                if release > 0:
                    park_release[wid] = release
            reported = 0
            if h.get("mem_source") == "driver":
                with contextlib.suppress(ValueError):
                    report = SizeReport(
                        int(h.get("mem_bytes") or 0),
                        int(h.get("kv_bytes") or 0),
                        int(h.get("lora_bytes") or 0),
                        self.private_bytes(self.backbone_records.get(h.get("backbone", ""))),
                        # a worker that does not say (older runtime) may still capture graphs
                        settled=str(h.get("graphs_pending", "")) == "0",
                    )
                    sizes[wid], reported = report, report.whole_bytes
                    if state in ("standby", "serving") and not parked:
                        overhead_reports.append(report.overhead_bytes)
                        if report.settled:
                            settled.append(report.overhead_bytes)
            if not reported:
                unreported.add(gpu)
            with contextlib.suppress(ValueError):
                if h.get("device_free_bytes") not in (None, ""):
                    beat = int(h.get("heartbeat") or 0)
                    if beat >= driver_free.get(gpu, (-1, 0))[0]:
                        driver_free[gpu] = (beat, int(h["device_free_bytes"]))
            with contextlib.suppress(ValueError):
                # the budget it was granted where it says (its cache is whole KV blocks: a little less)
                kv_reports[wid] = max(int(h.get("kv_bytes") or 0), int(h.get("kv_budget_bytes") or 0))
            if policy_state == "standby":
                function = None
            elif policy_state == "bound" and not function:
                continue
            # the functions a worker with adapter slots took in besides its first (workers.heartbeat)
            joined = tuple(
                f for f in (h.get("functions") or "").split(",") if f and f != function
            ) if policy_state == "bound" else ()  # fmt: skip
            free_slots = 0
            with contextlib.suppress(ValueError):
                free_slots = max(0, int(h.get("free_slots") or 0))
            out.append(
                Worker(
                    id=wid,
                    gpu=gpu,
                    backbone=h.get("backbone", ""),
                    state=policy_state,  # type: ignore[arg-type]
                    shape=h.get("shape") or None,
                    function=function,
                    mem_bytes=int(h.get("mem_bytes") or 0),
                    idle_s=float(h.get("idle_s") or 0.0),
                    running=running,
                    age_s=max(0.0, (now_ms - int(h.get("started") or 0) * 1000) / 1000)
                    if h.get("started")
                    else 0.0,
                    # a standby's pre-loaded adapter (runtime.standby); a bound one's is its own
                    preloaded=(h.get("preloaded") or None) if policy_state == "standby" else None,
                    reported_bytes=reported,
                    parked=parked,
                    # a runtime that can park says what a park frees (an older one would never answer)
                    parkable=h.get("park_release_bytes") not in (None, ""),
                    kv_bytes=kv_reports.get(wid, 0),
                    kv_grant=str(h.get("kv_grant", "")) == "1",
                    kv_limited=_kv_limited(h),
                    joined=joined,
                    free_slots=free_slots if policy_state == "bound" else 0,
                )
            )
        return LiveView(
            out,
            overhead_reports,
            kv_reports,
            sizes,
            settled,
            {g: free for g, (_, free) in driver_free.items() if g not in unreported},
            park_release,
        )


def _whole_mib(n: int) -> int:
    return -(-int(n) // MiB) * MiB


def default_sizing(device: str) -> SizingConfig:
    """Defaults per device kind (measured: docs/benchmarks.md, "Per-worker memory" and "Cold start")."""
    if device.startswith("cuda"):
        return SizingConfig(worker_overhead_bytes=560 * MiB, default_kv_bytes=256 * MiB, fresh_start_s=20.0)
    return SizingConfig(worker_overhead_bytes=64 * MiB, default_kv_bytes=32 * MiB, fresh_start_s=10.0)


def busy_since_heartbeat(workers: list[Worker], in_flight: dict[str, int]) -> list[Worker]:
    """``workers`` with the requests they took since their last heartbeat. A heartbeat is up to a second old;
    ``in_flight`` (a function's delivered, unacknowledged requests: `QueueDepth.pending`, read this round) is
    not. Where a function has more in flight than its workers' heartbeats say they run, its serving workers
    that look idle may hold them: counted running (idle 0), so that this round neither parks nor stops one
    that is busy (measured on the H100: a third of the parks planned from heartbeats alone were refused for
    a request that had just arrived). Which of several took it is not known: all of them, for one round."""
    running: dict[str, int] = {}  # draining workers' requests are in flight too
    for w in workers:
        if w.function:
            running[w.function] = running.get(w.function, 0) + w.running
    busy = {f for f, n in in_flight.items() if n > running.get(f, 0)}
    if not busy:
        return workers
    return [
        dataclasses.replace(w, running=1, idle_s=0.0)
        if w.state == "bound" and w.function in busy and w.running == 0 and not w.parked
        else w
        for w in workers
    ]


def _kv_limited(h: dict[str, str]) -> bool:
    """Whether a worker's KV cache, not its batch slots, bounds the requests it holds (its heartbeat's
    `kv_cap` below its `slot_cap`); True where it does not say (an older runtime, the read cap off)."""
    try:
        return int(h["kv_cap"]) < int(h["slot_cap"])
    except (KeyError, ValueError):
        return True
