"""Parking a bound worker (docs/runtime.md#parking, issue 16), with a real redis-server.

- A real worker process (`lorafn worker serve`, the real Engine on a tiny random Llama, CPU): `park` ->
  a `parked` lifecycle event with the released bytes and heartbeats with parked=1, kv_bytes=0; a request
  sent while parked stays queued (not delivered to the parked worker) and demand is recorded for its
  function (reason "parked"); `unpark` -> `unparked` with the KV bytes, and the queued request is answered
  with the same text as the same prompt before the park (greedy).
- The serving loop in a thread with a fake engine that can park: a park while a request runs is refused
  (`park_refused`, reason busy) and the request still finishes; a park once it is done succeeds; parking a
  parked worker and unparking an unparked one answer again; `stop` ends a parked worker, and so does
  keep-alive: the function's, or the park command's own `keep_alive_s` (the controller's parked keep-alive;
  "inf": never) while parked, the function's again after unpark; a bad `keep_alive_s` keeps the function's.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from lorafn.runtime.outputs import ParkRefused, StreamDelta
from lorafn.runtime.worker import ServingConfig, Worker
from lorafn.store import Keys, Store, control, stats, streams, workers
from lorafn.store.protocol import Done, RequestBody, SamplingWire
from tests.integration.gateway.harness import (
    FakeEngine,
    register,
    start_worker_process,
    stop_process,
    wait_live_workers,
)
from tests.waits import until as _until

FN = "team-a/parking"
WAIT_S = 60  # generous bound of every wait (a loaded 2-core VM); no assertion is on time


def _send(
    store: Store, keys: Keys, rid: str, prompt: str, max_tokens: int = 8, stop_token: int | None = None
) -> None:
    stop = [] if stop_token is None else [stop_token]
    body = RequestBody(
        prompt=prompt, params=SamplingWire(max_tokens=max_tokens, temperature=0.0, stop_token_ids=stop)
    )
    admitted = store.run(
        streams.admit(
            keys, FN, rid, body, deadline_ms=0, now_s=time.time(), rate_limit_rps=0.0,
            rate_limit_burst=1, heartbeat_ttl_ms=5000,
        )
    )  # fmt: skip
    assert admitted.status == "ok", admitted


def _answer(store: Store, keys: Keys, rid: str) -> tuple[str, Done]:
    """The request's text and its `done` event (waits for it)."""
    text, cursor = "", "0"
    while True:
        events = store.run(streams.read_replies(keys, rid, cursor, block_ms=WAIT_S * 1000))
        assert events, f"no reply for {rid}"
        for cursor, _worker, event in events:  # noqa: B007 - the last id is the next cursor
            if event.type == "delta":
                text += event.text
            elif event.type == "done":
                return text, event
            elif event.type == "error":
                raise AssertionError(f"{rid} ended with {event}")


class _Events:
    """The lifecycle stream read from where it ended when made."""

    def __init__(self, store: Store, keys: Keys) -> None:
        self.store, self.keys = store, keys
        self.cursor = store.run(control.last_event_id(keys))
        self.seen: list[dict[str, str]] = []

    def next(self, kind: str, worker: str) -> dict[str, str]:
        def probe() -> dict[str, str] | None:
            for entry_id, event in self.store.run(control.read_events(self.keys, self.cursor)):
                self.cursor = entry_id
                self.seen.append(event)
            for i, event in enumerate(self.seen):
                if event.get("kind") == kind and event.get("worker") == worker:
                    return self.seen.pop(i)
            return None

        return _until(f"a {kind} event of {worker}", probe)


def _heartbeat(store: Store, keys: Keys, wid: str) -> dict[str, str]:
    return store.run(workers.worker_info(keys, [wid])).get(wid, {})


