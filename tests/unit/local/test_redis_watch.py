"""When the local supervisor restarts redis-server (`RedisWatch`, pure)."""

from __future__ import annotations

from lorafn.local.redis_proc import RedisWatch


def test_a_dead_server_is_restarted_at_once() -> None:
    assert RedisWatch(hang_s=15).verdict(alive=False, answers=False, now=0.0) == "restart"


def test_a_live_server_that_does_not_answer_is_restarted_only_after_hang_s() -> None:
    watch = RedisWatch(hang_s=15)
    assert watch.verdict(alive=True, answers=False, now=100.0) == "wait"
    assert watch.verdict(alive=True, answers=False, now=114.0) == "wait"
    assert watch.verdict(alive=True, answers=False, now=115.0) == "restart"
    # the next silence is measured afresh
    assert watch.verdict(alive=True, answers=False, now=116.0) == "wait"


def test_an_answer_ends_the_silence() -> None:
    watch = RedisWatch(hang_s=15)
    assert watch.verdict(alive=True, answers=False, now=0.0) == "wait"
    assert watch.verdict(alive=True, answers=True, now=10.0) == "ok"
    assert watch.verdict(alive=True, answers=False, now=20.0) == "wait"
    assert watch.verdict(alive=True, answers=False, now=34.0) == "wait"
