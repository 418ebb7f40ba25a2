"""Parking idle bound workers (PolicyConfig.park_idle, issue 16): under memory pressure idle bound workers
release their KV cache (Park) before anything is stopped, in the offloading order; a parked worker's function
gets it back (Unpark) before a standby or a fresh start; workers are stopped only when parking cannot free
enough. Off by default, and then the policy never plans either action."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lorafn.controller.policy import PolicyConfig, Start, Stop, Wait, decide
from lorafn.controller.policy.actions import Bind, Park, Unpark
from lorafn.controller.policy.decide import fast_unparks
from lorafn.controller.policy.model import Worker
from lorafn.controller.policy.offload import choose_parks, park_candidates, release_bytes
from tests.unit.controller.helpers import GiB, bound, fn, gpu, snap, standby

PARK = PolicyConfig(park_idle=True, cold_prior_rps=0.0)
OFF = PolicyConfig(cold_prior_rps=0.0)
# 80 GiB x 0.92 = 73.6 GiB of capacity, 13 GiB of backbone: room for 30 workers of 2 GiB (0.6 GiB left)
CAPACITY_WORKERS = 30


def _full_gpu(rates: list[float], idle_s: float = 30.0, **kw) -> tuple[list, list]:
    """30 idle bound workers of 2 GiB (release 1 GiB each) filling the GPU, function i at ``rates[i]``
    (0.0 beyond the list), and one cold function ``cold`` with a request queued."""
    functions = [
        fn(f"f{i}", arrival_rate=rates[i] if i < len(rates) else 0.0, keep_alive_s=600)
        for i in range(CAPACITY_WORKERS)
    ]
    workers = [
        bound(f"w{i:02d}", "g0", f"f{i}", idle_s=idle_s, release_bytes=GiB, **kw)
        for i in range(CAPACITY_WORKERS)
    ]
    return [*functions, fn("cold", queued=1, oldest_wait_s=0.1)], workers


def test_off_by_default_and_then_nothing_parks():
    assert PolicyConfig().park_idle is False
    functions, workers = _full_gpu([])
    plan = decide(snap([gpu("g0")], functions, workers), OFF)
    assert plan.of_type(Park) == [] and plan.of_type(Unpark) == []
    assert len(plan.of_type(Stop)) == 1 and plan.of_type(Start) == []  # offload, start once it exited


def test_a_worker_that_cannot_park_is_never_parked_and_is_offloaded_as_without_parking():
    # Worker.parkable False: its runtime cannot park, or it refused lately (the driver's park_retry_s)
    functions, workers = _full_gpu([], parkable=False)
    plan = decide(snap([gpu("g0")], functions, workers), PARK)
    assert plan.of_type(Park) == [] and len(plan.of_type(Stop)) == 1 and plan.of_type(Start) == []
    # one parkable among them: that one is parked (two are needed: one parked, the rest as before)
    workers[0] = dataclasses.replace(workers[0], parkable=True)
    workers[1] = dataclasses.replace(workers[1], parkable=True)
    plan = decide(snap([gpu("g0")], functions, workers), PARK)
    assert sorted(p.worker_id for p in plan.of_type(Park)) == ["w00", "w01"]
    assert [s.function for s in plan.of_type(Start)] == ["cold"]
    later = dataclasses.replace(PARK, park_after_s=10.0)  # nor by park_after_s
    plan = decide(snap([gpu("g0")], functions[:-1], [dataclasses.replace(workers[2], idle_s=60)]), later)
    assert plan.of_type(Park) == []


def test_a_cold_start_parks_idle_workers_instead_of_stopping_one_and_starts_in_the_same_plan():
    functions, workers = _full_gpu([])
    plan = decide(snap([gpu("g0")], functions, workers), PARK)
    parks, starts = plan.of_type(Park), plan.of_type(Start)
    assert plan.of_type(Stop) == []
    # 0.6 GiB free, 2 GiB needed: two parks of 1 GiB each (the smallest set), then the start
    assert len(parks) == 2 and all(p.release_bytes == GiB and p.room_for == "cold" for p in parks)
    assert [s.function for s in starts] == ["cold"]
    assert max(plan.actions.index(p) for p in parks) < plan.actions.index(starts[0])
    assert plan.account["g0"].planned_free_bytes == plan.account["g0"].free_bytes + 2 * GiB - 2 * GiB


def test_parking_order_is_the_offloading_order_least_valuable_first_guarded_last():
    # f0..f29 at decreasing rates: the rarest go first; a recently idle one (expected back soon) goes last
    rates = [0.3 - 0.01 * i for i in range(CAPACITY_WORKERS)]
    functions, workers = _full_gpu(rates, idle_s=300.0)
    workers[29] = dataclasses.replace(workers[29], idle_s=0.5)  # rarest, but just idle: guarded
    plan = decide(snap([gpu("g0")], functions, workers), PARK)
    assert sorted(p.worker_id for p in plan.of_type(Park)) == ["w27", "w28"]
    cands = park_candidates(workers, {f.name: f for f in functions}, set(), 0.3, 0.45, guard_s=2.0)
    assert [c.worker.id for c in cands][:3] == ["w28", "w27", "w26"] and cands[-1].worker.id == "w29"


def test_never_parks_a_busy_worker_one_whose_function_waits_or_one_parked_already():
    functions, workers = _full_gpu([])
    workers[0] = dataclasses.replace(workers[0], running=1, idle_s=0.0)
    workers[1] = dataclasses.replace(workers[1], parked=True, mem_bytes=GiB)
    functions[2] = dataclasses.replace(functions[2], queued=1)
    by_name = {f.name: f for f in functions}
    ids = {c.worker.id for c in park_candidates(workers, by_name, {"w03"}, 0.3, 0.45)}
    assert ids.isdisjoint({"w00", "w01", "w02", "w03"}) and len(ids) == CAPACITY_WORKERS - 4
    plan = decide(snap([gpu("g0")], functions, workers), PARK)
    assert {p.worker_id for p in plan.of_type(Park)}.isdisjoint({"w00", "w01", "w02"})


def test_an_unpark_takes_its_release_bytes_back_and_no_standby_or_start():
    functions = [fn("f", queued=2, oldest_wait_s=0.1, arrival_rate=0.1), fn("g")]
    parked = bound("p", "g0", "f", mem_gib=1.2, parked=True, release_bytes=int(0.8 * GiB))
    sb = standby("s", "g0")
    plan = decide(snap([gpu("g0")], functions, [parked, sb]), PARK)
    assert plan.of_type(Unpark) == [Unpark("p", "f", "g0", int(0.8 * GiB))]
    assert plan.of_type(Bind) == [] and [s for s in plan.of_type(Start) if s.function] == []
    a = plan.account["g0"]
    assert a.planned_free_bytes <= a.free_bytes - int(0.8 * GiB)  # the pool may take more, never less
    # without release_bytes, the configured fraction of its unparked size: 1.2 GiB parked = 55% of ~2.2
    unknown = dataclasses.replace(parked, release_bytes=0)
    assert release_bytes(unknown, 0.45) == int(unknown.mem_bytes * 0.45 / (1 - 0.45))


def test_parked_workers_count_for_max_replicas():
    functions = [fn("f", queued=9, oldest_wait_s=0.1, max_replicas=2)]
    workers = [
        bound("b", "g0", "f", running=4),
        bound("p", "g0", "f", mem_gib=1, parked=True, release_bytes=GiB),
    ]
    plan = decide(snap([gpu("g0")], functions, workers), PARK)
    assert [u.worker_id for u in plan.of_type(Unpark)] == ["p"]  # the scale-up is the unpark
    assert plan.of_type(Start) == [] and plan.of_type(Bind) == []


def test_an_unpark_without_room_parks_others_first_never_itself():
    functions, workers = _full_gpu([])
    workers[0] = dataclasses.replace(workers[0], parked=True, mem_bytes=GiB)  # f0's, 1 GiB free more
    functions[0] = dataclasses.replace(functions[0], queued=1, oldest_wait_s=0.1)
    functions = functions[:-1]  # no cold function: only f0's request
    # fill the 1.6 GiB free with another worker, so f0's 1 GiB back needs room
    workers.append(bound("x", "g0", "fx", mem_gib=1.5, running=1))
    functions.append(fn("fx"))
    plan = decide(snap([gpu("g0")], functions, workers), PARK)
    parks, unparks = plan.of_type(Park), plan.of_type(Unpark)
    assert [u.worker_id for u in unparks] == ["w00"] and "w00" not in {p.worker_id for p in parks}
    assert len(parks) == 1 and plan.actions.index(parks[0]) < plan.actions.index(unparks[0])
    assert plan.of_type(Stop) == []


def test_when_parking_is_not_enough_workers_are_stopped_for_the_unparks_memory_only():
    # every other worker busy or parked: nothing to park; one idle parked worker of a rare function to stop
    functions = [fn("f", queued=1, oldest_wait_s=0.1), fn("rare", keep_alive_s=600), fn("busy")]
    workers = [
        bound("p", "g0", "f", mem_gib=1, parked=True, release_bytes=GiB),
        bound("r", "g0", "rare", mem_gib=1, parked=True, release_bytes=GiB, idle_s=300),
    ] + [bound(f"b{i}", "g0", "busy", running=1) for i in range(29)]
    # 73.6 - 13 - 2 - 58 = 0.6 GiB free: the unpark needs 1 GiB, a fresh worker 2
    plan = decide(snap([gpu("g0")], functions, workers), PARK)
    stops = plan.of_type(Stop)
    assert [s.worker_id for s in stops] == ["r"] and stops[0].room_for == "f"
    assert plan.of_type(Unpark) == [] and plan.of_type(Start) == []
    assert any(isinstance(a, Wait) and a.function == "f" for a in plan.actions)


def test_park_after_s_parks_long_idle_workers_without_pressure():
    functions = [fn("a"), fn("b"), fn("c", queued=1)]
    workers = [
        bound("wa", "g0", "a", idle_s=20, release_bytes=GiB),
        bound("wb", "g0", "b", idle_s=5, release_bytes=GiB),
        bound("wc", "g0", "c", idle_s=20, release_bytes=GiB),  # its function waits: it serves
    ]
    plan = decide(snap([gpu("g0")], functions, workers), dataclasses.replace(PARK, park_after_s=10.0))
    assert [p.worker_id for p in plan.of_type(Park)] == ["wa"]
    assert decide(snap([gpu("g0")], functions, workers), PARK).of_type(Park) == []


def test_fast_unparks_answers_a_parked_functions_demand_from_the_last_view():
    functions = [fn("f", queued=1), fn("g")]
    workers = [bound("p", "g0", "f", mem_gib=1, parked=True, release_bytes=GiB), bound("q", "g0", "g")]
    s = snap([gpu("g0")], functions, workers)
    assert fast_unparks(s, ["f", "g", "unknown"], PARK) == [Unpark("p", "f", "g0", GiB)]
    # off, nothing parks, but a worker parked while it was on still comes back
    assert fast_unparks(s, ["f"], OFF) == [Unpark("p", "f", "g0", GiB)]
    assert fast_unparks(snap([gpu("g0")], functions, [workers[1]]), ["f"], OFF) == []


def test_choose_parks_takes_the_smallest_set_the_order_allows():
    functions, workers = _full_gpu([])
    cands = park_candidates(workers, {f.name: f for f in functions}, set(), 0.3, 0.45)
    assert len(choose_parks(cands, int(1.5 * GiB)) or []) == 2
    assert choose_parks(cands, 0) == []
    assert choose_parks(cands, 31 * GiB) is None


def test_a_parked_worker_is_bound_and_idle():
    with pytest.raises(ValueError, match="parked"):
        Worker("s", "g0", "llama", "standby", "r16", None, GiB, parked=True)
    with pytest.raises(ValueError, match="parked"):
        bound("p", "g0", "f", parked=True, running=1)
    with pytest.raises(ValueError, match="park_release_fraction"):
        PolicyConfig(park_release_fraction=1.0)


# -- any snapshot ----------------------------------------------------------------------------------------


@st.composite
def _snapshots(draw):
    n_fn = draw(st.integers(1, 6))
    functions = [
        fn(
            f"f{i}",
            mem_gib=2,
            queued=draw(st.integers(0, 3)),
            oldest_wait_s=draw(st.floats(0, 5)),
            arrival_rate=draw(st.floats(0, 1)),
            max_replicas=draw(st.integers(1, 3)),
            min_replicas=draw(st.integers(0, 1)),
            ttft_slo_ms=2500.0,
        )
        for i in range(n_fn)
    ]
    workers = []
    for i in range(draw(st.integers(0, 14))):
        kind = draw(st.sampled_from(["bound", "parked", "busy", "standby", "starting"]))
        f = f"f{draw(st.integers(0, n_fn - 1))}"
        idle = draw(st.floats(0, 120))
        if kind == "standby":
            workers.append(standby(f"w{i}", "g0"))
        elif kind == "starting":
            workers.append(Worker(f"w{i}", "g0", "llama", "starting", "r16", f, 2 * GiB, age_s=1.0))
        elif kind == "parked":
            rel = draw(st.sampled_from([0, GiB]))
            workers.append(bound(f"w{i}", "g0", f, mem_gib=1, parked=True, release_bytes=rel, idle_s=idle))
        else:
            running = 1 if kind == "busy" else 0
            rel = draw(st.sampled_from([0, GiB]))
            workers.append(bound(f"w{i}", "g0", f, running=running, idle_s=idle, release_bytes=rel))
    total = draw(st.floats(20, 40))  # 18.4-36.8 GiB capacity, 13 of backbone: often short of memory
    config = dataclasses.replace(PARK, park_after_s=draw(st.sampled_from([None, 10.0])))
    return snap([gpu("g0", total)], functions, workers), config


@settings(max_examples=300, deadline=None)
@given(_snapshots())
def test_any_plan_parks_only_idle_bound_workers_and_unparks_only_parked_ones(case):
    s, config = case
    plan = decide(s, config)
    by_id = {w.id: w for w in s.workers}
    functions = {f.name: f for f in s.functions}
    touched: list[str] = []
    for p in plan.of_type(Park):
        w = by_id[p.worker_id]
        assert w.state == "bound" and not w.parked and w.running == 0
        assert functions[w.function or ""].queued == 0
        assert p.release_bytes == release_bytes(w, config.park_release_fraction) > 0
        touched.append(w.id)
    for u in plan.of_type(Unpark):
        w = by_id[u.worker_id]
        assert w.parked and functions[u.function].queued > 0 and w.function == u.function
        touched.append(w.id)
    touched += [a.worker_id for a in plan.actions if isinstance(a, (Stop, Bind))]
    assert len(touched) == len(set(touched))  # one action per worker at most
    # every Park's memory was used or is left: the plan never grants beyond the account (the ledger)
    a = plan.account["g0"]
    assert a.planned_free_bytes >= min(0, a.free_bytes)
    # without the switch nothing parks (a worker parked while it was on is still unparked)
    off = decide(s, dataclasses.replace(config, park_idle=False))
    assert off.of_type(Park) == []
    assert all(by_id[u.worker_id].parked for u in off.of_type(Unpark))
