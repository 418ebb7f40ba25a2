"""A policy-level simulation of the controller over a list of arrivals: the pure policy (`decide`,
`fast_binds`) driven round by round against a simple model of workers, GPUs and requests, so that a
policy change can be judged on a trace in seconds of CPU, without processes or a GPU.

The model (each part as simple as the question allows; none of it is measured here):
- one backbone, ``num_gpus`` GPUs of ``gpu_bytes``; every function and standby reserves ``worker_bytes``;
- a fresh start (standby or bound) is ``fresh_start_s`` of work; the starts under way on one GPU (one host)
  share ``start_parallelism`` starts' worth of speed (processor sharing: n > P starts each progress at
  P / n), so many at once all finish late together (the H100 replay: ~2 s alone, 2-4 s with ~20 at once,
  i.e. P ~ 10);
- or, with ``startup`` (a `StartupModel`), a fresh start's time depends on the GPU's state: its first stage
  (CUDA context creation + attach, "pre_runner") lasts ``base_s + per_running_s x R + per_start_s x S``
  at the current R = requests running on its GPU and S = other starts under way there (re-evaluated every
  tick: the stage advances by tick / that time), then ``fixed_s`` (adapter, KV, runner and the first
  prefill's excess over a warm one) at full speed; `STARTUP_MODELS` holds the fits to the H100 replays
  (the ``-ctx`` ones add ``per_context_s`` per other live process on the GPU beyond the fits' ~40);
- a stopped worker holds its memory for ``stop_s`` more (draining: the process exits, CUDA frees);
- a bind takes ``bind_s``; a bound worker serves up to ``max_batch`` requests at once, each for
  ``service_s``; its first token comes ``warm_ttft_s`` after it takes the request;
- the controller runs a round every ``round_s`` and answers a cold function's arrival at once from the
  last round's view (`fast_binds`); standby starts on a GPU wait ``refill_delay_s`` after a bind there
  (at most that long in a row), as the driver does; ``fresh_start_s`` as the policy sees it is the median
  of the last 9 measured fresh starts of bound workers (the driver's estimate), ``initial_fresh_start_s``
  until one is measured;
- arrival rates are what the snapshot computes: arrivals in the last ``rate_window_s`` / that window (and
  over ``long_window_s`` for ``Function.long_arrival_rate``);
- worker sizes (``overhead_quantiles`` set; else every worker is ``worker_bytes``, real and charged): each
  worker's process settles at ``kv_lora_bytes`` + an overhead drawn from that quantile function (seeded per
  worker); a fresh bound worker holds ``graph_bytes`` less until ``graph_settle_s`` after it is up (lazy
  decode graphs; it reports them pending), a standby is settled when up, a starting one holds its unsettled
  size. The snapshot charges them as `controller.snapshot` does (``charge``: "learned", every worker the
  largest reported overhead + margin, the rule before issue 16's change; "own", `charge.charge_bytes`), and
  with ``driver_guard`` each GPU carries the driver's free bytes (total - backbone - what processes hold -
  ``unattributed_bytes`` per process); ``late_growth_bytes``: what a fresh bound worker grows by once it has
  served (its activations after a longer step than its first). The result reports the peak of what the
  processes really hold;
- KV grants (`PolicyConfig.burst_kv_bytes`, ``kv_bytes`` set): a worker's batch is ``max_batch`` at its own
  ``kv_bytes`` of KV and grows in proportion with granted KV (a ResizeKV: charged and held at once, the
  larger batch from ``resize_s`` later; a return at once); a park gives a grant back;
- parking (`PolicyConfig.park_idle`, issue 16): a Park takes effect at once (the worker releases its KV and
  graph pools in milliseconds and acknowledges; the driver would wait for that); a parked worker holds
  ``park_release_bytes`` less (``worker_bytes - park_release_bytes`` unsized), is charged what it holds +
  the overhead margin, and serves nothing; an Unpark gives it its KV back at once and it serves
  ``unpark_s`` later (KV allocation + graph re-capture; its graph pools held and settled from then on). A
  request for a function whose workers are all parked is answered at once from the last round's view
  (`fast_unparks`, as `fast_binds` for a function with no worker), else by the next round.

Each request's path is as the trace replay reports it: warm (a bound worker was there), standby or fresh
(its arrival was answered by a bind or a fresh start and it was that worker's first request), queued (it
waited for a worker another request asked for, or for memory).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import random
import statistics
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from lorafn.controller.policy.actions import Bind, Park, ResizeKV, Start, Stop, Unpark
from lorafn.controller.policy.charge import (
    OVERHEAD_MARGIN_BYTES,
    SizeReport,
    charge_bytes,
    learned_overhead,
    overhead_floor,
)
from lorafn.controller.policy.config import PolicyConfig
from lorafn.controller.policy.decide import decide, fast_binds, fast_unparks
from lorafn.controller.policy.model import GPU, Backbone, Costs, Function, Snapshot, Worker, WorkerState

GiB = 2**30
BACKBONE = "bb"
SHAPE = "r16"


@dataclass(frozen=True)
class StartupModel:
    """A fresh worker's start-up time by what its GPU is doing (see the module docstring).

    pre_runner (CUDA context + attach) = ``base_s + per_running_s x running + per_start_s x others
    + per_context_s x (contexts - context_ref)``, where ``running`` = requests running on the GPU,
    ``others`` = other starts under way there and ``contexts`` = other live worker processes there (each
    holds a CUDA context: starting, standby, bound, parked or draining); then ``fixed_s``. A model fitted to
    binned medians of two H100 replays (`STARTUP_MODELS`), not a measurement of the GPU. Those replays had
    ~40 live processes throughout, so their fits hold the contexts inside ``base_s``: a context term is
    relative to ``context_ref`` = 40 (fewer contexts start faster, more slower) and its slope comes from
    `bench/context_probe.py` (the ``-ctx`` models). pre_runner is never below ``MIN_PRE_RUNNER_S``.
    """

    name: str
    base_s: float
    per_running_s: float
    per_start_s: float
    fixed_s: float
    per_context_s: float = 0.0
    context_ref: float = 0.0

    def __post_init__(self) -> None:
        for name in ("base_s", "per_running_s", "per_start_s", "fixed_s", "per_context_s", "context_ref"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"StartupModel.{name} must be >= 0, got {getattr(self, name)!r}")
        if self.base_s <= 0:
            raise ValueError(f"StartupModel.base_s must be > 0, got {self.base_s!r}")

    def pre_runner_s(self, running: float, others: float, contexts: float | None = None) -> float:
        """The first stage's time if the GPU stayed at ``running`` requests, ``others`` other starts and
        ``contexts`` other live processes (None: ``context_ref``, the fit's own)."""
        extra = 0.0 if contexts is None else self.per_context_s * (max(0.0, contexts) - self.context_ref)
        pre = self.base_s + self.per_running_s * max(0.0, running) + self.per_start_s * max(0.0, others)
        return max(MIN_PRE_RUNNER_S, pre + extra)

    def start_s(self, running: float, others: float, contexts: float | None = None) -> float:
        """The whole start at a steady state: pre_runner + ``fixed_s``."""
        return self.pre_runner_s(running, others, contexts) + self.fixed_s


# a fresh context's floor in the model (a context term can take a start below the fit's base_s)
MIN_PRE_RUNNER_S = 0.05


# Fits to bench/replay_breakdown.py on the H100 (64 functions of llama-2-7b, 4 rps code trace, KV 512 MiB,
# ~40 workers alive; docs/benchmarks.md "Fresh starts by the GPU's state, simulated"): a grid search over
# (base_s, per_running_s, per_start_s) that brought the simulated fresh starts' pre_runner p50, binned as the
# breakdown bins them (requests running during the start; starts under way at the decision), closest in log
# to the H100's (bench/policy_replay.py --sized --warmup-s 90 --service-s 1.5, seeds 0-1). fixed_s = adapter
# 0.18 + KV 0.03 + runner 0.25 + the first prefill's ~0.55 s over a warm TTFT.
STARTUP_MODELS: dict[str, StartupModel] = {
    "h100-conn1": StartupModel("h100-conn1", base_s=0.25, per_running_s=0.035, per_start_s=0.18, fixed_s=1.0),
    "h100-default": StartupModel(
        "h100-default", base_s=1.8, per_running_s=0.18, per_start_s=0.2, fixed_s=1.0
    ),
}
# h100-conn1 + a term per other live process (CUDA context) on the GPU, relative to the ~40 of the replays it
# was fitted to. The slope from `bench/context_probe.py` with one connection (docs/benchmarks.md, ninth H100
# session: quiet 225 ms; beside 12 GEMM-busy processes 424 ms; beside 8 busy + 30 idle 421 ms): all of the
# 38-context point's 196 ms on its contexts = 5.2 ms per context (the central value: the count matters more
# than the load, as those runs found); taking the 12 busy ones' 16.6 ms each as load + context leaves 2.1 ms
# per idle one (the low end). "-hi": the 8-connection probe's slope, (884 - 354) / 38 = 14 ms, as a
# pessimistic bound (the workers run one connection).
STARTUP_MODELS["h100-conn1-ctx"] = dataclasses.replace(
    STARTUP_MODELS["h100-conn1"], name="h100-conn1-ctx", per_context_s=0.0052, context_ref=40.0
)
STARTUP_MODELS["h100-conn1-ctx-hi"] = dataclasses.replace(
    STARTUP_MODELS["h100-conn1"], name="h100-conn1-ctx-hi", per_context_s=0.014, context_ref=40.0
)


@dataclass(frozen=True)
class SimSetup:
    """The simulated platform (see the module docstring); sizes in bytes, times in seconds."""

    num_functions: int
    num_gpus: int = 1
    gpu_bytes: int = 80 * GiB
    backbone_bytes: int = int(12.6 * GiB)
    worker_bytes: int = int(1.7 * GiB)
    fresh_start_s: float = 2.0
    start_parallelism: float = 10.0
    stop_s: float = 0.5
    bind_s: float = 0.05
    warm_ttft_s: float = 0.1
    service_s: float = 3.0
    max_batch: int = 4
    round_s: float = 0.2
    tick_s: float = 0.05
    refill_delay_s: float = 2.0
    initial_fresh_start_s: float = 20.0
    rate_window_s: float = 60.0
    keep_alive_s: float = 60.0
    max_replicas: int = 4
    min_standby: int = 1
    max_standby: int = 4
    slo_ms: float = 2500.0
    settle_s: float = 30.0
    long_window_s: float = 600.0
    # worker sizes (module docstring): None = every worker is worker_bytes
    overhead_quantiles: tuple[tuple[float, int], ...] | None = None
    kv_lora_bytes: int = 0
    graph_bytes: int = 150 * 2**20
    graph_settle_s: float = 2.0
    charge: str = "learned"  # "learned" | "own"
    driver_guard: bool = False
    unattributed_bytes: int = 0
    late_growth_bytes: int = 0  # a fresh bound worker grows by this once it has served (a longer step)
    startup: StartupModel | None = None  # None: fresh_start_s shared by start_parallelism (the fixed model)
    # parking (module docstring): what a park releases (KV + graph pools), and an unpark's time
    park_release_bytes: int = 0
    unpark_s: float = 0.3
    # KV grants (module docstring): a worker's own KV budget (0: its batch is max_batch whatever it holds)
    kv_bytes: int = 0
    resize_s: float = 0.03
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_functions < 1:
            raise ValueError(f"num_functions must be >= 1, got {self.num_functions!r}")
        for name in ("fresh_start_s", "service_s", "round_s", "tick_s", "rate_window_s", "start_parallelism"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SimSetup.{name} must be > 0, got {getattr(self, name)!r}")
        if self.max_batch < 1:
            raise ValueError(f"SimSetup.max_batch must be >= 1, got {self.max_batch!r}")
        if not 0 <= self.park_release_bytes < self.worker_bytes:
            raise ValueError(
                f"SimSetup.park_release_bytes must be in [0, worker_bytes), got {self.park_release_bytes!r}"
            )
        for name in ("unpark_s", "resize_s", "kv_bytes"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"SimSetup.{name} must be >= 0, got {getattr(self, name)!r}")
        if self.charge not in ("learned", "own"):
            raise ValueError(f"SimSetup.charge must be 'learned' or 'own', got {self.charge!r}")
        if self.overhead_quantiles is not None:
            qs = [q for q, _ in self.overhead_quantiles]
            if len(qs) < 2 or qs[0] != 0.0 or qs[-1] != 1.0 or qs != sorted(qs):
                raise ValueError(
                    "SimSetup.overhead_quantiles must run from q=0 to q=1 in order, got "
                    f"{self.overhead_quantiles!r}"
                )

    def draw_overhead(self, rng: random.Random) -> int:
        """One worker's settled overhead: the quantile function at a uniform draw (linear between knots)."""
        assert self.overhead_quantiles is not None
        u = rng.random()
        knots = self.overhead_quantiles
        for (q0, b0), (q1, b1) in itertools.pairwise(knots):
            if u <= q1:
                return int(b0 + (b1 - b0) * ((u - q0) / (q1 - q0) if q1 > q0 else 1.0))
        return int(knots[-1][1])


@dataclass
class _Worker:
    id: str
    gpu: str
    state: WorkerState
    function: str | None
    started_at: float
    ready_at: float  # bound: when it may take requests (after a bind); draining: when it is gone
    work_left: float = 0.0  # starting: seconds of start work left at full speed
    fresh_for: str | None = None  # started bound to this function (a fresh start)
    via_bind: bool = False
    served_any: bool = False
    running: list[float] = field(default_factory=list)  # end times of requests in flight
    idle_since: float = 0.0
    room_for: str | None = None  # draining: the function its offload made room for
    overhead: int = 0  # its settled overhead (sized setups)
    settled_at: float = 0.0  # when its decode graphs are captured (a fresh bound worker: after it is up)
    pre_left: float = 0.0  # with a StartupModel: the share of its pre_runner stage still to go (1 -> 0)
    starts_at_decision: int = 0  # starts under way on its GPU when it began, itself included
    running_sum: float = 0.0  # requests running on its GPU, summed over its pre_runner ticks
    pre_ticks: int = 0
    pre_s: float = 0.0  # its pre_runner stage's time, once done
    parked: bool = False
    unparked_first: bool = False  # unparked for a request and has not taken one yet
    kv: int = 0  # its KV budget now when granted more than its own (0: its own)
    kv_at: float = 0.0  # when its batch follows ``kv`` (a grant's resize done)


@dataclass
class SimResult:
    """What a run gives, as the replay reports it."""

    ttft_s: list[float]
    paths: dict[str, int]
    fresh_starts: int  # bound workers started for a function (cold starts that spawned a process)
    pool_starts: int
    binds: int
    offloads: int
    offloads_idle_bound: int
    waits: int  # rounds x functions told to Wait
    peak_workers: int
    slo_s: float
    unanswered: int
    peak_held_bytes: int = 0  # backbones + what the processes hold (sized setups; else charged sizes)
    over_gpu_ticks: int = 0  # ticks when that exceeded a GPU's memory
    # offloaded idle bound workers whose function was called again within its keep-alive of the offload
    # (an eviction the function paid for with a cold start), and fresh starts of functions offloaded before
    offloads_regretted: int = 0
    fresh_after_offload: int = 0
    # fresh bound starts in the measured window: (mean requests running on the GPU during its pre_runner
    # stage, starts under way at its decision incl. itself, pre_runner seconds) -- with a StartupModel
    start_records: list[tuple[float, int, float]] = field(default_factory=list)
    pool_empty_ticks: int = 0  # measured ticks with no ready standby on some GPU
    measured_ticks: int = 0
    parks: int = 0
    unparks: int = 0
    # the measured window's GPU memory held (backbones + processes), in GPU-seconds: sum over its ticks (to
    # its last arrival) of held / GPU bytes x tick (one GPU full all along = the window's length)
    held_gpu_s: float = 0.0
    parked_ticks: int = 0  # sum over measured ticks of parked workers (their mean = / measured_ticks)
    kv_grants: int = 0  # ResizeKV grants (more KV) in the measured window

    def row(self) -> dict[str, float | int]:
        ttft = sorted(self.ttft_s)

        def pct(q: float) -> float:
            return ttft[min(len(ttft) - 1, int(q * len(ttft)))] * 1000 if ttft else float("nan")

        return {
            "requests": len(ttft) + self.unanswered,
            "ttft_p50_ms": round(pct(0.5)),
            "ttft_p90_ms": round(pct(0.9)),
            "ttft_p99_ms": round(pct(0.99)),
            "slo_violations_pct": round(
                100.0
                * (sum(t > self.slo_s for t in ttft) + self.unanswered)
                / max(1, len(ttft) + self.unanswered),
                1,
            ),
            "warm": self.paths.get("warm", 0),
            "standby": self.paths.get("standby", 0),
            "fresh": self.paths.get("fresh", 0),
            "queued": self.paths.get("queued", 0),
            "fresh_starts": self.fresh_starts,
            "pool_starts": self.pool_starts,
            "binds": self.binds,
            "offloads": self.offloads,
            "offloads_idle_bound": self.offloads_idle_bound,
            "peak_workers": self.peak_workers,
            "offloads_regretted": self.offloads_regretted,
            "fresh_after_offload": self.fresh_after_offload,
            "peak_held_gib": round(self.peak_held_bytes / GiB, 1),
            "over_gpu_ticks": self.over_gpu_ticks,
            "pool_empty_pct": round(100.0 * self.pool_empty_ticks / max(1, self.measured_ticks), 1),
            "unparked": self.paths.get("unpark", 0),
            "parks": self.parks,
            "unparks": self.unparks,
            "mean_parked": round(self.parked_ticks / max(1, self.measured_ticks), 1),
            "held_gpu_s": round(self.held_gpu_s),
            "kv_grants": self.kv_grants,
        }


class Simulation:
    """One run: ``arrivals`` = (seconds from the start, function index), in time order."""

    def __init__(self, setup: SimSetup, config: PolicyConfig, arrivals: Sequence[tuple[float, int]]) -> None:
        self.setup, self.config = setup, config
        self.names = [f"sim/f{i:03d}" for i in range(setup.num_functions)]
        for _, i in arrivals:
            if not 0 <= i < setup.num_functions:
                raise ValueError(f"arrival for function {i}: not in 0..{setup.num_functions - 1}")
        # a warm-up's arrivals come at negative times: the run starts settle_s before the first of them, and
        # only arrivals from time 0 on (and starts and offloads from then on) are measured
        self.measure_from = setup.settle_s - min(0.0, min((t for t, _ in arrivals), default=0.0))
        self.arrivals = sorted((t + self.measure_from, i) for t, i in arrivals)
        # counts (starts, offloads) from the window's start after a warm-up; from the run's start without one
        self.count_from = self.measure_from if min((t for t, _ in arrivals), default=0.0) < 0 else 0.0
        self.rng = random.Random(setup.seed)
        self.offloaded_at: dict[str, list[tuple[float, bool]]] = {}  # function -> (offload time, counted)
        self.peak_held = 0
        self.over_gpu = 0
        self.workers: dict[str, _Worker] = {}
        self.queues: dict[str, deque[tuple[float, str]]] = defaultdict(deque)  # (arrival, path hint)
        self.history: dict[str, list[float]] = defaultdict(list)
        self.measured: deque[float] = deque(maxlen=9)
        self.last_bind: dict[str, float] = {}
        self.deferred_since: dict[str, float] = {}
        self.next_id = 0
        self.now = 0.0
        self.ttft: list[float] = []
        self.paths: dict[str, int] = defaultdict(int)
        self.counts: dict[str, int] = defaultdict(int)
        self.peak = 0
        self.start_records: list[tuple[float, int, float]] = []
        self.pool_empty = 0
        self.ticks = 0
        self.held_gpu_s = 0.0
        self.parked_ticks = 0
        self.held_share = 0.0
        self.gpus = tuple(
            GPU(f"gpu{g}", "node0", setup.gpu_bytes, {BACKBONE: setup.backbone_bytes})
            for g in range(setup.num_gpus)
        )
        self.backbone = Backbone(BACKBONE, setup.backbone_bytes, setup.min_standby, setup.max_standby)

    # -- the view the policy gets ----------------------------------------------------------------
    def fresh_start_estimate(self) -> float:
        return statistics.median(self.measured) if self.measured else self.setup.initial_fresh_start_s

    @property
    def sized(self) -> bool:
        return self.setup.overhead_quantiles is not None

    def held_bytes(self, w: _Worker) -> int:
        """What the worker's process holds now (the driver's count)."""
        s = self.setup
        grant = self.granted(w)
        if not self.sized:
            return s.worker_bytes + grant - (s.park_release_bytes if w.parked else 0)
        whole = s.kv_lora_bytes + w.overhead + grant
        if w.served_any and not w.via_bind:  # a standby's warm-up ran the longest steps already
            whole += s.late_growth_bytes
        if w.parked:  # KV and graph pools released (its cached activations kept)
            return max(0, whole - s.park_release_bytes)
        return whole if self.settled(w) else max(0, whole - s.graph_bytes)

    def granted(self, w: _Worker) -> int:
        """KV held beyond its own budget (a ResizeKV grant)."""
        return max(0, w.kv - self.setup.kv_bytes) if w.kv else 0

    def batch_of(self, w: _Worker) -> int:
        """Requests it serves at once: ``max_batch`` at its own KV, in proportion with a grant (resized)."""
        s = self.setup
        if s.kv_bytes <= 0 or not w.kv or self.now < w.kv_at:
            return s.max_batch
        return max(1, s.max_batch * w.kv // s.kv_bytes)

    def parked_charge(self, w: _Worker) -> int:
        """What the account charges ``w`` parked (nothing grows while it runs nothing): what it holds + the
        overhead margin; unsized: the flat size less the release."""
        s = self.setup
        if not self.sized:
            return s.worker_bytes - s.park_release_bytes
        was, w.parked = w.parked, True
        held = self.held_bytes(w)
        w.parked = was
        return held + OVERHEAD_MARGIN_BYTES

    def settled(self, w: _Worker) -> bool:
        return w.state != "starting" and self.now >= w.settled_at

    def snapshot(self) -> Snapshot:
        s, now = self.setup, self.now
        fn_bytes, floor = s.worker_bytes, 0
        if self.sized:
            reporting = [w for w in self.workers.values() if w.state in ("standby", "bound") and not w.parked]
            overheads = [self.held_bytes(w) - s.kv_lora_bytes for w in reporting]
            learned = learned_overhead(overheads, s.worker_bytes - s.kv_lora_bytes)
            settled = [self.held_bytes(w) - s.kv_lora_bytes for w in reporting if self.settled(w)]
            floor = overhead_floor(settled, learned - OVERHEAD_MARGIN_BYTES)
            fn_bytes = s.kv_lora_bytes + learned
        workers = []
        held_on: dict[str, int] = defaultdict(int)
        for w in self.workers.values():
            running = sum(1 for end in w.running if end > now)
            held = self.held_bytes(w)
            held_on[w.gpu] += held + s.unattributed_bytes
            release = 0
            if w.parked:
                charge, reported = self.parked_charge(w), held
                release = max(0, fn_bytes - charge)  # unparked, it is charged as an unsettled worker
            elif not self.sized:
                charge, reported = s.worker_bytes + self.granted(w), 0
            elif w.state == "starting":
                charge, reported = fn_bytes, 0
            elif w.state == "bound" and s.charge == "own":
                report = SizeReport(held, s.kv_lora_bytes, 0, settled=self.settled(w))
                charge, reported = charge_bytes(report, fn_bytes, floor), held
            else:
                charge, reported = max(held, fn_bytes), held
            if w.state == "bound" and not w.parked and s.park_release_bytes > 0:
                release = max(0, charge - self.parked_charge(w))  # what the next snapshot would show
            workers.append(
                Worker(
                    w.id,
                    w.gpu,
                    BACKBONE,
                    w.state,
                    SHAPE,
                    w.function,
                    charge,
                    idle_s=0.0 if running else max(0.0, now - w.idle_since),
                    running=running,
                    age_s=max(1e-3, now - w.started_at),
                    room_for=w.room_for if w.state == "draining" else None,
                    reported_bytes=reported,
                    parked=w.parked and w.state == "bound",  # a stopped one drains at its parked size
                    release_bytes=release,
                    kv_bytes=(w.kv or s.kv_bytes) if w.state == "bound" else 0,
                    kv_grant=self.granted(w) > 0,
                )
            )
        gpus = self.gpus
        if self.sized and s.driver_guard:
            gpus = tuple(
                GPU(
                    g.id,
                    g.node,
                    g.total_bytes,
                    g.backbones,
                    driver_free_bytes=max(0, g.total_bytes - s.backbone_bytes - held_on[g.id]),
                )
                for g in self.gpus
            )
        functions = []
        for name in self.names:
            times = self.history[name]
            recent = len(times) - bisect.bisect_left(times, now - s.rate_window_s)
            longer = len(times) - bisect.bisect_left(times, now - s.long_window_s)
            queue = self.queues[name]
            functions.append(
                Function(
                    name,
                    BACKBONE,
                    SHAPE,
                    fn_bytes,
                    max_replicas=s.max_replicas,
                    keep_alive_s=s.keep_alive_s,
                    ttft_slo_ms=s.slo_ms,
                    arrival_rate=recent / s.rate_window_s,
                    queued=len(queue),
                    oldest_wait_s=now - queue[0][0] if queue else 0.0,
                    long_arrival_rate=longer / s.long_window_s,  # as the snapshot: the whole horizon
                    kv_bytes=s.kv_bytes,
                )
            )
        costs = Costs(
            fresh_start_s=self.fresh_start_estimate(),
            bind_s=s.bind_s,
            default_standby_bytes=fn_bytes,
        )
        return Snapshot(now, gpus, (self.backbone,), tuple(workers), tuple(functions), costs)

    # -- applying actions ------------------------------------------------------------------------
    def _bind(self, a: Bind) -> None:
        w = self.workers.get(a.worker_id)
        if w is None or w.state != "standby":
            return
        w.state, w.function, w.via_bind = "bound", a.function, True
        w.ready_at, w.idle_since = self.now + self.setup.bind_s, self.now
        self.last_bind[w.gpu] = self.now
        self.count("binds")

    def _start(self, a: Start) -> None:
        s, now = self.setup, self.now
        if a.function is None:  # the driver defers a standby start just after a bind on that GPU
            if now - self.last_bind.get(a.gpu, -1e18) < s.refill_delay_s:
                since = self.deferred_since.setdefault(a.gpu, now)
                if now - since < s.refill_delay_s:
                    return
            else:
                self.deferred_since.pop(a.gpu, None)
        wid = f"w{self.next_id}"
        self.next_id += 1
        self.workers[wid] = _Worker(
            wid, a.gpu, "starting", a.function, now, now, work_left=s.fresh_start_s, fresh_for=a.function
        )
        if s.startup is not None:
            w = self.workers[wid]
            w.pre_left, w.work_left = 1.0, s.startup.fixed_s
            w.starts_at_decision = sum(
                1 for o in self.workers.values() if o.state == "starting" and o.gpu == a.gpu
            )
        if self.sized:
            self.workers[wid].overhead = s.draw_overhead(self.rng)
        self.count("fresh_starts" if a.function else "pool_starts")
        if a.function in self.offloaded_at:
            self.count("fresh_after_offload")

    def _stop(self, a: Stop) -> None:
        w = self.workers.get(a.worker_id)
        if w is None or w.state == "draining":
            return
        if a.reason == "offload":
            self.count("offloads")
            if w.state == "bound":
                self.count("offloads_idle_bound")
                counted = self.now >= self.count_from
                self.offloaded_at.setdefault(w.function or "", []).append((self.now, counted))
        w.state, w.ready_at = "draining", self.now + self.setup.stop_s
        w.room_for = a.room_for or None

    def _park(self, a: Park) -> None:
        w = self.workers.get(a.worker_id)
        if w is None or w.state != "bound" or w.parked or any(end > self.now for end in w.running):
            raise RuntimeError(f"the policy parked {a.worker_id}, which is not an idle bound worker")
        w.parked, w.unparked_first = True, False
        w.kv = 0  # a park releases the whole KV cache: unparked, it has its own budget
        self.count("parks")

    def _unpark(self, a: Unpark) -> None:
        w = self.workers.get(a.worker_id)
        if w is None or not w.parked:
            raise RuntimeError(f"the policy unparked {a.worker_id}, which is not parked")
        w.parked, w.unparked_first = False, True
        w.ready_at = w.settled_at = self.now + self.setup.unpark_s  # KV allocated, graphs re-captured
        self.count("unparks")

    def _resize(self, a: ResizeKV) -> None:
        w = self.workers.get(a.worker_id)
        if w is None or w.state != "bound" or w.parked:
            raise RuntimeError(f"the policy resized {a.worker_id}, which is not an unparked bound worker")
        own = self.setup.kv_bytes
        w.kv = a.kv_bytes if a.kv_bytes > own else 0
        w.kv_at = self.now + (self.setup.resize_s if a.delta_bytes > 0 else 0.0)
        if a.delta_bytes > 0:
            self.count("kv_grants")

    def apply(self, actions: Sequence[object]) -> None:
        for a in actions:
            if isinstance(a, ResizeKV):
                self._resize(a)
            elif isinstance(a, Park):
                self._park(a)
            elif isinstance(a, Unpark):
                self._unpark(a)
            elif isinstance(a, Stop):
                self._stop(a)
            elif isinstance(a, Start):
                self._start(a)
            elif isinstance(a, Bind):
                self._bind(a)
            elif type(a).__name__ == "Wait":
                self.count("waits")

    def count(self, what: str) -> None:
        if self.now >= self.count_from:  # the measured window's (after a warm-up)
            self.counts[what] += 1

    # -- the clock -------------------------------------------------------------------------------
    def _progress(self) -> None:
        """One tick of every start under way (processor sharing per GPU); drained workers go."""
        s = self.setup
        for wid in [w.id for w in self.workers.values() if w.state == "draining" and w.ready_at <= self.now]:
            del self.workers[wid]
        under_way: dict[str, int] = defaultdict(int)
        for w in self.workers.values():
            if w.state == "starting":
                under_way[w.gpu] += 1
        if s.startup is None:
            for w in self.workers.values():
                if w.state == "starting":
                    w.work_left -= s.tick_s * min(1.0, s.start_parallelism / under_way[w.gpu])
            return
        running_on = self.running_on()
        live_on: dict[str, int] = defaultdict(int)  # processes (CUDA contexts) on each GPU
        for w in self.workers.values():
            live_on[w.gpu] += 1
        for w in self.workers.values():
            if w.state != "starting":
                continue
            if w.pre_left > 0:
                r = running_on[w.gpu]
                w.running_sum += r
                w.pre_ticks += 1
                w.pre_s += s.tick_s
                others = under_way[w.gpu] - 1
                w.pre_left -= s.tick_s / s.startup.pre_runner_s(r, others, live_on[w.gpu] - 1)
            else:
                w.work_left -= s.tick_s

    def running_on(self) -> dict[str, int]:
        """Requests running now on each GPU."""
        out: dict[str, int] = defaultdict(int)
        for w in self.workers.values():
            if w.state == "bound":
                out[w.gpu] += sum(1 for end in w.running if end > self.now)
        return out

    def _finish_starts(self) -> None:
        for w in self.workers.values():
            if w.state == "starting" and w.pre_left <= 1e-9 and w.work_left <= 1e-9:
                if w.function is not None:
                    w.state, w.idle_since = "bound", self.now
                    w.settled_at = self.now + self.setup.graph_settle_s  # lazy decode graphs
                    self.measured.append(self.now - w.started_at)
                    if self.setup.startup is not None and w.started_at >= self.count_from:
                        mean_running = w.running_sum / max(1, w.pre_ticks)
                        self.start_records.append((mean_running, w.starts_at_decision, w.pre_s))
                else:
                    w.state, w.settled_at = "standby", self.now

    def _dispatch(self) -> None:
        now = self.now
        for name, queue in self.queues.items():
            if not queue:
                continue
            for w in sorted(
                (
                    w
                    for w in self.workers.values()
                    if w.function == name and w.state == "bound" and not w.parked
                ),
                key=lambda w: w.id,
            ):
                if w.ready_at > now:
                    continue
                w.running = [end for end in w.running if end > now]
                batch = self.batch_of(w)
                while queue and len(w.running) < batch:
                    at, hint = queue.popleft()
                    measured = at >= self.measure_from
                    if measured:
                        self.ttft.append(now - at + self.setup.warm_ttft_s)
                    if hint == "warm":
                        path = "warm"
                    elif w.unparked_first:
                        path = "unpark"
                    elif not w.served_any and (w.via_bind or w.fresh_for == name):
                        path = "standby" if w.via_bind else "fresh"
                    else:
                        path = "queued"
                    if measured:
                        self.paths[path] += 1
                    w.served_any, w.unparked_first = True, False
                    w.running.append(now + self.setup.service_s)
                    w.idle_since = now + self.setup.service_s
                if not queue:
                    break

    def _held(self) -> None:
        """The peak of what the GPUs' processes really hold, and ticks over a GPU's memory."""
        held: dict[str, int] = defaultdict(int)
        for w in self.workers.values():
            held[w.gpu] += self.held_bytes(w) + self.setup.unattributed_bytes
        self.held_share = 0.0  # this tick's memory held, in GPUs (for the window's GPU-seconds)
        for g in self.gpus:
            total = self.setup.backbone_bytes + held[g.id]
            self.peak_held = max(self.peak_held, total)
            self.over_gpu += total > g.total_bytes
            self.held_share += total / g.total_bytes

    def run(self, drain_s: float = 60.0) -> SimResult:
        s = self.setup
        end = (self.arrivals[-1][0] if self.arrivals else s.settle_s) + drain_s
        next_round, k = 0.0, 0
        while self.now <= end:
            self._finish_starts()
            woke, waking = [], []
            while k < len(self.arrivals) and self.arrivals[k][0] <= self.now:
                name = self.names[self.arrivals[k][1]]
                mine = [w for w in self.workers.values() if w.function == name]
                bound = [w for w in mine if w.state == "bound"]
                # warm: a bound worker serving (not parked, not unparking); parked: only parked/unparking ones
                if any(not w.parked and not w.unparked_first for w in bound):
                    hint = "warm"
                else:
                    hint = "parked" if bound else "cold"
                self.queues[name].append((self.arrivals[k][0], hint))
                self.history[name].append(self.arrivals[k][0])
                if not mine:
                    woke.append(name)
                elif all(w.parked for w in mine):
                    waking.append(name)
                k += 1
            if woke:  # the driver's fast path: binds from the last round's view at once
                self.apply(fast_binds(self.snapshot(), woke, self.config))
            if waking:  # and unparks (a driver that parks would answer its workers' demand so)
                self.apply(fast_unparks(self.snapshot(), waking, self.config))
            if self.now >= next_round:
                self.apply(decide(self.snapshot(), self.config).actions)
                next_round = self.now + s.round_s
            self._dispatch()
            self._progress()
            self.peak = max(self.peak, sum(1 for w in self.workers.values() if w.state != "draining"))
            self._held()
            if self.now >= self.measure_from and k < len(self.arrivals):  # the window, until its last arrival
                self.ticks += 1
                ready = {w.gpu for w in self.workers.values() if w.state == "standby"}
                self.pool_empty += any(g.id not in ready for g in self.gpus)
                self.parked_ticks += sum(1 for w in self.workers.values() if w.parked)
                self.held_gpu_s += self.held_share * s.tick_s
            self.now = round(self.now + s.tick_s, 9)
        c = self.counts
        regretted = 0
        for name, offloads in self.offloaded_at.items():
            times = self.history[name]
            for t, counted in offloads:
                k = bisect.bisect_right(times, t)
                regretted += counted and k < len(times) and times[k] <= t + s.keep_alive_s
        return SimResult(
            self.ttft,
            dict(self.paths),
            c["fresh_starts"],
            c["pool_starts"],
            c["binds"],
            c["offloads"],
            c["offloads_idle_bound"],
            c["waits"],
            self.peak,
            s.slo_ms / 1000,
            sum(1 for q in self.queues.values() for at, _ in q if at >= self.measure_from),
            self.peak_held,
            self.over_gpu,
            regretted,
            c["fresh_after_offload"],
            self.start_records,
            self.pool_empty,
            self.ticks,
            c["parks"],
            c["unparks"],
            self.held_gpu_s,
            self.parked_ticks,
            c["kv_grants"],
        )
