"""A function whose workers cannot start: the gateway answers with the controller's reason as soon as it
is known (503 `function_start_failed`), not after `cold_start_timeout_s` (issue 15).

The controller's side is its status hash (`lorafn.store.control`), written here by hand so each case is
exact; the real controller and a broken adapter are in tests/integration/local/test_faults.py."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from lorafn.gateway.relay import FAIL_FAST_AFTER, start_failure
from lorafn.store import Keys, Store, control
from tests.integration.gateway.harness import gateway, register

FN, KEY = "team-a/broken", "sk-broken-0123456789"
BODY = {"model": FN, "prompt": "hello", "max_tokens": 3}


@pytest.fixture
def cold(redis_server: str, tiny_model_dir: Path) -> Iterator[tuple[str, Store, Keys]]:
    """The gateway and a function with no worker; nobody runs a controller (the test writes its status)."""
    prefix = f"t{uuid.uuid4().hex[:8]}"
    store, keys = Store(redis_server), Keys(prefix)
    register(store, keys, FN, [KEY], model_dir=str(tiny_model_dir))
    with gateway(redis_server, prefix, cold_start_timeout_s=30) as url:
        yield url, store, keys
    store.close()


def _post(url: str, stream: bool = False) -> tuple[httpx.Response, float]:
    t0 = time.monotonic()
    r = httpx.post(
        f"{url}/v1/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={**BODY, "stream": stream},
        timeout=60,
    )
    return r, time.monotonic() - t0


def test_a_problem_the_controller_reported_is_answered_at_once(cold: tuple[str, Store, Keys]) -> None:
    url, store, keys = cold
    reason = "adapter: /adapters/a/adapter_model.safetensors: truncated"
    store.run(control.set_status(keys, FN, problem=reason, wait_reason=reason))
    r, took = _post(url)
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["code"] == "function_start_failed" and reason in error["message"], error
    assert took < 5, took  # one empty read of the reply stream, not cold_start_timeout_s (30 s)
    # streamed: the same error as the stream's one event
    r, took = _post(url, stream=True)
    assert r.status_code == 200 and "function_start_failed" in r.text and reason in r.text, r.text
    assert took < 5
    # nothing is left queued for a worker that never comes
    assert store.client.xlen(keys.requests(FN)) == 0


def test_a_start_that_fails_while_the_request_waits_ends_it_with_the_reason(
    cold: tuple[str, Store, Keys],
) -> None:
    url, store, keys = cold
    # an old failure: the request waits for the controller's next try
    store.run(control.set_status(keys, FN, start_failures=1, last_failure="old", last_failure_at_ms=1))

    def controller_tries_and_fails() -> None:
        time.sleep(2.0)
        store.run(control.record_start_failure(keys, FN, "bind failed: rank 8 != 4", int(time.time() * 1000)))

    t = threading.Thread(target=controller_tries_and_fails)
    t.start()
    r, took = _post(url)
    t.join()
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["code"] == "function_start_failed", error
    assert "rank 8 != 4" in error["message"] and "2 failed starts" in error["message"], error
    assert 2.0 <= took < 6, took


def test_start_failure_rules() -> None:
    now = 1_000_000
    assert start_failure({}, now) is None
    assert start_failure({"problem": "adapter: gone"}, now) == "adapter: gone"
    old = {"start_failures": "1", "last_failure": "boom", "last_failure_at_ms": str(now - 5)}
    assert start_failure(old, now) is None  # before this request: the next try may work
    assert start_failure({**old, "last_failure_at_ms": str(now + 5)}, now) == "boom (1 failed start in a row)"
    many = {**old, "start_failures": str(FAIL_FAST_AFTER)}
    assert start_failure(many, now) == f"boom ({FAIL_FAST_AFTER} failed starts in a row)"
    assert start_failure({**old, "start_failures": "0", "last_failure_at_ms": str(now + 5)}, now) is None
    assert start_failure({"start_failures": "x"}, now) is None
