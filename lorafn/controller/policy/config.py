"""The knobs of the policy (one typed config; the driver fills it from its settings)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

# the arrival rates idle bound workers may be ranked by for offloading (`offload.victim_rate`)
VictimRate = Literal["window", "long", "max"]
VICTIM_RATES: tuple[VictimRate, ...] = get_args(VictimRate)


@dataclass(frozen=True)
class PolicyConfig:
    """
    - ``gpu_utilization``: fraction of each GPU's memory the account may grant (the rest absorbs
      allocator fragmentation and CUDA's own growth).
    - ``driver_headroom``: where a worker reports the device's free memory as the driver counts it
      (`GPU.driver_free_bytes`), the account never grants more than that less what workers were promised
      and do not hold yet, less this fraction of the device (`account.accounts`): the second guard under an
      account that charges settled workers by their own reports (`charge`). 0.03: 2.4 GiB of an H100.
    - ``victim_rate``: the arrival rate idle bound workers are ranked by for offloading
      (`offload.victim_rate`): "window" (the snapshot's 60 s, the rule before), "long"
      (``Function.long_arrival_rate``: 10 minutes; the window's where not known) or "max" (the larger). On
      the simulated 64-function replay (`bench/policy_replay.py --sized`, 600 s, 5 seeds) "long" offloaded
      6% fewer idle workers whose functions came back within their keep-alive and made 4% fewer fresh starts
      than "window"; "max" was between them.
    - ``scale_up_queue_per_worker``: queued requests per live worker above which a function gets
      one more worker per round (up to ``max_replicas``).
    - ``backoff_base_s``, ``backoff_cap_s``: failed starts wait base, 2 base, 4 base, ... up to cap.
    - ``min_standby_probability``: the k-th standby of a shape is worth keeping only while the chance
      of k or more cold arrivals within one refill time is at least this.
    - ``refill_s``: time to bring a new standby up (None: ``Costs.fresh_start_s``).
    - ``warm_pool``: keep standby workers (pre-loading); off, every cold start is a fresh process (the
      trace replay's "no warm pool" ablation).
    - ``pool_min_age_s``: a surplus standby younger than this (its age known) is kept while memory allows,
      not stopped: it was started for a reason moments ago, and stopping it wastes that start (seen as
      standbys started and stopped within a second when cold demand flickered between rounds).
    - ``batch_backlog_per_worker``: a function with an offline batch backlog (``Function.batch_backlog``:
      requests its live workers had no room for) wants one more worker per this many of them (up to
      ``max_replicas``) and gets them by binding
      ready standbys only: never a fresh start, an offload or a claim on a warming standby (those are for
      online demand); they return through keep-alive once the backlog is gone. The batch runner's in-flight
      cap per worker (48) is the natural value.
    - ``offloading``: stop standby or idle bound workers to make room for a cold start; off, a function
      that does not fit waits for memory to free up by itself (the "no offloading" ablation).
    - ``cold_prior_rps``: the arrival rate the warm pool assumes for a registered function that has no
      worker and no arrival in the snapshot's window (``Function.arrival_rate`` 0), so that the pool is
      sized for the functions that may wake up before the first burst shows their rates (on the H100
      replay, 32 functions and no history: the pool held one standby and 28 cold starts spawned processes).
      0 = only observed rates count (the behaviour before; the "no burst anticipation" ablation).
    - ``max_fresh_starts_per_gpu``: fresh worker processes (bound or standby) starting at once on one GPU,
      the starting ones counted; beyond it, a function's demand waits for a standby or a start slot
      (`Wait` says which), unless starting now is what keeps its oldest request within its TTFT SLO, and
      the pool's refills wait for a slot (parallel starts slow each other down: ~2 s alone, 2-4 s with ~20
      at once on the H100). None = no cap. 6: on the simulated replay (`bench/policy_replay.py`, 32
      functions, 1 GiB of KV) it cuts the tail where a host runs few starts at full speed at once (4: TTFT
      p99 8.8 -> 4.7 s, violations 5.2% -> 6.5%) and costs nothing where it runs many (10: 0.2% either
      way; a cap of 4 gave 1.7% there).
    - ``thrash_horizon_starts``: an idle bound worker whose function is expected back within this many
      fresh starts (its rate, or its idle time: a function idle for s seconds is expected back in about s
      more, as in a bursty trace) is not offloaded for another function's start: it would come back cold at
      once (the H100 replay at 1 GiB of KV: 74 offloads, 81 fresh starts). Such a worker goes last, only
      when nothing else frees the memory, only for a cold start or the min_replicas floor (never for a
      scale-up), and only when a start now still meets the waiting request's deadline or it has waited
      this horizon already (no starvation). 0 = no guard.
    - ``max_pool_starts_per_node``: the warm pool begins a standby start on a node (a host: `GPU.node`) only
      while fewer than this many worker processes, standby or bound, are starting there; demand's starts are
      never held by it. None = no limit beyond ``max_fresh_starts_per_gpu``. For a CPU host, whose devices
      share its cores: a warm-up runs forwards on every core, and on the 2-core VM four standbys warming at
      once took ~6 s each (2 s alone, at the time) while the README demo's first request waited on one of
      them: first token after 6.2-6.6 s, 0.8 s with one at a time and ``pool_waits_for_demand``
      (docs/benchmarks.md, "The README demo"). `lorafn up` on CPU sets it to what the cores warm at once
      (cores // a worker's threads).
    - ``pool_waits_for_demand``: no standby start begins on a node while a request there waits for its
      function's first worker (queued, no bound worker: a fresh start or a warming standby is on its way), so
      that start has the host to itself; the pool refills once it is served. Off = refills compete with it
      (on a GPU host the driver's ``refill_delay_s`` after a bind is the only hold). `lorafn up` on CPU turns
      it on.
    - ``park_idle``: under memory pressure, *park* idle bound workers before stopping anything (issue 16):
      a parked worker releases its KV cache and the graph pools that point into it and keeps its process,
      context, adapter and backbone mapping (`actions.Park`); its function's next request unparks it
      (`actions.Unpark`: the KV back, graphs re-captured lazily: ``unpark_s``) instead of a fresh start or a
      bind. Idle workers are parked in the offloading order (`offload.park_candidates`); workers are stopped
      (parked ones included, charged their parked size) only when parking cannot free enough. Off in this
      pure default (the policy's tests and the simulator name it); on at the service edges (`lorafn up`,
      the controller's settings, the chart) since the H100 trace replays (docs/benchmarks.md, "Parking on
      the H100"; simulated: `bench/policy_replay.py --variants parking`).
    - ``park_release_fraction``: the share of a bound worker's charge a park releases where the snapshot
      does not say (`Worker.release_bytes` 0); the 7B at 512 MiB of KV: ~0.45 (KV 512 + graphs ~150 MiB of
      ~1.4 GiB).
    - ``unpark_s``: the policy's estimate of an unpark (allocate the KV, re-capture graphs on first need):
      what a parked worker's function pays on its next request (parking order: value = rate x unpark_s).
    - ``park_after_s``: also park a bound worker idle this long without memory pressure (None or inf: only
      under pressure), so that the warm pool gets the memory idle workers hold. None here; the services
      (`lorafn up`, the controller, the chart) ship 50 s since the 10-minute H100 replays (SLO violations
      5.7% -> 3.5%; docs/benchmarks.md).
    - ``parked_keep_alive_s``: a parked worker is stopped ("keep_alive") once idle this long (since its last
      request, as the function's keep-alive counts), instead of at its function's ``keep_alive_s`` (None,
      the default: the function's, as an unparked worker); ``math.inf``: never (only offloading stops it).
      A parked worker holds ~0.8 GiB instead of ~1.4, so keeping it longer may pay (`bench/policy_replay.py
      --variants parking2`). The driver sends it with each park command (`keep_alive_s`; "inf": never) and
      the worker keeps it while parked (its function's again once unparked).
    - ``batch_kv_bytes``: the KV budget a bound worker of a function with an offline batch backlog grows to
      (`ResizeKV`, docs/batch.md#kv-from-idle-memory), out of GPU memory nothing else in the round wants:
      granted after online demand, the warm pool and pre-loading, as much of it as leaves the GPU room for
      one more standby (nothing when that is less than half the worker's own KV more); given back when the
      backlog is gone and the worker has been idle ``kv_grant_idle_s`` (or when it parks).
      0 = off. A batch's decode batch is bounded by its worker's KV: this is what makes a batch faster
      than the same prompts sent as online requests to a worker of the function's own budget.
    - ``burst_kv_bytes``: the KV budget the busy workers of a function whose online requests wait in its
      queue (a burst) may grow to (`ResizeKV`), out of what online demand left free, keeping room for one
      more standby: as much as the queue needs at the workers' present KV per running request, at least half
      their own KV more, never less than one request's worth. A worker holds no more requests than its KV
      serves (`runtime.read_cap`), and a function scales up only past ``scale_up_queue_per_worker`` queued
      per worker, so a burst of a few requests behind a full worker otherwise waits for its running requests
      to end (the H100's 10-minute replay: 16 of 57 late requests, ~2.9 s each in the queue). A resize
      takes ~20-30 ms with requests running (docs/benchmarks.md, "KV from idle memory"); a second worker
      takes a fresh start or a bind. 0 = off.
    - ``scale_up_wait_fraction``: also scale a function up (one more worker per round, as for
      ``scale_up_queue_per_worker``) when its oldest queued request has waited this share of its TTFT SLO
      behind workers that are all busy: a short queue about to miss its deadline (a few requests behind a
      full worker never pass the per-worker threshold). None = off. Simulated on the 64-function replay
      (`bench/policy_replay.py --variants burst`, requests 3 s on their worker): 0.2 took SLO violations from
      5.3 to 4.3% at 2 rps and 14.8 to 12.9% at 4 rps; not measured on a GPU.
    - ``burst_kv_min_wait_s``: a burst is a queue whose oldest request has waited at least this long (a
      worker with a free slot reads a new request within one step: a shorter wait is no burst).
    - ``kv_grant_idle_s``: a worker holding granted KV (batch or burst) gets its function's own budget back
      once it has been idle this long with nothing queued and no batch backlog (bursts come back within
      seconds in a bursty trace; a park gives the KV back at once).
    """

    gpu_utilization: float = 0.92
    driver_headroom: float = 0.03
    victim_rate: VictimRate = "long"
    scale_up_queue_per_worker: float = 4.0
    backoff_base_s: float = 2.0
    backoff_cap_s: float = 300.0
    min_standby_probability: float = 0.01
    refill_s: float | None = None
    warm_pool: bool = True
    offloading: bool = True
    pool_min_age_s: float = 30.0
    batch_backlog_per_worker: float = 48.0
    cold_prior_rps: float = 0.01
    max_fresh_starts_per_gpu: int | None = 6
    thrash_horizon_starts: float = 1.0
    max_pool_starts_per_node: int | None = None
    pool_waits_for_demand: bool = False
    park_idle: bool = False
    park_release_fraction: float = 0.45
    unpark_s: float = 0.3
    park_after_s: float | None = None
    parked_keep_alive_s: float | None = None
    batch_kv_bytes: int = 0
    burst_kv_bytes: int = 0
    burst_kv_min_wait_s: float = 0.2
    scale_up_wait_fraction: float | None = None
    kv_grant_idle_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("batch_kv_bytes", "burst_kv_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.scale_up_wait_fraction is not None and not 0 < self.scale_up_wait_fraction <= 1:
            raise ValueError(
                f"scale_up_wait_fraction must be in (0, 1] or None, got {self.scale_up_wait_fraction!r}"
            )
        for name in ("burst_kv_min_wait_s", "kv_grant_idle_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not 0.0 < self.gpu_utilization <= 1.0:
            raise ValueError(f"gpu_utilization must be in (0, 1], got {self.gpu_utilization!r}")
        if self.victim_rate not in VICTIM_RATES:
            raise ValueError(f"victim_rate must be one of {VICTIM_RATES}, got {self.victim_rate!r}")
        if not 0.0 <= self.driver_headroom < 1.0:
            raise ValueError(f"driver_headroom must be in [0, 1), got {self.driver_headroom!r}")
        if not self.scale_up_queue_per_worker > 0:
            raise ValueError(f"scale_up_queue_per_worker must be > 0, got {self.scale_up_queue_per_worker!r}")
        if not 0 <= self.backoff_base_s <= self.backoff_cap_s:
            raise ValueError(
                f"need 0 <= backoff_base_s <= backoff_cap_s, got backoff_base_s={self.backoff_base_s!r}, "
                f"backoff_cap_s={self.backoff_cap_s!r}"
            )
        if not 0.0 < self.min_standby_probability <= 1.0:
            raise ValueError(
                f"min_standby_probability must be in (0, 1], got {self.min_standby_probability!r}"
            )
        if not self.batch_backlog_per_worker > 0:
            raise ValueError(f"batch_backlog_per_worker must be > 0, got {self.batch_backlog_per_worker!r}")
        if not self.pool_min_age_s >= 0:
            raise ValueError(f"pool_min_age_s must be >= 0, got {self.pool_min_age_s!r}")
        if not self.cold_prior_rps >= 0:
            raise ValueError(f"cold_prior_rps must be >= 0, got {self.cold_prior_rps!r}")
        if self.max_fresh_starts_per_gpu is not None and (
            isinstance(self.max_fresh_starts_per_gpu, bool)
            or not isinstance(self.max_fresh_starts_per_gpu, int)
            or self.max_fresh_starts_per_gpu < 1
        ):
            raise ValueError(
                "max_fresh_starts_per_gpu must be an integer >= 1 or None, "
                f"got {self.max_fresh_starts_per_gpu!r}"
            )
        if self.max_pool_starts_per_node is not None and (
            isinstance(self.max_pool_starts_per_node, bool)
            or not isinstance(self.max_pool_starts_per_node, int)
            or self.max_pool_starts_per_node < 1
        ):
            raise ValueError(
                "max_pool_starts_per_node must be an integer >= 1 or None, "
                f"got {self.max_pool_starts_per_node!r}"
            )
        if not self.thrash_horizon_starts >= 0:
            raise ValueError(f"thrash_horizon_starts must be >= 0, got {self.thrash_horizon_starts!r}")
        if not 0.0 < self.park_release_fraction < 1.0:
            raise ValueError(f"park_release_fraction must be in (0, 1), got {self.park_release_fraction!r}")
        if not self.unpark_s >= 0:
            raise ValueError(f"unpark_s must be >= 0, got {self.unpark_s!r}")
        if self.park_after_s is not None and not self.park_after_s >= 0:
            raise ValueError(f"park_after_s must be >= 0 or None, got {self.park_after_s!r}")
        if self.parked_keep_alive_s is not None and not self.parked_keep_alive_s >= 0:
            raise ValueError(
                f"parked_keep_alive_s must be >= 0 (inf: never) or None, got {self.parked_keep_alive_s!r}"
            )
        if self.refill_s is not None and not self.refill_s > 0:
            raise ValueError(f"refill_s must be > 0 or None, got {self.refill_s!r}")


def burst_overrides(
    cold_prior_rps: float | None, max_fresh_starts_per_gpu: int | None, thrash_horizon_starts: float | None
) -> dict[str, Any]:
    """`PolicyConfig` keyword arguments from a service's settings (`lorafn up`'s config), where None keeps
    PolicyConfig's default and a start cap of 0 means no cap (settings files have no None to say it)."""
    out: dict[str, Any] = {}
    if cold_prior_rps is not None:
        out["cold_prior_rps"] = cold_prior_rps
    if max_fresh_starts_per_gpu is not None:
        out["max_fresh_starts_per_gpu"] = max_fresh_starts_per_gpu or None
    if thrash_horizon_starts is not None:
        out["thrash_horizon_starts"] = thrash_horizon_starts
    return out
