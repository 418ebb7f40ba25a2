"""`Scheduler.next_prefill_deadline`: the deadline of the first prompt the next step's deadline plan serves on
time, the one the worker bids for its GPU's prefill budget with (docs/scheduler.md#deadline-order)."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from lorafn.runtime.sampling_params import SamplingParams
from lorafn.runtime.scheduler import Scheduler, SchedulerConfig, rank
from lorafn.runtime.sequence import Sequence


def cfg(**kw) -> SchedulerConfig:
    base = dict(
        max_num_seqs=16,
        max_num_batched_tokens=512,
        block_size=4,
        num_blocks=512,
        deadline_order=True,
        prefill_s_per_token=0.002,
    )
    base.update(kw)
    return SchedulerConfig(**base)


def add(s: Scheduler, seq_id: str, n_prompt: int, deadline: float | None, priority: int = 0) -> Sequence:
    seq = Sequence(seq_id, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=4, priority=priority))
    s.add(seq)
    s.set_deadline(seq_id, deadline)
    return seq


def first_prefill(s: Scheduler, now: float) -> str:
    out = s.schedule(now=now)
    return next(c.seq_id for c in out.chunks if not c.is_decode)


# ---------------------------------------------------------------------------- by example


def test_a_late_oldest_request_gives_the_deadline_of_the_first_one_that_can_make_it() -> None:
    # five 100-token prompts of one 1 s SLO, arrived 0.0 .. 0.4 s; at 0.9 s with 2 ms a token r0 cannot make
    # it (1.1 > 1.0), r1 can (its prefill ends at 1.1 <= 1.1): the plan serves r1 first, and that is the bid
    s = Scheduler(cfg())
    for i in range(5):
        add(s, f"r{i}", 100, 1.0 + 0.1 * i)
    assert s.next_prefill_deadline(0.9) == 1.1
    assert first_prefill(s, 0.9) == "r1"


def test_with_time_to_spare_it_is_the_oldest_deadline() -> None:
    s = Scheduler(cfg())
    add(s, "a", 10, 5.0)
    add(s, "b", 10, 6.0)
    assert s.next_prefill_deadline(0.0) == 5.0


def test_none_when_nothing_can_make_it_or_the_order_is_off() -> None:
    s = Scheduler(cfg())
    add(s, "late", 100, 0.1)  # 0.2 s of prefill from 0.0
    assert s.next_prefill_deadline(0.0) is None
    off = Scheduler(cfg(deadline_order=False))
    add(off, "a", 10, 5.0)
    assert off.next_prefill_deadline(0.0) is None  # first come first served: the caller's oldest rule


def test_overdue_resumed_batch_and_undated_requests_are_not_the_bid() -> None:
    s = Scheduler(cfg(overdue_after_s=1.0))
    add(s, "over", 10, 0.5)  # 1.5 s past its deadline at 2.0: served first, but not savable
    resumed = add(s, "resumed", 10, 0.4)
    resumed.output_token_ids = [3]  # preempted after its first token: no TTFT left to meet
    add(s, "batch", 10, None, priority=1)
    add(s, "undated", 10, None)
    assert s.next_prefill_deadline(2.0) is None
    add(s, "ok", 10, 9.0)
    assert s.next_prefill_deadline(2.0) == 9.0
    assert first_prefill(s, 2.0) == "resumed"  # the plan's order itself is unchanged


def test_a_partial_prefill_counts() -> None:
    # a 300-token prompt chunked over steps of 128 tokens: its remaining tokens are planned, as schedule does
    s = Scheduler(cfg(max_num_batched_tokens=128))
    add(s, "long", 300, 10.0)
    out = s.schedule(now=0.0)
    s.update(out, {})
    assert s.num_waiting == 0 and s.next_prefill_deadline(0.3) == 10.0
    # 172 tokens left at 2 ms: done at 0.3 + 0.344 > 0.6, so it is predicted late now
    s.set_deadline("long", 0.6)
    assert s.next_prefill_deadline(0.3) is None


def test_the_plan_is_not_changed_by_asking() -> None:
    s = Scheduler(cfg())
    for i in range(5):
        add(s, f"r{i}", 100, 1.0 + 0.1 * i)
    before = [x.seq_id for x in s.waiting]
    s.next_prefill_deadline(0.9)
    assert [x.seq_id for x in s.waiting] == before and s.last_plan is None


# ---------------------------------------------------------------------------- against the plan


@st.composite
def states(draw):
    """A scheduler with online and batch requests, some with deadlines, after a few steps (partial
    prefills, decodes), and a `now`. Memory is ample: no preemption between asking and scheduling."""
    budget = draw(st.integers(8, 96))
    s = Scheduler(
        cfg(
            max_num_batched_tokens=budget,
            max_num_seqs=8,
            prefill_s_per_token=draw(st.floats(0.0005, 0.01)),
            overdue_after_s=draw(st.sampled_from([math.inf, 0.3, 1.0])),
        )
    )
    now = 0.0
    for k in range(draw(st.integers(1, 12))):
        priority = draw(st.sampled_from([0, 0, 0, 1]))
        dated = priority == 0 and draw(st.integers(0, 5)) > 0
        deadline = now + draw(st.floats(0.0, 1.0)) if dated else None
        add(s, f"q{k}", draw(st.integers(1, 80)), deadline, priority)
        if draw(st.booleans()):  # a step between arrivals
            out = s.schedule(now=now)
            for x in s.update(out, {c.seq_id: 7 for c in out.chunks if c.samples}):
                if x.num_output_tokens >= x.params.max_tokens:
                    s.finish(x.seq_id, "length")
        now += draw(st.floats(0.0, 0.3))
    return s, now


@settings(max_examples=300, deadline=None)
@given(states())
def test_it_is_the_first_on_time_prompt_of_the_plan_the_next_step_uses(state) -> None:
    s, now = state
    got = s.next_prefill_deadline(now)
    deadlines = {x.seq_id: s.deadline_of(x.seq_id) for x in s.waiting + s.running}
    s.schedule(now=now)  # plans the pending prefills (after its decodes) as the accessor did
    plan = s.last_plan
    assert plan is not None

    def on_time(x: Sequence) -> bool:
        return (
            rank(x)[0] == 0
            and deadlines.get(x.seq_id) is not None
            and x.num_output_tokens == 0
            and x.seq_id not in plan.late
            and x.seq_id not in plan.overdue
        )

    served = [x for x in plan.order if on_time(x)]
    if not served:
        assert got is None
        return
    assert got == deadlines[served[0].seq_id]  # the first on-time prompt of the plan ...
    assert got == min(deadlines[x.seq_id] for x in served)  # ... its earliest on-time deadline ...
    assert all(got >= deadlines[x.seq_id] for x in plan.order if x.seq_id in plan.overdue)
    assert got >= now  # ... never one that has passed


def test_order_off_is_always_none_whatever_the_state() -> None:
    s = Scheduler(cfg(deadline_order=False))
    for i in range(4):
        add(s, f"r{i}", 20, 5.0 + i)
    out = s.schedule(now=0.0)
    s.update(out, {c.seq_id: 7 for c in out.chunks if c.samples})
    add(s, "r4", 20, 0.01)
    assert s.next_prefill_deadline(0.0) is None
