"""The generic greedy knapsack with precedence, and the exact solver it is measured against."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lorafn.controller.policy.exact import solve_exact
from lorafn.controller.policy.knapsack import Item, Problem, check_feasible, greedy, value_of


@st.composite
def problems(draw, max_items=7, max_bins=3):
    bins = [f"b{i}" for i in range(draw(st.integers(1, max_bins)))]
    capacity = {b: draw(st.integers(0, 20)) for b in bins}
    n = draw(st.integers(0, max_items))
    items = []
    for i in range(n):
        eligible = draw(st.lists(st.sampled_from(bins), min_size=1, max_size=len(bins), unique=True))
        requires = draw(st.sampled_from([None, *range(i)])) if i else None
        items.append(
            Item(
                key=i,
                value=draw(st.floats(0, 10, allow_nan=False)),
                weight=draw(st.integers(0, 12)),
                bins=tuple(eligible),
                group=draw(st.sampled_from([None, "x", "y"])),
                requires=requires,
                preferred=draw(st.sampled_from([None, *eligible])),
            )
        )
    limits = {(b, g): draw(st.integers(0, 3)) for b in bins for g in ("x",)}
    return Problem(tuple(items), capacity, limits)


def brute_force(problem: Problem) -> float:
    best = 0.0
    choices = [(None, *item.bins) for item in problem.items]
    for assignment in itertools.product(*choices):
        placement = {item.key: b for item, b in zip(problem.items, assignment, strict=True) if b is not None}
        try:
            check_feasible(problem, placement)
        except ValueError:
            continue
        best = max(best, value_of(problem, placement))
    return best


@settings(max_examples=300, deadline=None)
@given(problems())
def test_greedy_is_feasible_and_never_beats_exact(problem):
    g = greedy(problem)
    check_feasible(problem, g.placement)
    assert g.value == pytest.approx(value_of(problem, g.placement))
    e = solve_exact(problem)
    check_feasible(problem, e.placement)
    assert g.value <= e.value + 1e-9


@settings(max_examples=150, deadline=None)
@given(problems(max_items=5, max_bins=2))
def test_exact_matches_brute_force(problem):
    assert solve_exact(problem).value == pytest.approx(brute_force(problem))


def test_precedence_child_waits_for_its_parent():
    # the child is denser than its parent: seen first, placed only once the parent is in
    items = (Item("parent", 1.0, 10, ("g",)), Item("child", 5.0, 1, ("g",), requires="parent"))
    sol = greedy(Problem(items, {"g": 11}))
    assert sol.placement == {"parent": "g", "child": "g"}
    sol = greedy(Problem(items, {"g": 5}))  # the parent does not fit: neither does the child
    assert sol.placement == {}


def test_group_limit_and_most_room_and_preferred_bin():
    items = tuple(Item(i, 1.0, 1, ("a", "b"), group="llama") for i in range(5))
    sol = greedy(Problem(items, {"a": 10, "b": 9}, {("a", "llama"): 2, ("b", "llama"): 2}))
    assert sorted(sol.placement.values()) == ["a", "a", "b", "b"]
    # most room first: the first item goes to a (10 > 9)
    sol = greedy(Problem(items[:1], {"a": 10, "b": 9}))
    assert sol.placement == {0: "a"}
    # an existing worker's bin is preferred even with less room: no moving workers around
    sol = greedy(Problem((Item(0, 1.0, 1, ("a", "b"), preferred="b"),), {"a": 10, "b": 9}))
    assert sol.placement == {0: "b"}


def test_swap_pass_takes_the_big_item_instead_of_small_ones():
    # density prefers the small chain (0.09/GiB) but only the big one (0.084/GiB, worth more) fits with it out
    items = (
        Item("small-1", 0.231, 2, ("g",)),
        Item("big", 0.336, 4, ("g",)),
    )
    assert greedy(Problem(items, {"g": 4})).placement == {"big": "g"}
    chain = (
        Item("r16-1", 0.171, 3, ("g",)),
        Item("r16-2", 0.016, 3, ("g",), requires="r16-1"),
        Item("r24-1", 0.397, 8, ("g",)),
    )
    sol = greedy(Problem(chain, {"g": 10}))
    assert sol.placement == {"r24-1": "g"}
    assert sol.value == pytest.approx(solve_exact(Problem(chain, {"g": 10})).value)


def test_bad_problems_are_refused():
    with pytest.raises(ValueError, match="duplicate key"):
        Problem((Item(1, 1, 1, ("a",)), Item(1, 1, 1, ("a",))), {"a": 1})
    with pytest.raises(ValueError, match="requires unknown item"):
        Problem((Item(1, 1, 1, ("a",), requires=7),), {"a": 1})
    with pytest.raises(ValueError, match="bin 'z' has no capacity"):
        Problem((Item(1, 1, 1, ("z",)),), {"a": 1})
    with pytest.raises(ValueError, match="preferred bin 'b'"):
        Item(1, 1.0, 1, ("a",), preferred="b")
    with pytest.raises(ValueError, match="weight"):
        Item(1, 1.0, -1, ("a",))
    with pytest.raises(ValueError, match="max_items"):
        solve_exact(Problem(tuple(Item(i, 1, 1, ("a",)) for i in range(20)), {"a": 5}))
