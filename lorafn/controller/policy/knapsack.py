"""A generic multiple knapsack with precedence and per-bin count limits, solved greedily.

The problem (PCKP of ServerlessLoRA, as DESIGN §7 states it): items with a value and a weight
(bytes); bins (GPUs) with a capacity; an item may go only into its own ``bins`` (a standby only
where its backbone is resident); an item with ``requires`` may be taken only if that item is taken
(the k-th standby of a key only after the (k-1)-th); at most ``group_limit[(bin, group)]`` items of
one group per bin (a backbone's max standby workers per GPU).

`greedy` orders items by value density v/w (ties: higher value, then input order) and puts each
into a bin where it fits: its ``preferred`` bin first (where an existing worker already holds it,
so the plan does not move workers around), else the bin with the most room left (spreads standbys
over GPUs, leaving room for the next burst everywhere). An item met before its prerequisite waits
and is reconsidered right after the prerequisite is placed. Finally, as in the classic modified
greedy, the single most valuable item alone is taken instead if it beats the whole greedy set.
O(n log n + n·B). `lorafn.controller.policy.exact` solves small instances exactly for the tests.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Item:
    """One thing that could be kept. ``key`` is unique in its problem."""

    key: Hashable
    value: float
    weight: int
    bins: tuple[str, ...]
    group: str | None = None
    requires: Hashable | None = None
    preferred: str | None = None

    def __post_init__(self) -> None:
        if not self.value >= 0:
            raise ValueError(f"Item {self.key!r}: value must be >= 0, got {self.value!r}")
        if isinstance(self.weight, bool) or not isinstance(self.weight, int) or self.weight < 0:
            raise ValueError(f"Item {self.key!r}: weight must be an integer >= 0, got {self.weight!r}")

    @property
    def density(self) -> float:
        return self.value / self.weight if self.weight else float("inf")


@dataclass(frozen=True)
class Problem:
    items: tuple[Item, ...]
    capacity: Mapping[str, int]
    group_limit: Mapping[tuple[str, str], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        keys = set()
        for item in self.items:
            if item.key in keys:
                raise ValueError(f"Problem.items: duplicate key {item.key!r}")
            keys.add(item.key)
        for item in self.items:
            if item.requires is not None and item.requires not in keys:
                raise ValueError(f"Item {item.key!r}: requires unknown item {item.requires!r}")
            for b in item.bins:
                if b not in self.capacity:
                    raise ValueError(f"Item {item.key!r}: bin {b!r} has no capacity")


@dataclass(frozen=True)
class Solution:
    """``placement``: item key -> bin for every item taken."""

    placement: dict[Hashable, str]
    value: float


def value_of(problem: Problem, placement: Mapping[Hashable, str]) -> float:
    by_key = {i.key: i for i in problem.items}
    return sum(by_key[k].value for k in placement)


def check_feasible(problem: Problem, placement: Mapping[Hashable, str]) -> None:
    """Raise ValueError naming the first violated constraint (tests use it on every solution)."""
    by_key = {i.key: i for i in problem.items}
    load = dict.fromkeys(problem.capacity, 0)
    count: dict[tuple[str, str], int] = {}
    for key, b in placement.items():
        item = by_key[key]
        if b not in item.bins:
            raise ValueError(f"item {key!r} placed in {b!r}, not one of its bins {item.bins}")
        if item.requires is not None and item.requires not in placement:
            raise ValueError(f"item {key!r} taken without its prerequisite {item.requires!r}")
        load[b] += item.weight
        if item.group is not None:
            count[(b, item.group)] = count.get((b, item.group), 0) + 1
    for b, used in load.items():
        if used > problem.capacity[b]:
            raise ValueError(f"bin {b!r}: {used} > capacity {problem.capacity[b]}")
    for gk, n in count.items():
        limit = problem.group_limit.get(gk)
        if limit is not None and n > limit:
            raise ValueError(f"bin/group {gk!r}: {n} items > limit {limit}")


def greedy(problem: Problem) -> Solution:
    """The greedy solution described in the module docstring."""
    room = dict(problem.capacity)
    count: dict[tuple[str, str], int] = {}
    limit = problem.group_limit
    placement: dict[Hashable, str] = {}
    waiting: dict[Hashable, list[Item]] = {}  # prerequisite key -> items seen before it was placed

    def place(item: Item) -> None:
        if item.requires is not None and item.requires not in placement:
            waiting.setdefault(item.requires, []).append(item)
            return
        weight, group = item.weight, item.group
        chosen = None
        preferred = item.preferred
        if preferred is not None and room.get(preferred, -1) >= weight:
            cap = limit.get((preferred, group)) if group is not None else None
            if cap is None or count.get((preferred, group), 0) < cap:
                chosen = preferred
        if chosen is None:
            best = -1
            for b in item.bins:
                r = room[b]
                if r > best and r >= weight:
                    if group is not None:
                        cap = limit.get((b, group))
                        if cap is not None and count.get((b, group), 0) >= cap:
                            continue
                    chosen, best = b, r
        if chosen is None:
            return
        placement[item.key] = chosen
        room[chosen] -= weight
        if group is not None:
            count[(chosen, group)] = count.get((chosen, group), 0) + 1
        for child in waiting.pop(item.key, ()):
            place(child)

    items = problem.items
    for i in sorted(range(len(items)), key=lambda i: (-items[i].density, -items[i].value, i)):
        place(items[i])
    value = sum(i.value for i in problem.items if i.key in placement)

    # Modified greedy: density order can leave out one big valuable item; take it alone if better.
    single, single_bin = None, None
    for item in problem.items:
        if item.requires is None and (single is None or item.value > single.value):
            b = _first_fitting_bin(problem, item)
            if b is not None:
                single, single_bin = item, b
    if single is not None and single_bin is not None and single.value > value:
        return Solution({single.key: single_bin}, single.value)
    return Solution(placement, value)


def _first_fitting_bin(problem: Problem, item: Item) -> str | None:
    for b in item.bins:
        cap = problem.group_limit.get((b, item.group)) if item.group is not None else None
        if problem.capacity[b] >= item.weight and (cap is None or cap >= 1):
            return b
    return None
