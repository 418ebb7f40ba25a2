"""Idle work of a lazily started worker (`EngineConfig.lazy_graphs`: decode graphs captured after the first
request, in idle time): one piece per idle loop iteration, each after a read that barely waits, so a
request that arrives meanwhile is answered before the remaining pieces; none once the engine says it is
done; none while a request runs. Real redis-server, the gateway over real HTTP, a fake engine."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from lorafn.store import Keys, Store
from tests.integration.gateway.harness import (
    FakeEngine,
    client,
    expected_text,
    gateway,
    register,
    worker_thread,
)

FN, KEY = "team-a/lazy", "sk-lazy-0123456789"


@dataclass
class PiecewiseEngine(FakeEngine):
    """A fake engine with `pieces` of idle work (0.2 s each), recording when each ran and whether a request
    was running then."""

    pieces: int = 6
    done: list[tuple[float, int]] = field(default_factory=list)
    calls_after_done: int = 0

    def capture_pending_graph(self) -> bool:
        if len(self.done) >= self.pieces:
            self.calls_after_done += 1
            return False
        time.sleep(0.2)
        self.done.append((time.monotonic(), len(self.reqs)))
        return True


def test_idle_work_goes_piece_by_piece_between_reads_and_yields_to_a_request(redis_server: str) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    store, keys = Store(redis_server), Keys(prefix)
    register(store, keys, FN, [KEY])
    engine = PiecewiseEngine()
    with gateway(redis_server, prefix) as url, worker_thread(redis_server, prefix, FN, engine=engine):
        deadline = time.monotonic() + 10
        while not engine.done:  # idle work has begun
            assert time.monotonic() < deadline, "no idle work done"
            time.sleep(0.01)
        body = {"model": FN, "prompt": "while idle", "max_tokens": 4}
        r = client(url, KEY).post("/v1/completions", json=body, timeout=30)
        answered_at = time.monotonic()
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected_text("while idle", 4)
        # answered while pieces were left: the request waited for at most the piece under way
        assert len([t for t, _ in engine.done if t <= answered_at]) < engine.pieces
        deadline = time.monotonic() + 10
        while engine.calls_after_done == 0:
            assert time.monotonic() < deadline, "the idle work never finished"
            time.sleep(0.05)
        time.sleep(0.3)
    assert len(engine.done) == engine.pieces
    assert engine.calls_after_done == 1  # asked once more, told none is left, never again
    assert all(running == 0 for _, running in engine.done)  # never while a request ran
