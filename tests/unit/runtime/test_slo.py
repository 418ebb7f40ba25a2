"""SLO-aware batching policy (lorafn.runtime.slo): profile fit, max batch, fill-or-expire hold, deadline
margins and the admission order, with the no-starvation and deadline bounds as properties."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lorafn.runtime import slo
from lorafn.runtime.sampling_params import SamplingParams
from lorafn.runtime.scheduler import Scheduler, SchedulerConfig
from lorafn.runtime.sequence import Sequence


# -- the profile --------------------------------------------------------------------------------
def test_fit_latency_and_max_batch() -> None:
    fit = slo.Fit(t0_ms=20.0, alpha_ms=5.0)
    assert fit.latency_ms(1) == 20.0 and fit.latency_ms(5) == 40.0
    assert fit.max_batch(40.0, 64) == 5  # T(5) = 40 <= 40 < T(6) = 45
    assert fit.max_batch(44.9, 64) == 5
    assert fit.max_batch(1000.0, 8) == 8  # capped by the limit
    assert fit.max_batch(10.0, 8) == 1  # even one misses: served alone, not never
    assert slo.Fit(3.0, 0.0).max_batch(5.0, 16) == 16


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: slo.Fit(-1.0, 0.0), "t0_ms"),
        (lambda: slo.Fit(1.0, math.nan), "alpha_ms"),
        (lambda: slo.Fit(1.0, 1.0).latency_ms(0), "batch size"),
        (lambda: slo.Fit(1.0, 1.0).max_batch(-5, 4), "slo_ms"),
        (lambda: slo.LatencyProfile(decay=0), "decay"),
        (lambda: slo.LatencyProfile().observe(2, -1.0), "ms"),
        (lambda: slo.margin_ms(0, 0, -1, 1), "active"),
    ],
)
def test_bad_input_names_the_field(call, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        call()


@given(
    t0=st.floats(0.1, 500),
    alpha=st.floats(0, 50),
    sizes=st.lists(st.integers(1, 64), min_size=2, max_size=40).filter(lambda b: len(set(b)) > 1),
)
def test_profile_recovers_a_noiseless_line(t0: float, alpha: float, sizes: list[int]) -> None:
    profile = slo.LatencyProfile(decay=0.9)
    for b in sizes:
        profile.observe(b, t0 + alpha * (b - 1))
    fit = profile.fit()
    assert fit is not None and fit.samples == len(sizes)
    for b in (1, 8, 64):
        assert fit.latency_ms(b) == pytest.approx(t0 + alpha * (b - 1), rel=1e-4, abs=1e-3)


def test_profile_prior_answers_first_and_gives_the_slope_of_one_batch_size() -> None:
    prior = slo.Fit(10.0, 2.0, samples=50)
    profile = slo.LatencyProfile(prior=prior)
    assert profile.fit() == prior
    for _ in range(5):
        profile.observe(4, 30.0)  # one batch size: slope from the prior, level from the samples
    fit = profile.fit()
    assert fit is not None and fit.alpha_ms == 2.0 and fit.latency_ms(4) == pytest.approx(30.0)
    assert slo.Fit.from_fields(fit.to_fields()) == slo.Fit(
        round(fit.t0_ms, 4), round(fit.alpha_ms, 4), fit.samples
    )
    assert slo.Fit.from_fields({"t0_ms": "x"}) is None


def test_profile_follows_a_gpu_that_grows_slower() -> None:
    profile = slo.LatencyProfile(decay=0.9)
    for i in range(200):
        profile.observe(1 + i % 4, 10.0 + 2.0 * (i % 4))
    for i in range(200):  # another function now shares the GPU: every step takes twice as long
        profile.observe(1 + i % 4, 20.0 + 4.0 * (i % 4))
    fit = profile.fit()
    assert fit is not None and fit.latency_ms(1) == pytest.approx(20.0, rel=0.01)


# -- fill or expire -----------------------------------------------------------------------------
@given(
    t0=st.floats(0, 200),
    alpha=st.floats(0, 20),
    slo_ms=st.floats(1, 5000),
    fill_to=st.integers(1, 64),
    waited=st.floats(0, 5000),
    interval=st.none() | st.floats(0, 5000),
)
def test_hold_never_pushes_a_full_batch_past_the_slo(
    t0: float, alpha: float, slo_ms: float, fill_to: int, waited: float, interval: float | None
) -> None:
    fit = slo.Fit(t0, alpha)
    hold = slo.hold_ms(fit, slo_ms, fill_to, waited, interval)
    assert hold >= 0
    if hold > 0:
        assert waited + hold + fit.latency_ms(fill_to) <= slo_ms + 1e-6
        assert interval is not None and interval <= hold  # a companion is expected within it
        assert hold <= fit.latency_ms(1) + 1e-9  # never longer than a lone prefill
        assert fill_to >= 2


def test_hold_cases() -> None:
    fit = slo.Fit(50.0, 10.0)
    # SLO - T(N) - waited = 250 ms is left, but a hold never outlasts one lone prefill, T(1) = 50 ms
    assert slo.hold_ms(fit, 500.0, 11, waited_ms=100.0, interval_ms=20.0) == pytest.approx(50.0)
    assert slo.hold_ms(fit, 500.0, 11, waited_ms=100.0, interval_ms=60.0) == 0  # none due within T(1)
    assert slo.hold_ms(fit, 200.0, 11, waited_ms=30.0, interval_ms=5.0) == pytest.approx(20.0)  # SLO first
    assert slo.hold_ms(fit, 500.0, 11, waited_ms=100.0, interval_ms=None) == 0  # quiet function
    assert slo.hold_ms(fit, 500.0, 11, waited_ms=100.0, interval_ms=300.0) == 0  # none expected in time
    assert slo.hold_ms(fit, 500.0, 11, waited_ms=400.0, interval_ms=1.0) == 0  # would miss the SLO
    assert slo.hold_ms(None, 500.0, 11, waited_ms=0.0, interval_ms=1.0) == 0  # not yet measured
    assert slo.hold_ms(fit, 500.0, 1, waited_ms=0.0, interval_ms=1.0) == 0  # a batch of one needs nobody


def test_arrival_rate() -> None:
    rate = slo.ArrivalRate(smoothing=0.5)
    rate.arrived(1000.0)
    assert rate.interval_ms is None
    rate.arrived(1100.0)
    assert rate.interval_ms == 100.0
    rate.arrived(1140.0, count=2)  # two in 40 ms: 20 ms apart
    assert rate.interval_ms == 60.0


# -- the admission order ------------------------------------------------------------------------
def test_margin_is_slo_minus_wait_and_the_active_batches() -> None:
    # arrived at t=1000 with a 500 ms SLO, now t=1200 (w = 200), M = 3 batches of T = 50 ms
    assert slo.margin_ms(1000 + 500, 1200, 3, 50.0) == 500 - (200 + 3 * 50)


def test_pick_smallest_margin_then_worker_id() -> None:
    tight = slo.Waiter("w-b", deadline_ms=1300, t_ms=10)
    loose = slo.Waiter("w-a", deadline_ms=3000, t_ms=10)
    slow = slo.Waiter("w-c", deadline_ms=1500, t_ms=200)  # later deadline, but a long prefill
    assert slo.pick([loose, tight], now_ms=1000, active=1) == tight
    assert slo.pick([tight, slow], now_ms=1000, active=0) == tight  # M = 0: the deadline alone
    assert slo.pick([tight, slow], now_ms=1000, active=2) == slow  # 1500-400 < 1300-20
    twin = slo.Waiter("w-a", deadline_ms=1300, t_ms=10)
    assert slo.pick([tight, twin], now_ms=1000, active=1) == twin
    assert slo.pick([], now_ms=0, active=1) is None


@dataclass(frozen=True)
class Job:
    name: str
    release: float
    deadline: float
    t: float


def simulate(jobs: list[Job], active: int) -> dict[str, tuple[float, float]]:
    """One GPU prefill slot, work-conserving, non-preemptive: whenever it is free the released waiter of
    smallest margin runs its prefill. Returns name -> (start, finish)."""
    pending = sorted(jobs, key=lambda j: j.release)
    waiting: dict[str, Job] = {}
    now, out = 0.0, {}
    while pending or waiting:
        while pending and pending[0].release <= now:
            j = pending.pop(0)
            waiting[j.name] = j
        if not waiting:
            now = pending[0].release
            continue
        chosen = slo.pick([slo.Waiter(j.name, j.deadline, j.t) for j in waiting.values()], now, active)
        assert chosen is not None
        job = waiting.pop(chosen.worker)
        out[job.name] = (now, now + job.t)
        now += job.t
    return out


def jobs_strategy(burst: bool) -> st.SearchStrategy[list[Job]]:
    job = st.tuples(st.just(0.0) if burst else st.floats(0, 1000), st.floats(1, 3000), st.floats(1, 100))
    return st.lists(job, min_size=1, max_size=12).map(
        lambda xs: [Job(f"w{i:02d}", r, r + slack, t) for i, (r, slack, t) in enumerate(xs)]
    )


@settings(max_examples=300)
@given(jobs=jobs_strategy(burst=False), active=st.integers(0, 4))
def test_no_starvation_every_waiter_starts_within_a_bound(jobs: list[Job], active: int) -> None:
    """Once a waiter asks, the slot serves only the one running then and waiters of smaller margin
    (margins of all waiters fall at the same rate), each at most once: its start is bounded."""
    sched = simulate(jobs, active)
    assert set(sched) == {j.name for j in jobs}  # everyone is served
    t_max = max(j.t for j in jobs)

    def key(j: Job) -> tuple[float, str]:
        return (j.deadline - active * j.t, j.name)

    for j in jobs:
        ahead = sum(o.t for o in jobs if o is not j and key(o) < key(j))
        assert sched[j.name][0] <= j.release + t_max + ahead + 1e-6


@settings(max_examples=300)
@given(jobs=jobs_strategy(burst=True), active=st.integers(0, 4))
def test_a_feasible_burst_finishes_within_deadline_plus_bound(jobs: list[Job], active: int) -> None:
    """A burst (all asking at once) that earliest-deadline-first could serve in time: every prefill
    finishes by its deadline + M·T_max (the margin trades deadline for prefill length by at most that)."""
    by_deadline = sorted(jobs, key=lambda j: j.deadline)
    done = 0.0
    for j in by_deadline:
        done += j.t
        if done > j.deadline:
            return  # infeasible load: nothing promised
    sched = simulate(jobs, active)
    t_max = max(j.t for j in jobs)
    for j in jobs:
        assert sched[j.name][1] <= j.deadline + active * t_max + 1e-6


# -- the token budget (slo.admit, the Lua script's reference) ------------------------------------
def test_admit_grants_in_margin_order_while_tokens_fit_and_the_first_misfit_stops_the_line() -> None:
    a = slo.Waiter("w-a", deadline_ms=1100, t_ms=10, tokens=300)  # margin 90 (M = 1)
    b = slo.Waiter("w-b", deadline_ms=1200, t_ms=10, tokens=900)  # 190
    c = slo.Waiter("w-c", deadline_ms=1300, t_ms=10, tokens=100)  # 290
    order = [a, b, c]
    assert slo.admit([c, b, a], 1000, 1, used_tokens=0, budget_tokens=2048) == order  # all fit
    assert slo.admit(order, 1000, 1, used_tokens=0, budget_tokens=1024) == [a]  # b does not fit...
    assert slo.admit(order, 1000, 1, used_tokens=900, budget_tokens=1024) == []  # ...nor a: c waits too
    big = slo.Waiter("w-big", deadline_ms=1050, t_ms=10, tokens=5000)  # margin 40
    assert slo.admit([big, c], 1000, 1, used_tokens=0, budget_tokens=1024) == [big]  # alone, when free
    assert slo.admit([big, c], 1000, 1, used_tokens=1, budget_tokens=1024) == []
    assert slo.admit([], 1000, 1, used_tokens=0, budget_tokens=1) == []
    # a budget of one token is the single slot: one prefill at a time, smallest margin first
    assert slo.admit(order, 1000, 1, used_tokens=0, budget_tokens=1) == [a]


def test_a_waiter_that_cannot_afford_the_wait_goes_over_the_budget() -> None:
    """Shares are never pre-empted: a tight waiter whose margin is smaller than the expected wait for
    the soonest running prefill goes at once; looser ones behind a misfit still wait."""
    tight = slo.Waiter("w-tight", deadline_ms=1300, t_ms=10, tokens=500)  # margin 290 (M = 1)
    loose = slo.Waiter("w-loose", deadline_ms=9000, t_ms=10, tokens=500)  # 7990
    assert slo.admit([tight, loose], 1000, 1, 1000, 1024, wait_ms=100) == []  # 290 ms to spare > 100
    assert slo.admit([tight, loose], 1000, 1, 1000, 1024, wait_ms=400) == [tight]  # it cannot wait 400
    assert slo.admit([tight, loose], 1000, 1, 1000, 1024, wait_ms=9000) == [tight, loose]  # nor can loose
    late = slo.Waiter("w-late", deadline_ms=900, t_ms=10, tokens=500)  # already past its deadline
    assert slo.admit([late], 1000, 1, 1000, 1024) == [late]  # waiting cannot help it


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: slo.admit([], 0, 0, used_tokens=0, budget_tokens=0), "budget_tokens"),
        (lambda: slo.admit([], 0, 0, used_tokens=-1, budget_tokens=8), "used_tokens"),
        (lambda: slo.Waiter("w", 0, 0, tokens=0), "tokens"),
    ],
)
def test_budget_inputs_are_checked(call: object, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        call()  # type: ignore[operator]


@dataclass(frozen=True)
class SizedJob:
    name: str
    release: float
    deadline: float
    t: float
    tokens: int


def simulate_budget(jobs: list[SizedJob], active: int, budget: int) -> dict[str, tuple[float, float]]:
    """The GPU's token budget, work-conserving, non-preemptive: whenever a prefill ends or a waiter
    arrives, `slo.admit` grants the waiters in margin order while they fit, and those whose margin is below
    the wait for the soonest running prefill over the budget (the Lua script's rule; the worker re-asks
    within 20 x poll_ms, 100 ms, so asking at events only is the pessimistic side). Returns name -> (start,
    end)."""
    pending = sorted(jobs, key=lambda j: (j.release, j.name))
    waiting: dict[str, SizedJob] = {}
    running: dict[str, tuple[float, int]] = {}  # name -> (end, tokens)
    now, out = 0.0, {}
    while pending or waiting or running:
        for name in [n for n, (end, _) in running.items() if end <= now]:
            del running[name]
        while pending and pending[0].release <= now:
            j = pending.pop(0)
            waiting[j.name] = j
        used = sum(tok for _, tok in running.values())
        # as gpu_admission.lua: a waiter is urgent when its margin is below the expected wait for the soonest
        # running prefill to end (without it, a test once found a short tight prefill started at t=23 behind a
        # long urgent one where the single slot started it at 3: the simulation's fault, not the script's)
        wait = min((end - now for end, _ in running.values()), default=0.0)
        granted = slo.admit(
            [slo.Waiter(j.name, j.deadline, j.t, j.tokens) for j in waiting.values()],
            now,
            active,
            used,
            budget,
            wait,
        )
        for w in granted:
            job = waiting.pop(w.worker)
            out[job.name] = (now, now + job.t)
            running[job.name] = (now + job.t, job.tokens)
        events = [end for end, _ in running.values()] + ([pending[0].release] if pending else [])
        if not events:
            assert not waiting, "waiters left with nothing running: the budget is not work-conserving"
            break
        now = min(events)
    return out


def sized_jobs(burst: bool) -> st.SearchStrategy[list[SizedJob]]:
    job = st.tuples(
        st.just(0.0) if burst else st.floats(0, 1000), st.floats(1, 3000), st.floats(1, 100),
        st.integers(1, 3000),
    )  # fmt: skip
    return st.lists(job, min_size=1, max_size=12).map(
        lambda xs: [SizedJob(f"w{i:02d}", r, r + slack, t, tok) for i, (r, slack, t, tok) in enumerate(xs)]
    )


@settings(max_examples=300)
@given(jobs=sized_jobs(burst=False), active=st.integers(0, 4), budget=st.integers(1, 4096))
def test_budget_no_starvation_every_waiter_starts_within_a_bound(
    jobs: list[SizedJob], active: int, budget: int
) -> None:
    """While a waiter waits, only prefills running when it arrived and prefills of smaller margin run
    (the first misfit stops the line), and the GPU is never idle while it waits: its start is bounded
    by the longest prefill plus the prefills ahead of it, whatever the token sizes."""
    sched = simulate_budget(jobs, active, budget)
    assert set(sched) == {j.name for j in jobs}  # everyone is served
    t_max = max(j.t for j in jobs)

    def key(j: SizedJob) -> tuple[float, str]:
        return (j.deadline - active * j.t, j.name)

    for j in jobs:
        ahead = sum(o.t for o in jobs if o is not j and key(o) < key(j))
        assert sched[j.name][0] <= j.release + t_max + ahead + 1e-6


@settings(max_examples=300)
@given(jobs=sized_jobs(burst=True), active=st.integers(0, 4), budget=st.integers(1, 4096))
def test_budget_feasible_burst_finishes_within_deadline_plus_bound(
    jobs: list[SizedJob], active: int, budget: int
) -> None:
    """A burst that earliest-deadline-first could serve one at a time in time: with any budget every
    prefill finishes by its deadline + M·T_max. (This test also asserted that a share never starts a
    prefill later than the single slot would: false, hypothesis found bursts where it does, with and
    without the urgency rule's wait in the simulation; docs/scheduler.md "What the budget does not
    promise".)"""
    done = 0.0
    for j in sorted(jobs, key=lambda j: j.deadline):
        done += j.t
        if done > j.deadline:
            return  # infeasible load: nothing promised
    sched = simulate_budget(jobs, active, budget)
    t_max = max(j.t for j in jobs)
    for j in jobs:
        assert sched[j.name][1] <= j.deadline + active * t_max + 1e-6


def test_a_short_tight_prefill_goes_over_the_budget_beside_a_long_urgent_one() -> None:
    """Found by hypothesis while the simulation above left out the urgency rule's wait (2026-11-24). M = 3:
    w03 is long and loose (deadline 66, T 22) but urgent from the start (66 − now − 3·22 < 0): granted over
    a 2-token budget at t=1, it holds the budget to t=23. w02 (deadline 5, T 1) has margin 0 at t=2, below
    the 21 it would wait for w03: it is urgent too and starts at 2 (as admit says), not at 23."""
    jobs = [
        SizedJob("w00", 0.0, 2.0, 2.0, 1),
        SizedJob("w01", 0.0, 3.0, 1.0, 1),
        SizedJob("w02", 0.0, 5.0, 1.0, 1),
        SizedJob("w03", 0.0, 66.0, 22.0, 2),
    ]
    serial, shared = simulate_budget(jobs, 3, 1), simulate_budget(jobs, 3, 2)
    assert shared["w03"] == (1.0, 23.0) and shared["w02"] == (2.0, 3.0)
    assert serial["w02"] == (3.0, 4.0)
    assert slo.admit([slo.Waiter("w02", 5.0, 1.0, 1)], 2.0, 3, 2, 2) == []  # without the wait: it waits


# -- the scheduler's decode-only step -----------------------------------------------------------
def test_decode_only_step_never_holds_back_decodes() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, block_size=4, num_blocks=64))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    sched.add(Sequence(seq_id="a", prompt_token_ids=[1, 2, 3], params=params))
    assert sched.num_pending_prefills == 1
    out = sched.schedule()
    sched.update(out, {"a": 7})
    sched.add(Sequence(seq_id="b", prompt_token_ids=[4, 5, 6, 7], params=params))
    assert sched.num_pending_prefills == 1  # a decodes now, b waits
    out = sched.schedule(allow_prefill=False)
    assert [(c.seq_id, c.is_decode) for c in out.chunks] == [("a", True)]
    sched.update(out, {"a": 8})
    out = sched.schedule()
    assert [c.seq_id for c in out.chunks] == ["a", "b"]
    sched.update(out, {"a": 9, "b": 1})
    assert sched.num_pending_prefills == 0


