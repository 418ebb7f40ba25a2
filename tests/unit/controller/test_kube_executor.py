"""The Kubernetes executor's desired-count arithmetic, against a real redis-server.

Each count moves from what the operator runs now (the stored value within the spec's bounds), so every
Start means one more pod and every Stop one fewer; `starting()` is desired minus live, per count, with
pool pods (workers once seen as standby) counted for their pool even after they are bound.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from lorafn.api.sizing import MiB
from lorafn.controller.kube_executor import KubernetesExecutor, clamp
from lorafn.controller.policy.actions import Start
from lorafn.store import Keys, Store, control, workers
from lorafn.store.backbones import BackboneRecord, put_backbone
from lorafn.store.registry import FunctionRecord, put_function
from tests.unit.controller.redis_world import commands, queue_request, register_tiny

GPU_A, GPU_B = "node-1/GPU-aaaa", "node-1/GPU-bbbb"
FN = "team-a/french"
BIG, BIG_KV_MIB = "team-a/big", 96  # a KV budget above the default (8 MiB in the test below)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def world(redis_server: str) -> Any:
    store, keys = Store(redis_server), Keys(f"t{uuid.uuid4().hex[:8]}")
    store.run(
        put_backbone(
            keys,
            BackboneRecord(
                "tiny", "/models/tiny", "bfloat16",
                {"model": {"uri": "file:///models/tiny"}, "warmPool": {"minStandby": 1, "maxStandby": 3}},
            ),
        )
    )  # fmt: skip
    register(store, keys, FN, min_replicas=0, max_replicas=3)
    for gpu in (GPU_A, GPU_B):
        store.run(control.merge_gpu(keys, gpu, "node-1", 80_000 * MiB, "tiny", 13_000 * MiB))
    clock = Clock()
    executor = KubernetesExecutor(store, keys, heartbeat_ttl_s=5.0, clock=clock)
    executor.gpus()
    yield store, keys, executor, clock
    store.close()


def register(store: Store, keys: Keys, fn: str, min_replicas: int, max_replicas: int) -> None:
    spec = {
        "backbone": "tiny",
        "adapter": {"uri": "file:///adapters/x"},
        "scaling": {"minReplicas": min_replicas, "maxReplicas": max_replicas},
    }
    store.run(put_function(keys, FunctionRecord(fn, spec, "/models/tiny", "/adapters/x")))


def beat(store: Store, keys: Keys, wid: str, state: str, function: str | None, gpu: str = GPU_A) -> None:
    fields = {"state": state, "backbone": "tiny", "gpu": gpu}
    store.run(workers.heartbeat(keys, wid, function, 5000, fields))


def bound_start(gpu: str = GPU_A, fn: str = FN) -> Start:
    return Start(gpu, "tiny", "q_proj:8", fn, 300 * MiB, "queued")


def standby_start(gpu: str) -> Start:
    return Start(gpu, "tiny", None, None, 200 * MiB, "pool")


def desired(store: Store, keys: Keys, fn: str = FN) -> int | None:
    return store.run(control.desired_replicas(keys, [fn]))[fn]


def test_clamp_is_what_the_operator_runs() -> None:
    assert clamp(None, 1, 3) == 1 and clamp(0, 1, 3) == 1 and clamp(7, 1, 3) == 3 and clamp(2, 0, 3) == 2


def test_gpus_come_from_the_inventory(world: Any) -> None:
    store, keys, executor, _ = world
    store.run(control.merge_gpu(keys, GPU_A, "node-1", 80_000 * MiB, "other", 1 * MiB))
    by_id = {g.id: g for g in executor.gpus()}
    assert set(by_id) == {GPU_A, GPU_B}
    assert by_id[GPU_A].backbones == {"tiny": 13_000 * MiB, "other": 1 * MiB}
    assert by_id[GPU_A].total_bytes == 80_000 * MiB and by_id[GPU_A].node == "node-1"
    # The server of `tiny` on B is no longer Ready: B stays a GPU, without the backbone.
    store.run(control.merge_gpu(keys, GPU_B, "node-1", 80_000 * MiB, "tiny", None))
    assert {g.id: dict(g.backbones) for g in executor.gpus()}[GPU_B] == {}
    # The backbone is deleted: it leaves every entry; an entry left with none goes.
    assert store.run(control.drop_backbone_from_gpus(keys, "tiny")) == 2
    assert {g.id: dict(g.backbones) for g in executor.gpus()} == {GPU_A: {"other": 1 * MiB}}


def test_a_bound_start_raises_the_replica_count_until_its_pod_heartbeats(world: Any) -> None:
    store, keys, executor, clock = world
    # One stale standby placeholder per GPU (minStandby 1, nothing live): the operator's pool pods.
    assert sorted((w.gpu, w.function) for w in executor.starting()) == [(GPU_A, None), (GPU_B, None)]
    executor.start(bound_start(), "w-1")
    assert desired(store, keys) == 1
    clock.t += 3
    fn_starting = [w for w in executor.starting() if w.function == FN]
    assert [(w.id, w.gpu, w.state, w.shape, w.mem_bytes, w.age_s) for w in fn_starting] == [
        ("w-1", GPU_A, "starting", "q_proj:8", 300 * MiB, 3.0)
    ]
    executor.start(bound_start(GPU_B), "w-2")
    assert desired(store, keys) == 2
    # The operator's first pod heartbeats (under its pod name): one placeholder is left, the newest ask.
    beat(store, keys, "fn-team-a-french-0", "serving", FN)
    assert [w.id for w in executor.starting() if w.function == FN] == ["w-2"]
    beat(store, keys, "fn-team-a-french-1", "starting", FN, gpu=GPU_B)
    assert [w for w in executor.starting() if w.function == FN] == []


def test_counts_move_from_what_the_operator_runs(world: Any) -> None:
    store, keys, executor, _ = world
    register(store, keys, FN, min_replicas=2, max_replicas=3)
    beat(store, keys, "fn-0", "serving", FN)
    beat(store, keys, "fn-1", "serving", FN)
    # Nothing stored: the operator runs minReplicas (2) pods; one more Start means 3, not 1.
    executor.start(bound_start(), "w-1")
    assert desired(store, keys) == 3
    executor.start(bound_start(), "w-2")
    assert desired(store, keys) == 3  # maxReplicas: the operator would not create a 4th
    store.client.set(keys.desired_replicas(FN), 0)  # below min (written by an older controller)
    executor.stop("fn-1")
    assert desired(store, keys) == 1  # from 2 (what runs), not from 0
    with pytest.raises(ValueError, match="low"):
        control.add_desired_replicas(keys, FN, 1, 3, 2)


def test_stop_lowers_the_count_of_the_pod_and_marks_it_retiring(world: Any) -> None:
    store, keys, executor, _ = world
    store.client.set(keys.desired_replicas(FN), 2)
    beat(store, keys, "fn-0", "serving", FN)
    beat(store, keys, "fn-1", "serving", FN)
    executor.stop("fn-0")
    assert desired(store, keys) == 1
    assert set(store.run(control.retiring(keys))) == {"fn-0"}
    # The retiring worker still heartbeats while it drains: it is not counted, and no placeholder appears.
    assert [w for w in executor.starting() if w.function == FN] == []
    executor.stop("fn-1")
    assert desired(store, keys) == 0
    assert [w for w in executor.starting() if w.function == FN] == []
    # A worker nothing knows about (already gone) changes nothing.
    executor.stop("ghost")
    assert desired(store, keys) == 0 and "ghost" not in store.run(control.retiring(keys))


def test_stopping_a_placeholder_lowers_the_count_without_retiring(world: Any) -> None:
    store, keys, executor, _ = world
    executor.start(bound_start(), "w-1")
    executor.starting()
    executor.stop("w-1")
    assert desired(store, keys) == 0
    assert store.run(control.retiring(keys)) == {}
    assert [w for w in executor.starting() if w.function == FN] == []


def test_pool_pods_count_for_their_pool_also_when_bound(world: Any) -> None:
    store, keys, executor, _ = world
    executor.start(standby_start(GPU_A), "w-s1")
    # minStandby 1 written first (what the operator ran), then one more.
    assert store.run(control.desired_standby(keys, "tiny")) == {(GPU_A, None): 2}
    pool_a = [w for w in executor.starting() if w.function is None and w.gpu == GPU_A]
    assert [w.id for w in pool_a] == ["w-s1", "pending-pool-tiny-node-1-GPU-aaaa---1"]
    beat(store, keys, "tiny-x-standby-0", "standby", None)
    beat(store, keys, "tiny-x-standby-1", "standby", None)
    assert [w for w in executor.starting() if w.gpu == GPU_A] == []
    assert store.run(control.pool_workers(keys))["tiny-x-standby-0"] == ("tiny", GPU_A, None)
    # The controller binds standby-0 to the function: it serves from its pool pod. It still counts for
    # the pool (its pod is a pool pod) and not as a pod of the function.
    beat(store, keys, "tiny-x-standby-0", "serving", FN)
    assert executor.starting() == [w for w in executor.starting() if w.gpu == GPU_B]
    assert desired(store, keys) is None
    # Keep-alive over: the controller stops it; the pool count drops (its pod goes), not the function's.
    executor.stop("tiny-x-standby-0")
    assert store.run(control.desired_standby(keys, "tiny")) == {(GPU_A, None): 1}
    assert desired(store, keys) is None
    assert "tiny-x-standby-0" in store.run(control.retiring(keys))
    # Gone from the worker registry: forgotten as a pool worker.
    store.run(workers.deregister(keys, "tiny-x-standby-0", FN))
    executor.starting()
    assert "tiny-x-standby-0" not in store.run(control.pool_workers(keys))


def test_pool_counts_per_shape_within_warm_pool_bounds(world: Any) -> None:
    store, keys, executor, _ = world
    shaped = Start(GPU_B, "tiny", "q_proj:8", None, 250 * MiB, "pool")
    for i in range(5):
        executor.start(shaped, f"w-{i}")
    # minStandby 1 agnostic (what ran) + 2 of the shape: maxStandby 3 per GPU in all.
    stored = store.run(control.desired_standby(keys, "tiny"))
    assert stored == {(GPU_B, None): 1, (GPU_B, "q_proj:8"): 2}
    assert control.standby_counts(stored, GPU_B, 1, 3) == {None: 1, "q_proj:8": 2}
    assert control.standby_counts(stored, GPU_A, 1, 3) == {None: 1}  # nothing stored: minStandby
    shapes = sorted((w.shape or "", w.id) for w in executor.starting() if w.gpu == GPU_B)
    assert shapes == [("", "pending-pool-tiny-node-1-GPU-bbbb---0"), ("q_proj:8", "w-3"), ("q_proj:8", "w-4")]
    # The controller drops the agnostic one (a shaped standby is worth more): a placeholder, so the
    # count alone goes; nothing is marked retiring. Stored counts now rule (0 agnostic), not minStandby.
    executor.stop("pending-pool-tiny-node-1-GPU-bbbb---0")
    stored = store.run(control.desired_standby(keys, "tiny"))
    assert control.standby_counts(stored, GPU_B, 1, 3) == {"q_proj:8": 2}
    assert store.run(control.retiring(keys)) == {}
    for _ in range(5):
        store.run(control.add_desired_standby(keys, "tiny", GPU_B, "q_proj:8", -1, 1, 3))
    assert store.run(control.desired_standby(keys, "tiny"))[(GPU_B, "q_proj:8")] == 0


def test_exits_are_the_pod_terminations_the_operator_reports_each_counted_once(world: Any) -> None:
    from lorafn.controller.driver import Exit

    store, keys, executor, _clock = world
    old = control.PodExit("fn-old-0", FN, 1, "Error", "worker/0/t0")
    store.run(control.report_pod_exit(keys, old))
    assert executor.exits() == []  # the first call starts from now: a restarted controller skips history
    crash = control.PodExit("fn-french-0", FN, 137, "OOMKilled", "worker/0/t1")
    evicted = control.PodExit("fn-french-1", FN, None, "Evicted", "pod")
    for e in (crash, crash, evicted):  # every reconcile reports what it sees: the same one again
        store.run(control.report_pod_exit(keys, e))
    store.run(control.post_event(keys, control.BOUND, worker="w", function=FN, ms=1, path="standby"))
    assert executor.exits() == [
        Exit("fn-french-0", FN, 137, "OOMKilled"),
        Exit("fn-french-1", FN, None, "Evicted"),
    ]
    store.run(control.report_pod_exit(keys, crash))
    store.run(control.report_pod_exit(keys, control.PodExit("fn-french-0", FN, 1, "Error", "worker/1/t2")))
    assert executor.exits() == [Exit("fn-french-0", FN, 1, "Error")]  # a new termination after a restart


# -- the KV budget of standby pods (a standby must be big enough for the functions it is kept for) -------


def test_standby_kv_records_the_last_grant_per_gpu_and_shape(world: Any) -> None:
    store, keys, _executor, _ = world
    assert store.run(control.standby_kv(keys, "tiny")) == {}
    store.run(control.set_standby_kv(keys, "tiny", GPU_A, None, 256))
    store.run(control.set_standby_kv(keys, "tiny", GPU_A, "q_proj:8", 2048))
    store.run(control.set_standby_kv(keys, "tiny", GPU_A, "q_proj:8", 1024))  # the function went: last wins
    assert store.run(control.standby_kv(keys, "tiny")) == {(GPU_A, None): 256, (GPU_A, "q_proj:8"): 1024}
    # keyed like the counts beside it
    assert set(store.client.hkeys(keys.standby_kv("tiny"))) == {
        control.standby_field(GPU_A, None),
        control.standby_field(GPU_A, "q_proj:8"),
    }
    store.client.hset(keys.standby_kv("tiny"), f"{GPU_B}|*", "junk")  # unreadable: left out, not an error
    assert (GPU_B, None) not in store.run(control.standby_kv(keys, "tiny"))
    store.run(control.clear_standby_kv(keys, "tiny"))
    assert store.run(control.standby_kv(keys, "tiny")) == {}
    with pytest.raises(ValueError, match="kv_mib"):
        control.set_standby_kv(keys, "tiny", GPU_A, None, 0)
    with pytest.raises(ValueError, match="gpu"):
        control.set_standby_kv(keys, "tiny", "a|b", None, 8)


def test_a_standby_start_records_its_kv_budget_with_its_count(world: Any) -> None:
    store, keys, _, clock = world
    granted: list[Start] = []

    def kv_of(action: Start) -> int:
        granted.append(action)
        return action.mem_bytes - 99 * MiB  # whole MiB, as SnapshotReader.standby_kv_bytes rounds it

    executor = KubernetesExecutor(store, keys, heartbeat_ttl_s=5.0, clock=clock, standby_kv_bytes=kv_of)
    executor.gpus()
    shaped = Start(GPU_B, "tiny", "q_proj:8", None, 2148 * MiB, "pool")
    executor.start(shaped, "w-1")
    assert granted == [shaped]
    assert store.run(control.desired_standby(keys, "tiny")) == {(GPU_B, None): 1, (GPU_B, "q_proj:8"): 1}
    assert store.run(control.standby_kv(keys, "tiny")) == {(GPU_B, "q_proj:8"): 2049}
    # a bound start is sized by the operator from the function's spec: no standby budget is written
    executor.start(bound_start(GPU_B), "w-2")
    assert granted == [shaped]
    assert store.run(control.standby_kv(keys, "tiny")) == {(GPU_B, "q_proj:8"): 2049}
    # without a sizer nothing is recorded: the operator's default
    plain = KubernetesExecutor(store, keys, heartbeat_ttl_s=5.0, clock=clock)
    plain.start(standby_start(GPU_A), "w-3")
    assert plain.standby_kv_mib(standby_start(GPU_A)) is None
    assert (GPU_A, None) not in store.run(control.standby_kv(keys, "tiny"))
    # the sizer owns the rounding: a budget that is not whole MiB is refused, not rounded again here, and
    # nothing is recorded for that start (neither the budget nor a higher count)
    odd = KubernetesExecutor(
        store, keys, heartbeat_ttl_s=5.0, clock=clock, standby_kv_bytes=lambda a: 2049 * MiB - 1
    )
    odd.gpus()
    before = store.run(control.desired_standby(keys, "tiny"))
    with pytest.raises(ValueError, match=r"standby_kv_bytes.*2148532223"):
        odd.start(standby_start(GPU_A), "w-4")
    assert store.run(control.desired_standby(keys, "tiny")) == before
    assert (GPU_A, None) not in store.run(control.standby_kv(keys, "tiny"))


def test_a_function_above_the_default_kv_gets_standbys_that_hold_it(
    redis_server: str, tmp_path: Path
) -> None:
    """On Kubernetes the standby pods ran with the default KV budget, so a function whose spec asks for more
    could never take one (`pick_standby` refuses a smaller standby) and every cold start was a fresh pod (on
    the H100 in local mode: 0 of 240 requests took the standby path). The controller built as `lorafn
    controller run` builds it records, with each standby count, a budget that holds the function; a pool pod
    started with it (what the operator does) is then bound to it."""
    from lorafn.controller.cli import ControllerSettings, build_controller

    store, keys = Store(redis_server), Keys(f"t{uuid.uuid4().hex[:8]}")
    register_tiny(store, keys, tmp_path, {BIG: {"resources": {"kvCacheMiB": BIG_KV_MIB}}})
    store.run(control.merge_gpu(keys, GPU_A, "node-1", 8 << 30, "tiny", 8))
    settings = ControllerSettings(
        redis_url=redis_server, key_prefix=keys.prefix, device="cpu", default_kv_mib=8
    )
    controller = build_controller(settings)
    try:
        controller.round()
        size = controller.reader.sizes[BIG]
        assert size.kv_bytes == BIG_KV_MIB * MiB > settings.default_kv_mib * MiB
        counts = store.run(control.desired_standby(keys, "tiny"))
        budgets = store.run(control.standby_kv(keys, "tiny"))
        asked = {k: n for k, n in counts.items() if n > 0}
        assert asked == {(GPU_A, size.shape): 1}, counts  # the floor's standby, prepared for the shape
        assert budgets[(GPU_A, size.shape)] * MiB >= size.kv_bytes  # the budget holds the function

        # The operator's pod comes up with that budget and heartbeats what it allocated (a CPU worker).
        kv = budgets[(GPU_A, size.shape)] * MiB
        fields = {
            "state": "standby", "gpu": GPU_A, "backbone": "tiny", "shape": size.shape,
            "started": int(time.time()) - 5, "mem_bytes": kv + 2 * MiB, "kv_bytes": kv,
            "lora_bytes": size.lora_bytes,
        }  # fmt: skip
        pod = "tiny-x-standby-0a1b2c3d-0"  # a pool pod of the shape (the operator names it by a hash)
        store.run(workers.heartbeat(keys, pod, None, 5000, fields))
        queue_request(store, keys, BIG, "r1")
        controller.round()
        sent = [c for c in commands(store, keys, pod) if c.get("cmd") == "bind"]
        assert sent == [{"cmd": "bind", "function": BIG}]
        assert desired(store, keys, BIG) is None  # no fresh pod for it
    finally:
        store.close()


def test_after_a_restart_pods_not_yet_heartbeating_count_at_the_size_they_were_asked_for(
    redis_server: str, tmp_path: Path
) -> None:
    """A restarted controller knows only the counts of the pods asked for before it (Redis); the placeholders
    of pool pods had size 0, so the memory account saw a GPU full of starting pods as free. Now a pool pod
    counts as a standby with the KV budget recorded beside its count: what the controller before the
    restart asked for. (A function's pods asked then are not shown: the operator picks their GPU.)"""
    from lorafn.controller.cli import ControllerSettings, build_controller

    store, keys = Store(redis_server), Keys(f"t{uuid.uuid4().hex[:8]}")
    register_tiny(
        store, keys, tmp_path, {BIG: {"resources": {"kvCacheMiB": BIG_KV_MIB}, "scaling": {"minReplicas": 1}}}
    )
    store.run(control.merge_gpu(keys, GPU_A, "node-1", 8 << 30, "tiny", 8))
    settings = ControllerSettings(
        redis_url=redis_server, key_prefix=keys.prefix, device="cpu", default_kv_mib=8
    )
    first = build_controller(settings)
    try:
        first.round()  # minReplicas: a pod for BIG; the floor: a pool pod sized to take BIG
        asked = {(w.gpu, w.function): w.mem_bytes for w in first.executor.starting()}
        size = first.reader.sizes[BIG]
        assert asked == {(GPU_A, BIG): size.mem_bytes, (GPU_A, None): size.mem_bytes}
        assert store.run(control.standby_kv(keys, "tiny"))[(GPU_A, size.shape)] == BIG_KV_MIB

        restarted = build_controller(settings)  # no memory of what was asked: only Redis
        gpus = restarted.executor.gpus()
        starting = restarted.executor.starting()
        assert {w.mem_bytes for w in starting} == {0}  # placeholders: the count is known, not the grant
        assert all(w.id.startswith("pending-") for w in starting)
        snapshot = restarted.reader.read(gpus, starting)
        assert {(w.gpu, w.function): w.mem_bytes for w in snapshot.workers} == {
            (GPU_A, None): asked[(GPU_A, None)]
        }
        # without a recorded budget a pool pod is a default standby of its shape (what the operator starts)
        store.run(control.clear_standby_kv(keys, "tiny"))
        snapshot = restarted.reader.read(gpus, restarted.executor.starting())
        pool = [w for w in snapshot.workers if w.function is None]
        assert [w.mem_bytes for w in pool] == [snapshot.costs.standby_bytes_for(size.shape)]
        assert pool[0].mem_bytes < size.mem_bytes
    finally:
        store.close()
