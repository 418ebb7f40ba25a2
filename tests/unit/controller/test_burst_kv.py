"""More KV for a burst (`PolicyConfig.burst_kv_bytes`): the busy workers of a function whose online requests
have waited in its queue at least `burst_kv_min_wait_s` grow their KV caches by their share of the queue at
their present KV per running request (at least half their own KV more, never less than one request's worth,
up to the budget), out of what online demand left, keeping room for one more standby; not while one of its
workers is idle, not for a function an Unpark or a Bind of the plan serves now, never for a parked worker;
the grant goes back through the same rule as a batch's (`test_batch_kv`)."""

from __future__ import annotations

import pytest

from lorafn.controller.policy import Bind, PolicyConfig, ResizeKV, Start, decide

from .helpers import GiB, bound, fn, gpu, snap, standby

MiB = 1 << 20
KV = 512 * MiB
CONFIG = PolicyConfig(burst_kv_bytes=2 * GiB, warm_pool=False)


def resizes(plan) -> list[tuple[str, int, int]]:
    """(worker, new KV MiB, delta MiB) of each ResizeKV."""
    return [(a.worker_id, a.kv_bytes // MiB, a.delta_bytes // MiB) for a in plan.of_type(ResizeKV)]


def burst(queued: int = 3, wait_s: float = 0.5, **kw) -> list:
    return [fn("ns/f", mem_gib=1.5, kv_bytes=KV, queued=queued, oldest_wait_s=wait_s, max_replicas=4, **kw)]


def busy(id: str = "w1", running: int = 5, gpu_id: str = "g0", kv_bytes: int = KV, **kw):
    return bound(id, gpu_id, "ns/f", mem_gib=1.5, kv_bytes=kv_bytes, running=running, **kw)


def test_a_full_worker_grows_by_its_queue_at_its_kv_per_running_request() -> None:
    # 5 running in 512 MiB: ~102.4 MiB a request; 3 queued want 307.2 MiB more (> half its KV): 307 whole MiB
    plan = decide(snap([gpu("g0")], burst(queued=3), [busy()]), CONFIG)
    assert resizes(plan) == [("w1", 819, 307)]
    (grant,) = plan.of_type(ResizeKV)
    assert "burst: 3 queued (0.5 s) behind 1 busy worker(s)" in grant.detail
    # a short queue still grows by half the worker's KV (a growing burst does not resize it every round)
    assert resizes(decide(snap([gpu("g0")], burst(queued=1), [busy()]), CONFIG)) == [("w1", 768, 256)]
    # up to the budget, and nothing once there
    assert resizes(decide(snap([gpu("g0")], burst(queued=40), [busy()]), CONFIG)) == [("w1", 2048, 1536)]
    at_budget = [bound("w1", "g0", "ns/f", mem_gib=3, kv_bytes=2 * GiB, running=20, kv_grant=True)]
    assert resizes(decide(snap([gpu("g0")], burst(queued=5), at_budget), CONFIG)) == []


def test_two_busy_workers_share_the_queue() -> None:
    # 4 queued over 2 workers: 2 each, 2 x 128 MiB (4 running in 512) = 256 MiB = half the KV
    workers = [busy("w1", running=4), busy("w2", running=2)]
    plan = decide(snap([gpu("g0")], burst(queued=4), workers), CONFIG)
    # w2 runs 2 in 512 MiB: 256 MiB a request, 2 of them = 512 MiB
    assert resizes(plan) == [("w1", 768, 256), ("w2", 1024, 512)]


@pytest.mark.parametrize(
    ("functions", "workers", "why"),
    [
        (burst(wait_s=0.1), [busy()], "a request read within a step is no burst"),
        (burst(queued=0), [busy()], "nothing queued"),
        (burst(), [busy("w1"), busy("w2", running=0)], "an idle worker of it reads the queue next poll"),
        (
            burst(),
            [bound("w1", "g0", "ns/f", mem_gib=1, kv_bytes=KV, parked=True)],
            "parked: unparked instead",
        ),
        (burst(), [busy(kv_bytes=0)], "a worker that does not report its KV"),
        (burst(), [busy(kv_limited=False)], "its batch slots, not its KV, hold the queue back"),
    ],
)
def test_no_growth(functions, workers, why: str) -> None:
    assert resizes(decide(snap([gpu("g0")], functions, workers), CONFIG)) == [], why


def test_off_by_default() -> None:
    assert resizes(decide(snap([gpu("g0")], burst(), [busy()]), PolicyConfig(warm_pool=False))) == []


def test_a_function_at_its_max_replicas_grows_where_it_cannot_scale_up() -> None:
    capped = [fn("ns/f", mem_gib=1.5, kv_bytes=KV, queued=20, oldest_wait_s=0.5, max_replicas=1)]
    plan = decide(snap([gpu("g0")], capped, [busy()]), CONFIG)
    assert not plan.of_type(Start) and resizes(plan) == [("w1", 2048, 1536)]


def test_a_ready_standby_bound_for_it_serves_the_burst_instead() -> None:
    # 20 queued on one worker: a scale-up binds the standby; no KV grant on top of a worker ready in ms
    workers = [busy(), standby("s1", "g0")]
    plan = decide(snap([gpu("g0")], burst(queued=20), workers), PolicyConfig(burst_kv_bytes=2 * GiB))
    assert [a.function for a in plan.of_type(Bind)] == ["ns/f"] and resizes(plan) == []
    # a fresh start (seconds away) does not serve it now: the busy worker grows as well
    plan = decide(snap([gpu("g0")], burst(queued=20), workers[:1]), CONFIG)
    assert [a.function for a in plan.of_type(Start)] == ["ns/f"] and resizes(plan) == [("w1", 2048, 1536)]


def test_room_for_one_more_standby_is_kept_and_cold_starts_come_first() -> None:
    # T GiB of GPU: 0.92 T granted, less 13 (backbone), 1.5 (the worker), 20 (the cold start) and 2 (one
    # standby kept) = 0.92 T - 36.5 GiB of room for the burst, which asks 307 MiB (3 x ~102.4)
    functions = [*burst(queued=3), fn("ns/cold", mem_gib=20, queued=1, oldest_wait_s=1.0)]
    for total_gib, grant in ((41, [("w1", 819, 307)]), (39.9, [("w1", 724, 212)]), (39.7, [])):
        plan = decide(snap([gpu("g0", total_gib=total_gib)], functions, [busy()]), CONFIG)
        assert [a.function for a in plan.of_type(Start)] == ["ns/cold"], total_gib
        assert resizes(plan) == grant, total_gib  # 39.9: what fits; 39.7: ~29 MiB, less than one request
        (account,) = plan.account.values()
        assert account.planned_free_bytes >= 2 * GiB or not grant, total_gib


def test_less_room_than_one_request_is_no_grant() -> None:
    # 19.1 GiB of GPU: 17.57 granted - 13 - 1.5 = 3.07 GiB free, less the 2 GiB reserve: ~1.07 GiB of room.
    # A worker running 1 in 2 GiB needs 2 GiB for the next request: nothing
    big = [bound("w1", "g0", "ns/f", mem_gib=3, kv_bytes=2 * GiB, running=1)]
    config = PolicyConfig(burst_kv_bytes=8 * GiB, warm_pool=False)
    assert resizes(decide(snap([gpu("g0", total_gib=19.1)], burst(queued=2), big), config)) == []
    assert resizes(decide(snap([gpu("g0")], burst(queued=2), big), config)) == [("w1", 6144, 4096)]


def test_the_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="burst_kv_bytes must be an integer >= 0, got -1"):
        PolicyConfig(burst_kv_bytes=-1)
    with pytest.raises(ValueError, match="burst_kv_min_wait_s must be >= 0"):
        PolicyConfig(burst_kv_min_wait_s=-0.1)
    with pytest.raises(ValueError, match="kv_grant_idle_s must be >= 0"):
        PolicyConfig(kv_grant_idle_s=float("nan"))
