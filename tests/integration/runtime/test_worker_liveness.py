"""Liveness and the accept deadline (issue 15): a worker whose step loop hangs stops heartbeating so its
requests are taken over; `accepted` goes out when the worker reads an entry, not after the next engine
step; a warm request whose worker died waits for a cold start instead of 503 after queue_timeout_s.

Real redis-server, real worker processes (`lorafn worker serve` with a fake engine), the gateway over
real HTTP."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from lorafn.store import Keys, Store
from lorafn.store import streams as st
from tests.integration.gateway.harness import (
    FakeEngine,
    client,
    expected_text,
    gateway,
    register,
    start_worker_process,
    stop_process,
    wait_live_workers,
)

FN, KEY = "team-a/live", "sk-live-0123456789"


class HangingEngine(FakeEngine):
    """A fake engine whose step never returns (a hung kernel, a deadlock)."""

    def step(self) -> Any:
        time.sleep(3600)
        return []


def hanging_engine(settings: Any, record: Any) -> FakeEngine:
    """engine_factory: hangs in its first step when LORAFN_TEST_HANG=1."""
    return HangingEngine() if os.environ.get("LORAFN_TEST_HANG") else FakeEngine()


FACTORY = "tests.integration.runtime.test_worker_liveness:hanging_engine"


def _setup(redis_url: str) -> tuple[Store, Keys, str]:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    store, keys = Store(redis_url), Keys(prefix)
    register(store, keys, FN, [KEY])
    return store, keys, prefix


def test_a_hung_worker_looks_dead_and_its_request_is_taken_over(redis_server: str, tmp_path: Path) -> None:
    store, keys, prefix = _setup(redis_server)
    env = {"LORAFN_ENGINE_FACTORY": FACTORY, "LORAFN_STALL_AFTER_TTLS": "3"}
    hung = start_worker_process(redis_server, prefix, FN, tmp_path / "hung.log", LORAFN_TEST_HANG="1", **env)
    healthy = None
    try:
        with gateway(redis_server, prefix, heartbeat_ttl_s=1.0, request_timeout_s=40) as url:
            wait_live_workers(url, store, keys, FN, 1)
            result: dict[str, Any] = {}

            def call() -> None:
                body = {"model": FN, "prompt": "stuck?", "max_tokens": 4}
                result["r"] = client(url, KEY).post("/v1/completions", json=body, timeout=60)

            caller = threading.Thread(target=call)
            caller.start()
            deadline = time.monotonic() + 10
            while not store.run(st.pending(keys, FN, 0)):  # the hung worker holds the request
                assert time.monotonic() < deadline, "the first worker never read the request"
                time.sleep(0.05)
            healthy = start_worker_process(redis_server, prefix, FN, tmp_path / "ok.log", **env)
            caller.join(timeout=45)
            r = result["r"]
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == expected_text("stuck?", 4)
            assert hung.poll() is None  # alive, yet its request was served by the other one
    finally:
        stop_process(hung, signal.SIGKILL)
        if healthy is not None:
            stop_process(healthy)


def test_accepted_goes_out_before_the_first_engine_step(redis_server: str, tmp_path: Path) -> None:
    """A step of 3 s and a queue timeout of 1 s: the worker holds the request at once, so no 503."""
    store, keys, prefix = _setup(redis_server)
    worker = start_worker_process(redis_server, prefix, FN, tmp_path / "w.log", LORAFN_TEST_STEP_S="3")
    try:
        with gateway(redis_server, prefix, heartbeat_ttl_s=1.0, queue_timeout_s=1.0) as url:
            wait_live_workers(url, store, keys, FN, 1)
            body = {"model": FN, "prompt": "slow step", "max_tokens": 1}
            r = client(url, KEY).post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == expected_text("slow step", 1)
    finally:
        stop_process(worker)


def test_a_warm_request_whose_worker_died_waits_for_a_cold_start(redis_server: str, tmp_path: Path) -> None:
    store, keys, prefix = _setup(redis_server)
    first = start_worker_process(redis_server, prefix, FN, tmp_path / "a.log")
    second = None
    try:
        with gateway(
            redis_server, prefix, heartbeat_ttl_s=1.0, queue_timeout_s=1.5, cold_start_timeout_s=20
        ) as url:
            wait_live_workers(url, store, keys, FN, 1)
            first.send_signal(signal.SIGSTOP)  # frozen: live for one more TTL, reads nothing
            result: dict[str, Any] = {}

            def call() -> None:
                body = {"model": FN, "prompt": "orphan", "max_tokens": 2}
                result["r"] = client(url, KEY).post("/v1/completions", json=body, timeout=60)

            caller = threading.Thread(target=call)
            caller.start()
            time.sleep(3.0)  # past queue_timeout_s: the replacement comes later, as a cold start would
            second = start_worker_process(redis_server, prefix, FN, tmp_path / "b.log")
            caller.join(timeout=30)
            r = result["r"]
            assert r.status_code == 200, r.text
            assert r.headers["x-lorafn-cold-start"] == "0"  # admitted warm
            assert r.json()["choices"][0]["text"] == expected_text("orphan", 2)
    finally:
        stop_process(first, signal.SIGKILL)
        if second is not None:
            stop_process(second)


def test_a_write_handed_to_the_loop_rides_on_its_first_read_once(redis_server: str) -> None:
    """A bound standby posts its `bound` event with the serving loop's first read (Worker.send_with_next),
    not in a round trip of its own inside the cold start: it is written once, together with that read,
    and the loop serves as before."""
    from lorafn.runtime.worker import ServingConfig, Worker
    from lorafn.store.client import Op

    prefix = f"t{uuid.uuid4().hex[:8]}"
    store, keys = Store(redis_server), Keys(prefix)
    register(store, keys, FN, [KEY])
    marker = f"{prefix}:marker"
    worker = Worker(Store(redis_server), keys, FakeEngine(), ServingConfig(function=FN, block_ms=50))
    reads: list[int] = []
    first_read = worker._read

    def counting_read(block_ms: int | None) -> int:
        # what the marker holds when each read goes out: the write comes with the first one, not before
        reads.append(int(store.client.get(marker) or 0))
        return first_read(block_ms)

    worker._read = counting_read  # type: ignore[method-assign]
    worker.send_with_next(Op(lambda pipe: pipe.incr(marker), lambda r: r[0]))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        with gateway(redis_server, prefix) as url, client(url, KEY) as c:
            r = c.post("/v1/completions", json={"model": FN, "prompt": "x y", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected_text("x y", 3)
    finally:
        worker.drain()
        thread.join(timeout=10)
    assert reads[0] == 0 and len(reads) > 2, reads
    assert int(store.client.get(marker)) == 1