@pytest.mark.parametrize("overlap", ["false", "true"], ids=["steps-one-at-a-time", "overlapped"])
def test_a_parked_worker_process_keeps_requests_queued_records_demand_and_answers_after_unpark(
    redis_server: str, tiny_model_dir: Path, tmp_path: Path, overlap: str
) -> None:
    """Also with overlapped steps (the CUDA default): a request ended by a stop string leaves a step queued
    whose only row is its own, dropped; the idle worker still parks."""
    prefix = f"t{uuid.uuid4().hex[:8]}"
    store, keys = Store(redis_server), Keys(prefix)
    register(store, keys, FN, [], model_dir=str(tiny_model_dir))
    wid = "parking-worker-1"
    proc = start_worker_process(
        redis_server, prefix, FN, tmp_path / "worker.log",
        LORAFN_ENGINE_FACTORY="", LORAFN_WORKER_ID=wid, LORAFN_GPU="local/0",
        LORAFN_KEEP_ALIVE_SECONDS="600", LORAFN_DEVICE="cpu", LORAFN_OVERLAP_STEPS=overlap,
    )  # fmt: skip
    try:
        wait_live_workers(None, store, keys, FN, 1, timeout=WAIT_S)
        prompt = "The quick brown fox jumps over"
        _send(store, keys, "before", prompt)
        before, done = _answer(store, keys, "before")
        assert done.completion_tokens == 8 and before
        # the same greedy tokens as the worker's engine: the third ends the next request
        from lorafn.runtime import Engine, EngineConfig, SamplingParams

        tokens = (
            Engine(EngineConfig(model=tiny_model_dir, device="cpu"))
            .generate(prompt, SamplingParams(max_tokens=8, temperature=0.0))[0]
            .token_ids
        )
        _send(store, keys, "stopped", prompt, max_tokens=16, stop_token=tokens[2])
        _stopped, done = _answer(store, keys, "stopped")
        assert done.finish_reason == "stop" and done.completion_tokens == tokens.index(tokens[2]) + 1
        beat = _until("a heartbeat with parking fields", lambda: _heartbeat(store, keys, wid).get("parked"))
        assert beat == "0"

        events = _Events(store, keys)
        store.run(workers.send_control(keys, wid, "park"))
        parked = events.next(control.PARKED, wid)
        assert parked["function"] == FN and parked["gpu"] == "local/0"
        released = int(parked["released_bytes"])
        assert released > 0
        hb = _until(
            "a parked heartbeat", lambda: (h := _heartbeat(store, keys, wid)).get("parked") == "1" and h
        )
        assert hb["kv_bytes"] == "0" and int(hb["park_release_bytes"]) == released  # what unpark takes back
        demand_from = _until("the demand stream's end", lambda: store.run(_last_demand_id(keys)))

        _send(store, keys, "while-parked", prompt)
        demand = _until(
            "demand recorded by the parked worker",
            lambda: [
                f for _, f in store.run(streams.read_demand(keys, demand_from, None)) if f["function"] == FN
            ],
        )
        assert demand[0]["reason"] == "parked"
        depth = store.run(control.queue_depths(keys, [FN]))[FN]
        assert depth.queued == 1 and depth.pending == 0  # still queued: the parked worker did not take it
        assert store.run(streams.read_replies(keys, "while-parked", "0", None)) == []

        store.run(workers.send_control(keys, wid, "park"))  # parked again: the same answer
        assert int(events.next(control.PARKED, wid)["released_bytes"]) == released
        store.run(workers.send_control(keys, wid, "unpark"))
        unparked = events.next(control.UNPARKED, wid)
        assert int(unparked["kv_bytes"]) == released  # on CPU the KV cache is what parking released
        after, done = _answer(store, keys, "while-parked")
        assert after == before and done.completion_tokens == 8  # the same greedy tokens as before parking
        _until("an unparked heartbeat", lambda: _heartbeat(store, keys, wid).get("parked") == "0")
        assert int(_heartbeat(store, keys, wid)["kv_bytes"]) == released
        store.run(workers.send_control(keys, wid, "unpark"))  # unparked already: answers with its KV bytes
        assert int(events.next(control.UNPARKED, wid)["kv_bytes"]) == released
        assert proc.poll() is None  # the same process throughout
    finally:
        code = stop_process(proc)
    assert code == 0, (tmp_path / "worker.log").read_text()[-3000:]
    log = (tmp_path / "worker.log").read_text()
    assert f"worker {wid} parked: released {released} bytes" in log
    assert f"worker {wid} unparked: KV cache of {released} bytes" in log


def _last_demand_id(keys: Keys) -> Any:
    from lorafn.store.client import Op

    return Op(lambda pipe: pipe.xrevrange(keys.demand(), count=1), lambda r: r[0][0][0] if r[0] else "0-0")


@dataclass
class ParkableEngine(FakeEngine):
    """A fake engine that parks (release_bytes while unparked) and whose requests run until `finish` is
    set; it records the calls."""

    release: int = 1000
    finish: threading.Event = field(default_factory=threading.Event)
    is_parked: bool = False
    calls: list[str] = field(default_factory=list)

    @property
    def parked(self) -> bool:
        return self.is_parked

    def park(self) -> int:
        self.calls.append("park")
        if self.reqs:
            raise ParkRefused("busy in the engine")
        self.is_parked = True
        return self.release

    def unpark(self) -> int:
        self.calls.append("unpark")
        self.is_parked = False
        return self.release // 2

    def park_release_bytes(self) -> int:
        return self.release

    def add_request(self, prompt: str | list[int], params: Any, request_id: str | None = None) -> str:
        assert not self.is_parked, "a request reached a parked engine"
        return super().add_request(prompt, params, request_id)

    def step(self) -> list[StreamDelta]:
        if not self.finish.is_set():  # the request runs on: one step of nothing
            time.sleep(0.01)
            return []
        return super().step()


