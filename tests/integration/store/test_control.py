"""lorafn.store.control against a real redis-server: the lease, lifecycle events, status, queue depths."""

from __future__ import annotations

import time
import uuid

import pytest

from lorafn.store import Keys, Store, control, streams, workers
from lorafn.store.protocol import RequestBody

FN = "team-a/f"


@pytest.fixture
def sk(redis_server: str):
    store = Store(redis_server)
    yield store, Keys(f"t{uuid.uuid4().hex[:8]}")
    store.close()


def test_one_lease_holder_until_it_expires(sk) -> None:
    store, keys = sk
    assert store.run(control.acquire_lease(keys, "a", 300))
    assert not store.run(control.acquire_lease(keys, "b", 300))
    assert store.run(control.acquire_lease(keys, "a", 300))  # renewal by the holder
    assert store.run(control.lease_holder(keys)) == "a"
    time.sleep(0.4)
    assert store.run(control.acquire_lease(keys, "b", 300))
    assert store.run(control.lease_holder(keys)) == "b"


def test_lifecycle_events_in_order_after_a_cursor(sk) -> None:
    store, keys = sk
    assert store.run(control.last_event_id(keys)) == "0-0"
    store.run(control.post_event(keys, control.BOUND, worker="w1", function=FN, ms=12.5))
    cursor = store.run(control.last_event_id(keys))
    store.run(control.post_event(keys, control.BIND_FAILED, worker="w2", function=FN, reason="bad"))
    events = store.run(control.read_events(keys, cursor))
    assert [e["kind"] for _, e in events] == [control.BIND_FAILED]
    assert events[0][1]["reason"] == "bad"
    everything = store.run(control.read_events(keys, "0-0"))
    assert [e["worker"] for _, e in everything] == ["w1", "w2"]


def test_status_fields_set_count_and_remove(sk) -> None:
    store, keys = sk
    store.run(control.set_status(keys, FN, wait_reason="no memory", last_cold_start_ms=41))
    assert store.run(control.record_start_failure(keys, FN, "oom", 7)) == 1
    assert store.run(control.record_start_failure(keys, FN, "bind failed", 9)) == 2
    store.run(control.set_status(keys, FN, wait_reason=None))
    got = store.run(control.statuses(keys, [FN, "x/y"]))
    assert got == {
        FN: {
            "last_cold_start_ms": "41",
            "start_failures": "2",
            "last_failure": "bind failed",
            "last_failure_at_ms": "9",
        },
        "x/y": {},
    }


def test_a_failed_start_writes_its_reason_before_its_count(sk) -> None:
    """A reader that polls the count (the gateway waiting on a cold start, the kmock operator test) must find
    the reason with it: the reason is queued first, in the same round trip."""
    store, keys = sk
    pipe = store.client.pipeline(transaction=False)
    control.record_start_failure(keys, FN, "oom", 7).build(pipe)
    assert [c[0][0] for c in pipe.command_stack] == ["HSET", "HINCRBY"]
    pipe.reset()


def test_queue_depth_counts_undelivered_entries(sk) -> None:
    store, keys = sk
    assert store.run(control.queue_depths(keys, [FN]))[FN].queued == 0  # no stream yet
    assert store.run(control.queue_depths(keys, [])) == {}
    for i in range(3):
        store.run(
            streams.admit(
                keys, FN, f"r{i}", RequestBody(prompt="x"), deadline_ms=0, now_s=time.time(),
                rate_limit_rps=0.0, rate_limit_burst=1, heartbeat_ttl_ms=1000,
            )
        )  # fmt: skip
    depth = store.run(control.queue_depths(keys, [FN]))[FN]
    assert (depth.length, depth.pending, depth.queued) == (3, 0, 3)
    time.sleep(0.25)
    store.run(streams.create_group(keys, FN))
    store.run(streams.read_requests(keys, FN, "w1", 2, None))
    depth = store.run(control.queue_depths(keys, [FN]))[FN]
    assert (depth.length, depth.pending, depth.queued) == (3, 2, 1)
    # the oldest undelivered entry (r2, admitted > 250 ms ago by Redis's clock) is what has waited
    server_ms = store.run(workers.server_time_ms())
    r2_ms = int(store.client.xrange(keys.requests(FN))[-1][0].split("-")[0])
    assert 250 <= depth.oldest_wait_ms <= server_ms - r2_ms + 5
    store.run(streams.read_requests(keys, FN, "w1", 1, None))
    assert store.run(control.queue_depths(keys, [FN]))[FN] == control.QueueDepth(3, 3, 0)  # none waits


def test_pool_and_gpu_inventory(sk) -> None:
    store, keys = sk
    key = control.pool_key("local/0", "llama", None)
    store.run(control.set_pool(keys, {key: 2}))
    assert store.run(control.pool(keys)) == {"local/0|llama|*": 2}
    store.run(control.set_pool(keys, {}))
    assert store.run(control.pool(keys)) == {}
    store.run(control.put_gpu(keys, "n1/0", "n1", 80 << 30, {"llama": 13 << 30}))
    assert store.run(control.gpus(keys)) == {
        "n1/0": {"node": "n1", "total_bytes": 80 << 30, "backbones": {"llama": 13 << 30}}
    }
