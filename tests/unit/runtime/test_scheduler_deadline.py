"""Deadline order of the pending prefills (SchedulerConfig.deadline_order, docs/scheduler.md#deadline-order):
earliest deadline first among the requests that can still make theirs (Moore-Hodgson), the ones predicted
late behind them (served, never dropped), overdue ones back in front; tokens unchanged."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lorafn.runtime.sampling_params import SamplingParams
from lorafn.runtime.scheduler import DeadlinePlan, Scheduler, SchedulerConfig, deadline_plan, rank
from lorafn.runtime.sequence import Sequence

from .sched_harness import FakeEngine, Request
from .test_scheduler import check_against_reference, work_bound, workloads


def seq(seq_id: str, n_prompt: int = 4, priority: int = 0, max_tokens: int = 4, arrival: int = 0) -> Sequence:
    s = Sequence(
        seq_id, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens, priority=priority)
    )
    s.arrival = arrival
    return s


def jobs(*specs: tuple[str, int]) -> list[tuple[Sequence, int]]:
    """(id, tokens) in arrival order."""
    return [(seq(i, t, arrival=k), t) for k, (i, t) in enumerate(specs)]


def ids(plan: DeadlinePlan) -> list[str]:
    return [s.seq_id for s in plan.order]


def cfg(**kw) -> SchedulerConfig:
    base = dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=4, num_blocks=64, deadline_order=True)
    base.update(kw)
    return SchedulerConfig(**base)


def step(s: Scheduler, now: float) -> list[tuple[str, int]]:
    """One step at `now`, sampling token 7 for every sampling chunk (a request ends at max_tokens):
    (id, tokens) of its prefill chunks."""
    out = s.schedule(now=now)
    for x in s.update(out, {c.seq_id: 7 for c in out.chunks if c.samples}):
        if x.num_output_tokens >= x.params.max_tokens:
            s.finish(x.seq_id, "length")
    return [(c.seq_id, c.num_tokens) for c in out.chunks if not c.is_decode]


# ---------------------------------------------------------------------------- the plan, by example


def test_a_burst_of_equal_prompts_serves_the_ones_that_can_still_make_it_first() -> None:
    # five 100-token prompts of one SLO (1 s), arrived 0.0 .. 0.4 s; at 0.9 s with 2 ms a token (200 ms each)
    # first come first served would finish r0 at 1.1 (late), r1 at 1.3 (late), ... : all five late
    pending = jobs(*[(f"r{i}", 100) for i in range(5)])
    deadlines = {f"r{i}": 1.0 + 0.1 * i for i in range(5)}
    plan = deadline_plan(pending, deadlines, now=0.9, s_per_token=0.002)
    # r0 cannot make it (1.1 > 1.0); r1 then finishes at 1.1 <= 1.1, r2 at 1.3 > 1.2 (dropped), r3 at 1.3
    assert ids(plan) == ["r1", "r3", "r0", "r2", "r4"]
    assert plan.late == {"r0", "r2", "r4"} and not plan.overdue


def test_the_longest_prompt_is_the_one_moved_behind() -> None:
    # a long prompt with the earliest deadline would make the two short ones behind it late
    pending = jobs(("long", 300), ("a", 50), ("b", 50))
    deadlines = {"long": 0.31, "a": 0.33, "b": 0.36}
    plan = deadline_plan(pending, deadlines, now=0.0, s_per_token=0.001)
    assert ids(plan) == ["a", "b", "long"] and plan.late == {"long"}  # two on time instead of one


def test_without_pressure_the_order_is_earliest_deadline_first() -> None:
    pending = jobs(("x", 10), ("y", 10), ("z", 10))
    plan = deadline_plan(pending, {"x": 9.0, "y": 3.0, "z": 5.0}, now=0.0, s_per_token=0.001)
    assert ids(plan) == ["y", "z", "x"] and not plan.late


def test_tiers_resumed_then_overdue_then_on_time_then_late_and_batch_last() -> None:
    resumed = seq("resumed", 8, arrival=0)
    resumed.output_token_ids = [5, 5]  # preempted after its first token: no TTFT left to meet
    batch = seq("batch", 8, priority=1, arrival=1)
    nodl = seq("nodl", 8, arrival=2)  # no deadline: behind the on-time ones, with the late ones by arrival
    over = seq("over", 8, arrival=3)
    late = seq("late", 8, arrival=4)
    ok = seq("ok", 8, arrival=5)
    pending = [(s, s.num_tokens) for s in (batch, nodl, ok, late, over, resumed)]
    deadlines = {"over": 1.0, "late": 10.0, "ok": 20.0, "resumed": 0.5}
    plan = deadline_plan(pending, deadlines, now=9.99, s_per_token=0.001, overdue_after_s=5.0)
    assert ids(plan) == ["resumed", "over", "ok", "nodl", "late", "batch"]
    assert plan.overdue == {"over"} and plan.late == {"late"}


# ---------------------------------------------------------------------------- the plan, by property


@st.composite
def plan_inputs(draw, max_jobs: int = 10, single_class: bool = False):
    n = draw(st.integers(0, max_jobs))
    pending, deadlines = [], {}
    for k in range(n):
        s = seq(
            f"j{k}", draw(st.integers(1, 50)), priority=0 if single_class else draw(st.sampled_from([0, 1]))
        )
        s.arrival = k
        if not single_class and draw(st.integers(0, 5)) == 0:
            s.output_token_ids = [1]
        tokens = draw(st.integers(1, s.num_tokens))
        pending.append((s, tokens))
        if single_class or draw(st.integers(0, 4)):
            deadlines[s.seq_id] = draw(st.floats(-2.0, 3.0, allow_nan=False))
    order = draw(st.permutations(range(n)))  # the caller's list order must not matter
    now = draw(st.floats(0.0, 1.0))
    cost = draw(st.floats(0.001, 0.05))
    overdue_after = math.inf if single_class else draw(st.sampled_from([math.inf, 0.5, 2.0]))
    return [pending[i] for i in order], deadlines, now, cost, overdue_after


@settings(max_examples=400, deadline=None)
@given(plan_inputs())
def test_plan_is_a_permutation_in_class_and_deadline_order(inputs) -> None:
    pending, deadlines, now, cost, overdue_after = inputs
    plan = deadline_plan(pending, deadlines, now, cost, overdue_after)
    assert sorted(ids(plan)) == sorted(s.seq_id for s, _ in pending)  # nobody dropped or doubled
    tokens = {s.seq_id: t for s, t in pending}
    classes = [rank(s)[0] for s in plan.order]
    assert classes == sorted(classes)  # online before batch, as first come first served
    elapsed = 0
    for cls in sorted(set(classes)):
        members = [s for s in plan.order if rank(s)[0] == cls]

        def tier(s: Sequence) -> int:
            if s.num_output_tokens:
                return 0
            if s.seq_id in plan.overdue:
                return 1
            return 3 if s.seq_id in plan.late or s.seq_id not in deadlines else 2

        tiers = [tier(s) for s in members]
        assert tiers == sorted(tiers), tiers  # resumed, overdue, on time, late
        on_time = [s for s in members if tier(s) == 2]
        assert [deadlines[s.seq_id] for s in on_time] == sorted(deadlines[s.seq_id] for s in on_time)
        for s in members:
            if s.seq_id in plan.overdue:
                assert deadlines[s.seq_id] + overdue_after < now
            elapsed += tokens[s.seq_id]
            if tier(s) == 2:  # served one after another in this order, each on time
                assert now + cost * elapsed <= deadlines[s.seq_id] + 1e-9
        late = [s for s in members if tier(s) == 3]
        assert [rank(s) for s in late] == sorted(rank(s) for s in late)  # first come first served


@settings(max_examples=200, deadline=None)
@given(plan_inputs(max_jobs=6, single_class=True))
def test_plan_misses_the_fewest_deadlines_of_any_order(inputs) -> None:
    """Moore-Hodgson is optimal: no order of serving the prompts one after another misses fewer."""
    pending, deadlines, now, cost, _ = inputs

    def misses(order: list[tuple[Sequence, int]]) -> int:
        t, n = 0, 0
        for s, tokens in order:
            t += tokens
            n += now + cost * t > deadlines[s.seq_id]  # the plan's own arithmetic: no tolerance
        return n

    plan = deadline_plan(pending, deadlines, now, cost)
    tokens = {s.seq_id: t for s, t in pending}
    by_id = {s.seq_id: s for s, _ in pending}
    got = misses([(by_id[i], tokens[i]) for i in ids(plan)])
    assert got == len(plan.late)
    detail = [(s.seq_id, t, deadlines[s.seq_id]) for s, t in pending], now, cost, ids(plan)
    assert got == min(misses(list(p)) for p in itertools.permutations(pending)), detail


# ---------------------------------------------------------------------------- the scheduler, by example


def test_a_late_head_lets_a_request_that_can_still_make_it_start_when_memory_frees() -> None:
    # room for one 8-token request at a time (3 blocks of 4: 8 tokens + the decode's next block)
    s = Scheduler(cfg(num_blocks=3, prefill_s_per_token=0.01))
    for k, name in enumerate(["running", "old", "new"]):
        s.add(seq(name, 8, max_tokens=2))
        s.set_deadline(name, 1.0 + k)  # SLO 1 s, arrivals 0, 1, 2
    assert step(s, now=0.0) == [("running", 8)]  # old and new wait for its blocks
    assert step(s, now=0.5) == []  # running's last token: finishes, frees its blocks
    # at 2.5: old (deadline 2.0) cannot make it any more; new (3.0) can: it goes first
    assert step(s, now=2.5) == [("new", 8)]
    assert s.last_plan is not None and s.last_plan.late == {"old"}
    first_come = Scheduler(cfg(num_blocks=3, deadline_order=False))
    for name in ["running", "old", "new"]:
        first_come.add(seq(name, 8, max_tokens=2))
    step(first_come, 0.0)
    step(first_come, 0.5)
    assert step(first_come, 2.5) == [("old", 8)]  # first come first served: the late one, then new late too


def test_a_step_prefills_one_prompt_after_another_when_time_is_short() -> None:
    s = Scheduler(cfg(prefill_s_per_token=0.1))
    s.add(seq("a", 8))
    s.add(seq("b", 8))
    s.set_deadline("a", 1.0)  # 8 tokens: 0.8 s alone, 1.6 s with b's beside it
    s.set_deadline("b", 5.0)
    assert step(s, now=0.0) == [("a", 8)]
    assert step(s, now=0.8) == [("b", 8)]
    loose = Scheduler(cfg(prefill_s_per_token=0.1))
    for name in ("a", "b"):
        loose.add(seq(name, 8))
        loose.set_deadline(name, 5.0)
    assert step(loose, now=0.0) == [("a", 8), ("b", 8)]  # time enough: both in one step


def test_deadlines_are_ignored_when_the_order_is_off_or_no_clock_is_given() -> None:
    for s, now in ((Scheduler(cfg(deadline_order=False)), 0.0), (Scheduler(cfg()), None)):
        s.add(seq("old", 8))
        s.add(seq("urgent", 8))
        s.set_deadline("old", 100.0)
        s.set_deadline("urgent", 0.5)
        out = s.schedule(now=now)
        assert [c.seq_id for c in out.chunks] == ["old", "urgent"] and s.last_plan is None


def test_a_late_request_is_overtaken_only_until_it_is_overdue() -> None:
    # one slot; a fresh request that can make its deadline arrives before every step
    s = Scheduler(cfg(max_num_seqs=1, prefill_s_per_token=0.001, overdue_after_s=3.0))
    s.add(seq("late", 4, max_tokens=1))
    s.set_deadline("late", 0.0)  # already missed
    served: list[str] = []
    for k in range(8):
        s.add(seq(f"f{k}", 4, max_tokens=1))
        s.set_deadline(f"f{k}", k + 1.0)
        served += [i for i, _ in step(s, now=float(k))]
    assert served[:4] == ["f0", "f1", "f2", "f3"]  # behind the ones that can still make it ...
    assert served[4] == "late"  # ... until 3 s past its deadline (at 4.0 > 0 + 3)
    assert "late" not in s._seqs  # finished (max_tokens 1)


def test_admission_by_deadline_preempts_batch_requests_never_an_online_one() -> None:
    # 5 blocks of 4: on0 and b0 hold 2 each, on0's next decode takes the fifth
    s = Scheduler(cfg(num_blocks=5, prefill_s_per_token=0.001))
    s.add(seq("on0", 7, max_tokens=8))
    s.add(seq("b0", 7, priority=1, max_tokens=8))
    assert [i for i, _ in step(s, 0.0)] == ["on0", "b0"]
    s.add(seq("on1", 7, max_tokens=8))
    s.set_deadline("on1", 1.0)
    out = s.schedule(now=0.1)
    assert out.preempted == ["b0"] and "on1" in [c.seq_id for c in out.chunks]  # the batch one goes
    s.update(out, {c.seq_id: 7 for c in out.chunks if c.samples})
    s.add(seq("on2", 7, max_tokens=8))
    s.set_deadline("on2", 0.3)  # urgent, but the cache is held by older online requests: it waits
    out = s.schedule(now=0.2)
    assert out.preempted == [] and "on2" not in [c.seq_id for c in out.chunks]


def test_set_deadline_validation_and_cleanup() -> None:
    s = Scheduler(cfg())
    s.add(seq("a"))
    with pytest.raises(ValueError, match="deadline"):
        s.set_deadline("a", float("nan"))
    s.set_deadline("a", 2.0)
    s.set_deadline("gone", 1.0)  # unknown: ignored
    assert s.deadline_of("a") == 2.0 and s.deadline_of("gone") is None
    s.finish("a", "stop")
    assert s.deadline_of("a") is None


@pytest.mark.parametrize(
    "kw",
    [{"deadline_order": 1}, {"overdue_after_s": 0}, {"prefill_s_per_token": -1.0}, {"overdue_after_s": True}],
)
def test_config_validation(kw) -> None:
    name = next(iter(kw))
    with pytest.raises(ValueError, match=name):
        cfg(**kw)


# ---------------------------------------------------------------------------- the scheduler, by property


@st.composite
def deadline_workloads(draw, pressure: bool = False):
    config, requests = draw(workloads(pressure=pressure))
    config = SchedulerConfig(
        **{
            **config.__dict__,
            "deadline_order": True,
            "prefill_s_per_token": draw(st.sampled_from([0.001, 0.05, 0.3])),
            "overdue_after_s": draw(st.sampled_from([2.0, 10.0, math.inf])),
        }
    )
    for r in requests:
        if draw(st.integers(0, 4)):  # most have a TTFT SLO of 1 .. 20 steps; some none
            r.deadline = r.arrival_step + draw(st.integers(1, 20))
    return config, requests


def check_plans(result, requests: list[Request]) -> None:
    """Every step's plan: on-time prefills in deadline order, ahead of the late ones of their class."""
    deadlines = {r.seq_id: r.deadline for r in requests if r.deadline is not None}
    for plan in result.plans:
        if plan is None:
            continue
        for cls in (0, 1):
            members = [s for s in plan.order if rank(s)[0] == cls and not s.num_output_tokens]
            members = [s for s in members if s.seq_id not in plan.overdue]
            on_time = [s.seq_id for s in members if s.seq_id in deadlines and s.seq_id not in plan.late]
            assert [deadlines[i] for i in on_time] == sorted(deadlines[i] for i in on_time)
            positions = {s.seq_id: k for k, s in enumerate(members)}
            behind = [positions[s.seq_id] for s in members if s.seq_id not in on_time]
            assert all(positions[i] < min(behind, default=len(members)) for i in on_time)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(deadline_workloads())
