"""What a replay measured, and the arithmetic over it: percentiles, SLO violations, the path each request
took, GPU-seconds held, cost, cost-effectiveness. Pure (no I/O), so every figure is tested on its own.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

QUANTILES = (50, 90, 99)
# The paths a request can take (docs/replay.md#paths). `cold` is a cold request whose cold start left no
# `bound` event the replay could match (e.g. the run ended first); `none`: it never reached a worker.
# how a request found its worker; "join": a cold start into a free adapter slot of a live worker
# (docs/runtime.md#adapter-slots)
PATHS = ("warm", "unparked", "join", "standby", "fresh", "queued", "cold", "none")
MiB = 1 << 20
# The replay's clock: 0 is the measured window's start; a warm-up runs at negative times before it.
WINDOW_START_S = 0.0


@dataclass
class RequestResult:
    """One request as the client saw it. Times are seconds from the measured window's start (negative:
    the warm-up before it); durations in ms."""

    index: int
    function: str
    scheduled_s: float
    sent_s: float | None = None
    status: int = 0  # HTTP status; 0 when no response came (connection error, client timeout)
    cold: bool | None = None  # the gateway's x-lorafn-cold-start header: no live worker at admission
    request_id: str | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None  # set for every request that did not end with a complete answer
    path: str = "none"
    warmup: bool = False  # sent in the warm-up before the measured window: none of its figures

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_ms(self) -> float | None:
        """Mean time per output token after the first."""
        if self.ttft_ms is None or self.e2e_ms is None or not self.completion_tokens:
            return None
        if self.completion_tokens < 2:
            return None
        return (self.e2e_ms - self.ttft_ms) / (self.completion_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "tpot_ms": self.tpot_ms}

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> RequestResult:
        """The inverse of `to_json` (its derived `tpot_ms` is dropped): replay.json's request records."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in record.items() if k in names})


@dataclass(frozen=True)
class WorkerSample:
    """One worker as its heartbeat record said at a sampling instant."""

    worker_id: str
    state: str  # standby | serving | draining | ...
    function: str
    gpu: str
    backbone: str
    mem_bytes: int
    # the driver's count of the whole process (context included: `worker_overhead_bytes` is not added)
    whole_process: bool = False


@dataclass
class Sample:
    """The platform at one instant (seconds from the measured window's start; negative in the warm-up)."""

    t_s: float
    workers: list[WorkerSample] = field(default_factory=list)


@dataclass(frozen=True)
class BoundEvent:
    """A cold start completed: a worker took `function` by `path` (standby | fresh | join) at `t_s`; or (path
    `unparked`) a parked worker of `function` took its KV cache back (`PolicyConfig.park_idle`)."""

    t_s: float
    function: str
    path: str
    ms: float | None


def percentiles(values: Iterable[float | None], qs: Sequence[int] = QUANTILES) -> dict[str, float | None]:
    """`{"p50": ..., "p90": ..., "p99": ..., "mean": ...}` of the values that are not None (None if none)."""
    data = np.asarray([v for v in values if v is not None], dtype=float)
    if data.size == 0:
        return {**{f"p{q}": None for q in qs}, "mean": None}
    return {**{f"p{q}": float(np.percentile(data, q)) for q in qs}, "mean": float(data.mean())}


def decoding_functions(results: Sequence[RequestResult]) -> list[tuple[RequestResult, int]]:
    """Each request with a TPOT, paired with the number of distinct functions (its own included) that were
    generating tokens at the middle of its decode phase, [sent + TTFT, sent + E2E]. Every function is its
    own worker process and every worker's decode step reads the whole backbone, so TPOT grows with this
    count rather than with one function's batch (docs/architecture.md, "Decode cost across functions")."""
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in results:
        if r.sent_s is not None and r.ttft_ms is not None and r.e2e_ms is not None and r.e2e_ms > r.ttft_ms:
            spans[r.function].append((r.sent_s + r.ttft_ms / 1000, r.sent_s + r.e2e_ms / 1000))
    # one function's overlapping spans merged: then the distinct functions decoding at t are the merged
    # intervals holding t, counted from sorted starts and ends (O(n log n): a 4-hour replay has ~30k requests)
    merged: dict[str, list[tuple[float, float]]] = {}
    for fn, intervals in spans.items():
        intervals.sort()
        runs = [intervals[0]]
        for a, b in intervals[1:]:
            if a > runs[-1][1]:
                runs.append((a, b))
            else:
                runs[-1] = (runs[-1][0], max(runs[-1][1], b))
        merged[fn] = runs
    begin = np.sort(np.asarray([a for runs in merged.values() for a, _ in runs], dtype=float))
    finish = np.sort(np.asarray([b for runs in merged.values() for _, b in runs], dtype=float))
    out = []
    for r in results:
        if r.tpot_ms is None or r.sent_s is None or r.ttft_ms is None or r.e2e_ms is None:
            continue
        mid = r.sent_s + (r.ttft_ms + r.e2e_ms) / 2000
        n = int(np.searchsorted(begin, mid, side="right") - np.searchsorted(finish, mid, side="right"))
        # its own function counts too where its span is empty (E2E = TTFT) and none of its others holds mid
        runs = merged.get(r.function, [])
        i = bisect.bisect_right(runs, (mid, math.inf)) - 1
        own = i >= 0 and runs[i][0] <= mid < runs[i][1]
        out.append((r, n if own else n + 1))
    return out