def test_park_is_refused_while_busy_and_answered_again_when_parked(redis_server: str) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    store, keys = Store(redis_server), Keys(prefix)
    register(store, keys, FN, [])
    engine = ParkableEngine()
    config = ServingConfig(
        function=FN, block_ms=100, heartbeat_s=0.2, heartbeat_ttl_s=2.0, keep_alive_s=None,
        heartbeat_fields={"gpu": "g0"},
    )  # fmt: skip
    worker = Worker(Store(redis_server), keys, engine, config)
    wid = worker.worker_id
    result: dict[str, int] = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", worker.run()), daemon=True)
    thread.start()
    try:
        events = _Events(store, keys)
        _send(store, keys, "long", "runs until told")
        _until("the request running", lambda: engine.reqs)
        store.run(workers.send_control(keys, wid, "park"))
        refused = events.next(control.PARK_REFUSED, wid)
        assert refused["reason"] == "busy: 1 running" and refused["gpu"] == "g0"
        assert "park" not in engine.calls and not worker.parked  # the worker refused; the engine untouched
        engine.finish.set()
        text, _ = _answer(store, keys, "long")  # the refused park changed nothing: it finishes
        assert text

        store.run(workers.send_control(keys, wid, "park"))
        assert events.next(control.PARKED, wid)["released_bytes"] == "1000"
        hb = _until(
            "a parked heartbeat", lambda: (h := _heartbeat(store, keys, wid)).get("parked") == "1" and h
        )
        assert hb["park_release_bytes"] == "1000"
        store.run(workers.send_control(keys, wid, "park"))
        assert events.next(control.PARKED, wid)["released_bytes"] == "1000"
        store.run(workers.send_control(keys, wid, "unpark"))
        assert events.next(control.UNPARKED, wid)["kv_bytes"] == "500"
        store.run(workers.send_control(keys, wid, "unpark"))
        assert events.next(control.UNPARKED, wid)["kv_bytes"] == "500"
        assert not worker.parked

        store.run(workers.send_control(keys, wid, "park"))
        events.next(control.PARKED, wid)
        store.run(workers.send_control(keys, wid, "stop"))  # a parked worker stops as any idle one
        thread.join(timeout=WAIT_S)
        assert result.get("code") == 0
        counters = store.run(stats.counters(keys, FN))
        assert counters.get("parks") == 2 and counters.get("unparks") == 1
    finally:
        worker.drain()
        thread.join(timeout=10)


def test_a_park_that_the_engine_refuses_is_answered_with_its_reason(redis_server: str) -> None:
    """The engine's own refusal (ParkRefused: e.g. graph archives) reaches the controller as the reason."""

    @dataclass
    class Archived(ParkableEngine):
        def park(self) -> int:
            raise ParkRefused("graph archives")

    prefix = f"t{uuid.uuid4().hex[:8]}"
    store, keys = Store(redis_server), Keys(prefix)
    register(store, keys, FN, [])
    engine = Archived()
    worker = Worker(Store(redis_server), keys, engine, ServingConfig(function=FN, heartbeat_s=0.2))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        _until("the worker's first heartbeat", lambda: _heartbeat(store, keys, worker.worker_id))
        events = _Events(store, keys)  # (a command sent before the loop starts is never read)
        store.run(workers.send_control(keys, worker.worker_id, "park"))
        assert events.next(control.PARK_REFUSED, worker.worker_id)["reason"] == "graph archives"
        assert not worker.parked
    finally:
        worker.drain()
        thread.join(timeout=10)


def test_keep_alive_still_ends_a_parked_worker(redis_server: str) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    store, keys = Store(redis_server), Keys(prefix)
    register(store, keys, FN, [])
    engine = ParkableEngine()
    worker = Worker(
        Store(redis_server), keys, engine, ServingConfig(function=FN, heartbeat_s=0.2, keep_alive_s=3.0)
    )
    result: dict[str, int] = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", worker.run()), daemon=True)
    thread.start()
    try:
        _until("the worker's first heartbeat", lambda: _heartbeat(store, keys, worker.worker_id))
        events = _Events(store, keys)
        store.run(workers.send_control(keys, worker.worker_id, "park"))
        events.next(control.PARKED, worker.worker_id)
        thread.join(timeout=WAIT_S)
        assert result.get("code") == 0 and worker.parked  # it exited parked, on its own
        assert _heartbeat(store, keys, worker.worker_id) == {}  # and deregistered
        assert engine.calls == ["park"]
    finally:
        worker.drain()
        thread.join(timeout=10)


