"""The GPU's prefill budget in Redis (lua/gpu_admission.lua through lorafn.store.admission), on a real
redis-server: the script decides as `lorafn.runtime.slo.pick`/`admit` do (a budget of one token is one
slot; a larger one runs prefills at once while their tokens fit, the first misfit stops the line),
holds a share until it is released or its lease ends, forgets waiters that stopped asking, counts
active batches, and records each grant and release. Latency profiles round-trip."""

from __future__ import annotations

import time
import uuid

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lorafn.runtime import slo
from lorafn.store import Keys, Store
from lorafn.store import admission as adm

GPU = "local/0"


def _ask(store: Store, keys: Keys, worker: str, deadline: float, t: float, **kw: float) -> adm.SlotAnswer:
    args = {"lease_ms": 5000.0, "waiter_ttl_ms": 5000.0, "active_ttl_ms": 5000.0, **kw}
    return store.run(
        adm.ask(keys, GPU, worker, f"ns/{worker}", deadline_ms=deadline, t_ms=t, **args)  # type: ignore[arg-type]
    )


def _now_ms(store: Store) -> float:
    sec, usec = store.client.time()
    return sec * 1000 + usec // 1000


def test_the_holder_keeps_the_slot_until_it_releases_and_grants_are_recorded(redis_server: str) -> None:
    store, keys = Store(redis_server), Keys(f"t{uuid.uuid4().hex[:8]}")
    now = _now_ms(store)
    first = _ask(store, keys, "w-loose", now + 5000, 10)
    assert first.granted and first.active == 1  # alone: M counts the asker's own batch
    tight = _ask(store, keys, "w-tight", now + 100, 10)
    assert not tight.granted and tight.other == "w-loose"  # held: a prefill is not pre-empted
    again = _ask(store, keys, "w-loose", now + 5000, 10)  # the holder asks again: competes afresh
    assert not again.granted and again.other == "w-tight"
    assert _ask(store, keys, "w-tight", now + 100, 10).granted  # handed to it by w-loose's ask
    assert not store.run(adm.release(keys, GPU, "w-loose", 5000))  # not its slot any more
    assert store.run(adm.release(keys, GPU, "w-tight", 5000))  # handed on to w-loose, which waits
    assert store.client.lrange(keys.gpu_wake(GPU, "w-loose"), 0, -1) == ["1"]
    assert store.run(adm.wait_for_slot(keys, GPU, "w-loose", 1.0))
    assert _ask(store, keys, "w-loose", now + 5000, 10).granted
    grants = store.run(adm.grants(keys, GPU))
    assert [(g.worker, g.function) for g in grants] == [
        ("w-loose", "ns/w-loose"), ("w-tight", "ns/w-tight"), ("w-loose", "ns/w-loose"),
    ]  # fmt: skip
    assert grants[1].waiters == 2 and grants[2].waiters == 1
    assert grants[0].runner_up_ms is None and grants[2].runner_up_ms is None  # alone
    assert grants[1].runner_up_ms is not None and grants[1].margin_ms < grants[1].runner_up_ms


def test_nothing_to_wait_for_times_out(redis_server: str) -> None:
    store, keys = Store(redis_server), Keys(f"t{uuid.uuid4().hex[:8]}")
    started = time.monotonic()
    assert not store.run(adm.wait_for_slot(keys, GPU, "w-1", 0.1))
    assert time.monotonic() - started >= 0.09


def test_a_dead_holder_loses_the_slot_when_its_lease_ends(redis_server: str) -> None:
    store, keys = Store(redis_server), Keys(f"t{uuid.uuid4().hex[:8]}")
    now = _now_ms(store)
    assert _ask(store, keys, "w-dead", now + 1000, 10, lease_ms=150).granted
    refused = _ask(store, keys, "w-live", now + 1000, 10)
    assert not refused.granted and 0 < refused.retry_ms <= 150
    time.sleep(0.2)
    assert _ask(store, keys, "w-live", now + 1000, 10).granted


def test_a_waiter_that_stopped_asking_is_forgotten(redis_server: str) -> None:
    store, keys = Store(redis_server), Keys(f"t{uuid.uuid4().hex[:8]}")
    now = _now_ms(store)
    assert _ask(store, keys, "w-holder", now + 9000, 10).granted
    assert not _ask(store, keys, "w-gone", now + 5000, 10, waiter_ttl_ms=100).granted  # tightest, leaves
    assert store.run(adm.release(keys, GPU, "w-holder", 5000))
    assert not _ask(store, keys, "w-next", now + 8000, 10).granted  # handed to w-gone, still asking
    time.sleep(0.15)
    answer = _ask(store, keys, "w-next", now + 8000, 10)
    assert answer.granted and answer.waiters == 1


