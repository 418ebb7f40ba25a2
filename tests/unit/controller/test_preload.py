"""Pre-loading adapters into standby workers (policy.preload), binding the pre-loaded standby first, the fast
path's binds from the last snapshot (decide.fast_binds), and offloading's order and causes with pre-loads."""

from __future__ import annotations

import random

import pytest

from lorafn.controller.policy import Backbone, Bind, Costs, PolicyConfig, Start, Stop, decide
from lorafn.controller.policy.actions import Preload
from lorafn.controller.policy.decide import fast_binds
from lorafn.controller.policy.exact import solve_exact
from lorafn.controller.policy.knapsack import check_feasible, greedy
from lorafn.controller.policy.preload import PRIOR_RATE, plan_preload, preload_problem, preload_value
from lorafn.controller.policy.synthetic import GiB

from .helpers import COSTS, bound, fn, gpu, next_rounds, snap, standby

MiB = 2**20


def _preloads(plan) -> dict[str, str]:
    return {a.worker_id: a.function for a in plan.of_type(Preload)}


def test_each_ready_standby_preloads_the_most_valuable_cold_function_of_its_shape() -> None:
    functions = [
        fn("ns/hot", arrival_rate=0.5, lora_bytes=40 * MiB),
        fn("ns/warm", arrival_rate=2.0, lora_bytes=40 * MiB),  # has an idle bound worker: no pre-load
        fn("ns/rare", arrival_rate=0.01, lora_bytes=40 * MiB),
        fn("ns/never", arrival_rate=0.0, lora_bytes=40 * MiB),
        fn("ns/other", shape="r8", arrival_rate=3.0, lora_bytes=20 * MiB),  # no standby of its shape
    ]
    workers = [standby("s1", "g0"), standby("s2", "g0"), bound("b1", "g0", "ns/warm")]
    plan = decide(snap([gpu("g0")], functions, workers))
    assert not plan.of_type(Stop) and not plan.of_type(Bind)
    assert sorted(_preloads(plan).values()) == ["ns/hot", "ns/rare"]


def test_a_function_too_big_for_a_standby_is_never_preloaded_into_it() -> None:
    # with claims a standby serves the requests of the function it holds: it must be able to take it
    functions = [fn("ns/huge", mem_gib=6, arrival_rate=0.5), fn("ns/small", mem_gib=2, arrival_rate=0.01)]
    where = {"llama": ["g0"]}

    def preloads(standbys) -> dict[str, str]:
        _, actions = plan_preload(functions, standbys, where, COSTS, 20.0, set())
        return {a.worker_id: a.function for a in actions}

    assert preloads([standby("s1", "g0", mem_gib=2)]) == {"s1": "ns/small"}  # ns/huge is worth more
    assert preloads([standby("s1", "g0", mem_gib=2), standby("s2", "g0", mem_gib=6)]) == {
        "s1": "ns/small",
        "s2": "ns/huge",
    }


def test_functions_without_arrivals_fill_buffers_nobody_else_wants() -> None:
    # a newly registered function's first request is the typical cold start
    floor = (Backbone("llama", 13 * GiB, min_standby_per_gpu=1),)  # the pool keeps s1 without demand
    plan = decide(snap([gpu("g0")], [fn("ns/new", lora_bytes=MiB)], [standby("s1", "g0")], floor))
    assert not plan.of_type(Stop)
    assert _preloads(plan) == {"s1": "ns/new"}
    assert preload_value(fn("ns/new"), COSTS, 20.0) == pytest.approx(COSTS.bind_s * PRIOR_RATE)


def test_a_standby_keeps_what_it_holds_and_a_pending_preload_is_not_sent_again() -> None:
    functions = [fn("ns/a", arrival_rate=0.2), fn("ns/b", arrival_rate=0.1)]
    workers = [standby("s1", "g0", preloaded="ns/b"), standby("s2", "g0")]
    plan = decide(snap([gpu("g0")], functions, workers))
    assert _preloads(plan) == {"s2": "ns/a"}  # s1 keeps ns/b: no reload churn
    held = [standby("s1", "g0", preloaded="ns/b"), standby("s2", "g0", preloaded="ns/a")]
    assert _preloads(decide(snap([gpu("g0")], functions, held))) == {}


