"""What the controller sees: one immutable snapshot of GPUs, backbones, workers and functions.

The driver builds a `Snapshot` each round (from Redis, NVML and the specs); `decide` turns it into
a `Plan`. Every byte count is an integer; every duration is in seconds; rates are requests/s.
Constructors check their input and raise ValueError naming the offending field and value, so a
bad snapshot fails at the edge, not deep inside the policy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from lorafn.api.sizing import parse_shape_key

WorkerState = Literal["starting", "standby", "bound", "draining"]
WORKER_STATES: tuple[str, ...] = ("starting", "standby", "bound", "draining")


def shape_holds(slots_shape: str | None, shape: str) -> bool:
    """Whether adapter buffers of shape key ``slots_shape`` hold an adapter of shape key ``shape``: every
    projection it targets is there with at least its rank (the runtime zero-pads the rest, `fits_shape`).
    False for None or a key that does not parse."""
    if not slots_shape or not shape:
        return False
    try:
        have, want = parse_shape_key(slots_shape), parse_shape_key(shape)
    except ValueError:
        return False
    return all(have.get(module, 0) >= rank for module, rank in want.items())


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_bytes(owner: str, name: str, value: object) -> None:
    if not _is_int(value) or value < 0:  # type: ignore[operator]
        raise ValueError(f"{owner}.{name} must be an integer >= 0 (bytes), got {value!r}")


def _check_non_negative(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{owner}.{name} must be a number >= 0, got {value!r}")


@dataclass(frozen=True)
class GPU:
    """One GPU: its size and what is on it besides workers.

    ``backbones``: backbone name -> bytes resident on this GPU (loaded by its backbone server).
    ``other_bytes``: measured use not explained by our account (NVML used minus backbones and
    worker reservations; other tenants, fragmentation). ``reserve_bytes``: kept free on purpose.
    ``driver_free_bytes``: the device's free memory as the driver counts it (NVML), read by a worker on it
    at its latest heartbeat (None: no reading, e.g. CPU): the account's second guard
    (`account.accounts`).
    """

    id: str
    node: str
    total_bytes: int
    backbones: Mapping[str, int] = field(default_factory=dict)
    other_bytes: int = 0
    reserve_bytes: int = 0
    driver_free_bytes: int | None = None

    def __post_init__(self) -> None:
        if not self.id:
            raise ValueError("GPU.id must be a non-empty string")
        _check_bytes(f"GPU {self.id}", "total_bytes", self.total_bytes)
        if self.driver_free_bytes is not None:
            _check_bytes(f"GPU {self.id}", "driver_free_bytes", self.driver_free_bytes)
        _check_bytes(f"GPU {self.id}", "other_bytes", self.other_bytes)
        _check_bytes(f"GPU {self.id}", "reserve_bytes", self.reserve_bytes)
        for name, size in self.backbones.items():
            _check_bytes(f"GPU {self.id}", f"backbones[{name!r}]", size)


@dataclass(frozen=True)
class Worker:
    """One worker process (one CUDA context) and its whole GPU reservation.

    ``state``: starting (process coming up; ``function`` set = it will serve that function,
    None = it will be a standby), standby (tenant-neutral, waiting for a bind), bound (serving
    ``function``), draining (stopping; its memory is still in use).
    ``shape``: the adapter shape whose graphs it has ready (None = shape-agnostic).
    ``mem_bytes``: CUDA context + KV budget + LoRA buffers + graph pool.
    ``idle_s``: seconds since its last request finished; ``running``: requests in flight;
    ``age_s``: seconds since it was started. ``preloaded``: for a standby, the function whose adapter
    it holds in its LoRA buffers (pre-loading, DESIGN idea 4): a bind to that function needs no load.
    ``room_for``: for a draining worker stopped by an offload, the function whose start waits for its
    memory (that start is planned once the process has exited and the memory is really free; until then
    the next rounds count this memory as coming for that function instead of offloading more).
    ``reported_bytes``: what the driver counts its process holding now (0: no such figure, or not yet):
    ``mem_bytes`` less this is memory the account promised it that the device does not show used yet.
    ``parked``: a bound worker that released its KV cache and graph pools (`PolicyConfig.park_idle`); its
    ``mem_bytes`` is then its parked charge, and it serves nothing until unparked. ``release_bytes``: for a
    bound worker, what parking it would give back to the account; for a parked one, what unparking it takes
    back (0: not known; `PolicyConfig.park_release_fraction` of its charge stands in). ``parkable``: False
    for a worker no Park may be planned for (its runtime cannot park, or it refused or did not answer a park
    lately: the driver says so); it can still be stopped, and unparked when parked. ``kv_bytes``: its KV
    budget as it reports it (0: not known); ``kv_grant``: True while it holds more KV than it started with,
    granted for an offline batch or a burst (`PolicyConfig.batch_kv_bytes`, ``burst_kv_bytes``).
    ``joined``: the functions a worker with adapter slots serves besides ``function`` (they joined it,
    docs/runtime.md#adapter-slots); ``free_slots``: its empty adapter slots (0: none, or no slots).
    ``kv_limited``: its KV cache, not its batch slots (``max_running`` or the TPOT SLO's batch), bounds the
    requests it holds at once (True where it does not say): only then does more KV serve a burst sooner.
    """

    id: str
    gpu: str
    backbone: str
    state: WorkerState
    shape: str | None
    function: str | None
    mem_bytes: int
    idle_s: float = 0.0
    running: int = 0
    age_s: float = 0.0
    preloaded: str | None = None
    room_for: str | None = None
    reported_bytes: int = 0
    parked: bool = False
    release_bytes: int = 0
    parkable: bool = True
    kv_bytes: int = 0
    kv_grant: bool = False
    kv_limited: bool = True
    joined: tuple[str, ...] = ()
    free_slots: int = 0

    @property
    def functions(self) -> tuple[str, ...]:
        """Every function it serves: ``function`` first, then ``joined``."""
        return ((self.function,) if self.function else ()) + self.joined

    def __post_init__(self) -> None:
        owner = f"Worker {self.id}"
        _check_bytes(owner, "kv_bytes", self.kv_bytes)
        object.__setattr__(self, "joined", tuple(self.joined))
        if self.joined and (self.state != "bound" or self.function in self.joined or not all(self.joined)):
            raise ValueError(
                f"{owner}.joined: functions besides its own on a bound worker only, got {self.joined!r} on a "
                f"{self.state} worker serving {self.function!r}"
            )
        if not _is_int(self.free_slots) or self.free_slots < 0:
            raise ValueError(f"{owner}.free_slots must be an integer >= 0, got {self.free_slots!r}")
        if self.parked and self.state != "bound":
            raise ValueError(
                f"{owner}.parked must be False on a {self.state} worker (only a bound one parks)"
            )
        if self.parked and self.running:
            raise ValueError(f"{owner}: a parked worker runs nothing, got running={self.running!r}")
        _check_bytes(owner, "release_bytes", self.release_bytes)
        if not self.id:
            raise ValueError("Worker.id must be a non-empty string")
        if self.state not in WORKER_STATES:
            raise ValueError(f"{owner}.state must be one of {WORKER_STATES}, got {self.state!r}")
        if self.state == "bound" and not self.function:
            raise ValueError(f"{owner}.function must be set for a bound worker, got {self.function!r}")
        if self.state == "standby" and self.function is not None:
            raise ValueError(f"{owner}.function must be None for a standby worker, got {self.function!r}")
        if self.preloaded is not None and (not isinstance(self.preloaded, str) or not self.preloaded):
            raise ValueError(f"{owner}.preloaded must be None or a function name, got {self.preloaded!r}")
        if self.room_for is not None and (self.state != "draining" or not self.room_for):
            raise ValueError(
                f"{owner}.room_for must be None, or a function name on a draining worker; got "
                f"{self.room_for!r} on a {self.state} worker"
            )
        _check_bytes(owner, "mem_bytes", self.mem_bytes)
        _check_bytes(owner, "reported_bytes", self.reported_bytes)
        _check_non_negative(owner, "idle_s", self.idle_s)
        _check_non_negative(owner, "age_s", self.age_s)
        if not _is_int(self.running) or self.running < 0:
            raise ValueError(f"{owner}.running must be an integer >= 0, got {self.running!r}")


@dataclass(frozen=True)
class Function:
    """One LoRAFunction as the policy needs it: spec, recent load and start history.

    ``shape``: its adapter shape key (e.g. "q_proj:16,k_proj:16,..."); ``mem_bytes``: what one
    of its workers reserves. ``arrival_rate``: recent requests/s; ``queued``: requests waiting;
    ``oldest_wait_s``: how long the oldest has waited. ``start_failures``: consecutive failed
    starts, ``last_failure_s``: seconds since the last one, ``last_failure``: its message.
    ``lora_bytes``: its adapter's tensors (part of ``mem_bytes``; what pre-loading it into a standby
    occupies there; 0 = unknown). ``batch_backlog``: offline batch requests the batch runner holds but has
    not submitted yet (docs/batch.md): demand for more workers from the warm pool, never urgent.
    ``long_arrival_rate``: requests/s over a longer horizon than ``arrival_rate``'s (minutes; None: not
    known): what ranks idle bound workers for offloading (`offload.victim_rate`). ``kv_bytes``: the KV budget
    its spec gives each worker (part of ``mem_bytes``; 0 = not known): what a worker granted more KV for a
    batch returns to.
    """

    name: str
    backbone: str
    shape: str
    mem_bytes: int
    min_replicas: int = 0
    max_replicas: int = 1
    keep_alive_s: float = 60.0
    ttft_slo_ms: float | None = None
    arrival_rate: float = 0.0
    queued: int = 0
    oldest_wait_s: float = 0.0
    start_failures: int = 0
    last_failure_s: float | None = None
    last_failure: str = ""
    lora_bytes: int = 0
    batch_backlog: int = 0
    long_arrival_rate: float | None = None
    kv_bytes: int = 0

    def __post_init__(self) -> None:
        owner = f"Function {self.name}"
        if not self.name:
            raise ValueError("Function.name must be a non-empty string")
        _check_bytes(owner, "mem_bytes", self.mem_bytes)
        _check_bytes(owner, "lora_bytes", self.lora_bytes)
        _check_bytes(owner, "kv_bytes", self.kv_bytes)
        for name in ("min_replicas", "queued", "start_failures", "batch_backlog"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise ValueError(f"{owner}.{name} must be an integer >= 0, got {value!r}")
        if not _is_int(self.max_replicas) or self.max_replicas < max(1, self.min_replicas):
            raise ValueError(
                f"{owner}.max_replicas must be an integer >= max(1, min_replicas={self.min_replicas}), "
                f"got {self.max_replicas!r}"
            )
        for name in ("keep_alive_s", "arrival_rate", "oldest_wait_s"):
            _check_non_negative(owner, name, getattr(self, name))
        if self.long_arrival_rate is not None:
            _check_non_negative(owner, "long_arrival_rate", self.long_arrival_rate)
        if self.last_failure_s is not None:
            _check_non_negative(owner, "last_failure_s", self.last_failure_s)


@dataclass(frozen=True)
class Backbone:
    """A base model: its size, its warm-pool bounds per GPU, and the GPUs it may use.

    ``gpus``: GPU ids it is placed on (allowed); empty = any GPU. A GPU *holds* the backbone when
    it is in ``gpus`` (or ``gpus`` is empty) and the GPU lists it in ``GPU.backbones`` (loaded).
    ``adapter_slots``: adapters one worker of it serves at once (`BackboneSpec.adapter_slots`; 1: one
    function per process): its workers start with that many slots, and a cold start of a function joins a
    worker of its namespace that has one free (`decide`).
    """

    name: str
    bytes: int
    min_standby_per_gpu: int = 0
    max_standby_per_gpu: int = 4
    gpus: tuple[str, ...] = ()
    adapter_slots: int = 1

    def __post_init__(self) -> None:
        owner = f"Backbone {self.name}"
        if not self.name:
            raise ValueError("Backbone.name must be a non-empty string")
        _check_bytes(owner, "bytes", self.bytes)
        for name in ("min_standby_per_gpu", "max_standby_per_gpu"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise ValueError(f"{owner}.{name} must be an integer >= 0, got {value!r}")
        if not _is_int(self.adapter_slots) or self.adapter_slots < 1:
            raise ValueError(f"{owner}.adapter_slots must be an integer >= 1, got {self.adapter_slots!r}")
        if self.min_standby_per_gpu > self.max_standby_per_gpu:
            raise ValueError(
                f"{owner}.min_standby_per_gpu ({self.min_standby_per_gpu}) must be <= "
                f"max_standby_per_gpu ({self.max_standby_per_gpu})"
            )
        object.__setattr__(self, "gpus", tuple(self.gpus))


@dataclass(frozen=True)
class Costs:
    """Measured latencies and sizes the value function uses.

    ``fresh_start_s``: spawn -> serving for a fresh worker process (also the time to refill one
    standby). ``bind_s``: bind -> serving for a standby prepared for the function's shape (adapter
    load). ``capture_s``: extra for a standby not prepared for that shape (graph capture).
    ``adapter_load_s``: the part of ``bind_s`` that loads the adapter (file read, copy into the
    buffers): what a standby that pre-loaded the function's adapter saves (None: all of ``bind_s``).
    ``standby_bytes``: reservation of a standby prepared for a shape (key None = shape-agnostic);
    shapes not listed use ``default_standby_bytes``. A standby is never smaller than the largest
    ``mem_bytes`` of the functions it is kept for, or it could not take them.
    """

    fresh_start_s: float
    bind_s: float
    capture_s: float = 0.0
    default_standby_bytes: int = 0
    standby_bytes: Mapping[str | None, int] = field(default_factory=dict)
    adapter_load_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("fresh_start_s", "bind_s", "capture_s"):
            _check_non_negative("Costs", name, getattr(self, name))
        if self.adapter_load_s is not None:
            _check_non_negative("Costs", "adapter_load_s", self.adapter_load_s)
        _check_bytes("Costs", "default_standby_bytes", self.default_standby_bytes)
        for shape, size in self.standby_bytes.items():
            _check_bytes("Costs", f"standby_bytes[{shape!r}]", size)

    def standby_bytes_for(self, shape: str | None) -> int:
        return self.standby_bytes.get(shape, self.default_standby_bytes)

    def preload_saving_s(self) -> float:
        """Seconds a bind to a standby that pre-loaded the function's adapter saves over a plain bind."""
        return self.bind_s if self.adapter_load_s is None else min(self.bind_s, self.adapter_load_s)

    def bind_saving_s(self, prepared: bool) -> float:
        """Seconds a bind saves over a fresh start: less when the graphs must be captured."""
        return max(0.0, self.fresh_start_s - self.bind_s - (0.0 if prepared else self.capture_s))


@dataclass(frozen=True)
class Snapshot:
    """Everything one decision round sees. ``now_s``: the driver's clock (informational)."""

    now_s: float
    gpus: tuple[GPU, ...]
    backbones: tuple[Backbone, ...]
    workers: tuple[Worker, ...]
    functions: tuple[Function, ...]
    costs: Costs

    def __post_init__(self) -> None:
        for name in ("gpus", "backbones", "workers", "functions"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for name, items, attr in (
            ("gpus", self.gpus, "id"),
            ("backbones", self.backbones, "name"),
            ("workers", self.workers, "id"),
            ("functions", self.functions, "name"),
        ):
            seen: set[str] = set()
            for item in items:
                key = getattr(item, attr)
                if key in seen:
                    raise ValueError(f"Snapshot.{name}: duplicate {attr} {key!r}")
                seen.add(key)
        gpu_ids = {g.id for g in self.gpus}
        for w in self.workers:
            if w.gpu not in gpu_ids:
                raise ValueError(f"Worker {w.id}.gpu {w.gpu!r} is not a GPU of the snapshot")
