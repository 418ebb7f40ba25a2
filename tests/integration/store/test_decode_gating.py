"""Decode gating in Redis (lua/gpu_admission.lua through lorafn.store.admission), on a real redis-server:
a grant is marked urgent as `lorafn.runtime.slo.is_urgent` decides; a paused worker blocks until the last
live urgent grant ends (release, or `urgent_end` of a kept share) or its own bound passes, and returns at
once when nothing urgent is live; a dead urgent holder's mark ends with its lease; the counters add up."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lorafn.runtime import slo
from lorafn.store import Keys, Store
from lorafn.store import admission as adm

GPU = "local/0"


def _fresh(redis_server: str) -> tuple[Store, Keys]:
    return Store(redis_server), Keys(f"t{uuid.uuid4().hex[:8]}")


def _now_ms(store: Store) -> float:
    sec, usec = store.client.time()
    return sec * 1000 + usec // 1000


def _ask(
    store: Store, keys: Keys, worker: str, deadline: float, t: float = 10.0, **kw: Any
) -> adm.SlotAnswer:
    args = {"lease_ms": 5000.0, "waiter_ttl_ms": 5000.0, "active_ttl_ms": 5000.0, **kw}
    return store.run(adm.ask(keys, GPU, worker, f"ns/{worker}", deadline_ms=deadline, t_ms=t, **args))


def _gate_in_thread(
    redis_server: str, keys: Keys, worker: str, bound_s: float
) -> tuple[threading.Thread, dict]:
    out: dict[str, Any] = {}

    def run() -> None:
        started = time.monotonic()
        out["answer"] = Store(redis_server).run(adm.gate_wait(keys, GPU, worker, bound_s))
        out["s"] = time.monotonic() - started

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def _paused(store: Store, keys: Keys, worker: str) -> None:
    deadline = time.monotonic() + 5
    while not store.client.sismember(keys.gpu_paused(GPU), worker):
        assert time.monotonic() < deadline, "the gate never registered its worker"
        time.sleep(0.005)


def test_a_release_of_the_urgent_share_wakes_the_paused_worker(redis_server: str) -> None:
    store, keys = _fresh(redis_server)
    now = _now_ms(store)
    answer = _ask(store, keys, "w-tight", now + 200, urgent_ms=250)
    assert answer.granted and answer.urgent
    assert set(store.run(adm.urgent_grants(keys, GPU))) == {"w-tight"}
    thread, out = _gate_in_thread(redis_server, keys, "w-loose", bound_s=10.0)
    _paused(store, keys, "w-loose")
    assert store.run(adm.release(keys, GPU, "w-tight", 5000))
    thread.join(timeout=5)
    assert out["answer"] == adm.GateWait(gated=True, woken=True) and out["s"] < 5  # not the 10 s bound
    assert store.run(adm.urgent_grants(keys, GPU)) == {}
    (grant,) = store.run(adm.grants(keys, GPU))
    assert grant.urgent
    assert store.run(adm.gating_counters(keys, GPU))["urgent_grants"] == 1


def test_nothing_urgent_returns_at_once_and_a_loose_grant_is_not_urgent(redis_server: str) -> None:
    store, keys = _fresh(redis_server)
    now = _now_ms(store)
    answer = _ask(store, keys, "w-loose", now + 8000, urgent_ms=4000)  # margin ~8000: can wait
    assert answer.granted and not answer.urgent
    assert not _ask(store, keys, "w-off", now + 100, urgent_ms=0).urgent  # no threshold: gating off
    started = time.monotonic()
    assert store.run(adm.gate_wait(keys, GPU, "w-other", 10.0)) == adm.GateWait(gated=False, woken=False)
    assert time.monotonic() - started < 5
    assert not store.client.exists(keys.gpu_paused(GPU))


def test_the_bound_ends_a_pause_and_every_urgent_grant_must_end_first(redis_server: str) -> None:
    store, keys = _fresh(redis_server)
    now = _now_ms(store)
    assert _ask(store, keys, "w-a", now + 200, urgent_ms=250, budget=100, tokens=10).urgent
    assert _ask(store, keys, "w-b", now + 200, urgent_ms=250, budget=100, tokens=10).urgent
    # its own bound: it goes on although the urgent steps have not ended
    assert store.run(adm.gate_wait(keys, GPU, "w-d", 0.05)) == adm.GateWait(gated=True, woken=False)
    thread, out = _gate_in_thread(redis_server, keys, "w-d", bound_s=10.0)
    _paused(store, keys, "w-d")
    assert store.run(adm.release(keys, GPU, "w-a", 5000, budget=100))
    thread.join(timeout=0.3)
    assert thread.is_alive()  # w-b's urgent step still runs
    store.run(adm.urgent_end(keys, GPU, "w-b"))  # w-b keeps its share for its next ask, its urgent step ran
    thread.join(timeout=5)
    assert out["answer"] == adm.GateWait(gated=True, woken=True)
    assert store.client.hexists(keys.gpu_slot(GPU), "w-b")  # the share itself is kept


def test_a_dead_urgent_holders_mark_ends_with_its_lease(redis_server: str) -> None:
    store, keys = _fresh(redis_server)
    now = _now_ms(store)
    assert _ask(store, keys, "w-dead", now + 200, urgent_ms=250, lease_ms=100).urgent
    time.sleep(0.15)
    assert store.run(adm.gate_wait(keys, GPU, "w-d", 5.0)) == adm.GateWait(gated=False, woken=False)
    assert store.run(adm.urgent_grants(keys, GPU)) == {}


def test_a_kept_urgent_share_asked_again_is_marked_afresh(redis_server: str) -> None:
    store, keys = _fresh(redis_server)
    now = _now_ms(store)
    assert _ask(store, keys, "w-t", now + 200, urgent_ms=250).urgent
    again = _ask(store, keys, "w-t", now + 200, urgent_ms=250)  # kept, then competes afresh
    assert again.granted and again.urgent
    assert set(store.run(adm.urgent_grants(keys, GPU))) == {"w-t"}
    later = _ask(store, keys, "w-t", now + 200, urgent_ms=0)  # no longer urgent: the mark goes
    assert later.granted and not later.urgent
    assert store.run(adm.urgent_grants(keys, GPU)) == {}


def test_a_share_handed_on_while_waiting_keeps_its_urgent_mark(redis_server: str) -> None:
    store, keys = _fresh(redis_server)
    now = _now_ms(store)
    assert _ask(store, keys, "w-holder", now + 9000).granted
    assert not _ask(store, keys, "w-t", now + 200, urgent_ms=250).granted  # waits (one slot)
    assert store.run(adm.release(keys, GPU, "w-holder", 5000))  # handed to w-t: marked urgent now
    assert set(store.run(adm.urgent_grants(keys, GPU))) == {"w-t"}
    taken = _ask(store, keys, "w-t", now + 200, urgent_ms=250)
    assert taken.granted and taken.urgent


def test_gated_counters_add_up_in_total_and_per_function(redis_server: str) -> None:
    store, keys = _fresh(redis_server)
    store.run(adm.add_gated(keys, GPU, "ns/a", 3, 120.5, 1))
    store.run(adm.add_gated(keys, GPU, "ns/b", 1, 10.0, 0))
    c = store.run(adm.gating_counters(keys, GPU))
    assert (c["gated_steps"], c["gated_ms"], c["timeouts"], c["urgent_grants"]) == (4, 130.5, 1, 0)
    assert (c["gated_steps|ns/a"], c["gated_ms|ns/b"]) == (3, 10.0)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    left=st.integers(-2000, 6000),
    t=st.integers(0, 300),
    threshold=st.integers(0, 3000),
    active=st.integers(0, 3),
)
def test_the_script_marks_urgent_as_the_policy_does(
    redis_server: str, left: int, t: int, threshold: int, active: int
) -> None:
    m = active + 1  # the asker counts as one
    assume(abs(left) > 100 and abs(left - m * t - threshold) > 100)  # clear of the ms the calls take
    store, keys = _fresh(redis_server)
    for i in range(active):
        store.run(adm.mark_active(keys, GPU, f"busy-{i}", 60_000))
    now = _now_ms(store)
    answer = _ask(store, keys, "w", now + left, float(t), urgent_ms=threshold)
    assert answer.granted and answer.active == m
    assert answer.urgent == slo.is_urgent(now + left, now, m, float(t), float(threshold))