def test_the_warm_pool_switch_turns_preloading_off_too() -> None:
    plan = decide(
        snap([gpu("g0")], [fn("ns/a", arrival_rate=1)], [standby("s1", "g0")]), PolicyConfig(warm_pool=False)
    )
    assert _preloads(plan) == {}


def test_a_bind_takes_the_standby_that_preloaded_the_function() -> None:
    functions = [fn("ns/a", queued=1), fn("ns/b", arrival_rate=1.0)]
    workers = [
        standby("s0", "g0", preloaded="ns/b"),  # holds another function's adapter: last
        standby("s1", "g0", preloaded="ns/a"),
        standby("s2", "g0"),
    ]
    binds = decide(snap([gpu("g0")], functions, workers)).of_type(Bind)
    assert [(b.worker_id, b.preloaded) for b in binds] == [("s1", True)]
    workers = [standby("s0", "g0", preloaded="ns/b"), standby("s2", "g0")]
    binds = decide(snap([gpu("g0")], functions, workers)).of_type(Bind)
    assert [(b.worker_id, b.preloaded) for b in binds] == [("s2", False)]  # keeps s0 for ns/b


def test_a_bound_or_stopped_standby_gets_no_preload() -> None:
    functions = [fn("ns/a", queued=1), fn("ns/b", arrival_rate=0.5)]
    plan = decide(snap([gpu("g0")], functions, [standby("s1", "g0")]))
    assert [b.worker_id for b in plan.of_type(Bind)] == ["s1"]
    assert _preloads(plan) == {}


def test_fast_binds_answer_demand_from_the_snapshot_alone() -> None:
    functions = [
        fn("ns/a", arrival_rate=0.1),  # queued 0 in the old snapshot: demand says it needs one now
        fn("ns/served", arrival_rate=1.0),
        fn("ns/failing", start_failures=3, last_failure_s=1.0),
        fn("ns/big", mem_gib=8),
    ]
    workers = [
        standby("s1", "g0"),
        standby("s2", "g0", preloaded="ns/a"),
        bound("b1", "g0", "ns/served"),
    ]
    s = snap([gpu("g0")], functions, workers)
    binds = fast_binds(s, ["ns/a", "ns/served", "ns/failing", "ns/big", "ns/unknown", "ns/a"])
    assert [(b.worker_id, b.function, b.preloaded) for b in binds] == [("s2", "ns/a", True)]
    # the same in one call for two functions: two different standbys
    binds = fast_binds(s, ["ns/a", "ns/failing"], PolicyConfig(backoff_base_s=0.0, backoff_cap_s=0.0))
    assert sorted((b.worker_id, b.function) for b in binds) == [("s1", "ns/failing"), ("s2", "ns/a")]
    assert fast_binds(s, ["ns/a"], PolicyConfig(warm_pool=False)) == []


def _random_instance(rng: random.Random):
    shapes = ["r8", "r16"]
    functions = [
        fn(
            f"ns/f{i}",
            shape=rng.choice(shapes),
            arrival_rate=rng.choice([0.0, rng.uniform(0.001, 2.0)]),
            lora_bytes=rng.choice([20, 40]) * MiB,
        )
        for i in range(rng.randint(1, 7))
    ]
    gpus = [gpu(f"g{j}") for j in range(rng.randint(1, 3))]
    workers = [
        standby(
            f"s{k}",
            rng.choice(gpus).id,
            shape=rng.choice(shapes),
            preloaded=rng.choice([None, rng.choice(functions).name]),
        )
        for k in range(rng.randint(1, 4))
    ]
    return functions, gpus, workers


def test_greedy_preloading_is_optimal_on_small_instances() -> None:
    rng = random.Random(7)
    checked = 0
    for _ in range(300):
        functions, gpus, workers = _random_instance(rng)
        where = {"llama": [g.id for g in gpus]}
        pp = preload_problem(functions, workers, where, COSTS, 20.0, set())
        if len(pp.problem.items) > 12:
            continue
        got = greedy(pp.problem)
        check_feasible(pp.problem, got.placement)
        best = solve_exact(pp.problem)
        assert got.value >= best.value * (1 - 1e-9)
        # one adapter per standby, of its own shape
        by_id = {w.id: w for w in workers}
        assert len(set(got.placement.values())) == len(got.placement)
        for name, wid in got.placement.items():
            assert by_id[wid].shape == pp.functions[name].shape
        checked += 1
    assert checked > 200


