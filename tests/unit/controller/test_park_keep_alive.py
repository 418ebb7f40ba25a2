"""A parked worker's own keep-alive (`PolicyConfig.parked_keep_alive_s`, issue 16): None keeps today's rule (a
parked worker retires at its function's keep-alive, as an unparked one); a value retires parked workers at it
instead, ``inf`` never (only offloading stops them); unparked workers keep their function's keep-alive either
way. The controller's driver tells the worker in each park command (`keep_alive_s`; "inf": never), and the
worker keeps it while parked (tests/integration/runtime/test_worker_park.py)."""

from __future__ import annotations

import math

import pytest

from lorafn.controller.driver import Controller, ControllerConfig
from lorafn.controller.policy import PolicyConfig, Stop, decide
from lorafn.controller.policy.actions import Park
from lorafn.controller.policy.model import GPU
from lorafn.controller.snapshot import SizingConfig
from lorafn.store import Keys, Store, workers
from tests.unit.controller.helpers import GiB, bound, fn, gpu, snap
from tests.unit.controller.redis_world import RecordingExecutor

PARK = PolicyConfig(park_idle=True, cold_prior_rps=0.0)
SIZING = SizingConfig(worker_overhead_bytes=2**20, default_kv_bytes=64 * 2**20)


def _keep_alive_stops(config: PolicyConfig, idle_s: float, parked: bool = True) -> list[str]:
    """The workers a round stops for their keep-alive: one worker of f0 (keep-alive 60 s), idle ``idle_s``,
    parked or not, on a GPU with room to spare (no memory pressure)."""
    w = bound("w0", "g0", "f0", idle_s=idle_s, parked=parked, release_bytes=GiB)
    plan = decide(snap([gpu("g0")], [fn("f0", keep_alive_s=60.0)], [w]), config)
    return [s.worker_id for s in plan.of_type(Stop) if s.reason == "keep_alive"]


def test_by_default_a_parked_worker_retires_at_its_functions_keep_alive():
    assert PolicyConfig().parked_keep_alive_s is None
    assert _keep_alive_stops(PARK, idle_s=59.0) == []
    assert _keep_alive_stops(PARK, idle_s=61.0) == ["w0"]


@pytest.mark.parametrize("keep", [120.0, 300.0])
def test_a_parked_worker_retires_at_its_own_keep_alive(keep):
    config = PolicyConfig(park_idle=True, cold_prior_rps=0.0, parked_keep_alive_s=keep)
    assert _keep_alive_stops(config, idle_s=61.0) == []
    assert _keep_alive_stops(config, idle_s=keep - 1) == []
    assert _keep_alive_stops(config, idle_s=keep + 1) == ["w0"]
    # an unparked worker keeps its function's keep-alive
    assert _keep_alive_stops(config, idle_s=61.0, parked=False) == ["w0"]


def test_a_shorter_parked_keep_alive_retires_parked_workers_sooner():
    config = PolicyConfig(park_idle=True, cold_prior_rps=0.0, parked_keep_alive_s=10.0)
    assert _keep_alive_stops(config, idle_s=11.0) == ["w0"]
    assert _keep_alive_stops(config, idle_s=11.0, parked=False) == []


def test_never_retiring_parked_workers_keeps_them_until_memory_is_needed():
    config = PolicyConfig(park_idle=True, cold_prior_rps=0.0, parked_keep_alive_s=math.inf)
    assert _keep_alive_stops(config, idle_s=1e6) == []
    # under pressure a parked worker is still stopped: 60 parked workers charged 1 GiB each fill all but 0.6
    # GiB of the GPU (80 GiB x 0.92 - 13 GiB backbone); a cold start of 2 GiB can only stop some of them
    parked = [
        bound(f"p{i:02d}", "g0", f"f{i}", mem_gib=1.0, idle_s=1e6, parked=True, release_bytes=GiB)
        for i in range(60)
    ]
    functions = [fn(f"f{i}", keep_alive_s=60.0) for i in range(60)]
    plan = decide(snap([gpu("g0")], [*functions, fn("cold", queued=1, oldest_wait_s=0.1)], parked), config)
    offloads = [s for s in plan.of_type(Stop) if s.reason == "offload"]
    assert offloads and all(s.worker_id.startswith("p") for s in offloads)
    assert [s for s in plan.of_type(Stop) if s.reason == "keep_alive"] == []


