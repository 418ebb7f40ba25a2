"""/readyz has its own Redis connection; /metrics (no key needed) lists no function names unless enabled
(issue 15). Real gateway, real Redis."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import httpx

from lorafn.store import Keys, Store
from tests.integration.gateway.harness import client, gateway, register, worker_thread

A, KEY_A = "team-a/secret-project", "sk-a-0123456789"


def test_readyz_answers_while_every_request_connection_is_taken(redis_server: str) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    register(Store(redis_server), Keys(prefix), A, [KEY_A])
    # 4 Redis connections for requests; 40 requests wait for a worker that never comes (cold start)
    with gateway(redis_server, prefix, max_connections=4, cold_start_timeout_s=8) as url:
        waiting = [
            threading.Thread(
                target=lambda: client(url, KEY_A).post("/v1/completions", json={"model": A, "prompt": "x"})
            )
            for _ in range(40)
        ]
        for t in waiting:
            t.start()
        time.sleep(1.0)
        assert all(t.is_alive() for t in waiting)
        for _ in range(3):
            r = httpx.get(f"{url}/readyz", timeout=5)
            assert r.status_code == 200, r.text
        for t in waiting:
            t.join(timeout=30)


def test_metrics_name_no_function_unless_enabled(redis_server: str, tiny_model_dir: Path) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    register(Store(redis_server), Keys(prefix), A, [KEY_A], model_dir=str(tiny_model_dir))
    for per_function in (False, True):
        with (
            gateway(redis_server, prefix, metrics_per_function=per_function) as url,
            worker_thread(redis_server, prefix, A),
        ):
            body = {"model": A, "prompt": "hi", "max_tokens": 2}
            assert client(url, KEY_A).post("/v1/completions", json=body).status_code == 200
            metrics = httpx.get(f"{url}/metrics").text
            assert "lorafn_gateway_ttft_seconds_count" in metrics
            assert (A in metrics) is per_function, metrics
            if not per_function:
                assert 'lorafn_gateway_ttft_seconds_count{function="*"} 1.0' in metrics
