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
and is reconsidered right after the prerequisite is placed. A swap pass then lets a left-out item
replace less valuable ones in a bin (this subsumes the classic modified greedy's "best single item"
check, per bin). O(n log n + n·B) for the greedy; the swap pass looks only at one left-out item per
precedence chain and at bins holding something worth less than it, at most two rounds.
`lorafn.controller.policy.exact` solves small instances exactly, to test the greedy against.
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
        if self.preferred is not None and self.preferred not in self.bins:
            raise ValueError(
                f"Item {self.key!r}: preferred bin {self.preferred!r} is not in bins {self.bins}"
            )

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
        checked: set[tuple[str, ...]] = set()  # items of one backbone share their bins: check once
        for item in self.items:
            if item.requires is not None and item.requires not in keys:
                raise ValueError(f"Item {item.key!r}: requires unknown item {item.requires!r}")
            if item.bins in checked:
                continue
            for b in item.bins:
                if b not in self.capacity:
                    raise ValueError(f"Item {item.key!r}: bin {b!r} has no capacity")
            checked.add(item.bins)


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
    """The greedy solution described in the module docstring.

    Spreading (most room first) can split the room of two bins so that a big item fits in neither;
    when something is left out that the total room of its bins could hold, the same greedy is run
    packing tightly (least room that fits) and the better of the two is kept (ties: spread).
    """
    spread, fragmented = _greedy_once(problem, tight=False)
    if not fragmented:
        return spread
    packed, _ = _greedy_once(problem, tight=True)
    return packed if packed.value > spread.value + 1e-12 * max(1.0, spread.value) else spread


def _greedy_once(problem: Problem, tight: bool) -> tuple[Solution, bool]:
    room = dict(problem.capacity)
    count: dict[tuple[str, str], int] = {}
    limit = problem.group_limit
    placement: dict[Hashable, str] = {}
    waiting: dict[Hashable, list[Item]] = {}  # prerequisite key -> items seen before it was placed
    fragmented: list[Hashable] = []
    # (group, bins) -> the lightest weight that found no bin. Room and counts only shrink while
    # placing, so anything as heavy with the same bins and group fails too: skip the scan. (Many
    # standbys of a big cluster fail on the per-GPU limit; this keeps them O(1).)
    failed: dict[tuple[str | None, tuple[str, ...]], int] = {}
    inf = float("inf")

    def place(item: Item) -> None:
        if item.requires is not None and item.requires not in placement:
            waiting.setdefault(item.requires, []).append(item)
            return
        weight, group = item.weight, item.group
        memo = (group, item.bins)
        if weight >= failed.get(memo, inf):
            return
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
                if r >= weight and (best < 0 or (r < best if tight else r > best)):
                    if group is not None:
                        cap = limit.get((b, group))
                        if cap is not None and count.get((b, group), 0) >= cap:
                            continue
                    chosen, best = b, r
        if chosen is None:
            failed[memo] = weight
            # Left out although the bins together had the room: spreading split it (see `greedy`).
            if not fragmented:
                open_room = 0
                for b in item.bins:
                    cap = limit.get((b, group)) if group is not None else None
                    if cap is None or count.get((b, group), 0) < cap:
                        open_room += max(0, room[b])
                if open_room >= weight:
                    fragmented.append(item.key)
            return
        placement[item.key] = chosen
        room[chosen] -= weight
        if group is not None:
            count[(chosen, group)] = count.get((chosen, group), 0) + 1
        for child in waiting.pop(item.key, ()):
            place(child)

    items = problem.items
    order = sorted(range(len(items)), key=lambda i: (-items[i].density, -items[i].value, i))
    for i in order:
        place(items[i])

    # Swap pass: density order can fill a bin with small items and leave out a bigger, more valuable
    # one (room for one 4 GiB standby, taken by a 2.5 GiB one). For each item left out whose
    # prerequisite is in (at most one per precedence chain), try each bin: take out its least dense
    # items worth less than it (a prerequisite only together with everything placed that requires it)
    # until it fits; swap when that loses less value than it brings; then refill with what is left out.
    by_key = {item.key: item for item in items}
    for _ in range(2):
        improved = False
        in_bin: dict[str, list[Item]] = {}
        dependents: dict[Hashable, int] = {}
        for key, b in placement.items():
            item = by_key[key]
            in_bin.setdefault(b, []).append(item)
            if item.requires is not None:
                dependents[item.requires] = dependents.get(item.requires, 0) + 1
        outs = [
            x for x in items if x.key not in placement and (x.requires is None or x.requires in placement)
        ]
        outs.sort(key=lambda x: -x.value)
        for x in outs:
            if x.key in placement or (x.requires is not None and x.requires not in placement):
                continue
            best = None
            for b in x.bins:
                removable = [y for y in in_bin.get(b, ()) if y.value < x.value and y.key != x.requires]
                if not removable:
                    continue
                removable.sort(key=lambda y: (y.density, y.value))
                victims = _make_room(x, b, removable, room[b], count, limit, dependents)
                if victims is None:
                    continue
                lost = sum(y.value for y in victims)
                if lost < x.value - 1e-12 * max(1.0, x.value) and (best is None or lost < best[0]):
                    best = (lost, b, victims)
            if best is None:
                continue
            _, b, victims = best
            for y in victims:
                del placement[y.key]
                in_bin[b].remove(y)
                room[b] += y.weight
                if y.group is not None:
                    count[(b, y.group)] -= 1
                if y.requires is not None:
                    dependents[y.requires] -= 1
            placement[x.key] = b
            in_bin.setdefault(b, []).append(x)
            room[b] -= x.weight
            if x.group is not None:
                count[(b, x.group)] = count.get((b, x.group), 0) + 1
            if x.requires is not None:
                dependents[x.requires] = dependents.get(x.requires, 0) + 1
            improved = True
        if not improved:
            break
        waiting.clear()
        failed.clear()  # the swaps gave room back
        for i in order:  # refill the room the swaps left
            if items[i].key not in placement:
                place(items[i])
    value = sum(i.value for i in items if i.key in placement)
    return Solution(placement, value), bool(fragmented)