@pytest.mark.parametrize("bad", [-1.0, math.nan])
def test_an_impossible_parked_keep_alive_is_refused(bad):
    with pytest.raises(ValueError, match="parked_keep_alive_s"):
        PolicyConfig(parked_keep_alive_s=bad)


@pytest.mark.parametrize(("keep", "sent"), [(None, None), (300.0, "300.0"), (math.inf, "inf")])
def test_the_controller_sends_the_parked_keep_alive_with_the_park(redis_server: str, keep, sent):
    """The worker learns its parked keep-alive from the park command itself (`keep_alive_s`; none: its
    function's), so it exits when the policy would retire it."""
    store = Store(redis_server)
    try:
        keys = Keys(f"t-keep-{sent}")
        executor = RecordingExecutor([GPU("g0", "n", 1 << 40, {"tiny": 0})])
        policy = PolicyConfig(park_idle=True, parked_keep_alive_s=keep)
        config = ControllerConfig(holder="me", park_timeout_s=0.1, policy=policy)
        controller = Controller(store, keys, executor, SIZING, config)
        # nobody answers: the park times out (what it made room for waits a round); the command was sent
        park = Park("w0", "f0", "g0", GiB)
        assert controller._apply_parks([park], fast=False) == [park]
        [(_, body)] = store.run(workers.read_control(keys, "w0", "0"))
        assert body["cmd"] == "park" and body.get("keep_alive_s") == sent
    finally:
        store.close()


def test_the_parked_keep_alive_is_a_controller_and_a_local_setting(monkeypatch) -> None:
    from lorafn.controller.cli import ControllerSettings, build_controller
    from lorafn.local.config import LocalConfig

    # shipped: 300 s (the 10-minute H100 replay); "function" (or null in up.yaml): the function's keep-alive
    assert ControllerSettings().parked_keep_alive_s == 300.0 and LocalConfig().parked_keep_alive_s == 300.0
    assert LocalConfig(parked_keep_alive_s=None).parked_keep_alive_s is None
    for value, expected in (("inf", math.inf), ("120", 120.0), ("function", None)):
        monkeypatch.setenv("LORAFN_PARKED_KEEP_ALIVE_S", value)
        settings = ControllerSettings(redis_url="redis://127.0.0.1:1")
        assert build_controller(settings).config.policy.parked_keep_alive_s == expected
        assert LocalConfig(parked_keep_alive_s=value).parked_keep_alive_s == expected
    monkeypatch.delenv("LORAFN_PARKED_KEEP_ALIVE_S")
    for bad in ("-1", "nan", "soon"):
        with pytest.raises(ValueError, match="parked_keep_alive_s"):
            ControllerSettings(parked_keep_alive_s=bad)
        with pytest.raises(ValueError, match="parked_keep_alive_s"):
            LocalConfig(parked_keep_alive_s=bad)


def test_park_after_s_is_a_controller_and_a_local_setting(monkeypatch) -> None:
    """PolicyConfig.park_after_s (park workers idle that long without pressure): LORAFN_PARK_AFTER_S on the
    controller, LocalConfig.park_after_s for `lorafn up`; 50 s by default (the H100 replays); a number of
    seconds > 0, or inf / "never" (only under memory pressure; None in PolicyConfig means the same)."""
    from lorafn.controller.cli import ControllerSettings, build_controller
    from lorafn.local.config import LocalConfig

    monkeypatch.delenv("LORAFN_PARK_AFTER_S", raising=False)
    assert ControllerSettings().park_after_s == 50.0 and LocalConfig().park_after_s == 50.0
    assert (
        build_controller(ControllerSettings(redis_url="redis://127.0.0.1:1")).config.policy.park_after_s
        == 50.0
    )
    inf = float("inf")
    for value, expected in (("50", 50.0), ("2.5", 2.5), ("inf", inf), ("never", inf)):
        monkeypatch.setenv("LORAFN_PARK_AFTER_S", value)
        settings = ControllerSettings(redis_url="redis://127.0.0.1:1")
        assert build_controller(settings).config.policy.park_after_s == expected
        assert LocalConfig(park_after_s=value).park_after_s == expected
    monkeypatch.delenv("LORAFN_PARK_AFTER_S")
    for bad in ("0", "-1", "nan", "soon"):
        with pytest.raises(ValueError, match="park_after_s"):
            ControllerSettings(park_after_s=bad)
        with pytest.raises(ValueError, match="park_after_s"):
            LocalConfig(park_after_s=bad)
