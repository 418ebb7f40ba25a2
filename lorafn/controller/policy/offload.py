"""Offloading under memory pressure (DESIGN §7): which workers to stop so that a new one fits.

Candidates on one GPU, least valuable first:
1. standby workers (ready or still starting), by value density = cold-start rate of their shape
   (functions of that backbone and shape with no idle bound worker, `planner.ColdDemand`) x seconds
   a bind saves over a fresh start / bytes; a shape-agnostic standby counts every cold function of
   its backbone, with the smaller saving of a bind that must capture graphs; a standby holding a cold
   function's pre-loaded adapter adds that adapter's value (`preload.preload_value`), so the standbys
   of cold shapes and those pre-loaded with cold functions go first;
2. idle bound workers (``running == 0``) before their keep-alive ends, by value density = their
   functions' arrival rate x fresh-start seconds (what each next request pays) / bytes; among equals the
   longest idle first. A worker with adapter slots is valued by every function it serves (the sum of their
   rates), since it is the worker of each. A function's last ``min_replicas`` workers and the workers of
   functions with queued requests are not candidates (stopping them would be undone next round);
3. idle bound workers expected to have work again within ``guard_s`` (`expected_return_s`): stopping
   one makes its function start cold again at once (the thrash of the H100 replay at 1 GiB of KV: 32
   functions that did not all fit, 74 offloads and 81 fresh starts in 120 s). They are candidates only
   with ``allow_guarded`` (the caller's call: a request whose deadline a start now still meets), and
   then last.
Never a worker with requests in flight, never one draining (already going), never one the current
plan binds or keeps (``protected``).

`choose_victims` takes candidates in that order until enough bytes are freed, then drops again,
most valuable first, every victim the others make unnecessary: the smallest set the order allows.

Parking (`PolicyConfig.park_idle`, issue 16): before any worker is stopped, idle bound workers may be
*parked* (`park_candidates`): each releases its KV cache and graph pools (`release_bytes`) and stays its
function's worker, whose next request pays an unpark (~0.1-0.3 s) instead of a fresh start (1-3 s). The
order is the offloading order of idle bound workers: tier (expected back soon last), then value density =
arrival rate (of all its functions) x unpark seconds / bytes released, longest idle first among equals.
Unlike a stop, a park may take a function's last ``min_replicas`` workers and one expected back soon (it
stays a worker), but never a worker with requests in flight, one whose functions have requests queued
(they would unpark it at once), one parked already, or one the plan binds, unparks or keeps.
`choose_parks` is `choose_victims` by released bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from lorafn.controller.policy.config import VICTIM_RATES, VictimRate
from lorafn.controller.policy.model import Costs, Function, Worker
from lorafn.controller.policy.planner import ColdDemand
from lorafn.controller.policy.preload import preload_value

STANDBY, IDLE_BOUND, GUARDED = 0, 1, 2
T = TypeVar("T")


@dataclass(frozen=True)
class Victim:
    """A worker that could be stopped. ``tier``: 0 standby, 1 idle bound, 2 idle bound whose function is
    expected back soon; ``density``: value per byte."""

    worker: Worker
    tier: int
    density: float

    @property
    def rank(self) -> tuple[int, float, float, str]:
        return (self.tier, self.density, -self.worker.idle_s, self.worker.id)


def standby_density(
    worker: Worker, cold: ColdDemand, costs: Costs, functions: Mapping[str, Function] | None = None
) -> float:
    """Value density of keeping a standby: cold starts/s it could take x seconds saved / bytes.

    A standby prepared for a shape takes that shape's cold starts; a shape-agnostic one any of its
    backbone's (`planner.ColdDemand`). Plus, when it holds a still-cold function's pre-loaded adapter
    (one of ``functions``), the seconds per second that pre-load saves.
    """
    rate = cold.rate((worker.backbone, worker.shape))
    value = rate * costs.bind_saving_s(prepared=worker.shape is not None)
    held = (functions or {}).get(worker.preloaded or "")
    if held is not None and held.name in cold.key_of:
        value += preload_value(held, costs, cold.window_s)
    return value / max(1, worker.mem_bytes)


def victim_rate(function: Function | None, which: VictimRate = "window") -> float:
    """The arrival rate an idle bound worker's value is ranked by: the snapshot's window (``arrival_rate``,
    60 s), the longer horizon (``long_arrival_rate``, minutes; the window's where not known), or the larger
    of the two."""
    if function is None:
        return 0.0
    long = function.arrival_rate if function.long_arrival_rate is None else function.long_arrival_rate
    if which == "window":
        return function.arrival_rate
    if which == "long":
        return long
    if which == "max":
        return max(function.arrival_rate, long)
    raise ValueError(f"victim rate must be one of {VICTIM_RATES}, got {which!r}")


def served_functions(worker: Worker, functions: Mapping[str, Function]) -> list[Function]:
    """The known functions a bound worker serves: its own, then those that joined its adapter slots."""
    return [f for name in worker.functions if (f := functions.get(name)) is not None]


def served_rate(served: list[Function], rate: VictimRate = "window") -> float:
    """The arrival rate a bound worker's value is ranked by: the sum over every function it serves
    (`served_functions`; a worker with adapter slots is the worker of each, and stopping or parking it sends
    all their next requests to the cold path), each by `victim_rate`."""
    return sum(victim_rate(f, rate) for f in served)


def bound_density(worker: Worker, served: list[Function], costs: Costs, rate: VictimRate = "window") -> float:
    """Value density of an idle bound worker serving ``served``: their arrival rate x what each next request
    pays without it (a fresh start) / bytes."""
    return served_rate(served, rate) * costs.fresh_start_s / max(1, worker.mem_bytes)


def expected_return_s(worker: Worker, served: list[Function]) -> float:
    """Seconds until an idle bound worker is expected to have work again: the sooner of its functions' mean
    inter-arrival time (1 / the sum of their rates) and the time it has been idle. The second because
    arrivals are bursty (the code trace's inter-arrival CoV is ~13): a worker idle for s seconds is, on such
    a trace, about as likely to be needed within s more as not, and a 60 s rate of one or two arrivals says
    little."""
    rate = sum(f.arrival_rate for f in served)
    return min(1.0 / rate if rate > 0 else math.inf, worker.idle_s)


def candidates(
    workers: Iterable[Worker],
    functions: Mapping[str, Function],
    live_count: Mapping[str, int],
    cold: ColdDemand,
    costs: Costs,
    protected: set[str],
    guard_s: float = 0.0,
    allow_guarded: bool = True,
    rate: VictimRate = "window",
) -> list[Victim]:
    """The workers of one GPU that may be offloaded, least valuable first.

    ``live_count[f]``: f's bound and starting workers as the plan stands (for its min_replicas).
    ``guard_s``: an idle bound worker whose function is expected back sooner (`expected_return_s`) is in
    the last tier, and only with ``allow_guarded`` (0: no guard). ``rate``: which arrival rate ranks idle
    bound workers (`victim_rate`).
    """
    out = []
    spare = dict(live_count)
    for w in workers:
        if w.id in protected or w.running > 0 or w.state == "draining":
            continue
        if w.state == "standby" or (w.state == "starting" and w.function is None):
            out.append(Victim(w, STANDBY, standby_density(w, cold, costs, functions)))
        elif w.state == "bound":
            # every function it serves: none with requests queued (it reads them next), none at its floor
            mine = served_functions(w, functions)
            if any(f.queued > 0 or spare.get(f.name, 0) <= f.min_replicas for f in mine):
                continue
            guarded = guard_s > 0 and expected_return_s(w, mine) < guard_s
            if guarded and not allow_guarded:
                continue
            out.append(Victim(w, GUARDED if guarded else IDLE_BOUND, bound_density(w, mine, costs, rate)))
    out.sort(key=lambda v: v.rank)
    # min_replicas: of a function's idle workers only those above its floor may go; take the least
    # valuable first (the sort above) and count them off (a shared worker off each function it serves).
    kept = []
    for v in out:
        if v.tier != STANDBY:
            names = [f.name for f in served_functions(v.worker, functions)]
            if any(spare.get(name, 0) <= functions[name].min_replicas for name in names):
                continue
            for name in names:
                spare[name] = spare.get(name, 0) - 1
        kept.append(v)
    return kept


def choose_victims(ordered: list[Victim], need_bytes: int) -> list[Victim] | None:
    """The victims that free at least ``need_bytes`` (None when all of them together cannot)."""
    return _smallest_prefix_set(ordered, need_bytes, lambda v: v.worker.mem_bytes)


def _smallest_prefix_set(ordered: list[T], need_bytes: int, size: Callable[[T], int]) -> list[T] | None:
    """Take ``ordered`` from the front until ``need_bytes`` are freed, then drop, most valuable first, every
    item the others make unnecessary (None when all of them together cannot free enough)."""
    if need_bytes <= 0:
        return []
    chosen, freed = [], 0
    for v in ordered:
        if freed >= need_bytes:
            break
        chosen.append(v)
        freed += size(v)
    if freed < need_bytes:
        return None
    for v in reversed(list(chosen)):  # most valuable first: keep it if the others suffice
        if freed - size(v) >= need_bytes:
            chosen.remove(v)
            freed -= size(v)
    return chosen


def release_bytes(worker: Worker, fraction: float) -> int:
    """For a bound worker, the bytes parking it gives back; for a parked one, the bytes unparking it takes
    back: its ``release_bytes`` where the snapshot knows them, else ``fraction`` of its unparked charge."""
    if worker.release_bytes > 0:
        return worker.release_bytes
    if worker.parked:
        return int(worker.mem_bytes * fraction / (1.0 - fraction))
    return int(worker.mem_bytes * fraction)


@dataclass(frozen=True)
class ParkCandidate(Victim):
    """An idle bound worker that could be parked, ranked as a `Victim` (parking follows the offloading
    order): ``tier`` `IDLE_BOUND`, or `GUARDED` when its function is expected back soon; ``density``: value
    lost per byte released; ``release``: bytes it gives back."""

    release: int


def park_candidates(
    workers: Iterable[Worker],
    functions: Mapping[str, Function],
    protected: set[str],
    unpark_s: float,
    fraction: float,
    guard_s: float = 0.0,
    rate: VictimRate = "window",
) -> list[ParkCandidate]:
    """The workers of one GPU that may be parked, least valuable first (see the module docstring)."""
    out = []
    for w in workers:
        if w.state != "bound" or w.parked or not w.parkable or w.running > 0 or w.id in protected:
            continue
        mine = served_functions(w, functions)
        if any(f.queued > 0 for f in mine):
            continue
        release = release_bytes(w, fraction)
        if release <= 0:
            continue
        guarded = guard_s > 0 and expected_return_s(w, mine) < guard_s
        density = served_rate(mine, rate) * unpark_s / release
        out.append(ParkCandidate(w, GUARDED if guarded else IDLE_BOUND, density, release))
    out.sort(key=lambda c: c.rank)
    return out


def choose_parks(ordered: list[ParkCandidate], need_bytes: int) -> list[ParkCandidate] | None:
    """The workers to park that release at least ``need_bytes`` (None when all of them cannot)."""
    return _smallest_prefix_set(ordered, need_bytes, lambda c: c.release)


def lost_value(victims: list[Victim]) -> float:
    """Total value (density x bytes) the victims would take with them: to compare GPUs."""
    return sum(v.density * v.worker.mem_bytes for v in victims)
