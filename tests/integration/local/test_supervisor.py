"""The `lorafn up` loop (`LocalPlatform.tick`) around a real redis-server, without the other processes:
a controller whose rounds keep failing is replaced by a fresh one (a new lease holder), and SIGUSR1's
request does the same at the next tick (issue 15)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lorafn.local.config import LocalConfig
from lorafn.local.platform import CONTROLLER_MAX_FAILED_ROUNDS, LocalPlatform
from lorafn.local.redis_proc import RedisProcess
from lorafn.store import Store


class _Broken:
    """A controller whose every round fails (a bad record it cannot get past, a bug in its memory)."""

    def __init__(self, metrics: Any) -> None:
        self.metrics = metrics
        self.rounds = 0
        self.demand_cursor = None

    def wait_for_demand(self, timeout_s: float) -> list:
        return []

    def answer_demand(self, demand: list) -> list:
        return []

    def round(self) -> None:
        self.rounds += 1
        raise ValueError("a round that cannot succeed")


def _platform(redis: RedisProcess, tmp_path: Path) -> LocalPlatform:
    platform = LocalPlatform(LocalConfig(state_dir=tmp_path / "state", device="cpu", gateway_port=0))
    platform.redis = redis
    platform.store = Store(redis.url)
    platform.controller = platform._new_controller()
    return platform


def test_a_controller_that_keeps_failing_is_replaced(redis_process: RedisProcess, tmp_path: Path) -> None:
    platform = _platform(redis_process, tmp_path)
    first_holder = platform.controller.config.holder  # type: ignore[union-attr]
    broken = _Broken(platform.controller.metrics)  # type: ignore[union-attr]
    platform.controller = broken  # type: ignore[assignment]
    for _ in range(CONTROLLER_MAX_FAILED_ROUNDS):
        platform.tick(block_ms=1)
    assert broken.rounds == CONTROLLER_MAX_FAILED_ROUNDS
    assert platform.controller is not broken and platform.controller_restarts == 1
    assert platform.controller.config.holder != first_holder  # it waits out the old lease, as a new process
    platform.tick(block_ms=1)  # the fresh one runs (it may wait for the lease: None, no error)
    assert platform.controller_restarts == 1
    platform.store.close()  # type: ignore[union-attr]


def test_a_requested_restart_happens_at_the_next_tick(redis_process: RedisProcess, tmp_path: Path) -> None:
    platform = _platform(redis_process, tmp_path)
    before = platform.controller
    platform.request_controller_restart("SIGUSR1")
    assert platform.controller is before  # nothing happens inside the signal handler
    platform.tick(block_ms=1)
    assert platform.controller is not before and platform.controller_restarts == 1
    platform.store.close()  # type: ignore[union-attr]
