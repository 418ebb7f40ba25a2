"""Redis going away and coming back (documented in docs/gateway.md#failure-behaviour):
while it is down the gateway answers 503 `redis_unavailable` with Retry-After and /readyz fails;
when it is back (same data directory, AOF) both the gateway and the worker recover without restarts."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

from lorafn.local.redis_proc import RedisProcess
from lorafn.store import Keys, Store
from tests.integration.gateway.harness import client, gateway, register, worker_thread

FN, KEY = "team-a/summarize", "sk-a-0123456789"


def test_gateway_and_worker_survive_a_redis_restart(
    redis_process: RedisProcess, tiny_model_dir: Path
) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    store, keys = Store(redis_process.url), Keys(prefix)
    store.client.config_set("appendfsync", "always")  # the registration must survive the kill
    register(store, keys, FN, [KEY], model_dir=str(tiny_model_dir))
    body = {"model": FN, "prompt": "hello", "max_tokens": 3}
    with (
        gateway(redis_process.url, prefix, registry_cache_s=0) as url,
        worker_thread(redis_process.url, prefix, FN, heartbeat_ttl_s=2.0),
    ):
        c = client(url, KEY)
        assert c.post("/v1/completions", json=body).status_code == 200
        redis_process.kill()
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "redis_unavailable"
        assert r.headers["Retry-After"] == "1"
        assert c.get("/readyz").status_code == 503
        assert c.get("/healthz").status_code == 200  # alive, not ready
        redis_process.start()  # same port, same data directory
        deadline = time.monotonic() + 20
        while c.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, "the gateway did not become ready again"
            time.sleep(0.1)
        while True:  # the worker reconnects and heartbeats again; requests are served
            r = c.post("/v1/completions", json=body)
            if r.status_code == 200:
                break
            assert time.monotonic() < deadline, r.text
            time.sleep(0.2)
        assert len(r.json()["choices"][0]["text"].split()) == 3
