"""The policy's side of adapter slots (docs/runtime.md#adapter-slots, issue 13): a cold function joins a
bound worker of its namespace that has a free slot of a shape holding its adapter, on a Backbone that opted
in (`adapter_slots` > 1); never one of another namespace, a parked one, or a full one; a joined function
counts that worker as its live one; a worker is retired by its first function only; workers started for a
slot backbone carry the slot count."""

from __future__ import annotations

import dataclasses

import pytest

from lorafn.controller.policy import Backbone, Bind, PolicyConfig, Start, Stop, decide
from lorafn.controller.policy.decide import fast_binds
from lorafn.controller.policy.model import shape_holds
from tests.unit.controller.helpers import GiB, bound, fn, gpu, snap, standby

SHAPE = "q_proj:16,v_proj:16"
SLOTS = (Backbone("llama", 13 * GiB, min_standby_per_gpu=0, max_standby_per_gpu=4, adapter_slots=4),)
NO_SLOTS = (Backbone("llama", 13 * GiB, min_standby_per_gpu=0, max_standby_per_gpu=4),)
# no park, no warm pool refills: the plans hold only what these tests are about
CONFIG = PolicyConfig(park_idle=False)


def _binds(plan) -> list[Bind]:
    return list(plan.of_type(Bind))


def _slot_worker(**kw) -> object:
    return bound("w1", "g0", "team-a/first", shape=SHAPE, free_slots=3, idle_s=1.0, **kw)


def test_a_cold_function_joins_a_free_slot_of_its_namespace() -> None:
    snapshot = snap(
        [gpu("g0")],
        [fn("team-a/first", SHAPE), fn("team-a/second", "q_proj:8,v_proj:8", queued=1)],
        [_slot_worker(), standby("s1", "g0", SHAPE)],
        SLOTS,
    )
    plan = decide(snapshot, CONFIG)
    assert [(b.worker_id, b.function, b.join) for b in _binds(plan)] == [("w1", "team-a/second", True)]
    assert not plan.of_type(Start)
    # the fast path (demand just recorded) joins too
    assert [(b.worker_id, b.join) for b in fast_binds(snapshot, ["team-a/second"], CONFIG)] == [("w1", True)]


@pytest.mark.parametrize(
    ("why", "function", "worker_kw", "backbones"),
    [
        ("another namespace", fn("team-b/other", SHAPE, queued=1), {}, SLOTS),
        ("a shape its slots cannot hold", fn("team-a/big", "q_proj:32,v_proj:16", queued=1), {}, SLOTS),
        ("a projection its slots lack", fn("team-a/mlp", "q_proj:16,up_proj:16", queued=1), {}, SLOTS),
        ("no free slot", fn("team-a/second", SHAPE, queued=1), {"free_slots": 0}, SLOTS),
        ("a parked worker", fn("team-a/second", SHAPE, queued=1), {"parked": True}, SLOTS),
        ("a backbone that did not opt in", fn("team-a/second", SHAPE, queued=1), {}, NO_SLOTS),
    ],
)
def test_no_join_into(why: str, function, worker_kw: dict, backbones) -> None:
    kw = {"free_slots": 3, **worker_kw}
    worker = bound("w1", "g0", "team-a/first", shape=SHAPE, idle_s=1.0, **kw)
    snapshot = snap(
        [gpu("g0")], [fn("team-a/first", SHAPE), function], [worker, standby("s1", "g0", SHAPE)], backbones
    )
    binds = _binds(decide(snapshot, CONFIG))
    assert [(b.worker_id, b.join) for b in binds] == [("s1", False)], why


def test_joins_take_free_slots_once_each_in_a_round() -> None:
    """One free slot, two cold functions: one joins, the other takes the standby."""
    snapshot = snap(
        [gpu("g0")],
        [fn("team-a/first", SHAPE), fn("team-a/b", SHAPE, queued=1), fn("team-a/c", SHAPE, queued=1)],
        [
            bound("w1", "g0", "team-a/first", shape=SHAPE, free_slots=1, idle_s=1.0),
            standby("s1", "g0", SHAPE),
        ],
        SLOTS,
    )
    binds = sorted((b.worker_id, b.join) for b in _binds(decide(snapshot, CONFIG)))
    assert binds == [("s1", False), ("w1", True)]


