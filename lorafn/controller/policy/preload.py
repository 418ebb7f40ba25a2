"""Pre-loading adapters into standby workers (DESIGN idea 4, §7 PCKP: the "adapter on GPU" items).

A standby prepared for an adapter shape holds zeroed LoRA buffers of that shape. It can hold one function's
adapter in them before that function's first request: a bind to it is then registration only (no file read,
no copy into the buffers), and a bind to any other function overwrites every buffer (`runtime.lora.copy_lora`
zeroes and copies each one), so a standby that pre-loaded F and never served F's requests may still take G.
The memory is the standby's own buffers, already in its reservation: pre-loading grants no new bytes, it only
spends a load in the standby's idle time.

Items: one per function F that may start cold (no idle bound worker, none given this round): F's adapter in
one standby. Value = adapter-load seconds a pre-loaded bind saves (`Costs.preload_saving_s`) x the rate of
F's cold arrivals (the chance of at least one arrival within the refill window, per window, as in
`planner.ColdDemand`) + a tiny prior, so that functions without recent arrivals still fill buffers nobody
else wants (a newly registered function's first request is the typical cold start). Weight = the bytes of
the buffers F's adapter occupies: the standby's LoRA buffers of F's shape (the largest adapter of that shape).
Bins: each ready standby of F's backbone prepared for F's exact shape, on a GPU holding the backbone, with
room for one adapter of its shape. Solved by `knapsack.greedy` (value density order); the standby already
holding F is F's preferred bin (no reload churn). Every bin takes exactly one item and all items of a shape
weigh the same, so the density order is the value order within a shape and the greedy is optimal;
the tests check it against `exact.solve_exact`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from lorafn.controller.policy.actions import Preload
from lorafn.controller.policy.knapsack import Item, Problem, Solution, greedy
from lorafn.controller.policy.model import Costs, Function, Worker

# value of a function with no recent arrival (per second): below any function that had one, above nothing
PRIOR_RATE = 1e-6


@dataclass(frozen=True)
class PreloadProblem:
    problem: Problem
    functions: Mapping[str, Function]  # item key (function name) -> function
    values: Mapping[str, float]


def preload_value(fn: Function, costs: Costs, window_s: float) -> float:
    """Seconds saved per second by holding ``fn``'s adapter in a standby (see the module docstring)."""
    if not window_s > 0:
        raise ValueError(f"window_s must be > 0, got {window_s!r}")
    chance = 1.0 - math.exp(-fn.arrival_rate * window_s) if fn.arrival_rate > 0 else 0.0
    return costs.preload_saving_s() * (chance / window_s + PRIOR_RATE)


def preload_problem(
    functions: Iterable[Function],
    standbys: Iterable[Worker],
    where: Mapping[str, list[str]],
    costs: Costs,
    window_s: float,
    skip: set[str],
) -> PreloadProblem:
    """The knapsack instance: ``standbys`` are the ready, unclaimed ones; ``skip``: functions that need no
    pre-loading (warm, or given a worker this round)."""
    bins = [w for w in standbys if w.state == "standby" and w.shape is not None]
    by_place: dict[tuple[str, str], list[Worker]] = defaultdict(list)  # (backbone, shape) -> standbys
    for w in bins:
        if w.gpu in where.get(w.backbone, ()):
            by_place[(w.backbone, w.shape or "")].append(w)
    candidates = [f for f in functions if f.name not in skip and (f.backbone, f.shape) in by_place]
    buffer_bytes: dict[tuple[str, str], int] = defaultdict(lambda: 1)
    for f in candidates:  # the shape's buffers hold its largest adapter
        key = (f.backbone, f.shape)
        buffer_bytes[key] = max(buffer_bytes[key], f.lora_bytes)
    capacity = {w.id: buffer_bytes[(w.backbone, w.shape or "")] for ws in by_place.values() for w in ws}
    holder = {w.preloaded: w.id for ws in by_place.values() for w in sorted(ws, key=lambda w: w.id)}
    values = {f.name: preload_value(f, costs, window_s) for f in candidates}

    def bin_order(w: Worker) -> tuple[int, float, str]:
        # a function without a holder goes to a standby holding nothing wanted first, then to the one whose
        # adapter is worth least (the greedy takes the first bin with room): a stable pool is not reloaded
        held_value = values.get(w.preloaded or "")
        return (0, 0.0, w.id) if held_value is None else (1, held_value, w.id)

    items, named = [], {}
    for f in sorted(candidates, key=lambda f: f.name):
        key = (f.backbone, f.shape)
        value = values[f.name]
        # only a standby the function fits (a bind refuses a smaller one, and with claims a standby holding
        # a function's adapter serves its requests itself: on CPU a 4 GiB-KV function was served by a
        # 16 MiB-KV standby, found by test_controller_local)
        ids = tuple(w.id for w in sorted(by_place[key], key=bin_order) if w.mem_bytes >= f.mem_bytes)
        if not ids:
            continue
        held = holder.get(f.name)
        items.append(
            Item(
                key=f.name,
                value=value,
                weight=buffer_bytes[key],
                bins=ids,
                preferred=held if held in ids else None,
            )
        )
        named[f.name] = f
    return PreloadProblem(Problem(tuple(items), capacity), named, values)


def plan_preload(
    functions: Iterable[Function],
    standbys: Iterable[Worker],
    where: Mapping[str, list[str]],
    costs: Costs,
    window_s: float,
    skip: set[str],
) -> tuple[Solution, list[Preload]]:
    """Which adapter each standby should hold, and a `Preload` for each standby not holding it yet."""
    standbys = list(standbys)
    pp = preload_problem(functions, standbys, where, costs, window_s, skip)
    solution = greedy(pp.problem)
    by_id = {w.id: w for w in standbys}
    actions = []
    for name, wid in sorted(solution.placement.items(), key=lambda kv: kv[1]):
        w = by_id[wid]
        if w.preloaded != name:
            actions.append(Preload(wid, str(name), w.gpu, pp.values[str(name)]))
    return solution, actions
