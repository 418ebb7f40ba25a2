"""WaitTracker: a function's wait for a worker as episodes, each cause with how long it lasted."""

from __future__ import annotations

from lorafn.controller.waits import WaitStep, WaitTracker


def test_a_wait_begins_changes_cause_and_ends_with_the_seconds_of_each() -> None:
    t = WaitTracker()
    assert t.update({"ns/a": ("start_slot", "6 starts under way")}, now=10.0) == [
        WaitStep("ns/a", "start_slot", "6 starts under way")
    ]
    # the same cause again: nothing new (the reason's numbers change every round)
    assert t.update({"ns/a": ("start_slot", "5 starts under way")}, now=10.5) == []
    assert t.waiting == {"ns/a": "start_slot"}
    (step,) = t.update({"ns/a": ("making_room", "1 stopped worker exiting")}, now=11.25)
    assert (step.cause, step.ended, step.seconds, step.total_s) == ("making_room", "start_slot", 1.25, 1.25)
    (done,) = t.update({}, now=12.0)
    assert (done.function, done.cause, done.ended, done.seconds, done.total_s) == (
        "ns/a", None, "making_room", 0.75, 2.0,
    )  # fmt: skip
    assert t.waiting == {} and t.update({}, now=13.0) == []


def test_functions_are_tracked_apart_and_a_new_episode_starts_from_zero() -> None:
    t = WaitTracker()
    t.update({"ns/a": ("no_room", "r"), "ns/b": ("start_slot", "r")}, now=0.0)
    steps = t.update({"ns/b": ("start_slot", "r")}, now=3.0)
    assert [(s.function, s.cause, s.ended, s.total_s) for s in steps] == [("ns/a", None, "no_room", 3.0)]
    (again,) = t.update({"ns/a": ("no_room", "r"), "ns/b": ("start_slot", "r")}, now=5.0)
    assert again == WaitStep("ns/a", "no_room", "r")
    (b,) = t.update({"ns/a": ("no_room", "r")}, now=6.0)
    assert (b.function, b.ended, b.seconds, b.total_s) == ("ns/b", "start_slot", 6.0, 6.0)
