"""The warm pool's starts on a host: at most ``max_pool_starts_per_node`` worker processes starting at once
per node, none while a request waits for its function's first worker (``pool_waits_for_demand``), the
most valuable standby first. Found on the README demo (`lorafn up --demo --once`, 2-core VM): the cold
prior started standbys of both shapes, the first request's arrival two more, and demo/french's first
token came after 16.7 s (docs/benchmarks.md, "The README demo")."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lorafn.controller.policy import Backbone, Costs, PolicyConfig, Start, Stop, Wait, Worker, decide
from lorafn.controller.policy.planner import awaiting_first_worker

from .helpers import GiB, bound, fn, gpu, snap

# the demo's shapes on one CPU device: no fresh start measured yet (the CPU default, 10 s)
COSTS = Costs(fresh_start_s=10.0, bind_s=0.05, default_standby_bytes=1 * GiB)
DEMO_BB = (Backbone("llama", 13 * GiB, min_standby_per_gpu=1, max_standby_per_gpu=4),)
CPU = PolicyConfig(max_pool_starts_per_node=1, pool_waits_for_demand=True)


def demo_functions(french_queued: int = 0) -> list:
    waiting = {"queued": french_queued, "oldest_wait_s": 0.1, "arrival_rate": 1 / 60} if french_queued else {}
    return [
        fn("demo/french", shape="r8", mem_gib=1, ttft_slo_ms=2000, **waiting),
        fn("demo/gsm8k", shape="r16", mem_gib=1, ttft_slo_ms=2000),
    ]


def warming(
    id: str, shape: str, age_s: float = 1.0, gpu_id: str = "g0", function: str | None = None
) -> Worker:
    return Worker(id, gpu_id, "llama", "starting", shape, function, 1 * GiB, age_s=age_s)


def pool_starts(plan) -> list[Start]:
    return [a for a in plan.of_type(Start) if a.function is None]


def test_the_demo_before_the_fix_started_standbys_beside_a_waiting_request():
    """What the first request met with the limits off (the behaviour before): two standbys at once on an
    empty pool, then more while demo/french waited on a warming one; the last no longer (decide counts a
    function waiting on a warming standby as served, not cold)."""
    off = PolicyConfig()
    assert (off.max_pool_starts_per_node, off.pool_waits_for_demand) == (None, False)
    assert len(pool_starts(decide(snap([gpu("g0")], demo_functions(), (), DEMO_BB, COSTS), off))) == 2
    under_way = [warming("s16", "r16"), warming("s8", "r8")]
    plan = decide(snap([gpu("g0")], demo_functions(french_queued=1), under_way, DEMO_BB, COSTS), off)
    assert any("warming up" in w.reason for w in plan.of_type(Wait))
    assert pool_starts(plan) == []


def test_one_warm_up_at_a_time_and_none_while_the_first_request_waits():
    # an empty pool: one standby starts, not one per shape
    first = pool_starts(decide(snap([gpu("g0")], demo_functions(), (), DEMO_BB, COSTS), CPU))
    assert len(first) == 1
    # the request for the other shape arrives while it warms: its own fresh start, and no pool start beside it
    other = "r8" if first[0].shape == "r16" else "r16"
    name = "demo/french" if other == "r8" else "demo/gsm8k"
    functions = [
        fn(f.name, shape=f.shape, mem_gib=1, ttft_slo_ms=2000, **({"queued": 1} if f.name == name else {}))
        for f in demo_functions()
    ]
    plan = decide(snap([gpu("g0")], functions, [warming("s1", first[0].shape)], DEMO_BB, COSTS), CPU)
    assert [a.function for a in plan.of_type(Start)] == [name]
    # the next round: its worker is starting, the standby is ready; the request still waits: no pool start
    up = [Worker("s1", "g0", "llama", "standby", first[0].shape, None, 1 * GiB)]
    starting_for_it = warming("w1", other, age_s=0.5, function=name)
    plan = decide(snap([gpu("g0")], functions, [*up, starting_for_it], DEMO_BB, COSTS), CPU)
    assert pool_starts(plan) == []
    # served (bound) and its start done: the pool refills again, one at a time
    served = bound("w1", "g0", name, shape=other, mem_gib=1, running=1)
    plan = decide(snap([gpu("g0")], demo_functions(), [*up, served], DEMO_BB, COSTS), CPU)
    assert len(pool_starts(plan)) <= 1


def test_a_request_waiting_on_a_warming_standby_holds_the_pool():
    under_way = [warming("s8", "r8")]
    plan = decide(snap([gpu("g0")], demo_functions(french_queued=1), under_way, DEMO_BB, COSTS), CPU)
    assert any("warming up" in w.reason for w in plan.of_type(Wait))
    assert plan.of_type(Start) == []
    # only the hold: with room for more starts the request still keeps the host to itself
    hold_only = PolicyConfig(pool_waits_for_demand=True)
    plan = decide(snap([gpu("g0")], demo_functions(french_queued=1), under_way, DEMO_BB, COSTS), hold_only)
    assert pool_starts(plan) == []


def test_what_does_not_wait_for_a_start_does_not_hold_the_pool():
    big = fn("ns/huge", mem_gib=500, queued=1)  # fits on no GPU: it gets its 503
    failing = fn("ns/failing", queued=1, start_failures=3, last_failure_s=0.5)  # backing off
    busy = fn("ns/busy", queued=3)  # has a bound worker: a scale-up, not a first worker
    functions = [big, failing, busy, fn("ns/cold")]
    workers = [bound("b1", "g0", "ns/busy", running=4)]
    s = snap([gpu("g0")], functions, workers, DEMO_BB, COSTS)
    assert awaiting_first_worker(s, CPU) == []
    assert [f.name for f in awaiting_first_worker(snap([gpu("g0")], [fn("ns/x", queued=1)]), CPU)] == ["ns/x"]


def test_the_cap_counts_every_process_starting_on_the_node_across_its_gpus():
    gpus = [gpu("g0", node="n0"), gpu("g1", node="n0"), gpu("g2", node="n1")]
    bb = (Backbone("llama", 13 * GiB, min_standby_per_gpu=2, max_standby_per_gpu=4),)
    functions = [fn("ns/a", arrival_rate=0.5), fn("ns/b")]
    config = PolicyConfig(max_pool_starts_per_node=2)
    # nothing under way: two per node, whatever the GPUs
    plan = decide(snap(gpus, functions, (), bb, COSTS), config)
    per_node = Counter("n1" if a.gpu == "g2" else "n0" for a in pool_starts(plan))
    assert per_node == {"n0": 2, "n1": 2}
    # a bound worker starting on g1 takes one of n0's two
    under_way = [warming("w", "r16", gpu_id="g1", function="ns/b")]
    plan = decide(snap(gpus, functions, under_way, bb, COSTS), config)
    per_node = Counter("n1" if a.gpu == "g2" else "n0" for a in pool_starts(plan))
    assert per_node == {"n0": 1, "n1": 2}


def test_with_room_for_one_the_most_valuable_standby_starts():
    # demo/french has been called (an observed rate), demo/gsm8k not: french's shape is worth more
    functions = [
        fn("demo/french", shape="r8", mem_gib=1, arrival_rate=0.05),
        fn("demo/gsm8k", shape="r16", mem_gib=1),
    ]
    plan = decide(snap([gpu("g0")], functions, (), DEMO_BB, COSTS), CPU)
    assert [a.shape for a in pool_starts(plan)] == ["r8"]


@settings(max_examples=80, deadline=None)
@given(
    st.integers(1, 3),  # cap
    st.lists(st.tuples(st.sampled_from(["g0", "g1"]), st.booleans()), max_size=5),  # starting: gpu, bound?
    st.integers(0, 6),  # cold functions
    st.booleans(),  # one of them waits for its first worker
)
def test_pool_starts_never_exceed_the_node_room(cap, under_way, cold, waiting):
    gpus = [gpu("g0", total_gib=200), gpu("g1", total_gib=200)]  # one node
    bb = (Backbone("llama", 13 * GiB, min_standby_per_gpu=1, max_standby_per_gpu=6),)
    functions = [fn(f"ns/f{i}", shape=f"r{i % 3}") for i in range(cold)]
    if waiting:
        functions.append(fn("ns/w", shape="r9", queued=1))
    workers = [
        warming(f"s{i}", "r0", age_s=0.5, gpu_id=g, function="ns/x" if is_bound else None)
        for i, (g, is_bound) in enumerate(under_way)
    ]
    if any(is_bound for _, is_bound in under_way):
        functions.append(fn("ns/x", shape="r0"))
    config = PolicyConfig(max_pool_starts_per_node=cap, pool_waits_for_demand=True)
    plan = decide(snap(gpus, functions, workers, bb, COSTS), config)
    stopped = {a.worker_id for a in plan.of_type(Stop)}
    still = sum(1 for w in workers if w.id not in stopped)
    started = len(pool_starts(plan))
    assert started <= max(0, cap - still)
    if waiting:
        assert started == 0


def test_the_settings_are_checked_naming_the_field():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_pool_starts_per_node"):
            PolicyConfig(max_pool_starts_per_node=bad)  # type: ignore[arg-type]
    assert PolicyConfig(max_pool_starts_per_node=3).max_pool_starts_per_node == 3
