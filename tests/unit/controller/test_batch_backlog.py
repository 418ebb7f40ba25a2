"""Offline batch backlog as controller demand (docs/batch.md): a function whose batch runner holds
requests its live workers have no room for binds ready standbys, one per full wave of backlog, up to
maxReplicas; never starts, offloads or waits for it; and its workers return by keep-alive once the
backlog is gone."""

from __future__ import annotations

import pytest

from lorafn.controller.policy import Bind, PolicyConfig, Start, Stop, Wait, decide
from lorafn.controller.policy.model import Function

from .helpers import GiB, bound, fn, gpu, snap, standby

CONFIG = PolicyConfig(batch_backlog_per_worker=48)


def binds(plan) -> list[tuple[str, str]]:
    return sorted((b.worker_id, b.function) for b in plan.of_type(Bind))


def test_backlog_binds_one_ready_standby_per_full_wave_up_to_max_replicas() -> None:
    workers = [bound("w1", "g0", "ns/b", running=48), *(standby(f"s{i}", "g0") for i in range(4))]
    # 100 left over: two full waves -> two more workers
    plan = decide(snap([gpu("g0")], [fn("ns/b", batch_backlog=100, max_replicas=8)], workers), CONFIG)
    assert len(binds(plan)) == 2 and {f for _, f in binds(plan)} == {"ns/b"}
    # maxReplicas 2: only one more
    plan = decide(snap([gpu("g0")], [fn("ns/b", batch_backlog=1000, max_replicas=2)], workers), CONFIG)
    assert len(binds(plan)) == 1
    # less than a wave left: the live worker takes it next
    assert not binds(
        decide(snap([gpu("g0")], [fn("ns/b", batch_backlog=47, max_replicas=8)], workers), CONFIG)
    )


def test_backlog_uses_idle_standbys_only_never_a_start_an_offload_or_a_wait() -> None:
    # no standby, a GPU with free memory: nothing is started for a batch backlog
    workers = [bound("w1", "g0", "ns/b", running=48)]
    plan = decide(snap([gpu("g0")], [fn("ns/b", batch_backlog=500, max_replicas=8)], workers), CONFIG)
    assert not binds(plan)
    assert not [a for a in plan.of_type(Start) if a.function == "ns/b"]
    assert not plan.of_type(Wait)
    # a full GPU holding another function's idle worker: no offload for a batch
    full = [bound("w1", "g0", "ns/b", running=48, mem_gib=30), bound("x", "g0", "ns/x", mem_gib=30, idle_s=5)]
    functions = [fn("ns/b", batch_backlog=500, max_replicas=8, mem_gib=30), fn("ns/x", mem_gib=30)]
    plan = decide(snap([gpu("g0")], functions, full), CONFIG)
    assert not plan.of_type(Stop) and not binds(plan)


def test_online_demand_gets_the_standby_before_a_batch_backlog() -> None:
    workers = [bound("w1", "g0", "ns/b", running=48), standby("s0", "g0")]
    functions = [fn("ns/b", batch_backlog=500, max_replicas=8), fn("ns/on", queued=1)]
    assert binds(decide(snap([gpu("g0")], functions, workers), CONFIG)) == [("s0", "ns/on")]


def test_no_live_worker_is_left_to_the_cold_start_path() -> None:
    # the runner records cold-start demand and queues one wave (queued > 0): that path binds one worker
    plan = decide(
        snap([gpu("g0")], [fn("ns/b", batch_backlog=500, max_replicas=8)], [standby("s0", "g0")]), CONFIG
    )
    assert not binds(plan)


def test_workers_return_by_keep_alive_once_the_backlog_is_gone() -> None:
    workers = [bound("w1", "g0", "ns/b", idle_s=120), bound("w2", "g0", "ns/b", idle_s=120)]
    busy = fn("ns/b", batch_backlog=10, max_replicas=8, keep_alive_s=60)
    assert not decide(snap([gpu("g0")], [busy], workers), CONFIG).of_type(Stop)  # backlog left: kept
    done = fn("ns/b", batch_backlog=0, max_replicas=8, keep_alive_s=60)
    stops = {
        (s.worker_id, s.reason) for s in decide(snap([gpu("g0")], [done], workers), CONFIG).of_type(Stop)
    }
    assert stops == {("w1", "keep_alive"), ("w2", "keep_alive")}


def test_bad_values_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="batch_backlog"):
        Function("ns/b", "llama", "r16", GiB, batch_backlog=-1)
    with pytest.raises(ValueError, match="batch_backlog_per_worker"):
        PolicyConfig(batch_backlog_per_worker=0)
