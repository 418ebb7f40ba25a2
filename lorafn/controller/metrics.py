"""Prometheus metrics of the controller: cold starts by path, binds (fast path or round; adapter pre-loaded or
not) and the request -> bind command latency, pre-loads, starts, stops by reason, offloads by cause and
victim, parks (their refusals, how long a plan waited for them) and unparks, start failures, rounds and
their duration, the warm pool (standby workers wanted and present) and the workers of each GPU by state.

One registry per `Controller` (so two in one process, as in tests, do not collide). `lorafn controller
run --metrics-port N` serves it over HTTP; `lorafn up` serves it when `controller_metrics_port` is set.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from lorafn.controller.policy.model import Worker

# what a worker on a GPU is doing, for `lorafn_controller_gpu_workers`
GPU_WORKER_STATES = ("busy", "idle", "parked", "standby", "starting", "draining")


def gpu_worker_state(worker: Worker) -> str:
    """One of GPU_WORKER_STATES: a bound worker is busy with requests in flight, else parked or idle."""
    if worker.state != "bound":
        return worker.state
    if worker.parked:
        return "parked"
    return "busy" if worker.running > 0 else "idle"


def gpu_worker_counts(gpus: Iterable[str], workers: Iterable[Worker]) -> dict[tuple[str, str], int]:
    """Workers per (GPU, state), every state of every GPU present (0 where none: a series that drops to no
    worker reads 0, not its last value)."""
    counts = {(g, st): 0 for g in gpus for st in GPU_WORKER_STATES}
    for (g, st), n in Tally((w.gpu, gpu_worker_state(w)) for w in workers).items():
        counts[(g, st)] = n
    return counts


class ControllerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.cold_starts = Counter(
            "lorafn_controller_cold_starts",
            "Cold starts that completed, by path (standby|fresh)",
            ["path"],
            registry=r,
        )
        self.cold_start_seconds = Histogram(
            "lorafn_controller_cold_start_seconds",
            "Bind -> serving (standby) or spawn -> serving (fresh), as the workers report it",
            ["path"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80),
            registry=r,
        )
        self.binds = Counter(
            "lorafn_controller_binds",
            "Bind commands sent to standby workers, by path (fast: from the last snapshot on demand; round) "
            "and whether the standby had pre-loaded the function's adapter (yes|no)",
            ["path", "preloaded"], registry=r,
        )  # fmt: skip
        self.demand_to_bind = Histogram(
            "lorafn_controller_demand_to_bind_seconds",
            "From the gateway's demand record to the bind command (both on Redis's clock), by path",
            ["path"], buckets=(0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5), registry=r,
        )  # fmt: skip
        self.preloads = Counter(
            "lorafn_controller_preloads", "Pre-load commands sent to standby workers", registry=r
        )
        self.offloads = Counter(
            "lorafn_controller_offloads",
            "Workers stopped to make room, by cause (cold_start|min_replicas|scale_up) and victim "
            "(standby|idle_bound)",
            ["cause", "victim"], registry=r,
        )  # fmt: skip
        self.starts = Counter(
            "lorafn_controller_starts", "Workers started, by kind (standby|bound)", ["kind"], registry=r
        )
        self.stops = Counter(
            "lorafn_controller_stops", "Stop commands, by reason (offload|scale_down|pool_shrink|keep_alive)",
            ["reason"], registry=r,
        )  # fmt: skip
        # parking (PolicyConfig.park_idle): idle bound workers release their KV cache, keep their process
        self.parks = Counter(
            "lorafn_controller_parks",
            "Idle bound workers parked (the worker acknowledged), by path (round|fast: to make room for an "
            "unpark on demand)",
            ["path"], registry=r,
        )  # fmt: skip
        self.park_refusals = Counter(
            "lorafn_controller_park_refusals",
            "Parks that did not happen, by reason (refused: the worker had requests; timeout: no answer "
            "within park_timeout_s); what the park made room for waits for the next round",
            ["reason"], registry=r,
        )  # fmt: skip
        self.park_wait_seconds = Histogram(
            "lorafn_controller_park_wait_seconds",
            "From a plan's park commands to the last answer (or the timeout): what its other actions waited",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5), registry=r,
        )  # fmt: skip
        self.unparks = Counter(
            "lorafn_controller_unparks",
            "Unpark commands sent to parked workers, by path (fast: on demand from the last snapshot; round)",
            ["path"], registry=r,
        )  # fmt: skip
        self.kv_resizes = Counter(
            "lorafn_controller_kv_resizes",
            "KV budget commands sent to bound workers (grow: more KV out of idle GPU memory; shrink: the "
            "function's own budget back), by cause (batch: an offline batch's backlog; burst: online "
            "requests queued behind busy workers; return: a grant given back)",
            ["direction", "cause"], registry=r,
        )  # fmt: skip
        self.wait_seconds = Counter(
            "lorafn_controller_wait_seconds",
            "Seconds functions with demand waited for a worker, by cause (start_slot: every fresh-start slot "
            "taken; making_room: workers stopped for its memory still exiting; no_room; standby_warming; "
            "backoff; no_backbone)",
            ["cause"], registry=r,
        )  # fmt: skip
        self.start_failures = Counter(
            "lorafn_controller_start_failures", "Workers that failed to start or bind", registry=r
        )
        self.waiting = Gauge(
            "lorafn_controller_waiting_functions", "Functions with demand and no worker", registry=r
        )
        self.pool_target = Gauge("lorafn_controller_pool_target", "Standby workers wanted", registry=r)
        self.fresh_start_estimate = Gauge(
            "lorafn_controller_fresh_start_estimate_seconds",
            "Median of the last fresh starts (spawn -> serving): the policy's refill window", registry=r,
        )  # fmt: skip
        self.pool_standby = Gauge(
            "lorafn_controller_pool_standby", "Standby workers heartbeating", registry=r
        )
        self.gpu_workers = Gauge(
            "lorafn_controller_gpu_workers",
            "Workers per GPU by state (busy: bound with requests in flight; idle; parked; standby; starting; "
            "draining). Every busy worker's decode step reads the whole backbone, so each adds about one "
            "step (7-8 ms for a 7B on an H100) to the TPOT of every other busy worker of its GPU",
            ["gpu", "state"], registry=r,
        )  # fmt: skip
        self.rounds = Histogram(
            "lorafn_controller_round_seconds", "One decision round: snapshot, decide, apply",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5), registry=r,
        )  # fmt: skip

    def observe_gpus(self, gpus: Iterable[str], workers: Iterable[Worker]) -> None:
        """Set `lorafn_controller_gpu_workers` from one round's snapshot; GPUs gone since drop out."""
        self.gpu_workers.clear()
        for (gpu, state), n in gpu_worker_counts(gpus, workers).items():
            self.gpu_workers.labels(gpu, state).set(n)

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        """Expose the registry on http://host:port/metrics (a daemon thread)."""
        start_http_server(port, addr=host, registry=self.registry)