# -- decode gating ------------------------------------------------------------------------------
def test_urgent_threshold_is_a_share_of_the_slo_and_at_least_the_step() -> None:
    assert slo.urgent_threshold_ms(500.0, 40.0, 0.5) == 250.0
    assert slo.urgent_threshold_ms(100.0, 80.0, 0.5) == 80.0  # the step itself is longer than half the SLO
    assert slo.urgent_threshold_ms(500.0, 40.0, 0.0) == 0.0  # switched off: never urgent
    with pytest.raises(ValueError, match="urgent fraction"):
        slo.urgent_threshold_ms(500.0, 40.0, 1.5)
    with pytest.raises(ValueError, match="ttft_ms"):
        slo.urgent_threshold_ms(-1.0, 40.0, 0.5)


def test_urgent_means_a_small_margin_and_a_deadline_still_ahead() -> None:
    now = 1_000_000.0
    # deadline in 300 ms, 3 active batches of 40 ms: margin 180 < 250
    assert slo.is_urgent(now + 300, now, 3, 40.0, 250.0)
    assert not slo.is_urgent(now + 600, now, 3, 40.0, 250.0)  # margin 480: it can wait
    assert not slo.is_urgent(now - 1, now, 3, 40.0, 250.0)  # already late: pausing others saves nothing
    assert not slo.is_urgent(now + 300, now, 3, 40.0, 0.0)  # no threshold: gating off
    assert not slo.is_urgent(math.inf, now, 3, 40.0, 250.0)  # offline batch requests: no deadline