def _make_room(
    x: Item,
    b: str,
    removable: list[Item],
    room: int,
    count: Mapping[tuple[str, str], int],
    limit: Mapping[tuple[str, str], int],
    dependents: Mapping[Hashable, int],
) -> list[Item] | None:
    """Few of ``removable`` (least dense first) whose removal lets ``x`` into bin ``b``, or None.

    An item that placed items require goes only after all of them (so a chain leaves tail first).
    """
    cap = limit.get((b, x.group)) if x.group is not None else None
    n = count.get((b, x.group), 0) if x.group is not None else 0
    free = room
    left = dict(dependents)

    def fits() -> bool:
        return free >= x.weight and (cap is None or n < cap)

    victims: list[Item] = []
    pending = list(removable)
    progress = True
    while not fits() and progress:
        progress = False
        for y in pending:
            if left.get(y.key, 0) > 0:
                continue
            victims.append(y)
            pending.remove(y)
            free += y.weight
            n -= x.group is not None and y.group == x.group
            if y.requires is not None:
                left[y.requires] = left.get(y.requires, 0) - 1
            progress = True
            break
    if not fits():
        return None
    for y in reversed(list(victims)):  # keep what the others make unnecessary (and nothing needs gone)
        # y stays out when another victim requires it, or when it requires a victim
        if any(v.requires == y.key or y.requires == v.key for v in victims if v is not y):
            continue
        back_n = n + (x.group is not None and y.group == x.group)
        if free - y.weight >= x.weight and (cap is None or back_n < cap):
            victims.remove(y)
            free -= y.weight
            n = back_n
    return victims