class _Clock:
    """The worker's clock: monotonic plus an offset a test moves forward (keep-alive without waiting)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


def _clocked_worker(redis_server: str, keep_alive_s: float) -> tuple[Store, Keys, Worker, _Clock, Any, dict]:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    store, keys = Store(redis_server), Keys(prefix)
    register(store, keys, FN, [])
    clock = _Clock()
    config = ServingConfig(function=FN, heartbeat_s=0.2, keep_alive_s=keep_alive_s)
    worker = Worker(Store(redis_server), keys, ParkableEngine(), config, clock=clock)
    result: dict[str, int] = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", worker.run()), daemon=True)
    thread.start()
    _until("the worker's first heartbeat", lambda: _heartbeat(store, keys, worker.worker_id))
    return store, keys, worker, clock, thread, result


def _alive_answer(events: _Events, kind: str, worker: Worker, thread: threading.Thread) -> dict[str, str]:
    """The worker's next `kind` event; fails at once when the worker exited instead."""

    def probe() -> dict[str, str] | None:
        for entry_id, event in events.store.run(control.read_events(events.keys, events.cursor)):
            events.cursor = entry_id
            events.seen.append(event)
        for i, event in enumerate(events.seen):
            if event.get("kind") == kind and event.get("worker") == worker.worker_id:
                return events.seen.pop(i)
        assert thread.is_alive(), f"the worker exited before answering {kind}"
        return None

    return _until(f"a {kind} event of {worker.worker_id}", probe)


def test_a_park_commands_keep_alive_replaces_the_functions_while_parked(redis_server: str) -> None:
    """keep_alive_s "inf": a parked worker idle far beyond its function's keep-alive (3 s) stays; unparked,
    the function's keep-alive applies again. A longer finite one (1000 s): it stays past 3 s and exits,
    parked, past 1000 s."""
    store, keys, worker, clock, thread, result = _clocked_worker(redis_server, keep_alive_s=3.0)
    wid = worker.worker_id
    try:
        events = _Events(store, keys)
        store.run(workers.send_control(keys, wid, "park", keep_alive_s="inf"))
        events.next(control.PARKED, wid)
        clock.offset += 1e9  # idle for 30 years
        # a second park (answered again) and then an unpark: the loop went through its keep-alive check
        # at least once after the jump between the two answers, and the worker is still there
        store.run(workers.send_control(keys, wid, "park", keep_alive_s="inf"))
        _alive_answer(events, control.PARKED, worker, thread)
        store.run(workers.send_control(keys, wid, "unpark"))
        _alive_answer(events, control.UNPARKED, worker, thread)
        assert worker._keep_alive_s() == 3.0  # unparked: the function's again

        store.run(workers.send_control(keys, wid, "park", keep_alive_s="1000"))
        _alive_answer(events, control.PARKED, worker, thread)
        clock.offset += 500.0  # past the function's 3 s, before the parked 1000 s
        store.run(workers.send_control(keys, wid, "park", keep_alive_s="1000"))
        _alive_answer(events, control.PARKED, worker, thread)
        store.run(workers.send_control(keys, wid, "park", keep_alive_s="1000"))
        _alive_answer(events, control.PARKED, worker, thread)
        clock.offset += 600.0  # past 1000 s since the unpark
        thread.join(timeout=WAIT_S)
        assert result.get("code") == 0 and worker.parked  # it exited parked, at its parked keep-alive
        assert _heartbeat(store, keys, wid) == {}
    finally:
        worker.drain()
        thread.join(timeout=10)


@pytest.mark.parametrize("bad", ["soon", "-5", "nan", ""])
def test_a_bad_park_keep_alive_keeps_the_functions(redis_server: str, bad: str) -> None:
    """A park command whose keep_alive_s is no number of seconds >= 0 parks all the same (no crash), and the
    parked worker exits at its function's keep-alive."""
    store, keys, worker, clock, thread, result = _clocked_worker(redis_server, keep_alive_s=3.0)
    try:
        events = _Events(store, keys)
        store.run(workers.send_control(keys, worker.worker_id, "park", keep_alive_s=bad))
        assert events.next(control.PARKED, worker.worker_id)["released_bytes"] == "1000"
        assert worker._keep_alive_s() == 3.0
        clock.offset += 10.0
        thread.join(timeout=WAIT_S)
        assert result.get("code") == 0 and worker.parked  # exited parked, at the function's keep-alive
    finally:
        worker.drain()
        thread.join(timeout=10)