def test_the_delay_bound_is_the_tpot_slack() -> None:
    assert slo.decode_delay_bound_ms(200.0, 30.0) == 170.0
    assert slo.decode_delay_bound_ms(20.0, 30.0) == 0.0  # the step alone misses its TPOT: never paused
    with pytest.raises(ValueError, match="tpot_ms"):
        slo.decode_delay_bound_ms(math.nan, 30.0)


def test_the_gate_pauses_only_for_another_workers_urgent_grant_with_decodes_and_slack() -> None:
    gate = slo.DecodeGate("me", min_pause_ms=5.0)
    assert gate.pause_ms(decoding=4, prefilling=False, bound_ms=100.0) == 0  # nothing urgent seen
    gate.saw(["me"])  # its own urgent grant: nothing to make room for
    assert gate.pause_ms(4, False, 100.0) == 0
    gate.saw(["me", "other"])
    assert gate.pause_ms(0, False, 100.0) == 0  # no decodes: no TPOT bound that makes a wait safe
    assert gate.pause_ms(4, True, 100.0) == 0  # its own granted prefill runs in this step
    assert gate.pause_ms(4, False, 4.0) == 0  # slack below the minimum
    assert gate.pause_ms(4, False, 100.0) == 100.0
    gate.paused(60.0, gated=True, timed_out=False)
    assert gate.pause_ms(4, False, 100.0) == 0  # once per step, even if it saw the flag again
    gate.saw(["other"])
    assert gate.pause_ms(4, False, 100.0) == 0
    gate.stepped()
    gate.saw(["other"])
    assert gate.pause_ms(4, False, 100.0) == 100.0
    gate.paused(100.0, gated=True, timed_out=True)
    gate.stepped()
    gate.paused(0.5, gated=False, timed_out=False)  # the urgent step ended before the wait began
    assert (gate.gated_steps, gate.gated_ms, gate.timeouts) == (2, 160.0, 1)