def test_active_batches_count_in_the_margin_and_idle_leaves(redis_server: str) -> None:
    store, keys = Store(redis_server), Keys(f"t{uuid.uuid4().hex[:8]}")
    assert store.run(adm.mark_active(keys, GPU, "w-1", 5000)) == 1
    assert store.run(adm.mark_active(keys, GPU, "w-2", 5000)) == 2
    now = _now_ms(store)
    answer = _ask(store, keys, "w-3", now + 1000, 100)
    assert answer.granted and answer.active == 3  # two running batches + the asker's
    assert 1000 - 3 * 100 - 50 <= answer.margin_ms <= 1000 - 3 * 100
    store.run(adm.mark_idle(keys, GPU, "w-3", 5000))  # frees its slot too
    store.run(adm.mark_idle(keys, GPU, "w-1", 5000))
    answer = _ask(store, keys, "w-2", now + 1000, 100)
    assert answer.granted and answer.active == 1  # w-2 itself


# slack > M·t: no waiter is urgent (margin < the holder's expected rest, 0 here), so all wait for it
waiter = st.tuples(st.integers(4000, 9000), st.integers(0, 400))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(waiters=st.lists(waiter, min_size=1, max_size=6), active=st.integers(0, 3))
def test_the_script_picks_as_the_policy_does(
    redis_server: str, waiters: list[tuple[int, int]], active: int
) -> None:
    store, keys = Store(redis_server), Keys(f"t{uuid.uuid4().hex[:8]}")
    for i in range(active):
        store.run(adm.mark_active(keys, GPU, f"busy-{i}", 60_000))
    assert _ask(store, keys, "holder", 0, 0).granted  # everyone below waits while it holds the slot
    now = _now_ms(store)
    ws = [slo.Waiter(f"w-{i}", now + slack, float(t)) for i, (slack, t) in enumerate(waiters)]
    for w in ws:
        store.run(adm.mark_active(keys, GPU, w.worker, 60_000))  # all running: M is the same for each
        assert not _ask(store, keys, w.worker, w.deadline_ms, w.t_ms).granted
    store.run(adm.mark_idle(keys, GPU, "holder", 60_000))  # hands the slot on
    m = active + len(ws)
    expected = slo.pick(ws, now, m)
    assert expected is not None
    granted = [w.worker for w in ws if _ask(store, keys, w.worker, w.deadline_ms, w.t_ms).granted]
    assert granted == [expected.worker]


def test_profiles_round_trip(redis_server: str) -> None:
    store, keys = Store(redis_server), Keys(f"t{uuid.uuid4().hex[:8]}")
    fit = slo.Fit(12.5, 1.25, samples=64)
    store.run(
        adm.put_profile(
            keys, "tiny", "NVIDIA_H100_80GB_HBM3", "q_proj:16,v_proj:16", "prefill", fit.to_fields()
        )
    )
    got = store.run(adm.get_profile(keys, "tiny", "NVIDIA_H100_80GB_HBM3", "q_proj:16,v_proj:16"))
    assert slo.Fit.from_fields(got["prefill"]) == fit and "decode" not in got
    assert store.run(adm.get_profile(keys, "tiny", "cpu", "none")) == {}


def test_two_slots_let_two_prefills_run_and_hand_on_to_the_best_waiter(redis_server: str) -> None:
    store, keys = Store(redis_server), Keys(f"t{uuid.uuid4().hex[:8]}")
    now = _now_ms(store)
    assert _ask(store, keys, "w-a", now + 9000, 10, budget=2).granted
    assert _ask(store, keys, "w-b", now + 9000, 10, budget=2).granted  # the second slot
    third = _ask(store, keys, "w-c", now + 5000, 10, budget=2)
    assert not third.granted and third.other in {"w-a", "w-b"}
    assert not _ask(store, keys, "w-d", now + 100, 10, budget=2).granted
    assert store.run(adm.release(keys, GPU, "w-a", 5000, budget=2))  # to w-d: the smallest margin
    assert _ask(store, keys, "w-d", now + 100, 10, budget=2).granted
    assert not _ask(store, keys, "w-c", now + 5000, 10, budget=2).granted
    store.run(adm.mark_idle(keys, GPU, "w-b", 5000, budget=2))
    assert _ask(store, keys, "w-c", now + 5000, 10, budget=2).granted
    assert [g.worker for g in store.run(adm.grants(keys, GPU))] == ["w-a", "w-b", "w-d", "w-c"]


