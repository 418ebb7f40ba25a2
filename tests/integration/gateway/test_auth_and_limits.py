"""Auth (401/403/404 ordering), validation (400 naming the field), body size, rate limit, health."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from lorafn.store import Keys, Store
from lorafn.store import stats as store_stats
from tests.integration.gateway.harness import client, gateway, register, worker_thread

A, B = "team-a/summarize", "team-b/translate"
KEY_A, KEY_B = "sk-a-0123456789", "sk-b-9876543210"


@pytest.fixture
def env(redis_server: str, tiny_model_dir: Path):
    prefix = f"t{uuid.uuid4().hex[:8]}"
    store, keys = Store(redis_server), Keys(prefix)
    register(store, keys, A, [KEY_A], model_dir=str(tiny_model_dir))
    register(store, keys, B, [KEY_B], model_dir=str(tiny_model_dir), rate_limit_rps=0.1, rate_limit_burst=2)
    register(store, keys, "public/echo", [], model_dir=str(tiny_model_dir), public=True)
    with (
        gateway(redis_server, prefix, max_body_bytes=65536) as url,
        worker_thread(redis_server, prefix, A),
        worker_thread(redis_server, prefix, B),
        worker_thread(redis_server, prefix, "public/echo"),
    ):
        yield url, store, keys


def _err(r):
    body = r.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_isolation(env) -> None:
    url, *_ = env
    body = {"model": B, "prompt": "hi", "max_tokens": 2}
    assert client(url, KEY_B).post("/v1/completions", json=body).status_code == 200
    # a key of A on B: 403; the same for a function that does not exist (no existence leak)
    r = client(url, KEY_A).post("/v1/completions", json=body)
    assert r.status_code == 403 and _err(r)["code"] == "forbidden"
    r2 = client(url, KEY_A).post("/v1/completions", json={**body, "model": "team-b/nonexistent"})
    assert r2.status_code == 403
    # wrong namespace, same name
    assert (
        client(url, KEY_A).post("/v1/completions", json={**body, "model": "team-b/summarize"}).status_code
        == 403
    )
    # missing key, invalid key, malformed header
    r = client(url, None).post("/v1/completions", json=body)
    assert r.status_code == 401 and _err(r)["code"] == "missing_api_key"
    assert client(url, None).post("/v1/completions", json={**body, "model": "x/nope"}).status_code == 401
    r = client(url, "sk-nope").post("/v1/completions", json=body)
    assert r.status_code == 401 and _err(r)["code"] == "invalid_api_key"
    with client(url, None) as c:
        assert (
            c.post("/v1/completions", json=body, headers={"Authorization": f"Basic {KEY_B}"}).status_code
            == 401
        )
    # native form: same rules
    assert (
        client(url, KEY_A).post("/v1/functions/team-b/translate:invoke", json={"prompt": "x"}).status_code
        == 403
    )
    assert (
        client(url, KEY_B).post("/v1/functions/team-b/translate:invoke", json={"prompt": "x"}).status_code
        == 200
    )
    # public functions take any request
    assert client(url, None).post("/v1/completions", json={**body, "model": "public/echo"}).status_code == 200
    assert [m["id"] for m in client(url, None).get("/v1/models").json()["data"]] == ["public/echo"]


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 2}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 5000}, "max_tokens"),  # beyond the tiny model's 2048 context
        ({"prompt": "word " * 3000}, "prompt"),  # more prompt tokens than the context
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [1, 2, 10**6]}, "prompt"),  # outside the vocabulary
        ({"stop": [""]}, "stop.0"),
        ({"model": "no-slash"}, "model"),
        ({"model": None}, "model"),
        ({"logprobs": 3}, "logprobs"),
        ({"echo": True}, "echo"),
    ],
)
def test_validation_names_the_field(env, patch, param) -> None:
    url, *_ = env
    r = client(url, KEY_A).post("/v1/completions", json={"model": A, "prompt": "hi", **patch})
    assert r.status_code == 400, r.text
    assert _err(r)["param"] == param


def test_bad_bodies(env) -> None:
    url, *_ = env
    c = client(url, KEY_A)
    r = c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and _err(r)["code"] == "invalid_json"
    assert c.post("/v1/completions", json=[1, 2]).status_code == 400
    r = c.post("/v1/completions", json={"model": A, "prompt": "x" * 100_000})
    assert r.status_code == 413 and _err(r)["code"] == "body_too_large"
    r = c.post("/v1/chat/completions", json={"model": A, "messages": []})
    assert r.status_code == 400 and _err(r)["param"] == "messages"
    r = c.post("/v1/chat/completions", json={"model": A, "messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 400 and _err(r)["param"].startswith("messages.0.role")
    r = c.post("/v1/functions/team-a/summarize:invoke", json={"prompt": "x", "messages": [{"role": "user"}]})
    assert r.status_code == 400
    r = c.post("/v1/functions/Bad_NS/x:invoke", json={"prompt": "x"})
    assert r.status_code == 400 and _err(r)["param"] == "path"


def test_rate_limit_429_with_retry_after(env) -> None:
    url, store, keys = env
    c = client(url, KEY_B)
    codes = [c.post("/v1/completions", json={"model": B, "prompt": "hi", "max_tokens": 1}) for _ in range(4)]
    # burst 2, then one token per 10 s: the next two are refused
    assert [r.status_code for r in codes] == [200, 200, 429, 429]
    limited = codes[2:]
    assert int(limited[0].headers["Retry-After"]) >= 1
    assert _err(limited[0])["code"] == "rate_limit_exceeded"
    assert store.run(store_stats.counters(keys, B))["rate_limited"] >= 1


def test_health_ready_metrics_openapi(env) -> None:
    url, *_ = env
    c = client(url, None)
    health = c.get("/healthz").json()
    assert health["status"] == "ok" and health["instance"]  # the instance id `lorafn up` checks
    assert c.get("/readyz").status_code == 200
    client(url, KEY_A).post("/v1/completions", json={"model": A, "prompt": "hi", "max_tokens": 2})
    metrics = c.get("/metrics").text
    assert 'lorafn_gateway_requests_total{code="200",endpoint="completions"}' in metrics
    assert "lorafn_gateway_ttft_seconds_bucket" in metrics
    doc = c.get("/openapi.json").json()
    assert "/v1/chat/completions" in doc["paths"]
    assert "CompletionRequest" in doc["components"]["schemas"]


def test_cold_start_records_demand_and_times_out_with_503(redis_server: str, tiny_model_dir: Path) -> None:
    from lorafn.store import streams

    prefix = f"t{uuid.uuid4().hex[:8]}"
    store, keys = Store(redis_server), Keys(prefix)
    register(store, keys, A, [KEY_A], model_dir=str(tiny_model_dir))
    with gateway(redis_server, prefix, cold_start_timeout_s=1.0) as url:
        r = client(url, KEY_A).post("/v1/completions", json={"model": A, "prompt": "hi"})
        assert r.status_code == 503 and _err(r)["code"] == "no_worker"
        assert "Retry-After" in r.headers
        assert "cold start did not complete" in _err(r)["message"]
        demand = store.run(streams.read_demand(keys, "0", None))
        assert [d["function"] for _, d in demand] == [A]
        # the controller's reason for not starting a worker reaches the client
        from lorafn.store import control

        store.run(
            control.set_status(keys, A, wait_reason="needs 4.0 GiB; the most any GPU can free is 1.0 GiB")
        )
        r = client(url, KEY_A).post("/v1/completions", json={"model": A, "prompt": "hi"})
        assert r.status_code == 503 and "needs 4.0 GiB" in _err(r)["message"], _err(r)
        store.run(control.set_status(keys, A, wait_reason=None))
        # with a worker started on demand, the next request is served and reported as a cold start
        with worker_thread(redis_server, prefix, A):
            r = client(url, KEY_A).post(
                "/v1/functions/team-a/summarize:invoke", json={"prompt": "x", "max_tokens": 1}
            )
        assert r.status_code == 200 and r.json()["timing"]["cold_start"] is False