urgent_windows = st.lists(st.tuples(st.floats(0, 5000), st.floats(1, 800)), max_size=12)


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(st.floats(1, 60), min_size=1, max_size=60),
    windows=urgent_windows,
    tpot=st.floats(1, 400),
    retries=st.integers(1, 3),
)
def test_gated_decodes_are_bounded_and_never_starve(
    steps: list[float], windows: list[tuple[float, float]], tpot: float, retries: int
) -> None:
    """A decoding worker next to arbitrary urgent grants of another worker (any overlap, back to back,
    covering everything): each output token comes at most its step time plus the TPOT slack after the
    one before (bounded delay), and every step runs (no starvation), also when the loop asks the gate
    several times before a step."""

    def urgent_until(t: float) -> float | None:  # when the urgent grants live at t end (None: none)
        if not any(start <= t < start + length for start, length in windows):
            return None
        end = t
        while True:  # back-to-back or overlapping grants: the last one's end
            later = max((s + n for s, n in windows if s <= end < s + n), default=end)
            if later == end:
                return end
            end = later

    gate = slo.DecodeGate("decoder", min_pause_ms=0.0)
    t, last_token, tokens = 0.0, 0.0, 0
    for step_ms in steps:
        bound = slo.decode_delay_bound_ms(tpot, step_ms)  # the profile predicts this step exactly
        gate.saw(["urgent"] if urgent_until(t) is not None else [])  # the round trip after the last step
        for _ in range(retries):
            pause = gate.pause_ms(decoding=1, prefilling=False, bound_ms=bound)
            if pause == 0:
                continue
            end = urgent_until(t)  # what the script sees when the wait begins
            waited = 0.0 if end is None else min(pause, end - t)  # woken at the end, or the bound
            gate.paused(waited, gated=end is not None, timed_out=end is not None and waited == pause)
            t += waited
        t += step_ms  # the step runs
        gate.stepped()
        tokens += 1
        assert t - last_token <= step_ms + bound + 1e-6  # bounded delay: the TPOT SLO when step <= tpot
        last_token = t
    assert tokens == len(steps)  # never starved
    assert gate.gated_ms <= sum(slo.decode_delay_bound_ms(tpot, s) for s in steps) + 1e-6
