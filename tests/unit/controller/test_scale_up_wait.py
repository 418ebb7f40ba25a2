"""Scale-up on a queue's wait (`PolicyConfig.scale_up_wait_fraction`): a function whose oldest queued request
has waited that share of its TTFT SLO behind workers that are all busy gets one more worker (a bind here) even
with fewer queued than `scale_up_queue_per_worker` per worker; not while a worker of it is idle, not before
the wait, not above maxReplicas, and never when off (the default)."""

from __future__ import annotations

import pytest

from lorafn.controller.policy import Bind, PolicyConfig, decide

from .helpers import bound, fn, gpu, snap, standby

ON = PolicyConfig(scale_up_wait_fraction=0.2)


def queued(wait_s: float, queued: int = 2, max_replicas: int = 4) -> list:
    # SLO 2500 ms: 0.2 of it is 0.5 s
    return [fn("ns/f", queued=queued, oldest_wait_s=wait_s, ttft_slo_ms=2500, max_replicas=max_replicas)]


def binds(plan) -> list[str]:
    return [a.function for a in plan.of_type(Bind)]


def test_a_short_queue_that_waited_its_share_of_the_slo_gets_a_worker() -> None:
    workers = [bound("w1", "g0", "ns/f", running=4), standby("s1", "g0")]
    assert binds(decide(snap([gpu("g0")], queued(0.6), workers), ON)) == ["ns/f"]
    assert binds(decide(snap([gpu("g0")], queued(0.6), workers), PolicyConfig())) == []  # off by default


@pytest.mark.parametrize(
    ("functions", "workers", "why"),
    [
        (queued(0.3), [bound("w1", "g0", "ns/f", running=4)], "not waited 0.2 x 2.5 s yet"),
        (queued(0.6), [bound("w1", "g0", "ns/f", running=4), bound("w2", "g0", "ns/f")], "w2 idle: reads it"),
        (queued(0.6, max_replicas=1), [bound("w1", "g0", "ns/f", running=4)], "at maxReplicas"),
        (queued(0.6, queued=0), [bound("w1", "g0", "ns/f", running=4)], "nothing queued"),
    ],
)
def test_no_scale_up(functions, workers, why: str) -> None:
    plan = decide(snap([gpu("g0")], functions, [*workers, standby("s1", "g0")]), ON)
    assert binds(plan) == [], why


def test_the_setting_is_checked() -> None:
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="scale_up_wait_fraction must be in"):
            PolicyConfig(scale_up_wait_fraction=bad)