def test_the_least_busy_slot_worker_is_joined() -> None:
    snapshot = snap(
        [gpu("g0")],
        [fn("team-a/first", SHAPE), fn("team-a/third", SHAPE), fn("team-a/second", SHAPE, queued=1)],
        [
            bound("busy", "g0", "team-a/first", shape=SHAPE, free_slots=3, running=5),
            bound("calm", "g0", "team-a/third", shape=SHAPE, free_slots=1, running=1),
        ],
        SLOTS,
    )
    assert [(b.worker_id, b.join) for b in _binds(decide(snapshot, CONFIG))] == [("calm", True)]


def test_a_joined_function_counts_the_worker_as_its_own() -> None:
    """No start for a joined function with requests queued while its (shared) worker keeps up."""
    worker = bound("w1", "g0", "team-a/first", shape=SHAPE, free_slots=2, joined=("team-a/second",))
    snapshot = snap(
        [gpu("g0")], [fn("team-a/first", SHAPE), fn("team-a/second", SHAPE, queued=1)], [worker], SLOTS
    )
    plan = decide(snapshot, CONFIG)
    assert not plan.of_type(Start) and not _binds(plan)


def test_a_slot_worker_is_retired_by_its_first_function_only() -> None:
    functions = [fn("team-a/first", SHAPE, keep_alive_s=60.0), fn("team-a/second", SHAPE, keep_alive_s=1.0)]
    shared = {"shape": SHAPE, "free_slots": 2, "joined": ("team-a/second",)}
    young = bound("w1", "g0", "team-a/first", idle_s=10.0, **shared)
    assert not decide(snap([gpu("g0")], functions, [young], SLOTS), CONFIG).of_type(Stop)
    old = bound("w1", "g0", "team-a/first", idle_s=61.0, **shared)
    assert [
        s.worker_id for s in decide(snap([gpu("g0")], functions, [old], SLOTS), CONFIG).of_type(Stop)
    ] == ["w1"]


