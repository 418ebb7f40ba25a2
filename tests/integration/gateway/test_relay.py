"""The reply relay (lorafn/gateway/relay.py) driven by hand: 'workers' are entries written into the
reply stream with the protocol's own encoder, so every case is exact.

After a `restart`, only the new worker's events count — a presumed-dead worker that still writes is
ignored — and a non-streamed answer is the new attempt's text alone. A worker's error event becomes
the matching HTTP error; an entry the gateway cannot parse is the worker's fault (502 `invalid_reply`),
never a crash (500)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from lorafn.store import Keys, Store, workers
from lorafn.store import streams as st
from lorafn.store.protocol import Accepted, Delta, Done, Error, ReplyEvent, Restart, encode_events
from tests.integration.gateway.harness import gateway, register

FN, KEY = "team-a/manual", "sk-manual-0123456789"
Write = Callable[[str, str], None]


@pytest.fixture
def manual(redis_server: str, tiny_model_dir: Path) -> Iterator[tuple[str, Store, Keys]]:
    """The gateway, a function with one "live" worker that nobody runs: the test writes its replies."""
    prefix = f"t{uuid.uuid4().hex[:8]}"
    store, keys = Store(redis_server), Keys(prefix)
    register(store, keys, FN, [KEY], model_dir=str(tiny_model_dir))
    store.run(workers.heartbeat(keys, "w1", FN, 60_000, {}))  # "live", so the request is not cold
    store.run(st.create_group(keys, FN))
    with gateway(redis_server, prefix) as url:
        yield url, store, keys
    store.close()


def _request(url: str, store: Store, keys: Keys, body: dict, answer: Callable[[str], None]) -> httpx.Response:
    """Send `body` from a thread, take its entry as worker w1, let `answer(rid)` write the replies."""
    result: dict[str, httpx.Response] = {}
    t = threading.Thread(
        target=lambda: result.setdefault(
            "r",
            httpx.post(
                f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, json=body, timeout=30
            ),
        )
    )
    t.start()
    entries: list = []
    deadline = time.monotonic() + 10
    while not entries and time.monotonic() < deadline:
        entries = store.run(st.read_requests(keys, FN, "w1", 1, 100))
    ((_, fields),) = entries
    answer(fields["rid"])
    t.join(timeout=30)
    return result["r"]


def _write(store: Store, keys: Keys, rid: str, worker: str, *events: ReplyEvent) -> None:
    """One reply entry as a worker writes it: the events of one step, and the writer's id."""
    store.client.xadd(keys.reply(rid), {"e": encode_events(list(events)), "w": worker})


def test_stale_writer_is_ignored_after_a_restart(manual) -> None:
    url, store, keys = manual

    def answer(rid: str) -> None:
        _write(store, keys, rid, "w1", Accepted(worker="w1"), Delta(text="old ", tokens=1))
        _write(
            store,
            keys,
            rid,
            "w2",
            Restart(worker="w2", reason="test"),
            Accepted(worker="w2"),
            Delta(text="new ", tokens=1),
        )
        _write(
            store,
            keys,
            rid,
            "w1",
            Delta(text="STALE ", tokens=1),
            Done(finish_reason="stop", prompt_tokens=1, completion_tokens=2),
        )
        _write(
            store,
            keys,
            rid,
            "w2",
            Delta(text="answer", tokens=1),
            Done(finish_reason="length", prompt_tokens=1, completion_tokens=2),
        )

    r = _request(url, store, keys, {"model": FN, "prompt": "hello", "max_tokens": 4}, answer)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "new answer"
    assert r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("raw", "where"),
    [
        ('[{"type":"delta","text":"x"}]', "tokens"),  # a required field missing
        ('[{"type":"progress","worker":"w1"}]', "e.0"),  # an event type this gateway does not know
        ("not json", "e"),
    ],
)
def test_an_unreadable_reply_is_a_worker_error_not_a_crash(manual, raw: str, where: str) -> None:
    url, store, keys = manual

    def answer(rid: str) -> None:
        _write(store, keys, rid, "w1", Accepted(worker="w1"))
        store.client.xadd(keys.reply(rid), {"e": raw, "w": "w1"})

    r = _request(url, store, keys, {"model": FN, "prompt": "hello", "max_tokens": 4}, answer)
    assert r.status_code == 502, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_reply" and where in error["message"]
    metrics = httpx.get(f"{url}/metrics").text
    assert 'lorafn_gateway_errors_total{code="invalid_reply"} 1.0' in metrics


@pytest.mark.parametrize(
    ("code", "status"),
    [("invalid_request", 400), ("engine_error", 500), ("worker_failures", 503)],
)
def test_a_worker_error_event_becomes_the_matching_http_error(manual, code: str, status: int) -> None:
    url, store, keys = manual

    def answer(rid: str) -> None:
        _write(store, keys, rid, "w1", Accepted(worker="w1"), Error(code=code, message=f"worker says {code}"))

    r = _request(url, store, keys, {"model": FN, "prompt": "hello", "max_tokens": 4}, answer)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code
    assert r.json()["error"]["message"] == f"worker says {code}"
