"""The controller's Prometheus metrics move with what the driver does (real Redis, a fake executor)."""

from __future__ import annotations

import uuid

import pytest
from prometheus_client import generate_latest

from lorafn.controller.driver import Controller, ControllerConfig
from lorafn.controller.policy.model import GPU
from lorafn.controller.snapshot import SizingConfig
from lorafn.store import Keys, Store, control


class _Executor:
    """Devices only; nothing to start (no functions are registered); exits as the test sets them."""

    def __init__(self) -> None:
        self.ended: list = []

    def gpus(self) -> list[GPU]:
        return [GPU(id="g0", node="n", total_bytes=8 << 30)]

    def start(self, action, worker_id: str) -> None:
        raise AssertionError("nothing should start without functions or backbones")

    def stop(self, worker_id: str) -> None:
        pass

    def starting(self) -> list:
        return []

    def exits(self) -> list:
        out, self.ended = self.ended, []
        return out


@pytest.fixture
def controller(redis_server: str):
    store = Store(redis_server)
    c = Controller(
        store, Keys(f"t{uuid.uuid4().hex[:8]}"), _Executor(),
        SizingConfig(worker_overhead_bytes=1 << 20, default_kv_bytes=1 << 20), ControllerConfig(holder="me"),
    )  # fmt: skip
    yield c
    store.close()


def _sample(c: Controller, name: str, labels: dict[str, str] | None = None) -> float:
    value = c.metrics.registry.get_sample_value(name, labels or {})
    return 0.0 if value is None else value


def test_rounds_cold_starts_and_failures_are_counted(controller: Controller) -> None:
    store, keys = controller.store, controller.keys
    assert controller.round() is not None
    assert _sample(controller, "lorafn_controller_round_seconds_count") == 1
    store.run(control.post_event(keys, control.BOUND, worker="w1", function="a/b", ms=120.5, path="standby"))
    controller.round()
    assert _sample(controller, "lorafn_controller_cold_starts_total", {"path": "standby"}) == 1
    seconds = _sample(controller, "lorafn_controller_cold_start_seconds_sum", {"path": "standby"})
    assert seconds == pytest.approx(0.1205)
    store.run(
        control.post_event(keys, control.BIND_FAILED, worker="w2", function="a/b", reason="bad adapter")
    )
    controller.round()
    assert _sample(controller, "lorafn_controller_start_failures_total") == 1
    assert store.run(control.statuses(keys, ["a/b"]))["a/b"]["last_failure"] == "bad adapter"
    assert b"lorafn_controller_pool_target" in generate_latest(controller.metrics.registry)


def test_a_crash_after_serving_is_not_a_failed_start(controller: Controller) -> None:
    from lorafn.controller.driver import Exit

    store, keys = controller.store, controller.keys
    controller.round()
    store.run(control.post_event(keys, control.BOUND, worker="w1", function="a/b", ms=5, path="fresh"))
    controller.round()
    controller.executor.ended = [Exit("w1", "a/b", 1, "segfault"), Exit("w2", "a/b", 1, "import error")]
    controller.round()
    # w1 had served (its `bound` event): only w2, which never did, counts against the function
    assert _sample(controller, "lorafn_controller_start_failures_total") == 1
    assert store.run(control.statuses(keys, ["a/b"]))["a/b"]["start_failures"] == "1"


def test_demand_wakes_the_wait_at_once(controller: Controller) -> None:
    import threading
    import time

    from lorafn.store import streams

    assert controller.wait_for_demand(0.05) == []  # nothing recorded: the whole timeout
    store, keys = controller.store, controller.keys
    timer = threading.Timer(0.2, lambda: store.run(streams.record_demand(keys, "a/b", "request")))
    timer.start()
    t0 = time.monotonic()
    woke = controller.wait_for_demand(30.0)
    assert [d.function for d in woke] == ["a/b"]
    assert time.monotonic() - t0 < 20  # woken by the demand, not by the 30 s timeout
    timer.join()


def test_an_exit_is_not_lost_when_redis_fails_while_learning_it(
    controller: Controller, monkeypatch: pytest.MonkeyPatch
) -> None:
    import redis

    from lorafn.controller.driver import Exit

    store, keys = controller.store, controller.keys
    controller.round()
    controller.executor.ended = [Exit("w1", "a/b", 1, "import error"), Exit("w2", "a/b", 1, "oom")]
    real = control.record_start_failure

    def down(*args, **kwargs):  # Redis goes away while the first failed start is being counted
        raise redis.exceptions.ConnectionError("connection refused")

    monkeypatch.setattr(control, "record_start_failure", down)
    with pytest.raises(redis.exceptions.ConnectionError):
        controller.round()
    monkeypatch.setattr(control, "record_start_failure", real)
    controller.round()  # both exits were taken from the executor before the error: learned now
    assert store.run(control.statuses(keys, ["a/b"]))["a/b"]["start_failures"] == "2"


