"""Offloading order: cold standbys, then idle bound workers, by value density; never busy workers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lorafn.controller.policy import PolicyConfig, Start, Stop, Wait, Worker, decide
from lorafn.controller.policy.offload import (
    IDLE_BOUND,
    STANDBY,
    VICTIM_RATES,
    Victim,
    candidates,
    choose_victims,
    park_candidates,
    victim_rate,
)
from lorafn.controller.policy.planner import cold_demand

from .helpers import COSTS, GiB, bound, fn, gpu, next_rounds, snap, standby


def _candidates(workers, functions, protected=frozenset(), rate="window"):
    fs = {f.name: f for f in functions}
    live = {}
    for w in workers:
        if w.function and w.state in ("bound", "starting"):
            live[w.function] = live.get(w.function, 0) + 1
    warm = {w.function for w in workers if w.state == "bound" and w.running == 0}
    cold = cold_demand(functions, warm, COSTS.fresh_start_s)
    return candidates(workers, fs, live, cold, COSTS, set(protected), rate=rate)


def test_idle_bound_victims_by_the_long_horizon_rate():
    # ns/steady: 1 request in the last minute but 30 in the last ten; ns/burst: 3 in the last minute, 3 in
    # ten (one burst). By the window ns/steady goes first; by the long horizon, ns/burst does.
    functions = [
        fn("ns/steady", arrival_rate=1 / 60, long_arrival_rate=30 / 600),
        fn("ns/burst", arrival_rate=3 / 60, long_arrival_rate=3 / 600),
        fn("ns/new", arrival_rate=2 / 60),  # no long figure yet: its window rate stands in
    ]
    workers = [
        bound("w-steady", "g0", "ns/steady"),
        bound("w-burst", "g0", "ns/burst"),
        bound("w-new", "g0", "ns/new"),
    ]
    by = {
        r: [v.worker.id for v in _candidates(workers, functions, rate=r)] for r in ("window", "long", "max")
    }
    assert by["window"] == ["w-steady", "w-new", "w-burst"]
    assert by["long"] == ["w-burst", "w-new", "w-steady"]
    assert by["max"] == ["w-new", "w-burst", "w-steady"]  # 2/60 < max(3/60, 3/600) < max(1/60, 30/600)
    assert victim_rate(None, "long") == 0.0
    with pytest.raises(ValueError, match="victim rate"):
        victim_rate(functions[0], "ewma")


def test_decide_offloads_by_the_configured_victim_rate():
    functions = [
        fn("ns/steady", arrival_rate=1 / 60, long_arrival_rate=30 / 600),
        fn("ns/burst", arrival_rate=3 / 60, long_arrival_rate=3 / 600),
        fn("ns/cold", queued=1, oldest_wait_s=0.1),
    ]
    # room for exactly two 2-GiB workers beside the backbone: one must go for ns/cold
    g = gpu("g0", total_gib=(13 + 4.5) / PolicyConfig().gpu_utilization)
    workers = [bound("w-steady", "g0", "ns/steady", idle_s=30), bound("w-burst", "g0", "ns/burst", idle_s=30)]
    for rate, victim in (("window", "w-steady"), ("long", "w-burst")):
        config = PolicyConfig(victim_rate=rate, thrash_horizon_starts=0.0, warm_pool=False)
        plan = decide(snap([g], functions, workers), config)
        assert [a.worker_id for a in plan.of_type(Stop)] == [victim], rate


def test_the_policy_and_the_controller_settings_allow_the_same_victim_rates():
    from pydantic import ValidationError

    from lorafn.controller.cli import ControllerSettings

    assert VICTIM_RATES == ("window", "long", "max")
    for rate in VICTIM_RATES:
        assert PolicyConfig(victim_rate=rate).victim_rate == rate
        assert ControllerSettings(victim_rate=rate).victim_rate == rate
        assert victim_rate(fn("ns/a", arrival_rate=0.5), rate) == 0.5  # each one has its rule
    with pytest.raises(ValueError, match="victim_rate"):
        PolicyConfig(victim_rate="ewma")
    with pytest.raises(ValidationError, match="victim_rate"):
        ControllerSettings(victim_rate="ewma")


def test_order_cold_standby_then_hot_standby_then_idle_bound_by_density():
    functions = [
        fn("ns/hot", shape="r8", arrival_rate=1.0),
        fn("ns/cold", shape="r32", arrival_rate=0.001),
        fn("ns/busy", arrival_rate=5.0),
        fn("ns/popular", arrival_rate=2.0),
        fn("ns/rare", arrival_rate=0.01),
    ]
    workers = [
        standby("s-hot", "g0", shape="r8"),
        standby("s-cold", "g0", shape="r32"),
        standby("s-dead", "g0", shape="r99"),  # no function of this shape at all
        bound("b-busy", "g0", "ns/busy", running=2),
        bound("b-popular", "g0", "ns/popular"),
        bound("b-rare", "g0", "ns/rare"),
    ]
    order = [v.worker.id for v in _candidates(workers, functions)]
    assert order == ["s-dead", "s-cold", "s-hot", "b-rare", "b-popular"]


def test_protected_draining_and_min_replicas_are_never_candidates():
    functions = [fn("ns/a", min_replicas=1), fn("ns/b", min_replicas=1), fn("ns/q", queued=3)]
    workers = [
        bound("a1", "g0", "ns/a", idle_s=5),
        bound("b1", "g0", "ns/b", idle_s=5),
        bound("b2", "g0", "ns/b", idle_s=1),
        bound("q1", "g0", "ns/q"),  # its function has queued requests: about to work
        Worker("d1", "g0", "llama", "draining", "r16", "ns/a", GiB),
        standby("s1", "g0"),
    ]
    ids = [v.worker.id for v in _candidates(workers, functions, protected={"s1"})]
    assert ids in (["b1"], ["b2"])  # one of ns/b's two may go, ns/a keeps its only one


def test_choose_victims_frees_enough_with_the_fewest():
    def v(id, gib, tier=STANDBY, density=0.0):
        return Victim(Worker(id, "g0", "llama", "standby", None, None, int(gib * GiB)), tier, density)

    ordered = [v("a", 1), v("b", 1), v("c", 6, IDLE_BOUND)]
    assert [x.worker.id for x in choose_victims(ordered, 5 * GiB)] == ["c"]  # a, b would be wasted
    assert [x.worker.id for x in choose_victims(ordered, 2 * GiB)] == ["a", "b"]
    assert choose_victims(ordered, 9 * GiB) is None
    assert choose_victims(ordered, 0) == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 8), min_size=0, max_size=8), st.integers(1, 40))
def test_choose_victims_is_enough_and_minimal(sizes, need):
    ordered = [
        Victim(Worker(f"w{i}", "g0", "llama", "standby", None, None, s), STANDBY, float(i))
        for i, s in enumerate(sizes)
    ]
    chosen = choose_victims(ordered, need)
    if sum(sizes) < need:
        assert chosen is None
        return
    freed = sum(x.worker.mem_bytes for x in chosen)
    assert freed >= need
    for x in chosen:  # no victim is unnecessary
        assert freed - x.worker.mem_bytes < need


def test_decide_offloads_cold_standby_before_idle_bound_never_running():
    # 80 GiB x 0.92 = 73.6 GiB capacity; 13 GiB backbone; workers fill the rest
    g = gpu("g0", backbones={"llama": 13})
    functions = [
        fn("ns/new", mem_gib=14, queued=1),
        # back in ~100 s, later than a fresh start (20 s) takes: no anti-thrash guard
        fn("ns/idle", mem_gib=10, arrival_rate=0.01),
        fn("ns/busy", mem_gib=40, arrival_rate=3.0),
    ]
    workers = [
        standby("s-cold", "g0", shape="r64", mem_gib=4),
        # idle for longer than a fresh start takes: not expected back at once (no anti-thrash guard)
        bound("b-idle", "g0", "ns/idle", mem_gib=10, idle_s=30),
        bound("b-busy", "g0", "ns/busy", mem_gib=40, running=3),
    ]
    # free = 73.6 - 13 - 54 = 6.6 GiB, 7.4 short: the 4 GiB standby is not enough, the idle bound one is
    before = snap([g], functions, workers)
    plan = decide(before)
    stops = [a for a in plan.actions if isinstance(a, Stop) and a.reason == "offload"]
    assert [s.worker_id for s in stops] == ["b-idle"]  # freeing the standby too would be a waste
    assert stops[0].room_for == "ns/new"
    # no Start before the victim's process has exited (it holds its memory until then)
    assert not [a for a in plan.of_type(Start) if a.function]
    assert [w.reason for w in plan.of_type(Wait) if w.function == "ns/new"] == [
        "making room on GPU g0: 1 stopped worker(s) (10.0 GiB) are exiting; its worker starts once they "
        "are gone"
    ]
    exiting, gone = next_rounds(before, plan)
    assert not exiting.of_type(Stop) and not [a for a in exiting.of_type(Start) if a.function]
    assert [(w.function, w.cause) for w in exiting.of_type(Wait)] == [("ns/new", "making_room")]
    assert [a.function for a in gone.of_type(Start) if a.function] == ["ns/new"]
    assert not [a for a in gone.of_type(Stop) if a.reason == "offload"]


def test_decide_prefers_the_cold_standby_when_it_is_enough():
    g = gpu("g0", backbones={"llama": 13})
    functions = [
        fn("ns/new", mem_gib=9, queued=1),
        fn("ns/idle", mem_gib=10, arrival_rate=0.1),
        fn("ns/busy", mem_gib=40),
    ]
    workers = [
        standby("s-cold", "g0", shape="r64", mem_gib=4),  # too small to take ns/new
        bound("b-idle", "g0", "ns/idle", mem_gib=10),
        bound("b-busy", "g0", "ns/busy", mem_gib=40, running=1),
    ]
    # free = 73.6 - 13 - 54 = 6.6 GiB, 2.4 short: the standby is enough
    before = snap([g], functions, workers)
    plan = decide(before)
    assert [s.worker_id for s in plan.of_type(Stop)] == ["s-cold"]
    assert plan.of_type(Stop)[0].reason == "offload"
    assert not [a for a in plan.of_type(Start) if a.function]
    _, gone = next_rounds(before, plan)
    assert [(a.function, a.mem_bytes) for a in gone.of_type(Start) if a.function] == [("ns/new", 9 * GiB)]


def test_decide_never_offloads_busy_workers_and_waits_with_numbers():
    g = gpu("g0", backbones={"llama": 13})
    functions = [fn("ns/new", mem_gib=20, queued=2), fn("ns/busy", mem_gib=55, arrival_rate=3.0)]
    workers = [bound("b-busy", "g0", "ns/busy", mem_gib=55, running=1)]
    plan = decide(snap([g], functions, workers))
    assert not plan.of_type(Stop)
    assert not plan.of_type(Start)
    (wait,) = plan.of_type(Wait)
    assert wait.function == "ns/new"
    assert "20.0 GiB worker" in wait.reason and "g0: 5.6 GiB free of 73.6 GiB" in wait.reason


def test_offloading_switched_off_waits_instead_of_stopping_idle_workers():
    # the trace replay's "no offloading" ablation: the same GPU as above, nothing is stopped for ns/new
    g = gpu("g0", backbones={"llama": 13})
    functions = [fn("ns/new", mem_gib=14, queued=1), fn("ns/idle", mem_gib=10, arrival_rate=0.01)]
    workers = [
        standby("s-cold", "g0", shape="r64", mem_gib=4),
        bound("b-idle", "g0", "ns/idle", mem_gib=50, idle_s=30),
    ]
    offloads = [
        s.worker_id for s in decide(snap([g], functions, workers)).of_type(Stop) if s.reason == "offload"
    ]
    assert offloads == ["b-idle"]
    plan = decide(snap([g], functions, workers), PolicyConfig(offloading=False))
    assert not [s for s in plan.of_type(Stop) if s.reason == "offload"]
    assert [w.function for w in plan.of_type(Wait)] == ["ns/new"]


def test_memory_of_workers_exiting_for_a_function_is_its_own_and_nothing_more_is_offloaded():
    # the GPU's end: ns/a's offloaded worker (3 GiB) is still exiting; 1 GiB is free
    g = gpu("g0", total_gib=(13 + 3 + 3 + 1.01) / 0.92)
    functions = [
        fn("ns/a", mem_gib=3, queued=1, oldest_wait_s=2.0),
        fn("ns/b", mem_gib=1, queued=1, oldest_wait_s=1.0),
        fn("ns/idle", mem_gib=3, arrival_rate=0.001),
        fn("ns/gone", mem_gib=3, arrival_rate=0.001),
    ]
    workers = [
        Worker("d-a", "g0", "llama", "draining", "r16", "ns/gone", 3 * GiB, room_for="ns/a"),
        bound("b-idle", "g0", "ns/idle", mem_gib=3, idle_s=300),
    ]
    plan = decide(snap([g], functions, workers))
    # ns/a waits for d-a (no second victim for it: offloading again every round while the first victims
    # drain was the defect); d-a's 3 GiB cover its 3 GiB, so it takes none of the free GiB
    assert not [a for a in plan.of_type(Stop) if a.reason == "offload" and a.room_for == "ns/a"]
    assert "making room on GPU g0" in next(w.reason for w in plan.of_type(Wait) if w.function == "ns/a")
    # the free GiB was not ns/a's: ns/b starts in it
    assert [a.function for a in plan.of_type(Start) if a.function] == ["ns/b"]


def test_free_memory_a_waiting_function_needs_is_reserved_in_its_round():
    # ns/a (4 GiB) waits for d-a (3 GiB) plus 1 of the 1 GiB free; ns/b (1 GiB) must not take that GiB
    g = gpu("g0", total_gib=(13 + 3 + 1.01) / 0.92)
    functions = [
        fn("ns/a", mem_gib=4, queued=1, oldest_wait_s=2.0),
        fn("ns/b", mem_gib=1, queued=1, oldest_wait_s=1.0),
        fn("ns/gone", mem_gib=3),
    ]
    workers = [Worker("d-a", "g0", "llama", "draining", "r16", "ns/gone", 3 * GiB, room_for="ns/a")]
    plan = decide(snap([g], functions, workers))
    assert not plan.of_type(Start) and not plan.of_type(Stop)
    waits = {w.function: w.reason for w in plan.of_type(Wait)}
    assert "making room on GPU g0" in waits["ns/a"]
    assert "no GPU holding backbone llama has room for a 1.0 GiB worker" in waits["ns/b"]
    assert plan.account["g0"].planned_free_bytes < 0.02 * GiB  # the GiB is ns/a's


def test_exiting_memory_counts_only_for_its_function_and_a_gpu_with_room_now_goes_first():
    # d-a exits for ns/a on g0; ns/c may not wait on it (offloads its own), and ns/a itself starts at once
    # on g1 when g1 has room now
    g0 = gpu("g0", total_gib=(13 + 3.01) / 0.92)
    g1 = gpu("g1", total_gib=(13 + 3.01) / 0.92)
    functions = [fn("ns/a", mem_gib=3, queued=1), fn("ns/gone", mem_gib=3)]
    workers = [Worker("d-a", "g0", "llama", "draining", "r16", "ns/gone", 3 * GiB, room_for="ns/a")]
    plan = decide(snap([g0, g1], functions, workers))
    assert [(a.function, a.gpu) for a in plan.of_type(Start) if a.function] == [("ns/a", "g1")]
    other = decide(snap([g0], [fn("ns/c", mem_gib=3, queued=1), *functions[1:]], workers))
    assert not other.of_type(Start)
    assert "no GPU holding backbone llama has room" in other.of_type(Wait)[0].reason


def test_room_for_is_only_for_a_draining_worker():
    with pytest.raises(ValueError, match="room_for"):
        bound("b", "g0", "ns/a", room_for="ns/b")
    with pytest.raises(ValueError, match="room_for"):
        Worker("d", "g0", "llama", "draining", "r16", None, GiB, room_for="")


def test_a_worker_stopped_for_keep_alive_is_room_coming_not_free_memory():
    # b-old's keep-alive ends this round: its 3 GiB are held until its process exits, so ns/a does not
    # start in them now (OOM at context creation) and no second idle worker is offloaded for ns/a either
    g = gpu("g0", total_gib=(13 + 3 + 3 + 1.01) / 0.92)
    functions = [
        fn("ns/a", mem_gib=3, queued=1),
        fn("ns/old", mem_gib=3, keep_alive_s=60),
        fn("ns/recent", mem_gib=3, arrival_rate=0.001),
    ]
    workers = [
        bound("b-old", "g0", "ns/old", mem_gib=3, idle_s=300),
        bound("b-recent", "g0", "ns/recent", mem_gib=3, idle_s=40),
    ]
    before = snap([g], functions, workers)
    plan = decide(before)
    assert [(a.worker_id, a.reason) for a in plan.of_type(Stop)] == [("b-old", "keep_alive")]
    assert not plan.of_type(Start)
    assert "making room on GPU g0: 1 stopped worker(s) (3.0 GiB)" in plan.of_type(Wait)[0].reason
    exiting, gone = next_rounds(before, plan)
    assert not exiting.of_type(Stop) and not exiting.of_type(Start)  # still waiting for b-old
    assert [a.function for a in gone.of_type(Start)] == ["ns/a"]


# -- a worker with adapter slots is the worker of every function it serves -------------------------------
def _shared_candidates(workers, functions, guard_s=0.0, allow_guarded=True):
    """`candidates` with each worker counted as a live worker of every function it serves (as decide does)."""
    fs = {f.name: f for f in functions}
    live: dict[str, int] = {}
    for w in workers:
        for name in w.functions:
            live[name] = live.get(name, 0) + 1
    cold = cold_demand(functions, set(), COSTS.fresh_start_s)
    return candidates(workers, fs, live, cold, COSTS, set(), guard_s=guard_s, allow_guarded=allow_guarded)


def test_a_shared_worker_is_valued_by_every_function_it_serves():
    # w-shared serves three functions of 0.1 req/s each (0.3 in all); w-alone one of 0.2 req/s. Valued by its
    # first function alone (0.1), w-shared would go first and send three functions to the cold path.
    functions = [
        fn("team/a", arrival_rate=0.1),
        fn("team/b", arrival_rate=0.1),
        fn("team/c", arrival_rate=0.1),
        fn("other/x", arrival_rate=0.2),
    ]
    workers = [
        bound("w-shared", "g0", "team/a", joined=("team/b", "team/c"), idle_s=100.0),
        bound("w-alone", "g0", "other/x", idle_s=100.0),
    ]
    order = _shared_candidates(workers, functions)
    assert [v.worker.id for v in order] == ["w-alone", "w-shared"]
    assert order[1].density == pytest.approx(3 * order[0].density / 2)
    assert choose_victims(order, 2 * GiB)[0].worker.id == "w-alone"


def test_a_shared_worker_is_not_a_victim_while_a_joined_function_is_at_its_floor():
    functions = [fn("team/a", arrival_rate=0.0), fn("team/b", arrival_rate=0.0, min_replicas=1)]
    workers = [bound("w-shared", "g0", "team/a", joined=("team/b",), idle_s=100.0)]
    assert _shared_candidates(workers, functions) == []
    # a second worker of team/b: one of the two may go, never both (team/b keeps its floor); of equal value,
    # the tie goes by id
    workers.append(bound("w-b", "g0", "team/b", idle_s=100.0))
    assert [v.worker.id for v in _shared_candidates(workers, functions)] == ["w-b"]
    workers[1] = bound("w-b", "g0", "team/b", idle_s=500.0)  # idle longer: it goes first either way
    assert [v.worker.id for v in _shared_candidates(workers, functions)] == ["w-b"]
    workers[0] = bound("w-shared", "g0", "team/a", joined=("team/b",), idle_s=900.0)
    assert [v.worker.id for v in _shared_candidates(workers, functions)] == ["w-shared"]


def test_a_shared_worker_is_guarded_when_a_joined_function_is_expected_back():
    # its own function is quiet; the joined one arrives every 2 s: the worker is expected to have work again
    # within the guard, so it goes last, and not at all without allow_guarded
    functions = [fn("team/a", arrival_rate=0.0), fn("team/b", arrival_rate=0.5)]
    workers = [bound("w-shared", "g0", "team/a", joined=("team/b",), idle_s=100.0)]
    (victim,) = _shared_candidates(workers, functions, guard_s=10.0)
    assert victim.tier != IDLE_BOUND
    assert _shared_candidates(workers, functions, guard_s=10.0, allow_guarded=False) == []


def test_parking_values_a_shared_worker_by_every_function_it_serves():
    functions = {
        f.name: f
        for f in (fn("team/a", arrival_rate=0.1), fn("team/b", arrival_rate=0.3), fn("o/x", arrival_rate=0.2))
    }
    workers = [
        bound("w-shared", "g0", "team/a", joined=("team/b",), idle_s=100.0, parkable=True),
        bound("w-alone", "g0", "o/x", idle_s=100.0, parkable=True),
    ]
    order = park_candidates(workers, functions, set(), unpark_s=0.2, fraction=0.5)
    assert [c.worker.id for c in order] == ["w-alone", "w-shared"]  # 0.2 < 0.1 + 0.3
    queued = {**functions, "team/b": fn("team/b", arrival_rate=0.3, queued=1)}
    assert [c.worker.id for c in park_candidates(workers, queued, set(), 0.2, 0.5)] == ["w-alone"]