def test_random_workloads_by_deadline_finish_with_the_tokens_of_first_come_first_served(workload) -> None:
    config, requests = workload
    by_deadline = check_against_reference(FakeEngine(config), requests)  # tokens = generated alone
    check_plans(by_deadline, requests)
    fcfs = FakeEngine(SchedulerConfig(**{**config.__dict__, "deadline_order": False}))
    assert fcfs.run(requests, work_bound(requests)).outputs == by_deadline.outputs


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(deadline_workloads(pressure=True))
def test_random_workloads_by_deadline_under_memory_pressure(workload) -> None:
    config, requests = workload
    check_plans(check_against_reference(FakeEngine(config), requests), requests)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.integers(1, 12), st.integers(1, 4)), min_size=2, max_size=25),
    st.sampled_from([1.0, 3.0]),
)
def test_no_request_waits_forever_behind_a_stream_of_requests_that_can_make_it(reqs, overdue_after) -> None:
    """A request arrives every step; each waits for its first chunk at most its SLO + `overdue_after_s` +
    the time the requests ahead of it take (whatever the stream behind it)."""
    config = cfg(max_num_seqs=1, max_num_batched_tokens=16, num_blocks=16, prefill_s_per_token=1 / 16,
                 overdue_after_s=overdue_after)  # fmt: skip
    requests = [
        Request(f"r{k}", [1] * n, SamplingParams(max_tokens=m), arrival_step=k, deadline=k + 2.0)
        for k, (n, m) in enumerate(reqs)
    ]
    result = check_against_reference(FakeEngine(config), requests)
    # one request runs at a time: each one ahead takes at most one step per prompt chunk and output token
    per_request = max(-(-n // 16) + m for n, m in reqs)
    for k, r in enumerate(requests):
        ahead = sum(1 for q in requests if q.deadline <= r.deadline + overdue_after)
        bound = r.deadline + overdue_after + 1 + ahead * per_request
        assert result.first_chunk_step[r.seq_id] <= bound, (k, result.first_chunk_step)
