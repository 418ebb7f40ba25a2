"""The driver around a real redis-server: a ready standby is told to pre-load the function's adapter; demand
is answered from the last snapshot (a bind to that standby, marked pre-loaded) before any new round; the
round after it sends no second bind, and the pool's refill on that GPU waits while the bind is fresh."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from lorafn.controller.driver import Controller, ControllerConfig
from lorafn.controller.policy.config import PolicyConfig
from lorafn.controller.snapshot import SizingConfig
from lorafn.store import Keys, Store, workers
from tests.unit.controller.redis_world import RecordingExecutor, commands, queue_request, register_tiny

FN = "team/fa"
MiB = 1 << 20


@pytest.fixture
def world(redis_server: str, tmp_path: Path):
    store, keys = Store(redis_server), Keys(f"t{uuid.uuid4().hex[:8]}")
    register_tiny(store, keys, tmp_path, {FN: {}})
    executor = RecordingExecutor()
    controller = Controller(
        store, keys, executor, SizingConfig(worker_overhead_bytes=MiB, default_kv_bytes=MiB),
        ControllerConfig(holder="me", policy=PolicyConfig(pool_min_age_s=3600), refill_delay_s=30.0),
    )  # fmt: skip
    yield store, keys, controller, executor
    store.close()


def _beat(store: Store, keys: Keys, wid: str, shape: str, preloaded: str = "") -> None:
    fields = {
        "state": "standby", "gpu": "g0", "backbone": "tiny", "shape": shape, "mem_bytes": 4 * MiB,
        "started": int(time.time()) - 5, "preloaded": preloaded,
    }  # fmt: skip
    store.run(workers.heartbeat(keys, wid, None, 5000, fields))


def test_preload_then_a_fast_bind_from_the_snapshot(world) -> None:
    store, keys, controller, executor = world
    controller.round()
    shape = controller.reader.sizes[FN].shape
    _beat(store, keys, "s1", shape)
    controller.round()
    assert commands(store, keys, "s1") == [{"cmd": "preload", "function": FN, "claim": "1"}]
    controller.round()  # sent and not yet in its heartbeat: not sent again
    assert len(commands(store, keys, "s1")) == 1
    _beat(store, keys, "s1", shape, preloaded=FN)  # the standby loaded it
    controller.round()
    starts_before = len(executor.started)

    assert controller.wait_for_demand(0.01) == []
    queue_request(store, keys, FN, "r1")
    demand = controller.wait_for_demand(5.0)
    assert [d.function for d in demand] == [FN]
    binds = controller.answer_demand(demand)  # no round in between
    assert [(b.worker_id, b.function, b.preloaded) for b in binds] == [("s1", FN, True)]
    assert commands(store, keys, "s1")[-1] == {"cmd": "bind", "function": FN}
    reg = controller.metrics.registry
    assert reg.get_sample_value("lorafn_controller_binds_total", {"path": "fast", "preloaded": "yes"}) == 1
    assert reg.get_sample_value("lorafn_controller_demand_to_bind_seconds_count", {"path": "fast"}) == 1

    controller.round()  # the bind is pending: no second one; the refill of the pool on g0 is deferred
    assert [c["cmd"] for c in commands(store, keys, "s1")] == ["preload", "bind"]
    assert len(executor.started) == starts_before
    assert any(t.count > 0 for t in controller.last_plan.pool)  # the pool still wants its standby


def test_no_fast_bind_when_switched_off_or_before_a_round(world) -> None:
    store, keys, controller, _ = world
    from lorafn.controller.driver import Demand

    assert controller.answer_demand([Demand(FN, 0)]) == []  # no snapshot yet
    controller.config.fast_bind = False
    controller.round()
    _beat(store, keys, "s1", controller.reader.sizes[FN].shape)
    controller.round()
    assert controller.answer_demand([Demand(FN, 0)]) == []


def test_demand_recorded_while_a_round_runs_is_answered_inside_it(world) -> None:
    store, keys, controller, _ = world
    controller.round()
    _beat(store, keys, "s1", controller.reader.sizes[FN].shape, preloaded=FN)
    controller.round()
    assert controller.wait_for_demand(0.01) == []  # the cursor is now
    queue_request(store, keys, FN, "r1")
    controller.round()  # no wait in between: the round's first step reads and answers it
    reg = controller.metrics.registry
    assert reg.get_sample_value("lorafn_controller_binds_total", {"path": "fast", "preloaded": "yes"}) == 1
    assert reg.get_sample_value("lorafn_controller_binds_total", {"path": "round", "preloaded": "no"}) is None
    assert [c["cmd"] for c in commands(store, keys, "s1")] == ["bind"]


def test_a_standby_told_to_stop_is_never_bound(world) -> None:
    store, keys, controller, _ = world
    controller.round()
    shape = controller.reader.sizes[FN].shape
    _beat(store, keys, "s1", shape)
    _beat(store, keys, "s2", shape)
    controller.config.policy = PolicyConfig(pool_min_age_s=0)  # the floor is 1: one of the two goes
    controller.round()
    stopped = [
        wid for wid in ("s1", "s2") if {"cmd": "stop", "reason": "pool_shrink"} in commands(store, keys, wid)
    ]
    assert len(stopped) == 1
    kept = ({"s1", "s2"} - set(stopped)).pop()
    controller.round()  # the stopped one still heartbeats as standby: not stopped twice
    assert commands(store, keys, stopped[0]).count({"cmd": "stop", "reason": "pool_shrink"}) == 1
    assert controller.wait_for_demand(0.01) == []
    queue_request(store, keys, FN, "r1")
    binds = controller.answer_demand(controller.wait_for_demand(5.0))
    assert [b.worker_id for b in binds] == [kept]


def test_a_lifecycle_event_ends_the_wait_so_the_status_is_written_at_once(world) -> None:
    import threading

    from lorafn.store import control

    store, keys, controller, _ = world
    controller.round()
    assert controller.wait_for_demand(0.01) == []
    timer = threading.Timer(
        0.2,
        lambda: store.run(
            control.post_event(
                keys, control.BOUND, worker="w1", function=FN, ms=3, path="standby", preloaded=1
            )
        ),
    )
    timer.start()
    t0 = time.monotonic()
    assert controller.wait_for_demand(30.0) == []  # nothing to answer, but awake
    assert time.monotonic() - t0 < 20
    timer.join()
    controller.round()
    status = store.run(control.statuses(keys, [FN]))[FN]
    assert (status["last_cold_path"], status["last_cold_preloaded"], status["last_cold_start_ms"]) == (
        "standby", "1", "3",
    )  # fmt: skip
    t0 = time.monotonic()
    assert controller.wait_for_demand(0.3) == []  # that event does not wake it again
    assert time.monotonic() - t0 >= 0.25