def decode_concurrency(results: Sequence[RequestResult], width: int = 5) -> dict[str, Any]:
    """TPOT against the functions decoding at once (`decoding_functions`): per bin of `width` counts the
    requests, TPOT p50 and TPOT p50 ÷ the bin's mean count (the decode time each decoding function
    added), and over all requests the median of TPOT ÷ count (`ms_per_function`)."""
    if width < 1:
        raise ValueError(f"width: {width} must be >= 1")
    pairs = [(r.tpot_ms, n) for r, n in decoding_functions(results) if r.tpot_ms is not None]
    bins: dict[int, list[tuple[float, int]]] = {}
    for tpot, n in pairs:
        bins.setdefault((n - 1) // width * width + 1, []).append((tpot, n))
    rows = []
    for lo in sorted(bins):
        tpot = float(np.median([t for t, _ in bins[lo]]))
        mean_n = float(np.mean([n for _, n in bins[lo]]))
        rows.append(
            {"functions": [lo, lo + width - 1], "requests": len(bins[lo]), "tpot_ms_p50": tpot,
             "ms_per_function": tpot / mean_n}
        )  # fmt: skip
    return {
        "bins": rows,
        "ms_per_function": float(np.median([t / n for t, n in pairs])) if pairs else None,
        "functions_p50": float(np.median([n for _, n in pairs])) if pairs else None,
    }


def slo_violated(result: RequestResult, slo_ttft_ms: float) -> bool:
    """An error, or a first token later than the SLO, violates it (an unanswered request met no target)."""
    if slo_ttft_ms <= 0:
        raise ValueError(f"slo_ttft_ms: {slo_ttft_ms} must be > 0")
    return (not result.ok) or result.ttft_ms is None or result.ttft_ms > slo_ttft_ms


def assign_paths(
    results: Sequence[RequestResult], events: Sequence[BoundEvent], slack_s: float = 1.0
) -> None:
    """Set each result's `path` in place.

    The gateway tells per request whether a live worker existed at admission (`cold`). Which way a cold
    start went is recorded per function (`bound` lifecycle events with their path), not per request, so
    it is inferred: per function, the first cold request with no cold start in flight leads an episode,
    which ends at its first token (or its end); the first `bound` event of that function at or after the
    leader was sent (less `slack_s` for clock skew) gives the leader its path, and the other cold requests
    sent during the episode waited behind that same start: `queued`.

    A parked worker (`PolicyConfig.park_idle`) is live to the gateway, so a request that waited for its
    unpark arrives as warm: a warm request with an `unparked` event of its function between its sending
    (less `slack_s`) and its first token (or its end) is `unparked` instead (an inference too: a function
    with another, unparked worker may have served it without waiting).
    """
    by_function: dict[str, list[BoundEvent]] = defaultdict(list)
    unparks: dict[str, list[float]] = defaultdict(list)
    for e in sorted(events, key=lambda e: e.t_s):
        if e.path == "unparked":
            unparks[e.function].append(e.t_s)
        else:
            by_function[e.function].append(e)
    for r in results:
        r.path = "none" if r.cold is None else "warm" if not r.cold else "cold"
        if r.path == "warm" and r.sent_s is not None and unparks.get(r.function):
            waited = r.ttft_ms if r.ttft_ms is not None else r.e2e_ms
            first_s = r.sent_s + (waited or 0.0) / 1000
            if any(r.sent_s - slack_s <= t <= first_s for t in unparks[r.function]):
                r.path = "unparked"
    cold = sorted(
        (r for r in results if r.cold and r.sent_s is not None), key=lambda r: (r.function, r.sent_s or 0.0)
    )
    episode_end: dict[str, float] = {}
    for r in cold:
        assert r.sent_s is not None
        if r.sent_s < episode_end.get(r.function, -math.inf):
            r.path = "queued"
            continue
        ends = r.ttft_ms if r.ttft_ms is not None else r.e2e_ms
        episode_end[r.function] = r.sent_s + (ends or 0.0) / 1000
        queue = by_function.get(r.function, [])
        while queue and queue[0].t_s < r.sent_s - slack_s:
            queue.pop(0)  # a start for an earlier episode (or before the replay): not this one's
        if queue:
            r.path = queue.pop(0).path or "cold"


def summarize(results: Sequence[RequestResult], slo_ttft_ms: float) -> dict[str, Any]:
    """Counts, latency percentiles (ms), SLO violations and paths of a set of requests."""
    ok = [r for r in results if r.ok]
    errors = Counter((r.error or "").split(":", 1)[0] for r in results if not r.ok)
    violations = sum(slo_violated(r, slo_ttft_ms) for r in results)
    return {
        "requests": len(results),
        "answered": len(ok),
        "errors": sum(errors.values()),
        "error_kinds": dict(errors),
        "slo_ttft_ms": slo_ttft_ms,
        "slo_violations": violations,
        "slo_violation_rate": violations / len(results) if results else 0.0,
        "ttft_ms": percentiles(r.ttft_ms for r in ok),
        "tpot_ms": percentiles(r.tpot_ms for r in ok),
        "e2e_ms": percentiles(r.e2e_ms for r in ok),
        "paths": {p: n for p in PATHS if (n := sum(r.path == p for r in results))},
        "completion_tokens": sum(r.completion_tokens or 0 for r in ok),
    }


def summarize_all(results: Sequence[RequestResult], slo_ms: dict[str, float]) -> dict[str, Any]:
    """Overall (violations judged against each request's own function's SLO) and per function."""
    per_function = {
        fn: summarize([r for r in results if r.function == fn], slo)
        for fn, slo in sorted(slo_ms.items())
        if any(r.function == fn for r in results)
    }
    overall = summarize(results, 1.0)  # its violation fields are replaced just below
    violations = sum(slo_violated(r, slo_ms[r.function]) for r in results)
    overall.update(
        slo_ttft_ms=None,
        slo_violations=violations,
        slo_violation_rate=violations / len(results) if results else 0.0,
    )
    return {"overall": overall, "functions": per_function}


def own_bytes(w: WorkerSample, worker_overhead_bytes: int) -> int:
    """What a worker holds of its own: its reservation, plus `worker_overhead_bytes` (its context) unless the
    heartbeat carries the driver's count of the whole process, which holds the context already."""
    return w.mem_bytes + (0 if w.whole_process else worker_overhead_bytes)


def held_bytes(
    sample: Sample,
    devices: Sequence[str],
    backbone_bytes: dict[str, int],
    shared: bool,
    worker_overhead_bytes: int,
) -> dict[str, int]:
    """Memory held on each device at one instant: every worker's reservation (its heartbeat `mem_bytes`:
    KV cache + LoRA, on GPU all torch reserved) plus `worker_overhead_bytes` (its context) unless the
    heartbeat carries the driver's count of the whole process (`mem_source: driver`), plus the
    backbone weights: with sharing one copy of each backbone per device (the backbone server holds it
    whether or not a worker runs), without sharing one copy inside every worker (already in a
    whole-process count, which holds the private copy as it holds the context)."""
    held = dict.fromkeys(devices, 0)
    if shared:
        for d in devices:
            held[d] += sum(backbone_bytes.values())
    for w in sample.workers:
        extra = 0 if shared or w.whole_process else backbone_bytes.get(w.backbone, 0)
        held[w.gpu] = held.get(w.gpu, 0) + own_bytes(w, worker_overhead_bytes) + extra
    return held


def _integrate(
    samples: Sequence[Sample], end_s: float, start_s: float | None, gpus_at: Callable[[Sample], float]
) -> float:
    """∫ gpus_at(sample in force) dt over [first sample, end_s], or over [start_s, end_s] when given. Each
    sample holds until the next (step function), so the sample in force at `start_s` counts from `start_s`
    on and the samples before it count for nothing else."""
    if not samples:
        return 0.0
    ordered = sorted(samples, key=lambda s: s.t_s)
    total = 0.0
    for s, nxt in zip(ordered, [*ordered[1:], None], strict=True):
        since = s.t_s if start_s is None else max(s.t_s, start_s)
        until = end_s if nxt is None else nxt.t_s
        dt = max(0.0, until - since)
        if dt > 0.0:
            total += dt * gpus_at(s)
    return total


def gpu_seconds(
    samples: Sequence[Sample],
    end_s: float,
    device_bytes: dict[str, int],
    backbone_bytes: dict[str, int],
    shared: bool,
    worker_overhead_bytes: int = 0,
    start_s: float | None = None,
) -> float:
    """∫ Σ_devices min(1, held / device size) dt over [first sample, end_s], or over [start_s, end_s] when
    given (the measured window after a warm-up): a GPU held whole for a second is one GPU-second; half its
    memory for a second, half of one (what a GPU shared by functions costs each)."""

    def gpus_at(s: Sample) -> float:
        held = held_bytes(s, list(device_bytes), backbone_bytes, shared, worker_overhead_bytes)
        return sum(min(1.0, held.get(d, 0) / size) for d, size in device_bytes.items() if size > 0)

    return _integrate(samples, end_s, start_s, gpus_at)


def unshared_gpu_seconds(
    samples: Sequence[Sample],
    end_s: float,
    device_bytes: dict[str, int],
    backbone_bytes: dict[str, int],
    worker_overhead_bytes: int = 0,
    start_s: float | None = None,
) -> float:
    """What the same workers at the same times would have held without backbone sharing, in GPU-seconds:
    every bound worker (anything not on standby) with its own copy of its backbone beside its own memory, a
    standby worker only its own memory, and no shared copy. Not capped at one GPU per device: the workers
    that one shared GPU holds at once would need several GPUs without sharing (GPU-equivalents = held /
    device size). A computed lower bound for serving the same requests as promptly without sharing (such
    a platform would also load its weights at every cold start and hold its GPUs longer), not a
    measurement: the no-sharing ablation measures what one GPU's worth of private copies serves."""
    size = sum(device_bytes.values())
    if size <= 0:
        return 0.0

    def gpus_at(s: Sample) -> float:
        held = 0
        for w in s.workers:
            held += own_bytes(w, worker_overhead_bytes)
            if w.state != "standby":
                held += backbone_bytes.get(w.backbone, 0)
        # the devices are alike in a run (one GPU model); their mean size turns bytes into GPUs
        return held / (size / len(device_bytes))

    return _integrate(samples, end_s, start_s, gpus_at)


def worker_series(samples: Sequence[Sample]) -> dict[str, list[float]]:
    """Time series for the plots: bound and standby worker counts and the workers' memory (MiB)."""
    out: dict[str, list[float]] = {"t_s": [], "bound": [], "standby": [], "worker_mib": []}
    for s in sorted(samples, key=lambda s: s.t_s):
        out["t_s"].append(s.t_s)
        out["standby"].append(sum(w.state == "standby" for w in s.workers))
        out["bound"].append(sum(w.state != "standby" for w in s.workers))
        out["worker_mib"].append(sum(w.mem_bytes for w in s.workers) / MiB)
    return out


def cost_usd(gpu_s: float, usd_per_gpu_hour: float) -> float:
    if usd_per_gpu_hour < 0:
        raise ValueError(f"usd_per_gpu_hour: {usd_per_gpu_hour} must be >= 0")
    return gpu_s / 3600.0 * usd_per_gpu_hour


def cost_effectiveness(
    e2e_ms: float | None, cost: float, base_e2e_ms: float | None, base_cost: float
) -> float | None:
    """ServerlessLoRA's cost-effectiveness 1 / (E2E × cost), relative to a baseline's (baseline = 1)."""
    if not e2e_ms or not base_e2e_ms or cost <= 0 or base_cost <= 0:
        return None
    return (base_e2e_ms * base_cost) / (e2e_ms * cost)


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, None when either is missing or b is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def reduction(value: float | None, baseline: float | None) -> float | None:
    """1 - value / baseline: 0.87 means 87% lower than the baseline."""
    r = ratio(value, baseline)
    return None if r is None else 1.0 - r
