"""The driver around a real redis-server, at a GPU's end: a cold start that needs an idle worker offloaded
starts only once that worker's process has exited (the executor reports it), not in the round of the
offload, nor when the worker has only deregistered; and the rounds in between offload nothing more.

Found on the H100 with 110 functions: the new worker, forked in ~1 s, created its CUDA context before
the victim (~2 s to exit) had freed its memory and died of OOM."""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path

import pytest

from lorafn.controller.driver import Controller, ControllerConfig, Exit
from lorafn.controller.policy.config import PolicyConfig
from lorafn.controller.policy.model import GPU
from lorafn.controller.snapshot import SizingConfig
from lorafn.store import Keys, Store, control, workers
from tests.unit.controller.redis_world import RecordingExecutor, commands, queue_request, register_tiny

NEW, IDLE, OTHER = "team/new", "team/idle", "team/other"
MiB = 1 << 20


class _Executor(RecordingExecutor):
    reports_every_exit = True  # as `lorafn up`'s executor

    def __init__(self, gpus: list[GPU]) -> None:
        super().__init__(gpus)
        self.stopped: list[str] = []
        self.ended: list[Exit] = []

    def stop(self, worker_id: str) -> None:
        self.stopped.append(worker_id)

    def exits(self) -> list:
        out, self.ended = self.ended, []
        return out


@pytest.fixture
def world(redis_server: str, tmp_path: Path):
    store, keys = Store(redis_server), Keys(f"t{uuid.uuid4().hex[:8]}")
    long = {"scaling": {"keepAliveSeconds": 3600}}  # offloaded, not retired by its keep-alive
    register_tiny(store, keys, tmp_path, {NEW: {}, IDLE: long, OTHER: long}, warm_pool=(0, 0))
    executor = _Executor([GPU("g0", "n", 1 << 40, {"tiny": 0})])
    controller = Controller(
        store, keys, executor, SizingConfig(worker_overhead_bytes=MiB, default_kv_bytes=MiB),
        ControllerConfig(holder="me", policy=PolicyConfig(cold_prior_rps=0.0, pool_min_age_s=3600)),
    )  # fmt: skip
    yield store, keys, controller, executor
    store.close()


def _worker(store: Store, keys: Keys, wid: str, function: str, mem_bytes: int, running: int = 0) -> None:
    fields = {
        "state": "serving", "gpu": "g0", "backbone": "tiny", "shape": "", "mem_bytes": mem_bytes,
        "started": int(time.time()) - 600, "idle_s": 0 if running else 600, "running": running,
    }  # fmt: skip
    store.run(workers.heartbeat(keys, wid, function, 5000, fields))


def test_a_start_waits_until_its_offloaded_victim_has_exited(world, caplog) -> None:
    store, keys, controller, executor = world
    caplog.set_level(logging.INFO, logger="lorafn.controller")
    controller.round()
    size = controller.reader.sizes[NEW].mem_bytes
    # the GPU holds exactly two workers (90% utilization, no reserve): busy OTHER and idle IDLE
    executor._gpus = [GPU("g0", "n", int((2 * size + size // 2) / 0.92), {"tiny": 0})]
    _worker(store, keys, "w-idle", IDLE, size)
    _worker(store, keys, "w-other", OTHER, size, running=1)
    queue_request(store, keys, NEW, "r1")

    controller.round()  # offload w-idle (idle for 600 s, no arrivals) for NEW, and no start yet
    assert executor.stopped == ["w-idle"]
    assert commands(store, keys, "w-idle")[-1]["cmd"] == "stop"
    assert not [s for s in executor.started if s.function == NEW]
    reason = store.run(control.statuses(keys, [NEW]))[NEW]["wait_reason"]
    assert reason.startswith("making room on GPU g0: 1 stopped worker(s)")

    _worker(store, keys, "w-idle", IDLE, size)  # still heartbeating while it drains
    controller.round()
    store.run(workers.deregister(keys, "w-idle", IDLE))  # deregistered; its process not yet gone
    controller.round()
    assert not [s for s in executor.started if s.function == NEW]
    assert executor.stopped == ["w-idle"]  # nothing more stopped while it exits

    executor.ended.append(Exit("w-idle", IDLE, 0, "stopped"))
    controller.round()
    assert [s.function for s in executor.started if s.function] == [NEW]
    assert executor.stopped == ["w-idle"]
    # the wait, logged once when it began and once when it ended, its seconds counted by cause
    lines = [m for m in (r.getMessage() for r in caplog.records) if f" {NEW} " in m and "wait" in m]
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"controller: wait {NEW} (making_room): making room on GPU g0")
    assert lines[1].startswith(f"controller: waited {NEW} ") and "(last making_room " in lines[1]
    waited = controller.metrics.registry.get_sample_value(
        "lorafn_controller_wait_seconds_total", {"cause": "making_room"}
    )
    assert waited is not None and 0 < waited == pytest.approx(float(lines[1].split()[3]), abs=0.01)


def test_where_clean_exits_are_not_reported_a_deregistered_worker_counts_as_gone(world) -> None:
    # Kubernetes: the operator reports failed containers only; waiting for a clean exit that is never
    # reported would hold the start for the whole bind timeout
    store, keys, controller, executor = world
    executor.reports_every_exit = False
    controller.round()
    size = controller.reader.sizes[NEW].mem_bytes
    executor._gpus = [GPU("g0", "n", int((2 * size + size // 2) / 0.92), {"tiny": 0})]
    _worker(store, keys, "w-idle", IDLE, size)
    _worker(store, keys, "w-other", OTHER, size, running=1)
    queue_request(store, keys, NEW, "r1")
    controller.round()
    assert executor.stopped == ["w-idle"] and not [s for s in executor.started if s.function == NEW]
    store.run(workers.deregister(keys, "w-idle", IDLE))
    controller.round()
    assert [s.function for s in executor.started if s.function] == [NEW]


def test_a_round_slower_than_slow_round_s_is_logged_with_its_parts(world, caplog) -> None:
    controller = world[2]
    caplog.set_level(logging.INFO, logger="lorafn.controller")
    controller.round()
    assert not [r for r in caplog.records if "slow round" in r.getMessage()]  # ms, under the 1 s default
    controller.config.slow_round_s = 0.0
    controller.round()
    (line,) = [r.getMessage() for r in caplog.records if "slow round" in r.getMessage()]
    assert "(read " in line and ", decide " in line and ", apply " in line and " workers)" in line
