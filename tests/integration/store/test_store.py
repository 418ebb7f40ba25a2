"""lorafn.store against a real redis-server: Lua scripts, registry, worker liveness, claiming."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import redis

from lorafn.store import AsyncStore, Keys, Store, combine, stats, streams, workers
from lorafn.store import registry as reg
from lorafn.store.protocol import RequestBody

FN = "team-a/f"


@pytest.fixture
def sk(redis_server: str):
    store = Store(redis_server)
    yield store, Keys(f"t{uuid.uuid4().hex[:8]}")
    store.close()


def _admit(store, keys, rid, rps=0.0, burst=1, max_queue=0, ttl_ms=1000):
    return store.run(
        streams.admit(
            keys,
            FN,
            rid,
            RequestBody(prompt="x"),
            deadline_ms=0,
            now_s=time.time(),
            rate_limit_rps=rps,
            rate_limit_burst=burst,
            heartbeat_ttl_ms=ttl_ms,
            max_queue=max_queue,
        )
    )


def test_token_bucket_limits_bursts_and_refills(sk) -> None:
    store, keys = sk
    got = [_admit(store, keys, f"r{i}", rps=10.0, burst=3).status for i in range(5)]
    assert got == ["ok", "ok", "ok", "rate_limited", "rate_limited"]
    limited = _admit(store, keys, "r5", rps=10.0, burst=3)
    assert 0 < limited.retry_after_ms <= 100
    time.sleep(0.25)  # 2.5 tokens back
    assert [_admit(store, keys, f"s{i}", rps=10.0, burst=3).status for i in range(3)] == [
        "ok",
        "ok",
        "rate_limited",
    ]
    counts = store.run(stats.counters(keys, FN))
    assert counts["requests"] == 5 and counts["rate_limited"] == 4
    assert sum(store.run(stats.arrivals(keys, FN, time.time(), 60))) == 5


def test_queue_cap_and_cold_counting(sk) -> None:
    store, keys = sk
    assert [_admit(store, keys, f"r{i}", max_queue=2).status for i in range(3)] == ["ok", "ok", "queue_full"]
    assert store.run(stats.counters(keys, FN))["cold_requests"] == 2
    store.run(workers.heartbeat(keys, "w1", FN, 1000, {}))
    assert _admit(store, keys, "live", max_queue=0).live_workers == 1


def test_demand_is_deduplicated(sk) -> None:
    store, keys = sk
    first = store.run(streams.record_demand(keys, FN, "request", guard_ms=200))
    assert first is not None
    assert store.run(streams.record_demand(keys, FN, "request", guard_ms=200)) is None
    time.sleep(0.25)
    assert store.run(streams.record_demand(keys, FN, "waiting", guard_ms=200)) is not None
    entries = store.run(streams.read_demand(keys, "0", None))
    assert [(e["function"], e["reason"]) for _, e in entries] == [(FN, "request"), (FN, "waiting")]


def test_heartbeats_expire_and_deregister(sk) -> None:
    store, keys = sk
    store.run(workers.heartbeat(keys, "w1", FN, 300, {"pid": 1}))
    assert store.run(workers.count_live_workers(keys, FN, 300)) == 1
    info = store.run(workers.worker_info(keys, store.run(workers.worker_ids(keys))))
    assert info["w1"]["function"] == FN and info["w1"]["pid"] == "1"
    time.sleep(0.4)
    assert store.run(workers.count_live_workers(keys, FN, 300)) == 0
    assert store.run(workers.worker_info(keys, ["w1"])) == {}  # the hash expired
    store.run(workers.heartbeat(keys, "w2", FN, 5000, {}))
    assert store.run(workers.count_live_workers(keys, FN, 300)) == 1
    store.run(workers.deregister(keys, "w2", FN))
    assert store.run(workers.count_live_workers(keys, FN, 300)) == 0


def test_api_keys_open_one_function_and_are_replaced(sk) -> None:
    store, keys = sk
    salt = store.run(reg.ensure_salt(keys))
    assert store.run(reg.ensure_salt(keys)) == salt
    h1, h2 = reg.hash_api_key(salt, "k1"), reg.hash_api_key(salt, "k2")
    store.run(reg.put_function(keys, reg.FunctionRecord(FN, {"a": 1})))
    store.run(reg.set_api_keys(keys, FN, [h1]))
    with pytest.raises(redis.ResponseError, match="API_KEY_TAKEN"):
        store.run(reg.set_api_keys(keys, "team-b/g", [h1]))
    store.run(reg.set_api_keys(keys, FN, [h2]))  # replacing revokes k1
    assert store.run(combine(reg.lookup_api_key(keys, h1), reg.lookup_api_key(keys, h2))) == (None, FN)
    with pytest.raises(ValueError, match="plaintext"):
        reg.set_api_keys(keys, FN, ["k1"])
    assert store.run(reg.delete_function(keys, FN)) is True
    assert store.run(reg.lookup_api_key(keys, h2)) is None
    assert store.run(reg.list_functions(keys)) == []


def test_claiming_from_a_dead_consumer_has_one_winner(sk) -> None:
    store, keys = sk
    _admit(store, keys, "r1")
    store.run(streams.create_group(keys, FN))
    with pytest.raises(redis.ResponseError, match="BUSYGROUP"):
        store.run(streams.create_group(keys, FN))
    ((entry_id, fields),) = store.run(streams.read_requests(keys, FN, "dead", 10, None))
    assert fields["rid"] == "r1"
    time.sleep(0.05)
    pending = store.run(streams.pending(keys, FN, 20))
    assert [(p.entry_id, p.consumer, p.deliveries) for p in pending] == [(entry_id, "dead", 1)]
    won = store.run(streams.claim(keys, FN, "w1", 20, [entry_id]))
    lost = store.run(streams.claim(keys, FN, "w2", 20, [entry_id]))  # idle was reset by the first claim
    assert [e for e, _ in won] == [entry_id] and lost == []
    store.run(streams.ack(keys, FN, [entry_id]))
    assert store.run(streams.pending(keys, FN, 0)) == []


def test_async_store_runs_the_same_operations(redis_server: str) -> None:
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")

    async def main() -> tuple:
        store = AsyncStore(redis_server)
        try:
            await store.run(reg.put_function(keys, reg.FunctionRecord(FN, {"x": 1}, model_dir="/m")))
            return await store.run(combine(reg.get_function(keys, FN), reg.list_functions(keys)))
        finally:
            await store.close()

    record, names = asyncio.run(main())
    assert record.model_dir == "/m" and names == [FN]
