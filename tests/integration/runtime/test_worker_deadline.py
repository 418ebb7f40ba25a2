"""The serving loop hands the engine each online request's TTFT deadline (enqueue time + spec.slo.ttftMs, the
clock of the stream entry id) for the deadline order (docs/scheduler.md#deadline-order); batch requests get
none. A real worker (thread) on a real redis-server with a recording fake engine."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from lorafn.runtime.batching import BatchingConfig
from lorafn.store import Keys, Store
from lorafn.store.protocol import Done, RequestBody
from lorafn.store.streams import entry_ms
from tests.integration.gateway.harness import register, worker_thread
from tests.integration.runtime.test_worker_admission import PrefillEngine, _final, _spec


@dataclass
class DeadlineEngine(PrefillEngine):
    deadlines: dict[str, float | None] = field(default_factory=dict)

    def set_deadline(self, request_id: str, deadline_s: float | None) -> None:
        assert request_id in self.reqs  # after add_request: the scheduler knows the request
        self.deadlines[request_id] = deadline_s


def _send(store: Store, keys: Keys, function: str, rid: str, **params: Any) -> str:
    body = RequestBody(prompt="hi", params={"max_tokens": 2, **params}).encode()  # type: ignore[arg-type]
    return store.client.xadd(keys.requests(function), {"rid": rid, "body": body, "deadline": "0"})


def test_online_requests_get_enqueue_time_plus_the_ttft_slo_batch_requests_none(redis_server: str) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    store, keys = Store(redis_server), Keys(prefix)
    register(store, keys, "t/f", [], spec=_spec(300), public=True)
    engine = DeadlineEngine()
    with worker_thread(redis_server, prefix, "t/f", engine, batching=BatchingConfig(batch_hold=False)):
        online = _send(store, keys, "t/f", "on-1")
        batch = _send(store, keys, "t/f", "batch-1", priority=1)
        assert isinstance(_final(store, keys, "on-1"), Done)
        assert isinstance(_final(store, keys, "batch-1"), Done)
    assert engine.deadlines["on-1"] == (entry_ms(online) + 300) / 1000
    assert "batch-1" not in engine.deadlines and entry_ms(batch) > 0