def test_starts_on_a_slot_backbone_carry_the_slot_count_and_reserve_every_slot_s_kv() -> None:
    """A worker with 4 slots reserves the KV and adapter buffers of the 3 functions that may join it."""
    first = fn("team-a/first", SHAPE, queued=1, kv_bytes=GiB, lora_bytes=GiB // 8)
    plan = decide(snap([gpu("g0")], [first], [], SLOTS), CONFIG)
    starts = [s for s in plan.of_type(Start) if s.function]
    assert [(s.function, s.adapter_slots) for s in starts] == [("team-a/first", 4)]
    assert starts[0].mem_bytes == first.mem_bytes + 3 * (GiB + GiB // 8)
    plan = decide(snap([gpu("g0")], [fn("team-a/first", SHAPE, queued=1)], [], NO_SLOTS), CONFIG)
    assert [(s.function, s.adapter_slots) for s in plan.of_type(Start)] == [("team-a/first", 1)]


def test_shape_holds() -> None:
    assert shape_holds("q_proj:16,v_proj:16", "q_proj:8")
    assert shape_holds("q_proj:16,v_proj:16", "q_proj:16,v_proj:16")
    assert not shape_holds("q_proj:16,v_proj:16", "q_proj:16,v_proj:32")
    assert not shape_holds("q_proj:16", "k_proj:4")
    assert not shape_holds(None, "q_proj:8") and not shape_holds("r16", "q_proj:8")


def test_joined_functions_only_on_a_bound_worker() -> None:
    with pytest.raises(ValueError, match="joined"):
        standby("s1", "g0", SHAPE, joined=("team-a/x",))
    with pytest.raises(ValueError, match="joined"):
        bound("w1", "g0", "team-a/first", joined=("team-a/first",))
    with pytest.raises(ValueError, match="free_slots"):
        bound("w1", "g0", "team-a/first", free_slots=-1)


def test_a_burst_of_cold_functions_of_a_namespace_starts_one_process_per_slots() -> None:
    """Five cold functions of one namespace, four slots a worker: one start takes the first, three wait to
    join it, the fifth starts a second worker; once the first is up the three join it."""
    from lorafn.controller.policy import Wait

    config = PolicyConfig(park_idle=False, max_fresh_starts_per_gpu=4)
    names = [f"team-a/f{i}" for i in range(5)]
    functions = [fn(n, SHAPE, queued=1) for n in names]
    plan = decide(snap([gpu("g0")], functions, [], SLOTS), config)
    starts = [s for s in plan.of_type(Start) if s.function]
    assert [(s.function, s.adapter_slots) for s in starts] == [("team-a/f0", 4), ("team-a/f4", 4)]
    waits = [w for w in plan.of_type(Wait) if "adapter slots" in w.reason]
    assert sorted(w.function for w in waits) == names[1:4]
    # the next round, f0's worker still starting: the three keep waiting for it, nothing else starts
    starting = dataclasses.replace(bound("w0", "g0", "team-a/f0", shape=SHAPE), state="starting")
    plan = decide(snap([gpu("g0")], functions, [starting], SLOTS), config)
    assert [s.function for s in plan.of_type(Start) if s.function] == ["team-a/f4"]
    assert sorted(w.function for w in plan.of_type(Wait) if "adapter slots" in w.reason) == names[1:4]
    # up (3 free slots): the three join it
    up = bound("w0", "g0", "team-a/f0", shape=SHAPE, free_slots=3)
    plan = decide(snap([gpu("g0")], functions, [up], SLOTS), config)
    assert sorted((b.function, b.join) for b in _binds(plan)) == [(n, True) for n in names[1:4]]


def test_functions_that_join_bring_their_kv_budget() -> None:
    """A worker whose KV was sized for one function (a standby of a slot backbone) gets each joined
    function's KV budget as a grant, in the round of the join and in later ones; one already holding the KV
    of all its functions (a worker started for a slot backbone) gets none."""
    from lorafn.controller.policy import ResizeKV

    first = fn("team-a/first", SHAPE, kv_bytes=GiB)
    second = fn("team-a/second", SHAPE, queued=1, kv_bytes=GiB)
    small = bound("w1", "g0", "team-a/first", shape=SHAPE, free_slots=3, idle_s=1.0, kv_bytes=GiB)
    plan = decide(snap([gpu("g0")], [first, second], [small], SLOTS), CONFIG)
    assert [(b.function, b.join) for b in _binds(plan)] == [("team-a/second", True)]
    assert [(r.worker_id, r.delta_bytes, r.cause) for r in plan.of_type(ResizeKV)] == [("w1", GiB, "join")]
    joined = bound(
        "w1", "g0", "team-a/first", shape=SHAPE, free_slots=2, joined=("team-a/second",), kv_bytes=GiB
    )
    plan = decide(snap([gpu("g0")], [first, dataclasses.replace(second, queued=0)], [joined], SLOTS), CONFIG)
    assert [(r.delta_bytes, r.cause) for r in plan.of_type(ResizeKV)] == [(GiB, "join")]
    big = dataclasses.replace(joined, kv_bytes=4 * GiB)
    plan = decide(snap([gpu("g0")], [first, dataclasses.replace(second, queued=0)], [big], SLOTS), CONFIG)
    assert not plan.of_type(ResizeKV)


def test_a_shared_worker_is_neither_offloaded_nor_parked_while_a_joined_function_has_requests_queued() -> (
    None
):
    from lorafn.controller.policy.offload import candidates, park_candidates
    from lorafn.controller.policy.planner import ColdDemand
    from tests.unit.controller.helpers import COSTS

    functions = {
        "team-a/first": fn("team-a/first", SHAPE),
        "team-a/second": fn("team-a/second", SHAPE, queued=2),
    }
    shared = bound("w1", "g0", "team-a/first", shape=SHAPE, joined=("team-a/second",), idle_s=100.0)
    alone = bound("w2", "g0", "team-a/first", shape=SHAPE, idle_s=100.0)
    live = {"team-a/first": 2, "team-a/second": 1}
    victims = candidates([shared, alone], functions, live, ColdDemand({}, {}), COSTS, set())
    assert [v.worker.id for v in victims] == ["w2"]
    parks = park_candidates([shared, alone], functions, set(), unpark_s=0.1, fraction=0.5)
    assert [c.worker.id for c in parks] == ["w2"]
