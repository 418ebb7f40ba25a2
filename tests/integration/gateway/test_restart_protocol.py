"""The reply-stream protocol around a restart, driven by hand (two 'workers' written with the store):
after a `restart`, only the new worker's events count — a presumed-dead worker that still writes is
ignored — and a non-streamed answer is the new attempt's text alone."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import httpx

from lorafn.store import Keys, Store, workers
from lorafn.store import streams as st
from tests.integration.gateway.harness import gateway, register

FN, KEY = "team-a/manual", "sk-manual-0123456789"


def test_stale_writer_is_ignored_after_a_restart(redis_server: str, tiny_model_dir: Path) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    store, keys = Store(redis_server), Keys(prefix)
    register(store, keys, FN, [KEY], model_dir=str(tiny_model_dir))
    store.run(workers.heartbeat(keys, "w1", FN, 60_000, {}))  # "live", so the request is not cold
    store.run(st.create_group(keys, FN))
    result: dict[str, httpx.Response] = {}
    with gateway(redis_server, prefix) as url:
        t = threading.Thread(
            target=lambda: result.setdefault(
                "r",
                httpx.post(
                    f"{url}/v1/completions",
                    headers={"Authorization": f"Bearer {KEY}"},
                    json={"model": FN, "prompt": "hello", "max_tokens": 4},
                    timeout=30,
                ),
            )
        )
        t.start()
        entries: list = []
        deadline = time.monotonic() + 10
        while not entries and time.monotonic() < deadline:
            entries = store.run(st.read_requests(keys, FN, "w1", 1, 100))
        ((_, fields),) = entries
        rid = fields["rid"]

        def write(worker: str, *events: dict) -> None:
            store.run(st.reply_events(keys, worker, [(rid, e) for e in events], 60_000))

        write("w1", {"type": "accepted", "worker": "w1"}, {"type": "delta", "text": "old ", "tokens": 1})
        write(
            "w2",
            {"type": "restart", "worker": "w2", "reason": "test"},
            {"type": "accepted", "worker": "w2"},
            {"type": "delta", "text": "new ", "tokens": 1},
        )
        write(
            "w1", {"type": "delta", "text": "STALE ", "tokens": 1}, {"type": "done", "finish_reason": "stop"}
        )
        write(
            "w2",
            {"type": "delta", "text": "answer", "tokens": 1},
            {"type": "done", "finish_reason": "length", "prompt_tokens": 1, "completion_tokens": 2},
        )
        t.join(timeout=30)
    r = result["r"]
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "new answer"
    assert r.json()["choices"][0]["finish_reason"] == "length"