def test_offloads_are_counted_by_cause_and_victim(controller: Controller) -> None:
    from lorafn.controller.policy.actions import Plan, Stop

    controller.round()
    controller._apply(
        Plan(
            [
                Stop("w1", "offload", "g0", "standby of r16 makes room for a/b", "cold_start", "standby"),
                Stop(
                    "w2",
                    "offload",
                    "g0",
                    "idle bound worker of c/d makes room for a/b",
                    "scale_up",
                    "idle_bound",
                ),
                Stop("w3", "keep_alive", "g0", "idle 60 s"),
            ]
        )
    )
    assert (
        _sample(controller, "lorafn_controller_offloads_total", {"cause": "cold_start", "victim": "standby"})
        == 1
    )
    assert (
        _sample(controller, "lorafn_controller_offloads_total", {"cause": "scale_up", "victim": "idle_bound"})
        == 1
    )
    assert _sample(controller, "lorafn_controller_stops_total", {"reason": "offload"}) == 2
    assert _sample(controller, "lorafn_controller_stops_total", {"reason": "keep_alive"}) == 1
    assert b"lorafn_controller_offloads_total" in generate_latest(controller.metrics.registry)


def test_gpu_workers_gauge_counts_what_each_worker_of_a_gpu_is_doing(controller: Controller) -> None:
    import time

    from lorafn.store import workers

    store, keys = controller.store, controller.keys

    def beat(wid: str, function: str | None, state: str, running: int = 0, parked: bool = False) -> None:
        fields = {
            "state": state, "gpu": "g0", "backbone": "tiny", "shape": "", "mem_bytes": 0,
            "started": int(time.time()) - 600, "idle_s": 0 if running else 30, "running": running,
            "parked": int(parked),
        }  # fmt: skip
        store.run(workers.heartbeat(keys, wid, function, 5000, fields))

    beat("w-busy", "a/busy", "serving", running=2)
    beat("w-busy2", "a/other", "serving", running=1)
    beat("w-idle", "a/idle", "serving")
    beat("w-parked", "a/parked", "serving", parked=True)
    beat("w-standby", None, "standby")
    controller.round()
    got = {
        st: _sample(controller, "lorafn_controller_gpu_workers", {"gpu": "g0", "state": st})
        for st in ("busy", "idle", "parked", "standby", "starting", "draining")
    }
    assert got == {"busy": 2, "idle": 1, "parked": 1, "standby": 1, "starting": 0, "draining": 0}
    # the next round counts what is there now: no worker left busy reads 0, not the last value
    store.run(workers.heartbeat(keys, "w-busy", "a/busy", 5000, {"running": 0, "idle_s": 1}))
    store.run(workers.heartbeat(keys, "w-busy2", "a/other", 5000, {"running": 0, "idle_s": 1}))
    controller.round()
    assert _sample(controller, "lorafn_controller_gpu_workers", {"gpu": "g0", "state": "busy"}) == 0
    # (no function or backbone is registered here, so the first round stopped them all: now draining)
    assert _sample(controller, "lorafn_controller_gpu_workers", {"gpu": "g0", "state": "draining"}) == 5
    assert b'lorafn_controller_gpu_workers{gpu="g0",state="idle"}' in generate_latest(
        controller.metrics.registry
    )


def test_gpu_worker_counts_list_every_state_of_every_gpu() -> None:
    from lorafn.controller.metrics import GPU_WORKER_STATES, gpu_worker_counts
    from lorafn.controller.policy.model import Worker

    def w(wid: str, gpu: str, state: str, running: int = 0, parked: bool = False) -> Worker:
        return Worker(wid, gpu, "bb", state, None, "a/f" if state == "bound" else None, 1, running=running,
                      parked=parked)  # fmt: skip

    counts = gpu_worker_counts(
        ["g0", "g1"],
        [w("1", "g0", "bound", running=3), w("2", "g0", "bound", parked=True, running=0),
         w("3", "g0", "starting"), w("4", "g2", "draining")],
    )  # fmt: skip
    assert counts[("g0", "busy")] == 1 and counts[("g0", "parked")] == 1 and counts[("g0", "starting")] == 1
    assert all(counts[("g1", st)] == 0 for st in GPU_WORKER_STATES)  # a GPU without workers reads zeros
    assert counts[("g2", "draining")] == 1  # a worker on a GPU the executor no longer lists still counts
