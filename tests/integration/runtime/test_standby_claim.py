"""A standby pre-loaded with `claim=1` takes its function's first request itself (real Redis, the tiny
model on CPU): it registers as the function's worker only while the function has none, a control command
read in the same wake goes first, and the serving loop it built ahead serves the request exactly."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

from lorafn.runtime import Engine, EngineConfig
from lorafn.store import Keys, Store, workers
from lorafn.store.registry import FunctionRecord, put_function
from tests.integration.runtime.engine_helpers import write_peft_adapter

SHAPE = "q_proj:4,v_proj:4"


def _settings() -> Any:
    from lorafn.runtime.worker import WorkerSettings

    return WorkerSettings(
        standby=True, backbone="tiny", device="cpu", gpu="cpu/0", worker_id="w-claim", heartbeat_s=0.2
    )


@pytest.fixture
def setup(tiny_model_dir: Path, tmp_path: Path, redis_server: str):  # type: ignore[no-untyped-def]
    adapter = write_peft_adapter(
        tiny_model_dir, tmp_path / "f", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]
    )
    store, keys = Store(redis_server), Keys(f"t{uuid.uuid4().hex[:8]}")
    spec = {"backbone": "tiny", "adapter": {"uri": f"file://{adapter}"}, "scaling": {"keepAliveSeconds": 30}}
    store.run(put_function(keys, FunctionRecord("t/f", spec, str(tiny_model_dir), str(adapter))))
    engine = Engine(EngineConfig(model=tiny_model_dir, lora_shape=SHAPE, num_kv_blocks=64))
    yield store, keys, engine, adapter
    store.close()


def _standby(store: Store, keys: Keys, engine: Engine) -> Any:
    from lorafn.runtime.standby import Standby

    return Standby(store, keys, _settings(), engine, "w-claim")


def _waiting(standby: Any) -> tuple[threading.Thread, list[str | None]]:
    got: list[str | None] = []
    t = threading.Thread(target=lambda: got.append(standby.wait()), daemon=True)
    t.start()
    return t, got


def _request(keys: Keys, url: str, function: str = "t/f") -> str:
    from lorafn.store.protocol import RequestBody, SamplingWire

    body = RequestBody(prompt_token_ids=[1, 5, 9], params=SamplingWire(max_tokens=4, temperature=0.0))
    client = redis.Redis.from_url(url, decode_responses=True)
    return str(client.xadd(keys.requests(function), {"rid": uuid.uuid4().hex, "body": body.encode()}))


def test_only_if_alone_heartbeat_lets_one_racer_in(setup, redis_server: str) -> None:  # type: ignore[no-untyped-def]
    store, keys, _, _ = setup
    beat = lambda wid: workers.heartbeat(keys, wid, "t/f", 5000, {"state": "binding"}, only_if_alone=True)  # noqa: E731
    assert store.run(beat("a")) > 0
    assert store.run(beat("a")) > 0, "its own earlier registration does not count against it"
    assert store.run(beat("b")) == 0
    assert store.run(workers.live_workers(keys, "t/f", 5000, store.run(workers.server_time_ms()))) == ["a"]
    assert store.run(workers.worker_info(keys, ["b"])) == {}, "a refused claim writes nothing"
    with pytest.raises(ValueError, match="needs the function"):
        workers.heartbeat(keys, "c", None, 5000, {}, only_if_alone=True)


def test_a_claiming_preload_takes_the_first_request_and_serves_it(setup, redis_server: str) -> None:  # type: ignore[no-untyped-def]
    store, keys, engine, _ = setup
    standby = _standby(store, keys, engine)
    before = _request(keys, redis_server)  # already there before the pre-load: the demand path's, not its
    store.run(workers.send_control(keys, "w-claim", "preload", function="t/f", claim=1))
    thread, got = _waiting(standby)
    client = redis.Redis.from_url(redis_server, decode_responses=True)
    import time

    deadline = time.monotonic() + 30
    while client.hget(keys.worker("w-claim"), "preloaded") != "t/f" or standby._watched() != "t/f":
        assert time.monotonic() < deadline, "the standby never reported the pre-load"
        time.sleep(0.05)
    assert thread.is_alive(), "a request from before the pre-load must not wake a claim"
    _request(keys, redis_server)
    thread.join(10)
    assert got == ["t/f"] and standby.claimed
    assert client.hget(keys.worker("w-claim"), "state") == "binding"
    assert client.zscore(keys.function_workers("t/f"), "w-claim") is not None
    rounds = []
    real_run = store.run
    store.run = lambda op: rounds.append(op) or real_run(op)  # type: ignore[method-assign]
    try:
        _record, _ms = standby.bind("t/f")
        worker = standby.worker("t/f", _record)
    finally:
        store.run = real_run  # type: ignore[method-assign]
    assert standby.bound_preloaded, "the pre-loaded adapter is used as is"
    assert rounds == [], "the claim read the registration: the bind makes no round trip of its own"
    assert worker._prepared, "the serving loop built at pre-load time is the one that serves"
    # the loop serves both requests (the one from before the pre-load too: it is the function's worker now)
    worker.config.keep_alive_s = 0.5
    assert worker.run() == 0
    assert worker.served == 2 and before


def test_no_claim_while_the_function_has_a_worker(setup, redis_server: str) -> None:  # type: ignore[no-untyped-def]
    store, keys, engine, _ = setup
    store.run(workers.heartbeat(keys, "w-bound", "t/f", 60_000, {"state": "serving"}))
    standby = _standby(store, keys, engine)
    store.run(workers.send_control(keys, "w-claim", "preload", function="t/f", claim=1))
    thread, got = _waiting(standby)
    import time

    time.sleep(1.0)
    _request(keys, redis_server)
    time.sleep(1.0)
    assert thread.is_alive() and not standby.claimed, "a function with a live worker keeps it"
    store.run(workers.send_control(keys, "w-claim", "stop"))
    thread.join(10)
    assert got == [None]


def test_a_preload_without_claim_waits_for_the_bind(setup, redis_server: str) -> None:  # type: ignore[no-untyped-def]
    store, keys, engine, _ = setup
    standby = _standby(store, keys, engine)
    store.run(workers.send_control(keys, "w-claim", "preload", function="t/f"))
    thread, got = _waiting(standby)
    import time

    time.sleep(1.0)
    _request(keys, redis_server)
    time.sleep(1.0)
    assert thread.is_alive() and not standby.claimed
    store.run(workers.send_control(keys, "w-claim", "bind", function="t/f"))
    thread.join(10)
    assert got == ["t/f"] and not standby.claimed


def test_a_control_command_in_the_same_wake_goes_first(setup, redis_server: str) -> None:  # type: ignore[no-untyped-def]
    store, keys, engine, _ = setup
    standby = _standby(store, keys, engine)
    standby._preload_logged("t/f", claim=True)
    assert standby._watched() == "t/f"
    # both are there before the standby reads: the controller's bind to another function and a request
    store.run(workers.send_control(keys, "w-claim", "bind", function="t/g"))
    _request(keys, redis_server)
    assert standby.wait() == "t/g"
    assert not standby.claimed
    assert store.run(workers.live_workers(keys, "t/f", 5000, store.run(workers.server_time_ms()))) == []