def test_token_shares_run_prefills_at_once_and_the_first_misfit_stops_the_line(redis_server: str) -> None:
    store, keys = Store(redis_server), Keys(f"t{uuid.uuid4().hex[:8]}")
    now = _now_ms(store)
    assert _ask(store, keys, "w-a", now + 9000, 10, budget=1000, tokens=600).granted
    assert _ask(store, keys, "w-b", now + 9000, 10, budget=1000, tokens=300).granted  # 900 of 1000 held
    tight = _ask(store, keys, "w-c", now + 100, 10, budget=1000, tokens=500)
    assert not tight.granted and tight.other in {"w-a", "w-b"}
    small = _ask(store, keys, "w-d", now + 8000, 10, budget=1000, tokens=50)  # fits, but w-c is ahead
    assert not small.granted
    step_end = time.time() * 1000
    assert store.run(adm.release(keys, GPU, "w-a", 5000, budget=1000, prefilled=2, step_end_ms=step_end))
    # 600 freed: w-c (500) and then w-d (50) fit beside w-b's 300, in margin order
    assert store.client.lrange(keys.gpu_wake(GPU, "w-c"), 0, -1) == ["1"]
    assert store.client.lrange(keys.gpu_wake(GPU, "w-d"), 0, -1) == ["1"]
    assert _ask(store, keys, "w-c", now + 100, 10, budget=1000, tokens=500).granted
    assert _ask(store, keys, "w-d", now + 8000, 10, budget=1000, tokens=50).granted
    assert not _ask(store, keys, "w-e", now + 9000, 10, budget=1000, tokens=200).granted  # 850 + 200 > 1000
    grants = store.run(adm.grants(keys, GPU))
    assert [(g.worker, g.tokens, g.used) for g in grants] == [
        ("w-a", 600, 600), ("w-b", 300, 900), ("w-c", 500, 800), ("w-d", 50, 850),
    ]  # fmt: skip
    assert grants[2].waited_ms >= 0 and grants[2].runner_up_ms is not None
    assert grants[2].margin_ms < grants[2].runner_up_ms
    (rel,) = store.run(adm.releases(keys, GPU))
    assert (rel.worker, rel.prefilled) == ("w-a", 2)
    assert rel.held_ms >= 0 and rel.late_ms is not None and 0 <= rel.late_ms < 1000


def test_a_share_larger_than_the_budget_runs_alone(redis_server: str) -> None:
    store, keys = Store(redis_server), Keys(f"t{uuid.uuid4().hex[:8]}")
    now = _now_ms(store)
    assert _ask(store, keys, "w-big", now + 100, 10, budget=512, tokens=4000).granted  # nothing held
    assert not _ask(store, keys, "w-small", now + 9000, 10, budget=512, tokens=1).granted
    assert store.run(adm.release(keys, GPU, "w-big", 5000, budget=512))
    assert _ask(store, keys, "w-small", now + 9000, 10, budget=512, tokens=1).granted
    assert not _ask(store, keys, "w-big", now + 100, 10, budget=512, tokens=4000).granted  # 1 is held


sized = st.tuples(st.integers(4000, 9000), st.integers(0, 400), st.integers(1, 1500))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(waiters=st.lists(sized, min_size=1, max_size=6), active=st.integers(0, 3), budget=st.integers(1, 2048))
def test_the_script_admits_as_the_policy_does(
    redis_server: str, waiters: list[tuple[int, int, int]], active: int, budget: int
) -> None:
    store, keys = Store(redis_server), Keys(f"t{uuid.uuid4().hex[:8]}")
    for i in range(active):
        store.run(adm.mark_active(keys, GPU, f"busy-{i}", 60_000))
    assert _ask(store, keys, "holder", 0, 0, budget=budget, tokens=budget).granted  # all of it
    now = _now_ms(store)
    ws = [slo.Waiter(f"w-{i}", now + slack, float(t), tok) for i, (slack, t, tok) in enumerate(waiters)]
    for w in ws:
        store.run(adm.mark_active(keys, GPU, w.worker, 60_000))  # all running: M is the same for each
        assert not _ask(store, keys, w.worker, w.deadline_ms, w.t_ms, budget=budget, tokens=w.tokens).granted
    store.run(adm.mark_idle(keys, GPU, "holder", 60_000, budget=budget))  # hands the budget on
    expected = [w.worker for w in slo.admit(ws, now, active + len(ws), used_tokens=0, budget_tokens=budget)]
    assert expected  # the first in line always gets it
    granted = [
        w.worker
        for w in ws
        if _ask(store, keys, w.worker, w.deadline_ms, w.t_ms, budget=budget, tokens=w.tokens).granted
    ]
    assert sorted(granted) == sorted(expected)


