"""The driver lends KV to an offline batch's worker (`PolicyConfig.batch_kv_bytes`, docs/batch.md#kv-from-
idle-memory) around a real redis-server: the batch runner's backlog (`store.batches.set_backlog`) makes a
round send the function's bound worker a `kv_budget` command with the grant; until the worker's heartbeat
shows it, the next rounds charge the grant in the account and send nothing again; once the heartbeat shows the
grant (kv_grant 1) and the backlog is gone and the worker idle, the function's own budget is sent back."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from lorafn.controller.driver import Controller
from lorafn.controller.policy.actions import ResizeKV
from lorafn.controller.policy.config import PolicyConfig
from lorafn.store import Keys, Store, batches, workers
from tests.unit.controller.redis_world import commands, tiny_controller

FN = "team/batch"
MiB = 1 << 20
KV, GRANT = 64 * MiB, 512 * MiB


@pytest.fixture
def world(redis_server: str, tmp_path: Path) -> Iterator[tuple[Store, Keys, Controller]]:
    store, keys = Store(redis_server), Keys(f"t{uuid.uuid4().hex[:8]}")
    policy = PolicyConfig(batch_kv_bytes=GRANT, warm_pool=False, cold_prior_rps=0.0, pool_min_age_s=3600)
    controller = tiny_controller(
        store, keys, tmp_path, FN, {"scaling": {"keepAliveSeconds": 3600}}, policy, KV
    )
    yield store, keys, controller
    store.close()


def _beat(store: Store, keys: Keys, running: int, kv: int = KV, grant: bool = False) -> None:
    fields = {
        "state": "serving", "gpu": "g0", "backbone": "tiny", "shape": "", "mem_bytes": 0,
        "started": int(time.time()) - 600, "idle_s": 0 if running else 5, "running": running,
        "kv_bytes": kv, "kv_budget_bytes": kv, "kv_grant": int(grant), "parked": 0, "park_release_bytes": kv,
    }  # fmt: skip
    store.run(workers.heartbeat(keys, "w-b", FN, 5000, fields))


def _budgets(store: Store, keys: Keys) -> list[int]:
    return [int(c["bytes"]) for c in commands(store, keys, "w-b") if c["cmd"] == "kv_budget"]


def test_a_backlog_gets_its_worker_a_grant_charged_until_shown_then_returned(
    world: tuple[Store, Keys, Controller],
) -> None:
    store, keys, controller = world
    _beat(store, keys, running=8)
    plan = controller.round()
    assert plan is not None and not plan.of_type(ResizeKV) and _budgets(store, keys) == []  # no backlog
    free_before = plan.account["g0"].free_bytes

    store.run(batches.set_backlog(keys, {FN: 100}, 60_000))
    plan = controller.round()
    assert plan is not None
    (resize,) = plan.of_type(ResizeKV)
    assert (resize.worker_id, resize.kv_bytes, resize.delta_bytes) == ("w-b", GRANT, GRANT - KV)
    assert _budgets(store, keys) == [GRANT]

    plan = controller.round()  # the heartbeat does not show it yet: charged, not sent again
    assert plan is not None and not plan.of_type(ResizeKV) and _budgets(store, keys) == [GRANT]
    assert plan.account["g0"].free_bytes == free_before - (GRANT - KV)

    _beat(store, keys, running=8, kv=GRANT, grant=True)  # the worker resized
    plan = controller.round()
    assert plan is not None and not plan.of_type(ResizeKV)
    assert plan.account["g0"].free_bytes == free_before - (GRANT - KV)  # its own report charges it now

    store.run(batches.set_backlog(keys, {}, 60_000))
    plan = controller.round()  # the backlog is gone but the worker still runs the last wave: kept
    assert plan is not None and not plan.of_type(ResizeKV)
    _beat(store, keys, running=0, kv=GRANT, grant=True)
    plan = controller.round()
    assert plan is not None
    (back,) = plan.of_type(ResizeKV)
    assert (back.kv_bytes, back.delta_bytes) == (KV, KV - GRANT) and "grant done" in back.detail
    assert _budgets(store, keys) == [GRANT, KV]