def test_preload_actions_only_where_the_standby_holds_something_else() -> None:
    functions = [fn("ns/a", arrival_rate=1.0), fn("ns/b", arrival_rate=0.5)]
    workers = [standby("s1", "g0", preloaded="ns/a"), standby("s2", "g1")]
    solution, actions = plan_preload(functions, workers, {"llama": ["g0", "g1"]}, COSTS, 20.0, skip=set())
    assert solution.placement == {"ns/a": "s1", "ns/b": "s2"}
    assert actions == [Preload("s2", "ns/b", "g1", actions[0].value)]
    assert actions[0].value > 0
    # a standby on a GPU that does not hold the backbone is no bin
    _, actions = plan_preload(functions, workers, {"llama": ["g0"]}, COSTS, 20.0, skip={"ns/a"})
    assert actions == [Preload("s1", "ns/b", "g0", actions[0].value)]


def test_preload_saving_is_the_adapter_load_part_of_a_bind() -> None:
    assert Costs(fresh_start_s=3.0, bind_s=0.1).preload_saving_s() == pytest.approx(0.1)
    assert Costs(fresh_start_s=3.0, bind_s=0.1, adapter_load_s=0.08).preload_saving_s() == pytest.approx(0.08)
    with pytest.raises(ValueError, match="adapter_load_s"):
        Costs(fresh_start_s=3.0, bind_s=0.1, adapter_load_s=-1.0)


def test_offload_stops_standbys_holding_cold_adapters_first_and_names_its_cause() -> None:
    # room for the 2 standbys and 1.5 GiB: ns/new's 3 GiB worker needs one standby gone
    g = gpu("g0", total_gib=(13 + 2 * 2 + 1.5) / 0.92)
    functions = [
        fn("ns/new", shape="r32", mem_gib=3, queued=1),  # no standby can take it: a fresh start
        fn("ns/hot", arrival_rate=0.5),
        fn("ns/cold", arrival_rate=0.0001),
    ]
    workers = [standby("s-hot", "g0", preloaded="ns/hot"), standby("s-cold", "g0", preloaded="ns/cold")]
    config = PolicyConfig(pool_min_age_s=0)
    before = snap([g], functions, workers, costs=COSTS)
    plan = decide(before, config)
    stops = [a for a in plan.of_type(Stop) if a.reason == "offload"]
    assert [(a.worker_id, a.cause, a.victim) for a in stops] == [("s-cold", "cold_start", "standby")]
    assert not [a for a in plan.of_type(Start) if a.function]  # once s-cold has exited
    _, gone = next_rounds(before, plan, config)
    assert [a.function for a in gone.of_type(Start) if a.function] == ["ns/new"]


def test_offload_for_a_burst_is_a_scale_up_and_spares_busy_workers() -> None:
    g = gpu("g0", total_gib=(13 + 3 * 2 + 1) / 0.92)
    functions = [
        fn("ns/burst", queued=20, max_replicas=4),
        fn("ns/idle", arrival_rate=0.001),
        fn("ns/busy", arrival_rate=0.001),
    ]
    workers = [
        bound("b1", "g0", "ns/burst", running=4),
        bound("b2", "g0", "ns/idle", idle_s=30),  # idle longer than a fresh start (20 s): no thrash guard
        bound("b3", "g0", "ns/busy", running=1),
    ]
    before = snap([g], functions, workers)
    plan = decide(before)
    stops = [a for a in plan.of_type(Stop) if a.reason == "offload"]
    assert [(a.worker_id, a.cause, a.victim) for a in stops] == [("b2", "scale_up", "idle_bound")]
    assert not plan.of_type(Start)
    exiting, gone = next_rounds(before, plan)
    assert not exiting.of_type(Stop) and not exiting.of_type(Start)
    assert [a.function for a in gone.of_type(Start)] == ["ns/burst"]


def test_worker_preloaded_must_name_a_function() -> None:
    with pytest.raises(ValueError, match="preloaded"):
        standby("s1", "g0", preloaded="")
    assert GiB == 2**30