def test_a_waiter_that_cannot_afford_the_wait_goes_over_the_budget(redis_server: str) -> None:
    """A share is never pre-empted: a waiter whose margin is smaller than the expected rest of the
    soonest running prefill (its grant time + its T(b)) is granted at once, over the budget; a looser
    one waits (as `slo.admit` with `wait_ms`)."""
    store, keys = Store(redis_server), Keys(f"t{uuid.uuid4().hex[:8]}")
    now = _now_ms(store)
    assert _ask(store, keys, "w-long", now + 60_000, 2000, budget=1000, tokens=1000).granted  # ~2 s step
    loose = _ask(store, keys, "w-loose", now + 30_000, 10, budget=1000, tokens=100)
    assert not loose.granted  # 30 s to spare: it waits
    tight = _ask(store, keys, "w-tight", now + 500, 10, budget=1000, tokens=100)
    assert tight.granted  # 500 ms to spare < the ~2 s the long step still runs
    grants = store.run(adm.grants(keys, GPU))
    assert [(g.worker, g.used) for g in grants] == [("w-long", 1000), ("w-tight", 1100)]
    assert not _ask(store, keys, "w-loose", now + 30_000, 10, budget=1000, tokens=100).granted


def test_a_worker_with_only_batch_prefills_has_no_deadline(redis_server: str) -> None:
    """Offline batch requests (docs/batch.md) ask with deadline +inf: behind every online waiter however
    loose its deadline, never urgent (no grant over the budget), and the script agrees with `slo.admit`."""
    store, keys = Store(redis_server), Keys(f"t{uuid.uuid4().hex[:8]}")
    inf = float("inf")
    now = _now_ms(store)
    assert _ask(store, keys, "w-long", now + 60_000, 2000, budget=1000, tokens=1000).granted  # ~2 s step
    batch = _ask(store, keys, "w-batch", inf, 10, budget=1000, tokens=100)
    assert not batch.granted and batch.margin_ms == inf  # not urgent: an online one in its place would be
    assert not _ask(store, keys, "w-online", now + 59_000, 10, budget=1000, tokens=100).granted
    store.run(adm.release(keys, GPU, "w-long", 5000, budget=1000))
    grants = store.run(adm.grants(keys, GPU))
    assert [g.worker for g in grants] == ["w-long", "w-online", "w-batch"]  # loose online first, both fit
    assert grants[1].runner_up_ms == inf and grants[2].margin_ms == inf
    # a budget that holds one of them: the online one, however loose; the script decides as the policy
    store2, keys2 = Store(redis_server), Keys(f"t{uuid.uuid4().hex[:8]}")
    assert _ask(store2, keys2, "holder", 0, 0, budget=100, tokens=100).granted
    now = _now_ms(store2)
    ws = [slo.Waiter("a-batch", inf, 5.0, 100), slo.Waiter("z-online", now + 3_600_000, 5.0, 100)]
    for w in ws:
        assert not _ask(store2, keys2, w.worker, w.deadline_ms, w.t_ms, budget=100, tokens=w.tokens).granted
    store2.run(adm.release(keys2, GPU, "holder", 5000, budget=100))
    expected = [w.worker for w in slo.admit(ws, now, 2, used_tokens=0, budget_tokens=100)]
    assert expected == ["z-online"]
    assert [g.worker for g in store2.run(adm.grants(keys2, GPU))][1:] == expected


def test_a_share_handed_on_holds_the_tokens_the_waiter_asked_with(redis_server: str) -> None:
    """The budget counted the tokens of the ask a worker waited with; when the share is handed to it and
    it asks again with more (requests arrived meanwhile), it is granted the earlier tokens, no more: its
    step prefills that many and the rest waits for the next grant. Fewer stay fewer."""
    store, keys = Store(redis_server), Keys(f"t{uuid.uuid4().hex[:8]}")
    now = _now_ms(store)
    held = _ask(store, keys, "w-a", now + 9000, 10, budget=1000, tokens=900)
    assert held.granted and held.tokens == 900  # a plain grant: what it asked
    assert not _ask(store, keys, "w-b", now + 5000, 10, budget=1000, tokens=300).granted
    assert store.run(adm.release(keys, GPU, "w-a", 5000, budget=1000))  # handed to w-b with its 300
    grown = _ask(store, keys, "w-b", now + 5000, 10, budget=1000, tokens=800)
    assert grown.granted and grown.tokens == 300
    assert store.client.hget(keys.gpu_slot(GPU), "w-b").split("|")[2] == "300"  # what the budget holds
    assert _ask(store, keys, "w-c", now + 9000, 10, budget=1000, tokens=700).granted  # 300 + 700 fit
    assert store.run(adm.release(keys, GPU, "w-c", 5000, budget=1000))
    assert not _ask(store, keys, "w-d", now + 9000, 10, budget=1000, tokens=800).granted  # 300 + 800 > 1000
    assert store.run(adm.release(keys, GPU, "w-b", 5000, budget=1000))  # handed to w-d with its 800
    shrunk = _ask(store, keys, "w-d", now + 9000, 10, budget=1000, tokens=200)
    assert shrunk.granted and shrunk.tokens == 200
