"""A standby kept for functions with a KV budget above the default must be able to take them.

Found on the H100 trace replay: every function asked for `kvCacheMiB: 2048`, the pool's standbys were
started with the default KV budget (256 MiB), so none was ever big enough and every cold start spawned a
fresh process (0 standby paths in 240 requests). Real Redis; heartbeats written as workers write them.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from lorafn.controller.driver import Controller, ControllerConfig
from lorafn.controller.policy.config import PolicyConfig
from lorafn.controller.snapshot import SizingConfig
from lorafn.store import Keys, Store, control, streams, workers
from tests.unit.controller.redis_world import RecordingExecutor, commands, queue_request, register_tiny

FN = "team/big"
MiB = 1 << 20
KV_MIB = 96  # the function's budget; the default is 8 MiB


@pytest.fixture
def world(redis_server: str, tmp_path: Path):
    store, keys = Store(redis_server), Keys(f"t{uuid.uuid4().hex[:8]}")
    register_tiny(store, keys, tmp_path, {FN: {"resources": {"kvCacheMiB": KV_MIB}}})
    executor = RecordingExecutor()
    controller = Controller(
        store, keys, executor, SizingConfig(worker_overhead_bytes=4 * MiB, default_kv_bytes=8 * MiB),
        ControllerConfig(holder="me", policy=PolicyConfig(pool_min_age_s=3600)),
    )  # fmt: skip
    yield store, keys, controller, executor
    store.close()


def test_a_standby_sized_for_a_large_kv_budget_gets_it_and_is_bound(world) -> None:
    store, keys, controller, executor = world
    controller.round()
    size = controller.reader.sizes[FN]
    assert size.kv_bytes == KV_MIB * MiB
    pool_starts = [a for a in executor.started if a.function is None]
    assert pool_starts, "the warm pool asked for no standby"
    start = pool_starts[0]
    assert start.mem_bytes >= size.mem_bytes  # the planner sized it for the function
    # what the executor passes as --kv-budget-mib: the function's KV, not the default
    kv = controller.reader.standby_kv_bytes(start.mem_bytes, start.shape, start.backbone)
    assert kv >= KV_MIB * MiB

    # the standby comes up and reports what it allocated (a CPU worker: no driver figure, its allocator's)
    fields = {
        "state": "standby", "gpu": "g0", "backbone": "tiny", "shape": size.shape,
        "started": int(time.time()) - 5,
        "mem_bytes": kv + 2 * MiB, "kv_bytes": kv, "lora_bytes": size.lora_bytes,
    }  # fmt: skip
    store.run(workers.heartbeat(keys, "s1", None, 5000, fields))
    queue_request(store, keys, FN, "r1")
    before = len(executor.started)
    controller.round()
    sent = [c for c in commands(store, keys, "s1") if c.get("cmd") == "bind"]
    assert sent == [{"cmd": "bind", "function": FN}]
    assert not [a for a in executor.started[before:] if a.function == FN]  # no fresh start for it


def test_a_standby_whose_cache_is_a_little_under_its_grant_is_still_bound(world) -> None:
    """A worker's KV cache is whole blocks, one fewer than its budget holds (ModelRunner._num_kv_blocks):
    judged by the cache it reports, a standby started with exactly a function's budget looked too small
    for it (and the pool's floor would replace it again and again). Its heartbeat names the grant."""
    store, keys, controller, _executor = world
    controller.round()
    size = controller.reader.sizes[FN]
    cache = (KV_MIB - 2) * MiB  # what the blocks came to
    fields = {
        "state": "standby", "gpu": "g0", "backbone": "tiny", "shape": size.shape,
        "started": int(time.time()) - 5,
        "mem_bytes": cache + 2 * MiB, "kv_bytes": cache, "lora_bytes": size.lora_bytes,
        "kv_budget_bytes": KV_MIB * MiB,
    }  # fmt: skip
    store.run(workers.heartbeat(keys, "s1", None, 5000, fields))
    queue_request(store, keys, FN, "r1")
    controller.round()
    sent = [c for c in commands(store, keys, "s1") if c.get("cmd") == "bind"]
    assert sent == [{"cmd": "bind", "function": FN}]


def test_a_standby_with_the_default_kv_is_not_bound_to_a_function_it_cannot_hold(world) -> None:
    store, keys, controller, _executor = world
    controller.round()
    size = controller.reader.sizes[FN]
    fields = {
        "state": "standby", "gpu": "g0", "backbone": "tiny", "shape": size.shape,
        "started": int(time.time()) - 5,
        "mem_bytes": 10 * MiB, "kv_bytes": 8 * MiB, "lora_bytes": size.lora_bytes,
    }  # fmt: skip
    store.run(workers.heartbeat(keys, "small", None, 5000, fields))
    store.run(streams.record_demand(keys, FN, "request", 1))
    controller.round()
    sent = [c for c in commands(store, keys, "small") if c.get("cmd") == "bind"]
    assert sent == []


def test_without_sharing_each_worker_counts_its_own_weights(redis_server: str, tmp_path: Path) -> None:
    """The replay's no-sharing ablation crash-looped on the H100: the account counted one backbone copy
    per GPU and ~3 GiB per worker, so it started eight 7B workers (13.5 GB each) at once and they died of
    CUDA OOM. With private weights a worker's size holds its copy and the GPU none: only what fits starts,
    the rest waits with a reason."""
    store, keys = Store(redis_server), Keys(f"t{uuid.uuid4().hex[:8]}")
    names = [f"team/f{i}" for i in range(3)]
    # 3 GiB of "weights" in a sparse file: st_size is what the controller reads
    kv = {"resources": {"kvCacheMiB": KV_MIB}}
    register_tiny(store, keys, tmp_path, dict.fromkeys(names, kv), warm_pool=(0, 0), weights_bytes=3 << 30)

    executor = RecordingExecutor()  # its GPU holds "tiny" at 0 bytes: resident, privately, in each worker
    sizing = SizingConfig(worker_overhead_bytes=4 * MiB, default_kv_bytes=8 * MiB, private_weights=True)
    controller = Controller(store, keys, executor, sizing, ControllerConfig(holder="me"))
    try:
        controller.round()
        size = controller.reader.sizes[names[0]]
        assert size.weights_bytes == 3 << 30
        assert size.mem_bytes == 4 * MiB + KV_MIB * MiB + size.lora_bytes + (3 << 30)
        for i, name in enumerate(names):
            queue_request(store, keys, name, f"r{i}")
        controller.round()
        started = [a.function for a in executor.started if a.function]
        assert len(started) == 2, started  # 2 x ~3.1 GiB fit in 8 GiB, a third would not
        waits = [a for a in controller.last_plan.actions if type(a).__name__ == "Wait"]
        assert [w.function for w in waits] == sorted(set(names) - set(started))
    finally:
        store.close()


def test_fresh_starts_teach_the_policy_its_refill_window(world) -> None:
    """The pool's refill window and the wait on a warming standby use fresh_start_s: the configured 20 s
    of a bare GPU process made the H100 replay wait seconds on warming standbys while a fresh worker from
    the zygote serves in ~1.7 s. Measured fresh starts (the workers' `bound` events) replace it."""
    store, keys, controller, _executor = world
    controller.round()
    assert controller.last_snapshot.costs.fresh_start_s == controller.reader.sizing.fresh_start_s
    for ms in (1700, 1500, 9000):  # the median of what was measured, not the last nor the mean
        store.run(control.post_event(keys, control.BOUND, function=FN, worker="w", path="fresh", ms=ms))
    store.run(control.post_event(keys, control.BOUND, function=FN, worker="s", path="standby", ms=80))
    controller.round()  # events after the first round's cursor are learned
    controller.round()
    assert controller.reader.sizing.fresh_start_s == 1.7
    assert controller.last_snapshot.costs.fresh_start_s == 1.7
    reg = controller.metrics.registry
    assert reg.get_sample_value("lorafn_controller_fresh_start_estimate_seconds") == 1.7
