"""More KV for offline batches (`PolicyConfig.batch_kv_bytes`, docs/batch.md#kv-from-idle-memory): a bound
worker of a function with a batch backlog grows its KV cache out of GPU memory nothing else in the round
wants, as much as keeps room for one more standby (up to the budget); less than half the worker's own KV
more is not granted; the grant comes after online demand and gets what it left; a granted worker shrinks
back to its function's budget once the backlog is gone and it has been idle `kv_grant_idle_s` (not while it
runs, not when it was never granted); off by default."""

from __future__ import annotations

import pytest

from lorafn.controller.policy import PolicyConfig, ResizeKV, Start, decide
from lorafn.controller.policy.account import accounts

from .helpers import GiB, bound, fn, gpu, snap

MiB = 1 << 20

CONFIG = PolicyConfig(batch_kv_bytes=16 * GiB, warm_pool=False)


def resizes(plan) -> list[tuple[str, int, int]]:
    return [(a.worker_id, a.kv_bytes // GiB, a.delta_bytes // GiB) for a in plan.of_type(ResizeKV)]


def test_a_worker_with_a_batch_backlog_grows_to_the_batch_budget() -> None:
    functions = [fn("ns/b", batch_backlog=200, kv_bytes=4 * GiB, mem_gib=6)]
    workers = [bound("w1", "g0", "ns/b", mem_gib=6, kv_bytes=4 * GiB, running=48)]
    plan = decide(snap([gpu("g0")], functions, workers), CONFIG)
    assert resizes(plan) == [("w1", 16, 12)]
    assert "offline batch backlog of 200" in plan.of_type(ResizeKV)[0].detail
    before = accounts(snap([gpu("g0")], functions, workers), CONFIG.gpu_utilization, CONFIG.driver_headroom)
    assert plan.account["g0"].planned_free_bytes == before["g0"].free_bytes - 12 * GiB  # taken in this plan


def backlog_beside_busy(kv_gib: int, mem_gib: int) -> tuple[list, list]:
    """(functions, workers): w1 of ns/b (a batch backlog of 200, KV `kv_gib`, `mem_gib` in all, 8 running)
    beside w2 of ns/x (6 GiB, one running), both bound on g0."""
    functions = [fn("ns/b", batch_backlog=200, kv_bytes=kv_gib * GiB, mem_gib=mem_gib), fn("ns/x", mem_gib=6)]
    workers = [
        bound("w1", "g0", "ns/b", mem_gib=mem_gib, kv_bytes=kv_gib * GiB, running=8),
        bound("w2", "g0", "ns/x", mem_gib=6, running=1),
    ]
    return functions, workers


def test_the_grant_leaves_room_for_one_more_standby() -> None:
    # 80 GiB x 0.92 = 73.6; backbone 13 and two 6 GiB workers leave 48.6 GiB: a 46 GiB grant leaves 2.6 GiB
    # (one standby is 2 GiB: all of it granted); a 52 GiB budget gets what leaves 2 GiB (whole MiB)
    functions, workers = backlog_beside_busy(kv_gib=4, mem_gib=6)
    config = PolicyConfig(batch_kv_bytes=50 * GiB, warm_pool=False)
    assert resizes(decide(snap([gpu("g0")], functions, workers), config)) == [("w1", 50, 46)]
    tight = decide(
        snap([gpu("g0")], functions, workers), PolicyConfig(batch_kv_bytes=52 * GiB, warm_pool=False)
    )
    (grant,) = tight.of_type(ResizeKV)
    free = accounts(snap([gpu("g0")], functions, workers), 0.92, 0.03)["g0"].free_bytes
    assert (
        grant.delta_bytes == (free - 2 * GiB) // MiB * MiB and grant.kv_bytes == 4 * GiB + grant.delta_bytes
    )
    assert 2 * GiB <= tight.account["g0"].planned_free_bytes < 2 * GiB + MiB


def test_no_grant_of_less_than_half_the_workers_own_kv() -> None:
    # 32 GiB of KV: a grant must add 16 GiB at least. 60 GiB GPU: 55.2 - 13 - 34 - 6 = 2.2 GiB free, room 0.2
    functions, workers = backlog_beside_busy(kv_gib=32, mem_gib=34)
    config = PolicyConfig(batch_kv_bytes=64 * GiB, warm_pool=False)
    assert resizes(decide(snap([gpu("g0", total_gib=60)], functions, workers), config)) == []
    # 90 GiB: 82.8 - 53 = 29.8 free, room 27.8 GiB >= 16: granted (27 whole GiB and some MiB)
    (grant,) = decide(snap([gpu("g0", total_gib=90)], functions, workers), config).of_type(ResizeKV)
    assert 27 * GiB < grant.delta_bytes < 28 * GiB


def test_online_demand_comes_first() -> None:
    # a cold function's start takes its room first; the grant gets what is left
    functions = [
        fn("ns/b", batch_backlog=200, kv_bytes=4 * GiB, mem_gib=6),
        fn("ns/cold", mem_gib=30, queued=3),
    ]
    workers = [bound("w1", "g0", "ns/b", mem_gib=6, kv_bytes=4 * GiB, running=8)]
    config = PolicyConfig(batch_kv_bytes=40 * GiB, warm_pool=False)
    plan = decide(snap([gpu("g0")], functions, workers), config)
    assert [a.function for a in plan.of_type(Start)] == ["ns/cold"]
    (grant,) = plan.of_type(ResizeKV)
    assert grant.delta_bytes < 24 * GiB  # 73.6 - 13 - 6 - 30 - 2 = 22.6 GiB
    alone = decide(snap([gpu("g0")], functions[:1], workers), config)
    assert resizes(alone) == [("w1", 40, 36)]


@pytest.mark.parametrize(
    ("backlog", "running", "granted", "expected"),
    [
        (0, 0, True, [("w1", 4, -12)]),  # batch done, idle: back to the function's own budget
        (0, 5, True, []),  # still running (the last wave, or online requests): later
        (0, 0, False, []),  # never granted (e.g. a standby bound with a larger KV): left alone
        (100, 0, True, []),  # a backlog left: keeps it
    ],
)
def test_a_granted_worker_shrinks_back_once_the_batch_is_done(
    backlog: int, running: int, granted: bool, expected: list
) -> None:
    functions = [fn("ns/b", batch_backlog=backlog, kv_bytes=4 * GiB, mem_gib=6)]
    idle_s = 0.0 if running else 10.0
    grant = {"kv_bytes": 16 * GiB, "kv_grant": granted}
    workers = [bound("w1", "g0", "ns/b", mem_gib=18, running=running, idle_s=idle_s, **grant)]
    assert resizes(decide(snap([gpu("g0")], functions, workers), CONFIG)) == expected
    if expected:  # not before it has been idle kv_grant_idle_s (5 s: a burst may come back), nor with a queue
        fresh = [bound("w1", "g0", "ns/b", mem_gib=18, kv_bytes=16 * GiB, kv_grant=True, idle_s=4.0)]
        assert resizes(decide(snap([gpu("g0")], functions, fresh), CONFIG)) == []
        queued = [fn("ns/b", kv_bytes=4 * GiB, mem_gib=6, queued=1, oldest_wait_s=0.05)]
        assert resizes(decide(snap([gpu("g0")], queued, workers), CONFIG)) == []


def test_off_by_default_and_never_for_parked_workers() -> None:
    functions = [fn("ns/b", batch_backlog=200, kv_bytes=4 * GiB, mem_gib=6)]
    workers = [bound("w1", "g0", "ns/b", mem_gib=6, kv_bytes=4 * GiB, running=48)]
    assert resizes(decide(snap([gpu("g0")], functions, workers), PolicyConfig(warm_pool=False))) == []
    parked = [bound("w1", "g0", "ns/b", mem_gib=2, kv_bytes=4 * GiB, parked=True)]
    assert resizes(decide(snap([gpu("g0")], functions, parked), CONFIG)) == []


def test_the_setting_is_checked() -> None:
    with pytest.raises(ValueError, match="batch_kv_bytes must be an integer >= 0, got -1"):
        PolicyConfig(batch_kv_bytes=-1)
