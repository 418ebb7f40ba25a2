"""Decode gating in the serving loop, with real workers (threads) on a real redis-server and the fake
engine of test_worker_admission (prefills and decodes take time): while a tight function's urgent
prefill runs, the other functions' workers pause their decode steps (each pause bounded by their TPOT
slack and ended by the urgent worker's release), the tight worker never pauses, nothing is lost, and
the counters in Redis match the workers'. A worker alone on its GPU makes no gating command at all,
and the urgent-grant read only ever rides on a round trip the loop makes anyway."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from lorafn.runtime.batching import BatchingConfig
from lorafn.runtime.worker import ServingConfig, Worker
from lorafn.store import Keys, Op, Store, streams
from lorafn.store import admission as adm
from lorafn.store.protocol import Done
from tests.integration.gateway.harness import register
from tests.integration.runtime.test_worker_admission import PrefillEngine, _final, _send, _spec, _wait

GPU = "sim/0"
GATING_KEYS = (":urgent", ":paused", ":gatewake:")


class CountingStore(Store):
    """A Store that records, for each round trip, the commands it carried (EVAL as `EVAL:<op>`) and
    whether `busy()` said the worker had work then."""

    def __init__(self, url: str, busy: Callable[[], bool]) -> None:
        super().__init__(url)
        self.busy = busy
        self.trips: list[tuple[bool, list[str]]] = []

    def run(self, op: Op[Any]) -> Any:
        pipe = self.client.pipeline(transaction=False)
        op.build(pipe)
        names = []
        for args, _ in pipe.command_stack:
            name = str(args[0]).upper()
            if name == "EVAL":
                name = f"EVAL:{args[3 + int(args[2])]}"  # the script's op (its first ARGV)
            elif len(args) > 1 and any(k in str(args[1]) for k in GATING_KEYS):
                name = f"{name}:{next(k for k in GATING_KEYS if k in str(args[1])).strip(':')}"
            names.append(name)
        self.trips.append((self.busy(), names))
        return op.parse(pipe.execute())


@contextmanager
def counted_worker(
    redis_url: str, prefix: str, function: str, engine: PrefillEngine, cfg: BatchingConfig
) -> Iterator[Worker]:
    store = CountingStore(redis_url, lambda: bool(engine.reqs))
    w = Worker(store, Keys(prefix), engine, ServingConfig(function=function, block_ms=100, batching=cfg))
    thread = threading.Thread(target=w.run, daemon=True)
    thread.start()
    try:
        yield w
    finally:
        w.drain()
        thread.join(timeout=10)


def _config(**kw: Any) -> BatchingConfig:
    return BatchingConfig(
        **{
            "gpu": GPU,
            "gpu_admission": True,
            "decode_gating": True,
            "batch_hold": False,
            "warmup_steps": 0,
            **kw,
        }
    )


def _gating_commands(store: Store) -> list[str]:
    assert isinstance(store, CountingStore)
    return [
        n for _, names in store.trips for n in names if n == "EVAL:gate" or n.endswith(("urgent", "gatewake"))
    ]


def test_other_workers_pause_their_decodes_for_an_urgent_prefill_and_nothing_is_lost(
    redis_server: str,
) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    store, keys = Store(redis_server), Keys(prefix)
    register(store, keys, "t/tight", [], spec=_spec(300), public=True)
    register(store, keys, "t/loose-a", [], spec=_spec(20_000), public=True)
    register(store, keys, "t/loose-b", [], spec=_spec(20_000), public=True)
    engines = {
        fn: PrefillEngine(prefill_s=0.15, decode_s=0.01) for fn in ("t/tight", "t/loose-a", "t/loose-b")
    }
    # a generous TPOT (no spec.slo.tpotMs): every pause ends at the urgent worker's release, not at its bound
    cfg = _config(gate_tpot_ms=5000.0)
    with (
        counted_worker(redis_server, prefix, "t/tight", engines["t/tight"], cfg) as tight,
        counted_worker(redis_server, prefix, "t/loose-a", engines["t/loose-a"], cfg) as loose_a,
        counted_worker(redis_server, prefix, "t/loose-b", engines["t/loose-b"], cfg) as loose_b,
    ):
        _send(store, keys, "t/tight", "tight-warm", max_tokens=2)  # its prefill profile: T(1) ~ 150 ms
        assert isinstance(_final(store, keys, "tight-warm"), Done)
        assert not any(g.urgent for g in store.run(adm.grants(keys, GPU)))  # alone: M = 1, margin ~150
        _send(store, keys, "t/loose-a", "loose-a-1", max_tokens=200)
        _send(store, keys, "t/loose-b", "loose-b-1", max_tokens=200)
        # both decode, and each knows from its active mark that another worker is active on the GPU
        _wait(lambda: loose_a.batching._others_active and loose_b.batching._others_active)
        for i in range(3):
            _send(store, keys, "t/tight", f"tight-{i}", max_tokens=2)
            assert isinstance(_final(store, keys, f"tight-{i}"), Done)
        finals = {rid: _final(store, keys, rid, timeout=60) for rid in ("loose-a-1", "loose-b-1")}
        assert all(isinstance(e, Done) and e.completion_tokens == 200 for e in finals.values()), finals

        grants = [g for g in store.run(adm.grants(keys, GPU)) if g.function == "t/tight"]
        assert any(g.urgent for g in grants)  # M = 3 x T(1) ~ 450 ms > its 300 ms SLO: urgent
        gated = [w.batching.gate for w in (loose_a, loose_b)]
        assert sum(g.gated_steps for g in gated) >= 1, "no decode step paused for the urgent prefill"
        assert tight.batching.gate.gated_steps == 0  # the urgent worker itself never pauses
        for w in (loose_a, loose_b):
            for step in w.batching.gated_log:
                assert step.bound_ms <= 5000.0  # the TPOT slack: gate_tpot_ms - T_decode(b)
                assert step.woken  # ended by the urgent worker's release, not by its bound
            assert w.batching.gate.timeouts == 0
        # the counters in Redis are the workers' (sent on their next round trip)
        want = sum(g.gated_steps for g in gated)
        _wait(lambda: store.run(adm.gating_counters(keys, GPU))["gated_steps"] == want)
        counters = store.run(adm.gating_counters(keys, GPU))
        assert counters["urgent_grants"] >= 1 and counters["timeouts"] == 0
        assert counters["gated_steps|t/loose-a"] + counters["gated_steps|t/loose-b"] == want
        # the urgent-grant read rides on the round trip after a step, never one of its own
        for w in (loose_a, loose_b):
            assert isinstance(w.store, CountingStore)
            reads = [names for _, names in w.store.trips if "HGETALL:urgent" in names]
            assert reads and all(len(names) > 1 for names in reads)
            gates = [names for _, names in w.store.trips if "EVAL:gate" in names]
            assert len(gates) >= w.batching.gate.gated_steps  # one round trip per pause, no more
            assert len(gates) <= len(engines[w.function].steps)  # at most one per step
        for fn in engines:
            assert store.run(streams.pending(keys, fn, 0)) == []


def test_a_worker_alone_on_its_gpu_makes_no_gating_command(redis_server: str) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    store, keys = Store(redis_server), Keys(prefix)
    register(store, keys, "t/alone", [], spec=_spec(300), public=True)
    engine = PrefillEngine(prefill_s=0.05, decode_s=0.005)
    with counted_worker(redis_server, prefix, "t/alone", engine, _config()) as worker:
        for i in range(3):
            _send(store, keys, "t/alone", f"a-{i}", max_tokens=40)
            assert isinstance(_final(store, keys, f"a-{i}"), Done)
        assert worker.batching.urgent_reads == 0 and _gating_commands(worker.store) == []
        assert worker.batching.gate.gated_steps == 0
        # round trips while it had work: one per engine step (the read after it, which also carries the
        # control read every control_poll_ms) and one per ask, plus the odd claim sweep (every second):
        # nothing per decode step for gating, and no round trip of its own for control
        busy_trips = sum(1 for busy, _ in worker.store.trips if busy)
        asks = worker.batching.granted + worker.batching.refused
        assert busy_trips <= len(engine.steps) + asks + 4, (busy_trips, len(engine.steps), asks)
    assert store.run(adm.gating_counters(keys, GPU))["gated_steps"] == 0
