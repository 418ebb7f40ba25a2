"""Two real `lorafn controller run` processes on one real redis-server: only the lease holder ever acts,
and the other takes over once the holder is gone."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lorafn.api.sizing import MiB
from lorafn.store import Keys, Store, control, streams
from lorafn.store.backbones import BackboneRecord, put_backbone
from lorafn.store.protocol import RequestBody
from lorafn.store.registry import FunctionRecord, put_function
from tests.unit.operator._peft import write_adapter, write_backbone

pytestmark = pytest.mark.timeout(90)
GPU = "node-1/GPU-aaaa"
ACTIONS = ("controller: start", "controller: stop", "controller: bind", "desired replicas ->", "pool pods on")


def wait_until(check: Callable[[], Any], timeout_s: float = 20.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def deployment(redis_server: str, tmp_path: Path) -> Iterator[tuple[Store, Keys]]:
    """A backbone loaded on one GPU of the inventory and two functions, as the operator registers them."""
    store, keys = Store(redis_server), Keys(f"t{uuid.uuid4().hex[:8]}")
    model = write_backbone(tmp_path / "models" / "tiny")
    adapter = write_adapter(tmp_path / "adapters" / "fr", rank=4)
    spec = {"model": {"uri": f"file://{model}"}, "warmPool": {"minStandby": 0, "maxStandby": 2}}
    store.run(put_backbone(keys, BackboneRecord("tiny", str(model), "float32", spec)))
    for name in ("fr", "de"):
        fn_spec = {
            "backbone": "tiny",
            "adapter": {"uri": f"file://{adapter}"},
            "scaling": {"minReplicas": 0, "maxReplicas": 2},
        }
        store.run(put_function(keys, FunctionRecord(f"team-a/{name}", fn_spec, str(model), str(adapter))))
    store.run(control.merge_gpu(keys, GPU, "node-1", 16_000 * MiB, "tiny", 1 * MiB))
    yield store, keys
    store.close()


@pytest.fixture
def controllers(redis_server: str, tmp_path: Path) -> Iterator[Callable[[Keys, str], subprocess.Popen]]:
    procs: list[subprocess.Popen] = []

    def start(keys: Keys, name: str) -> subprocess.Popen:
        env = dict(
            os.environ,
            LORAFN_REDIS_URL=redis_server,
            LORAFN_KEY_PREFIX=keys.prefix,
            LORAFN_INTERVAL_S="0.1",
            LORAFN_LEASE_TTL_S="1.5",
            LORAFN_DEVICE="cpu",
        )
        log = (tmp_path / f"{name}.log").open("w")
        proc = subprocess.Popen(
            [sys.executable, "-m", "lorafn.cli", "controller", "run"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(10)


def holder_of(proc: subprocess.Popen) -> str:
    return f"{socket.gethostname()[:40]}-{proc.pid}"


def actions(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if any(a in line for a in ACTIONS)]


def admit(store: Store, keys: Keys, fn: str, rid: str) -> None:
    store.run(
        streams.admit(
            keys, fn, rid, RequestBody(prompt="hi"), deadline_ms=0, now_s=time.time(),
            rate_limit_rps=0.0, rate_limit_burst=1, heartbeat_ttl_ms=5000,
        )
    )  # fmt: skip


def test_two_controllers_never_both_act(deployment: Any, controllers: Any, tmp_path: Path) -> None:
    store, keys = deployment
    a, b = controllers(keys, "a"), controllers(keys, "b")
    holder = wait_until(lambda: store.run(control.lease_holder(keys)), what="a lease holder")
    assert holder in {holder_of(a), holder_of(b)}
    active, idle = (a, b) if holder == holder_of(a) else (b, a)
    active_log, idle_log = (tmp_path / "a.log", tmp_path / "b.log")
    if active is b:
        active_log, idle_log = idle_log, active_log
    wait_until(lambda: "controller" in idle_log.read_text(), what="the second controller's start-up line")

    # Demand: the active controller starts a worker (one pod asked for, not one per controller).
    for i in range(3):
        admit(store, keys, "team-a/fr", f"r{i}")
    wait_until(lambda: store.run(control.desired_replicas(keys, ["team-a/fr"]))["team-a/fr"], what="a start")
    time.sleep(1.0)  # several rounds of both
    assert store.run(control.desired_replicas(keys, ["team-a/fr"]))["team-a/fr"] <= 2  # maxReplicas
    assert any("team-a/fr" in line for line in actions(active_log))
    assert actions(idle_log) == []
    assert store.run(control.lease_holder(keys)) == holder

    # The holder dies without a word: the other takes the lease once it lapses, and acts.
    active.send_signal(signal.SIGKILL)
    active.wait(10)
    wait_until(
        lambda: store.run(control.lease_holder(keys)) == holder_of(idle), timeout_s=10, what="takeover"
    )
    admit(store, keys, "team-a/de", "r-de")
    wait_until(lambda: any("team-a/de" in line for line in actions(idle_log)), what="the new holder acts")
    # the log line comes just before the executor writes the count: wait for it, do not race it
    wait_until(
        lambda: store.run(control.desired_replicas(keys, ["team-a/de"]))["team-a/de"] == 1,
        what="the new holder's desired count",
    )
    assert idle.poll() is None
