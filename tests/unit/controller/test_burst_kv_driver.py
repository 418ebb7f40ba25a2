"""The driver grows a busy worker's KV for a burst (`PolicyConfig.burst_kv_bytes`) around a real
redis-server: requests in the function's stream that no worker has read, the worker's heartbeat (bound,
running, its KV); the snapshot reads how long the oldest has waited from the stream (Redis's clock), so a
fresh queue gets nothing and one that has waited `burst_kv_min_wait_s` gets the worker a `kv_budget` grant."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from lorafn.controller.driver import Controller
from lorafn.controller.policy.actions import ResizeKV
from lorafn.controller.policy.config import PolicyConfig
from lorafn.store import Keys, Store, control, streams, workers
from lorafn.store.protocol import RequestBody
from tests.unit.controller.redis_world import commands, tiny_controller

FN = "team/burst"
MiB = 1 << 20
KV = 64 * MiB


@pytest.fixture
def world(redis_server: str, tmp_path: Path) -> Iterator[tuple[Store, Keys, Controller]]:
    store, keys = Store(redis_server), Keys(f"t{uuid.uuid4().hex[:8]}")
    spec = {"scaling": {"keepAliveSeconds": 3600, "maxReplicas": 1}}
    policy = PolicyConfig(
        burst_kv_bytes=512 * MiB,
        burst_kv_min_wait_s=0.3,
        warm_pool=False,
        cold_prior_rps=0.0,
        pool_min_age_s=3600,
    )
    controller = tiny_controller(store, keys, tmp_path, FN, spec, policy, KV)
    yield store, keys, controller
    store.close()


def _busy(store: Store, keys: Keys, **extra: int) -> None:
    """Worker w-b's heartbeat: bound to FN on g0, 2 running in KV bytes, and ``extra`` fields."""
    fields: dict[str, object] = {
        "state": "serving", "gpu": "g0", "backbone": "tiny", "shape": "", "mem_bytes": 0,
        "started": int(time.time()) - 600, "idle_s": 0, "running": 2,
        "kv_bytes": KV, "kv_budget_bytes": KV, "kv_grant": 0, "parked": 0, "park_release_bytes": KV, **extra,
    }  # fmt: skip
    store.run(workers.heartbeat(keys, "w-b", FN, 5000, fields))


def _queue(store: Store, keys: Keys, count: int) -> None:
    """``count`` requests admitted to FN's stream that no worker reads."""
    for i in range(count):
        store.run(
            streams.admit(
                keys, FN, f"r{i}", RequestBody(prompt="hi"), deadline_ms=0, now_s=time.time(),
                rate_limit_rps=0.0, rate_limit_burst=1, heartbeat_ttl_ms=5000,
            )
        )  # fmt: skip


def test_a_queue_that_has_waited_behind_a_busy_worker_gets_it_more_kv(
    world: tuple[Store, Keys, Controller],
) -> None:
    store, keys, controller = world
    _busy(store, keys)
    _queue(store, keys, 3)  # admitted, never read: the worker has no room
    plan = controller.round()
    assert plan is not None and not plan.of_type(ResizeKV)  # just admitted: a worker with room reads it now
    time.sleep(0.4)
    assert store.run(control.queue_depths(keys, [FN]))[FN].oldest_wait_ms >= 400
    plan = controller.round()
    assert plan is not None
    (grant,) = plan.of_type(ResizeKV)
    # 2 running in 64 MiB: 32 MiB a request, 3 queued: 96 MiB more
    assert (grant.worker_id, grant.kv_bytes, grant.delta_bytes) == ("w-b", 160 * MiB, 96 * MiB)
    assert "burst: 3 queued" in grant.detail
    assert [int(c["bytes"]) for c in commands(store, keys, "w-b") if c["cmd"] == "kv_budget"] == [160 * MiB]
    # the worker has not resized yet (its heartbeat says 64 MiB) and the queue is still there: nothing more is
    # sent until it confirms (a grant per round would compound while the first one is on its way)
    controller.round()
    assert [int(c["bytes"]) for c in commands(store, keys, "w-b") if c["cmd"] == "kv_budget"] == [160 * MiB]
    registry = controller.metrics.registry
    sample = registry.get_sample_value(
        "lorafn_controller_kv_resizes_total", {"direction": "grow", "cause": "burst"}
    )
    assert sample == 1.0


def test_a_worker_whose_slots_not_its_kv_bound_it_gets_no_grant(
    world: tuple[Store, Keys, Controller],
) -> None:
    """Its heartbeat says its KV would hold as many requests as its slots (kv_cap >= slot_cap): more KV would
    sit idle, so the queue waits for a scale-up instead."""
    store, keys, controller = world
    _busy(store, keys, kv_cap=2, slot_cap=2)
    _queue(store, keys, 3)
    time.sleep(0.4)
    plan = controller.round()
    assert plan is not None and not plan.of_type(ResizeKV)
    _busy(store, keys, kv_cap=1, slot_cap=2)  # now its KV is the bound: granted
    plan = controller.round()
    assert plan is not None and len(plan.of_type(ResizeKV)) == 1
