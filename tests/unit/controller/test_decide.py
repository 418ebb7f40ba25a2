"""One decision round end to end: binds, placement, waits, replicas, backoff, determinism, speed."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from lorafn.controller.policy import Backbone, Bind, PolicyConfig, Start, Stop, Wait, Worker, decide
from lorafn.controller.policy.synthetic import random_snapshot

from .helpers import GiB, bound, fn, gpu, snap, standby

TWO = (Backbone("llama", 13 * GiB), Backbone("mistral", 14 * GiB))


def _demand_starts(plan):
    return [a for a in plan.of_type(Start) if a.function is not None]


def test_three_functions_of_two_shapes_bind_standbys_not_fresh_starts():
    functions = [
        fn("ns/a", shape="r16", queued=1),
        fn("ns/b", shape="r16", queued=2),
        fn("ns/c", shape="r8", queued=1),
    ]
    workers = [standby("s1", "g0", "r16"), standby("s2", "g0", "r16"), standby("s3", "g0", "r8")]
    plan = decide(snap([gpu("g0")], functions, workers))
    binds = {(b.worker_id, b.function) for b in plan.of_type(Bind)}
    assert binds == {("s1", "ns/a"), ("s2", "ns/b"), ("s3", "ns/c")} or binds == {
        ("s2", "ns/a"),
        ("s1", "ns/b"),
        ("s3", "ns/c"),
    }
    assert all(b.prepared for b in plan.of_type(Bind))
    assert not _demand_starts(plan)
    assert not plan.of_type(Wait)


def test_bind_prefers_prepared_then_agnostic_then_any_and_never_too_small():
    f = fn("ns/a", shape="r16", mem_gib=3, queued=1)
    for workers, expected in (
        (
            [standby("any", "g0", None, 4), standby("other", "g0", "r8", 4), standby("same", "g0", "r16", 4)],
            "same",
        ),
        ([standby("other", "g0", "r8", 4), standby("any", "g0", None, 4)], "any"),
        ([standby("other", "g0", "r8", 4)], "other"),
    ):
        (b,) = decide(snap([gpu("g0")], [f], workers)).of_type(Bind)
        assert b.worker_id == expected
        assert b.prepared == (expected == "same")
    plan = decide(snap([gpu("g0")], [f], [standby("tiny", "g0", "r16", 2)]))  # 2 GiB < 3 GiB
    assert not plan.of_type(Bind)
    assert [(a.function, a.mem_bytes) for a in _demand_starts(plan)] == [("ns/a", 3 * GiB)]


def test_fresh_start_goes_to_the_gpu_holding_the_backbone_with_most_free_memory():
    gpus = [
        gpu("g0", backbones={"mistral": 14}),
        gpu("g1", backbones={"llama": 13}),
        gpu("g2", backbones={"llama": 13}),
        gpu("g3", backbones={"llama": 13, "mistral": 14}),
    ]
    workers = [bound("busy", "g1", "ns/other", mem_gib=10, running=1)]
    functions = [fn("ns/a", queued=1), fn("ns/m", backbone="mistral", queued=1), fn("ns/other", mem_gib=10)]
    plan = decide(snap(gpus, functions, workers, backbones=TWO))
    starts = {a.function: a.gpu for a in _demand_starts(plan)}
    assert starts == {"ns/a": "g2", "ns/m": "g0"}  # g2: llama, most free; g0: mistral, more free than g3


def test_allowed_gpus_of_a_backbone_limit_placement():
    bb = (Backbone("llama", 13 * GiB, gpus=("g1",)),)
    plan = decide(snap([gpu("g0"), gpu("g1")], [fn("ns/a", queued=1)], backbones=bb))
    assert [a.gpu for a in _demand_starts(plan)] == ["g1"]


def test_function_that_cannot_fit_waits_with_reason_and_others_are_untouched():
    functions = [fn("ns/huge", mem_gib=70, queued=1), fn("ns/a", queued=1), fn("ns/b", shape="r8", queued=1)]
    workers = [standby("s1", "g0", "r8")]
    plan = decide(snap([gpu("g0")], functions, workers))
    (wait,) = plan.of_type(Wait)
    assert wait.function == "ns/huge" and wait.cause == "no_room"
    assert "no GPU holding backbone llama has room for a 70.0 GiB worker" in wait.reason
    assert "g0:" in wait.reason and "free of 73.6 GiB" in wait.reason
    assert [b.function for b in plan.of_type(Bind)] == ["ns/b"]
    assert [a.function for a in _demand_starts(plan)] == ["ns/a"]
    assert not [s for s in plan.of_type(Stop) if s.reason == "offload"]


def test_backbone_not_loaded_or_unknown_waits_with_reason():
    functions = [fn("ns/m", backbone="mistral", queued=1), fn("ns/x", backbone="nope", queued=1)]
    plan = decide(snap([gpu("g0")], functions, backbones=TWO))
    reasons = {w.function: w.reason for w in plan.of_type(Wait)}
    assert reasons == {
        "ns/m": "backbone mistral is not loaded on any GPU",
        "ns/x": "backbone nope is not known to the controller",
    }
    assert {w.cause for w in plan.of_type(Wait)} == {"no_backbone"}


def test_min_replicas_kept_and_never_offloaded_or_expired():
    f = fn("ns/a", min_replicas=2, max_replicas=3, keep_alive_s=10)
    workers = [bound("b1", "g0", "ns/a", idle_s=500)]
    plan = decide(snap([gpu("g0")], [f], workers))
    assert not plan.of_type(Stop)
    assert [a.function for a in _demand_starts(plan)] == ["ns/a"]  # the second replica
    workers = [bound("b1", "g0", "ns/a", idle_s=500), bound("b2", "g0", "ns/a", idle_s=500)]
    assert not decide(snap([gpu("g0")], [f], workers)).actions


def test_keep_alive_and_scale_down():
    functions = [
        fn("ns/a", keep_alive_s=60, max_replicas=2),
        fn("ns/q", keep_alive_s=60, queued=1),
        fn("ns/m", max_replicas=1),
    ]
    workers = [
        bound("expired", "g0", "ns/a", idle_s=61),
        bound("fresh", "g0", "ns/a", idle_s=5),
        bound("queued", "g0", "ns/q", idle_s=600),  # has work waiting: not expired
        bound("m1", "g0", "ns/m", idle_s=1),
        bound("m2", "g0", "ns/m", idle_s=2),
        bound("orphan", "g0", "ns/deleted"),
    ]
    stops = {(s.worker_id, s.reason) for s in decide(snap([gpu("g0")], functions, workers)).of_type(Stop)}
    assert stops == {("expired", "keep_alive"), ("m2", "scale_down"), ("orphan", "scale_down")}


def test_scale_up_one_per_round_up_to_max_replicas():
    config = PolicyConfig(scale_up_queue_per_worker=4)
    f = fn("ns/a", queued=20, max_replicas=3)
    one = [bound("b1", "g0", "ns/a", running=8)]
    assert [a.function for a in _demand_starts(decide(snap([gpu("g0")], [f], one), config))] == ["ns/a"]
    two = [*one, Worker("b2", "g0", "llama", "starting", "r16", "ns/a", 2 * GiB)]
    assert len(_demand_starts(decide(snap([gpu("g0")], [f], two), config))) == 1  # 20 / 2 > 4
    three = [*two, bound("b3", "g0", "ns/a", running=8)]
    assert not _demand_starts(decide(snap([gpu("g0")], [f], three), config))  # at max_replicas
    calm = fn("ns/a", queued=4, max_replicas=3)  # 4 per worker: not above the threshold
    assert not _demand_starts(decide(snap([gpu("g0")], [calm], one), config))


def test_backoff_waits_then_retries():
    f = fn("ns/a", queued=1, start_failures=3, last_failure_s=1.0, last_failure="CUDA out of memory")
    plan = decide(snap([gpu("g0")], [f]), PolicyConfig(backoff_base_s=2, backoff_cap_s=60))
    (wait,) = plan.of_type(Wait)
    assert wait.reason.startswith("backing off after 3 failed starts: CUDA out of memory")
    assert wait.cause == "backoff"
    assert not _demand_starts(plan) and not plan.of_type(Bind)
    later = fn("ns/a", queued=1, start_failures=3, last_failure_s=9.0, last_failure="CUDA out of memory")
    assert [a.function for a in _demand_starts(decide(snap([gpu("g0")], [later])))] == ["ns/a"]


def test_oldest_waiting_function_gets_the_last_room_first():
    # room for one 30 GiB worker: the function waiting longest gets it
    functions = [
        fn("ns/new", mem_gib=30, queued=1, oldest_wait_s=0.5),
        fn("ns/old", mem_gib=30, queued=1, oldest_wait_s=9),
    ]
    workers = [bound("busy", "g0", "ns/busy", mem_gib=25, running=1)]
    plan = decide(snap([gpu("g0")], [*functions, fn("ns/busy", mem_gib=25)], workers))
    assert [a.function for a in _demand_starts(plan)] == ["ns/old"]
    assert [w.function for w in plan.of_type(Wait)] == ["ns/new"]


def test_account_after_the_plan():
    plan = decide(snap([gpu("g0")], [fn("ns/a", mem_gib=5, queued=1)]))
    acc = plan.account["g0"]
    pool_bytes = sum(a.mem_bytes for a in plan.of_type(Start) if a.function is None)
    assert acc.planned_free_bytes == acc.free_bytes - 5 * GiB - pool_bytes
    assert acc.planned_free_bytes >= 0


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 60), st.integers(1, 6))
def test_plans_are_deterministic_and_never_overcommit(seed, num_functions, num_gpus):
    s = random_snapshot(seed, num_functions, num_gpus, num_backbones=2, num_shapes=3, gpu_bytes=40 * GiB)
    plan = decide(s)
    assert decide(s) == plan
    workers = {w.id: w for w in s.workers}
    stopped = [a.worker_id for a in plan.of_type(Stop)]
    bound_now = [a.worker_id for a in plan.of_type(Bind)]
    assert len(set(stopped)) == len(stopped) and not set(stopped) & set(bound_now)
    for a in plan.of_type(Stop):
        if a.reason == "offload":
            assert workers[a.worker_id].running == 0
    for g, acc in plan.account.items():
        # never start anything on a GPU whose plan does not fit (an over-committed GPU may stay so)
        started = sum(a.mem_bytes for a in plan.of_type(Start) if a.gpu == g)
        if started:
            assert acc.planned_free_bytes >= 0


def test_decide_is_fast_enough_for_a_big_cluster():
    # the benchmark measures properly (bench/controller.py); this only guards against a blow-up
    s = random_snapshot(1, 1000, 64, num_backbones=4, num_shapes=6)
    t = time.perf_counter()
    decide(s)
    assert time.perf_counter() - t < 1.0


def test_a_warming_standby_is_waited_for_once_not_raced_by_a_fresh_start():
    warming = Worker("s-warm", "g0", "llama", "starting", "r16", None, 2 * GiB, age_s=5.0)
    one = decide(snap([gpu("g0")], [fn("ns/a", shape="r16", queued=1)], [warming]))
    assert [w.function for w in one.of_type(Wait)] == ["ns/a"] and "warming up" in one.of_type(Wait)[0].reason
    assert not _demand_starts(one)
    assert "s-warm" not in {s.worker_id for s in one.of_type(Stop)}  # the planner keeps it
    # two functions, one warming standby: the first in line waits for it, the other starts fresh
    two = decide(snap([gpu("g0")], [fn("ns/a", queued=1), fn("ns/b", queued=1)], [warming]))
    assert len(two.of_type(Wait)) == 1 and len(_demand_starts(two)) == 1
    # one of unknown age (a placeholder) or older than a fresh start (stuck?) is not waited for
    for age in (0.0, 25.0):
        stale = Worker("s-old", "g0", "llama", "starting", "r16", None, 2 * GiB, age_s=age)
        plan = decide(snap([gpu("g0")], [fn("ns/a", shape="r16", queued=1)], [stale]))
        assert not plan.of_type(Wait) and len(_demand_starts(plan)) == 1, age
    # a warming standby of another shape does not hold anyone back
    other = decide(snap([gpu("g0")], [fn("ns/a", shape="r8", queued=1)], [warming]))
    assert not other.of_type(Wait) and len(_demand_starts(other)) == 1


def test_a_function_waiting_on_a_warming_standby_is_not_cold_for_the_pool():
    # the README demo's snapshot: french's first request waits on the r8 standby the cold prior started;
    # the pool must not start more r8 standbys for french (it started two, found by helper B's profiling)
    warming = Worker("s-r8", "g0", "llama", "starting", "r8", None, 2 * GiB, age_s=1.0)
    functions = [fn("demo/french", shape="r8", queued=1, arrival_rate=1.0), fn("demo/gsm8k", shape="r16")]
    backbone = Backbone("llama", 13 * GiB, min_standby_per_gpu=0, max_standby_per_gpu=4)
    plan = decide(snap([gpu("g0")], functions, [warming], backbones=(backbone,)), PolicyConfig())
    assert [w.function for w in plan.of_type(Wait)] == ["demo/french"]
    assert not [a for a in plan.of_type(Start) if a.shape == "r8"]


def test_warm_pool_switched_off_stops_standbys_and_starts_fresh_workers():
    # the trace replay's "no warm pool" ablation: no standby is bound, kept or started
    functions = [fn("ns/a", queued=1), fn("ns/b", arrival_rate=5.0)]
    workers = [standby("s1", "g0", "r16")]
    plan = decide(snap([gpu("g0")], functions, workers), PolicyConfig(warm_pool=False))
    assert not plan.of_type(Bind)
    assert [(s.worker_id, s.reason) for s in plan.of_type(Stop)] == [("s1", "pool_shrink")]
    assert [a.function for a in plan.of_type(Start)] == ["ns/a"]  # a fresh worker, no standby starts
    assert plan.pool == []


def test_a_busy_worker_keeping_up_needs_no_standby_one_falling_behind_does():
    """A function whose worker is busy but whose queue is empty batches its next request: it is warm, and
    the pool keeps nothing for it (the H100 replay held four standbys for such functions the whole run).
    Once requests wait in its queue, another worker may be needed: then it counts as cold demand."""
    keeping_up = [fn("ns/a", arrival_rate=1.0, queued=0)]
    workers = [bound("w", "g0", "ns/a", running=3)]
    plan = decide(snap([gpu("g0")], keeping_up, workers))
    assert sum(t.count for t in plan.pool) == 0
    assert not [a for a in plan.of_type(Start) if a.function is None]

    behind = [fn("ns/a", arrival_rate=1.0, queued=1)]
    plan = decide(snap([gpu("g0")], behind, workers))
    assert sum(t.count for t in plan.pool) >= 1


def test_a_function_that_fits_nowhere_does_not_inflate_its_shapes_standbys():
    """Standbys are sized for the functions of their shape (so that a large KV budget can take one), but
    not for one bigger than any GPU holding the backbone: it gets its explicit error, the pool stays."""
    functions = [fn("ns/a", mem_gib=3, arrival_rate=0.5), fn("ns/huge", mem_gib=500, arrival_rate=0.5)]
    plan = decide(snap([gpu("g0")], functions, []))
    pool_starts = [a for a in plan.of_type(Start) if a.function is None]
    assert pool_starts and all(3 * GiB <= a.mem_bytes < 80 * GiB for a in pool_starts)
