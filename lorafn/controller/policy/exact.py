"""The exact optimum of a small `knapsack.Problem`, to measure the greedy against (tests, benchmark).

Depth-first branch and bound: items are visited in density order, each prerequisite before the
items that require it; each item goes into one of its bins (where it fits and its prerequisite is
taken) or is left out. A branch is cut when its value plus the fractional relaxation of the
remaining items into the total remaining room (bins, groups and precedence ignored, so it never
underestimates) cannot beat the best found. Exponential in the worst case: refuses more than
``max_items`` items.
"""

from __future__ import annotations

from collections.abc import Hashable

from lorafn.controller.policy.knapsack import Item, Problem, Solution


def solve_exact(problem: Problem, max_items: int = 14) -> Solution:
    if len(problem.items) > max_items:
        raise ValueError(
            f"solve_exact: {len(problem.items)} items > max_items={max_items} (exponential search)"
        )
    by_key = {i.key: i for i in problem.items}
    order: list[Item] = []
    seen: set[Hashable] = set()

    def visit(item: Item) -> None:
        if item.key in seen:
            return
        seen.add(item.key)
        if item.requires is not None:
            visit(by_key[item.requires])
        order.append(item)

    for item in sorted(problem.items, key=lambda i: (-i.density, -i.value)):
        visit(item)
    # rest[k]: the items order[k:] sorted by density, for the fractional bound.
    rest = [sorted(order[k:], key=lambda i: -i.density) for k in range(len(order) + 1)]

    room = dict(problem.capacity)
    count: dict[tuple[str, str], int] = {}
    placement: dict[Hashable, str] = {}
    best: list = [0.0, {}]

    def bound(k: int, value: float) -> float:
        left = sum(max(0, r) for r in room.values())
        for item in rest[k]:
            if item.weight <= left:
                left -= item.weight
                value += item.value
            else:
                return value + item.value * left / item.weight
        return value

    def search(k: int, value: float) -> None:
        if value > best[0]:
            best[0], best[1] = value, dict(placement)
        if k == len(order) or bound(k, value) <= best[0] + 1e-12:
            return
        item = order[k]
        if item.requires is None or item.requires in placement:
            for b in item.bins:
                cap = problem.group_limit.get((b, item.group)) if item.group is not None else None
                if room[b] < item.weight or (cap is not None and count.get((b, item.group), 0) >= cap):
                    continue
                placement[item.key] = b
                room[b] -= item.weight
                if item.group is not None:
                    count[(b, item.group)] = count.get((b, item.group), 0) + 1
                search(k + 1, value + item.value)
                del placement[item.key]
                room[b] += item.weight
                if item.group is not None:
                    count[(b, item.group)] -= 1
        search(k + 1, value)

    search(0, 0.0)
    return Solution(best[1], best[0])
