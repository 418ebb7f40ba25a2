"""`actions.unbacked`: what a plan loses when some of its parks do not happen (refused or unanswered): only
the Starts and Unparks that counted on their memory, never a Stop, a Bind or another function's action."""

from __future__ import annotations

from lorafn.controller.policy.actions import Action, Bind, Park, Start, Stop, Unpark, Wait, unbacked

GiB = 1 << 30


def _start(fn: str | None, gpu: str = "g0", mem: int = GiB) -> Start:
    return Start(gpu, "bb", "s", fn, mem, "demand" if fn else "warm pool")


def _park(wid: str, room_for: str, gpu: str = "g0", release: int = GiB) -> Park:
    return Park(wid, f"fn-{wid}", gpu, release, "", room_for)


def test_a_failed_park_drops_the_action_it_made_room_for_and_nothing_else() -> None:
    p_a, p_b = _park("w1", "a"), _park("w2", "b")
    stop = Stop("w3", "offload", "g0", room_for="c")
    actions: list[Action] = [
        p_a, _start("a"), p_b, Unpark("w9", "b", "g0", GiB), stop, _start("c"), Bind("w4", "d", "g0"),
        Wait("e", "x", "no_room"),
    ]  # fmt: skip
    assert unbacked(actions, [p_a]) == [actions[1]]
    assert unbacked(actions, [p_b]) == [actions[3]]
    assert unbacked(actions, [p_a, p_b]) == [actions[1], actions[3]]
    assert unbacked(actions, []) == []


def test_the_room_is_per_gpu() -> None:
    p = _park("w1", "a", gpu="g1")
    actions: list[Action] = [_start("a", gpu="g0"), p, _start("a", gpu="g1")]
    assert unbacked(actions, [p]) == [actions[2]]


def test_parks_made_for_no_one_drop_starts_from_the_plans_end_until_their_bytes_are_covered() -> None:
    # park_after_s parks free memory that any later action may have used: the last ones go first
    p1, p2 = _park("w1", "", release=GiB), _park("w2", "", release=GiB // 2)
    s1, s2, s3 = _start(None, mem=GiB), _start(None, mem=GiB), _start("x", mem=GiB // 4)
    actions: list[Action] = [p1, p2, s1, s2, s3, _start(None, gpu="g1")]
    # equal standby starts are told apart by position (the driver compares by identity): with 1 GiB short,
    # the later one and the start after it go
    assert _positions(actions, unbacked(actions, [p1])) == [3, 4]
    assert _positions(actions, unbacked(actions, [p2])) == [3, 4]
    assert _positions(actions, unbacked(actions, [p1, p2])) == [2, 3, 4]


def _positions(actions: list[Action], chosen: list[Action]) -> list[int]:
    return [next(i for i, a in enumerate(actions) if a is c) for c in chosen]
