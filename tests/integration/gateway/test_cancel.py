"""Cancellation: a client that goes away stops its request at the worker (docs/gateway.md#failure-behaviour).

A real redis-server, the gateway on a real port and a worker thread with a slow recording fake engine
(one token per request per step): a streamed request whose client closes the connection after the first
tokens, and a non-streamed one whose client disconnects, are aborted well before max_tokens and end with
a `done` event whose finish_reason is "abort"; a request cancelled while still queued is never started;
the other requests of the batch finish with their full answers.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from lorafn.gateway.tokenizer import GatewayTokenizer
from lorafn.store import Keys, Store
from lorafn.store import stats as store_stats
from lorafn.store import streams as st
from lorafn.store.protocol import Done, ReplyEvent
from tests.integration.gateway.harness import RecordingEngine, expected_text, gateway, register, worker_thread

FN, KEY = "team-a/cancel", "sk-cancel-0123456789"
MAX = 150  # max_tokens of the requests that get cancelled (at 30 ms a step: 4.5 s if never aborted)


def _wait(what: str, cond: Callable[[], Any], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def env(redis_server: str, tiny_model_dir: Path):
    prefix = f"t{uuid.uuid4().hex[:8]}"
    store, keys = Store(redis_server), Keys(prefix)
    register(store, keys, FN, [KEY], model_dir=str(tiny_model_dir))
    tok = GatewayTokenizer(tiny_model_dir)
    yield redis_server, prefix, store, keys, tok
    store.close()


def _key(tok: GatewayTokenizer, prompt: str) -> str:
    return ",".join(map(str, tok.encode(prompt)))


def _raw_post(url: str, body: dict[str, Any]) -> socket.socket:
    """A non-streamed request on a raw socket, so that the test can close the connection mid-request."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def _last_event(store: Store, keys: Keys, rid: str) -> ReplyEvent | None:
    events = store.run(st.read_replies(keys, rid, "0", None))
    return events[-1][2] if events else None


def _collect(url: str, prompt: str, max_tokens: int, out: dict[str, Any]) -> None:
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        out[prompt] = c.post(
            "/v1/completions", json={"model": FN, "prompt": prompt, "max_tokens": max_tokens}
        )


def test_streamed_client_that_closes_aborts_the_request(env) -> None:
    redis_url, prefix, store, keys, tok = env
    engine = RecordingEngine(step_s=0.03, max_output=1000)
    others: dict[str, Any] = {}
    with gateway(redis_url, prefix) as url, worker_thread(redis_url, prefix, FN, engine=engine):
        # a neighbour in the same batch, running for the whole time
        neighbour = threading.Thread(target=_collect, args=(url, "neighbour", 60, others))
        neighbour.start()
        _wait("the neighbour to start", lambda: engine.added)
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as c:
            body = {"model": FN, "prompt": "stream then leave", "max_tokens": MAX, "stream": True}
            with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                rid = r.headers["x-lorafn-request-id"]
                texts = 0
                for line in r.iter_lines():
                    if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                        texts += 1
                        if texts == 2:
                            break  # the client closes the connection after the first tokens
        _wait("the worker to cancel it", lambda: rid in engine.aborted)
        counters = _wait(
            "the cancelled counter",
            lambda: (s := store.run(store_stats.counters(keys, FN))).get("cancelled") and s,
        )
        assert counters["cancelled"] == 1
        assert engine.generated[rid] < MAX // 2
        last = _wait("the final event", lambda: _last_event(store, keys, rid))
        assert isinstance(last, Done) and last.finish_reason == "abort"
        assert last.completion_tokens == engine.generated[rid]
        neighbour.join(timeout=60)
    r = others["neighbour"]
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected_text(_key(tok, "neighbour"), 60)
    assert not store.run(st.pending(keys, FN, 0))


def test_non_streamed_client_that_disconnects_aborts_the_request(env) -> None:
    redis_url, prefix, store, keys, tok = env
    engine = RecordingEngine(step_s=0.03, max_output=1000)
    others: dict[str, Any] = {}
    with gateway(redis_url, prefix) as url, worker_thread(redis_url, prefix, FN, engine=engine):
        sock = _raw_post(url, {"model": FN, "prompt": "wait then leave", "max_tokens": MAX})
        rid = _wait("the request to start", lambda: engine.added and engine.added[0])
        neighbour = threading.Thread(target=_collect, args=(url, "neighbour", 40, others))
        neighbour.start()
        _wait("a few tokens", lambda: engine.generated.get(rid, 0) >= 3)
        sock.close()  # the client disconnects while the gateway waits for the answer
        _wait("the worker to cancel it", lambda: rid in engine.aborted)
        assert engine.generated[rid] < MAX // 2
        counters = _wait(
            "the cancelled counter",
            lambda: (s := store.run(store_stats.counters(keys, FN))).get("cancelled") and s,
        )
        assert counters["cancelled"] == 1
        last = _wait("the final event", lambda: _last_event(store, keys, rid))
        assert isinstance(last, Done) and last.finish_reason == "abort"
        neighbour.join(timeout=60)
    r = others["neighbour"]
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected_text(_key(tok, "neighbour"), 40)
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert not store.run(st.pending(keys, FN, 0))


def test_cancelled_queued_request_is_skipped(env) -> None:
    redis_url, prefix, store, keys, tok = env
    engine = RecordingEngine(step_s=0.03, max_output=1000)
    out: dict[str, Any] = {}
    with (
        gateway(redis_url, prefix) as url,
        worker_thread(redis_url, prefix, FN, engine=engine, max_running=1),
    ):
        first = threading.Thread(target=_collect, args=(url, "first", 40, out))
        first.start()
        _wait("the first request to run", lambda: engine.added)
        # the only batch slot is taken: this one waits in the request stream
        sock = _raw_post(url, {"model": FN, "prompt": "queued then leave", "max_tokens": MAX})
        _wait("it to be queued", lambda: store.client.xlen(keys.requests(FN)) == 2)
        sock.close()
        _wait("the gateway to drop it", lambda: store.client.xlen(keys.requests(FN)) == 1)
        first.join(timeout=60)
        # FIFO: a request sent now is read after the cancelled one would have been
        _collect(url, "last", 3, out)
    assert out["first"].status_code == 200, out["first"].text
    assert out["first"].json()["choices"][0]["text"] == expected_text(_key(tok, "first"), 40)
    assert out["last"].status_code == 200, out["last"].text
    assert out["last"].json()["choices"][0]["text"] == expected_text(_key(tok, "last"), 3)
    assert len(engine.added) == 2 and not engine.aborted  # the cancelled one never reached the engine
    assert not store.run(st.pending(keys, FN, 0))
