"""Scheduler: stall-free chunked prefill under a token budget, paged KV blocks, preemption by recompute."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lorafn.runtime.sampling_params import SamplingParams
from lorafn.runtime.scheduler import Scheduler, SchedulerConfig, _chunk_tokens, _outranks
from lorafn.runtime.sequence import Sequence, SequenceStatus

from .sched_harness import FakeEngine, Request, reference


def cfg(**kw) -> SchedulerConfig:
    base = dict(max_num_seqs=4, max_num_batched_tokens=16, block_size=4, num_blocks=64)
    base.update(kw)
    return SchedulerConfig(**base)


def work_bound(requests: list[Request]) -> int:
    """Generous step bound: every token of every request computed a few times over."""
    return (
        50
        + 4 * sum(len(r.prompt) + r.params.max_tokens for r in requests)
        + max((r.arrival_step for r in requests), default=0)
    )


def check_against_reference(engine: FakeEngine, requests: list[Request]):
    result = engine.run(requests, work_bound(requests))
    max_len = engine.scheduler.max_model_len
    for r in requests:
        if len(r.prompt) > max_len:
            assert r.seq_id in result.refused
            continue
        tokens, reason = reference(r.prompt, r.params, max_len)
        if result.reasons[r.seq_id] == "abort":  # aborted mid-way: a prefix of the right tokens
            assert r.abort_step is not None
            assert tokens[: len(result.outputs[r.seq_id])] == result.outputs[r.seq_id]
            continue
        assert result.outputs[r.seq_id] == tokens, r.seq_id
        assert result.reasons[r.seq_id] == reason, r.seq_id
        if reason == "length" and len(r.prompt) + r.params.max_tokens <= max_len:
            assert len(tokens) == r.params.max_tokens  # exactly max_tokens
    return result


# ---------------------------------------------------------------------------- property-based


@st.composite
def workloads(draw, chunked: bool | None = None, pressure: bool = False, aborts: bool = False):
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    max_num_seqs = draw(st.integers(1, 6))
    budget = draw(st.integers(max_num_seqs, 48))
    num_requests = draw(st.integers(3, 10) if pressure else st.integers(1, 8))
    requests = []
    for i in range(num_requests):
        prompt = draw(st.lists(st.integers(0, 16), min_size=1, max_size=40))
        stop_ids = draw(st.lists(st.integers(0, 16), max_size=2))
        params = SamplingParams(max_tokens=draw(st.integers(1, 24)), temperature=0.0, stop_token_ids=stop_ids)
        arrival = draw(st.integers(0, 30))
        abort = draw(st.one_of(st.none(), st.integers(arrival, arrival + 30))) if aborts else None
        requests.append(Request(f"r{i}", prompt, params, arrival_step=arrival, abort_step=abort))
    longest = max(len(r.prompt) for r in requests)
    # From "barely fits the longest prompt" (heavy preemption) to plenty of memory.
    min_blocks = -(-longest // block_size)
    num_blocks = draw(st.integers(min_blocks, min_blocks + (3 if pressure else 40)))
    max_model_len = draw(st.one_of(st.none(), st.integers(1, 80)))
    enable_chunked = draw(st.booleans()) if chunked is None else chunked
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        block_size=block_size,
        num_blocks=num_blocks,
        enable_chunked_prefill=enable_chunked,
        max_model_len=max_model_len,
    )
    return config, requests


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_finish_correctly_within_limits(workload):
    config, requests = workload
    check_against_reference(FakeEngine(config), requests)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(pressure=True))
def test_random_workloads_under_memory_pressure(workload):
    # A cache that barely holds the longest prompt: preemption by recompute is the common case.
    config, requests = workload
    check_against_reference(FakeEngine(config), requests)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(aborts=True))
def test_random_aborts_free_everything_and_do_not_disturb_others(workload):
    config, requests = workload
    check_against_reference(FakeEngine(config), requests)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(chunked=True))
def test_chunked_on_and_off_give_the_same_tokens(workload):
    config, requests = workload
    on = FakeEngine(config).run(requests, work_bound(requests))
    config_off = SchedulerConfig(**{**config.__dict__, "enable_chunked_prefill": False})
    off = FakeEngine(config_off).run(requests, work_bound(requests))
    assert on.outputs == off.outputs
    assert on.reasons == off.reasons
    assert on.refused == off.refused


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.integers(1, 64))
def test_budget_and_memory_do_not_change_tokens(workload, budget):
    config, requests = workload
    base = FakeEngine(config).run(requests, work_bound(requests))
    other = SchedulerConfig(
        **{
            **config.__dict__,
            "max_num_batched_tokens": max(budget, config.max_num_seqs),
            "num_blocks": 512,
            "max_model_len": Scheduler(config).max_model_len,  # the cache caps it: keep it equal
        }
    )
    assert FakeEngine(other).run(requests, work_bound(requests)).outputs == base.outputs


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.integers(1, 64))
def test_a_prefill_cap_bounds_every_step_and_does_not_change_tokens(workload, cap):
    """Every step's prefill chunks stay within `max_prefill_tokens` (the GPU admission's grant; checked
    in FakeEngine.check_step), decodes are not held back by it, and the tokens are the same."""
    config, requests = workload
    base = FakeEngine(config).run(requests, work_bound(requests))
    capped = FakeEngine(config, prefill_cap=cap).run(requests, 4 * work_bound(requests))
    assert capped.outputs == base.outputs and capped.refused == base.refused


# ---------------------------------------------------------------------------- policy, by example


def run_steps(sched: Scheduler, tokens: int = 5, max_tokens: dict[str, int] | None = None):
    """Drive a scheduler with a constant token until done; return the step log."""
    log = []
    while sched.has_unfinished():
        out = sched.schedule()
        log.append([(c.seq_id, c.start, c.num_tokens, c.samples) for c in out.chunks])
        for seq in sched.update(out, {c.seq_id: tokens for c in out.chunks if c.samples}):
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq.seq_id, "length")
        assert len(log) < 1000
    return log


def seq(seq_id: str, n: int, max_tokens: int = 4) -> Sequence:
    return Sequence(seq_id, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, temperature=0))


def test_worked_example_from_the_docs():
    sched = Scheduler(cfg(max_num_seqs=4, max_num_batched_tokens=8, block_size=4, num_blocks=16))
    sched.add(seq("A", 3, max_tokens=3))
    sched.add(seq("B", 10, max_tokens=2))
    sched.add(seq("C", 6, max_tokens=2))
    log = run_steps(sched)
    assert log == [
        [("A", 0, 3, True), ("B", 0, 5, False)],
        [("A", 3, 1, True), ("B", 5, 5, True), ("C", 0, 2, False)],
        [("A", 4, 1, True), ("B", 10, 1, True), ("C", 2, 4, True)],
        [("C", 6, 1, True)],
    ]


def test_decodes_first_then_partial_prefill_then_new_requests():
    sched = Scheduler(cfg(max_num_seqs=8, max_num_batched_tokens=8, block_size=4, num_blocks=64))
    sched.add(seq("d", 2, max_tokens=10))
    out = sched.schedule()
    sched.update(out, {"d": 1})  # d is now decoding
    sched.add(seq("long", 20))
    out = sched.schedule()  # d decodes, long starts its prefill with the rest of the budget
    assert [(c.seq_id, c.num_tokens) for c in out.chunks] == [("d", 1), ("long", 7)]
    sched.update(out, {"d": 1})
    sched.add(seq("new", 3))
    out = sched.schedule()
    assert [(c.seq_id, c.start, c.num_tokens) for c in out.chunks] == [("d", 3, 1), ("long", 7, 7)]
    assert out.num_decodes == 1 and out.num_batched_tokens == 8
    sched.update(out, {"d": 1})
    out = sched.schedule()
    assert [(c.seq_id, c.start, c.num_tokens) for c in out.chunks] == [
        ("d", 4, 1),
        ("long", 14, 6),
        ("new", 0, 1),
    ]


def test_max_num_seqs_limits_the_running_batch():
    sched = Scheduler(cfg(max_num_seqs=2, max_num_batched_tokens=64))
    for i in range(5):
        sched.add(seq(f"s{i}", 3, max_tokens=3))
    out = sched.schedule()
    assert [c.seq_id for c in out.chunks] == ["s0", "s1"]
    assert sched.num_running == 2 and sched.num_waiting == 3


def test_unchunked_prefill_is_whole_or_waits():
    sched = Scheduler(cfg(max_num_seqs=4, max_num_batched_tokens=10, enable_chunked_prefill=False))
    sched.add(seq("a", 6, max_tokens=5))
    sched.add(seq("b", 6, max_tokens=5))
    out = sched.schedule()
    assert [(c.seq_id, c.num_tokens) for c in out.chunks] == [("a", 6)]  # b does not fit in the rest
    sched.update(out, {"a": 1})
    out = sched.schedule()
    assert [(c.seq_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 6)]


def test_unchunked_prompt_longer_than_budget_runs_alone_after_the_batch_drains():
    sched = Scheduler(cfg(max_num_seqs=4, max_num_batched_tokens=8, enable_chunked_prefill=False))
    sched.add(seq("a", 3, max_tokens=3))
    sched.add(seq("big", 20, max_tokens=2))
    sched.add(seq("c", 2, max_tokens=2))  # behind big: first come first served
    log = run_steps(sched)
    assert log[0] == [("a", 0, 3, True)]
    assert log[1] == [("a", 3, 1, True)]
    assert log[2] == [("a", 4, 1, True)]
    assert log[3] == [("big", 0, 20, True)]  # alone, over the budget
    assert log[4] == [("big", 20, 1, True), ("c", 0, 2, True)]


def test_prompt_longer_than_max_model_len_is_refused():
    sched = Scheduler(cfg(max_model_len=10))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add(seq("x", 11))
    sched.add(seq("ok", 10))
    # The cache caps max_model_len: 2 blocks of 4 hold 8 positions.
    small = Scheduler(cfg(num_blocks=2, max_model_len=100))
    assert small.max_model_len == 8
    with pytest.raises(ValueError, match="max_model_len"):
        small.add(seq("y", 9))


def test_add_validation():
    sched = Scheduler(cfg())
    sched.add(seq("a", 3))
    with pytest.raises(ValueError, match="seq_id"):
        sched.add(seq("a", 3))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        sched.add(Sequence("e", [], SamplingParams()))


@pytest.mark.parametrize(
    ("field", "kw"),
    [
        ("max_num_seqs", dict(max_num_seqs=0)),
        ("max_num_batched_tokens", dict(max_num_batched_tokens=0)),
        ("max_num_batched_tokens", dict(max_num_seqs=8, max_num_batched_tokens=4)),
        ("block_size", dict(block_size=0)),
        ("num_blocks", dict(num_blocks=-1)),
        ("max_model_len", dict(max_model_len=0)),
        ("enable_chunked_prefill", dict(enable_chunked_prefill="yes")),
        ("num_blocks", dict(num_blocks=2.5)),
    ],
)
def test_config_validation_names_the_field(field, kw):
    with pytest.raises(ValueError, match=field):
        cfg(**kw)


def test_length_finish_at_max_model_len():
    sched = Scheduler(cfg(max_model_len=6))
    sched.add(seq("a", 4, max_tokens=100))
    sched.add(seq("full", 6, max_tokens=100))  # a prompt of max_model_len still gets one token
    finished = {}
    while sched.has_unfinished():
        out = sched.schedule()
        for s in sched.update(out, {c.seq_id: 1 for c in out.chunks if c.samples}):
            if sched.reached_max_model_len(s):
                finished[s.seq_id] = sched.finish(s.seq_id, "length")
    assert finished["a"].num_tokens == 6 and finished["a"].num_output_tokens == 2
    assert finished["full"].num_output_tokens == 1
    assert sched.block_manager.num_free_blocks == sched.config.num_blocks


def test_safety_net_finishes_at_max_model_len_when_the_caller_does_not():
    sched = Scheduler(cfg(max_model_len=5))
    sched.add(seq("a", 3, max_tokens=100))
    reasons = []
    for _ in range(10):
        out = sched.schedule()
        reasons += [(s.seq_id, s.finish_reason) for s in out.finished]
        for c in out.chunks:
            assert c.end <= 5
        sched.update(out, {c.seq_id: 1 for c in out.chunks if c.samples})
        if not sched.has_unfinished():
            break
    assert reasons == [("a", "length")]
    assert sched.block_manager.num_free_blocks == sched.config.num_blocks


def test_abort_and_finish_free_blocks_and_are_idempotent():
    sched = Scheduler(cfg(num_blocks=8))
    sched.add(seq("a", 8))
    sched.add(seq("b", 4))
    sched.add(seq("w", 30))  # cannot fit yet: waits
    out = sched.schedule()
    assert sched.block_manager.num_free_blocks == 8 - 3
    aborted = sched.abort("a")
    assert aborted.status is SequenceStatus.FINISHED and aborted.finish_reason == "abort"
    assert sched.abort("a") is None and sched.finish("a", "stop") is None
    assert aborted.finish_reason == "abort"
    assert sched.abort("w").finish_reason == "abort"  # a waiting request
    sched.update(out, {"b": 3})  # a's chunk is skipped: it was aborted after schedule()
    assert sched.get("b").output_token_ids == [3]
    sched.finish("b", "stop")
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == 8


def test_update_twice_or_without_a_sample_is_an_error():
    sched = Scheduler(cfg())
    sched.add(seq("a", 3))
    out = sched.schedule()
    with pytest.raises(ValueError, match="sampled"):
        sched.update(out, {})
    sched = Scheduler(cfg())
    sched.add(seq("a", 3))
    out = sched.schedule()
    sched.update(out, {"a": 1})
    with pytest.raises(RuntimeError, match="stale"):
        sched.update(out, {"a": 1})


def test_a_step_prefills_at_most_the_granted_tokens_and_the_rest_waits_for_the_next_grant():
    sched = Scheduler(cfg(max_num_seqs=8, max_num_batched_tokens=16, block_size=4, num_blocks=64))
    sched.add(seq("d", 2, max_tokens=10))
    sched.update(sched.schedule(), {"d": 1})  # d decodes from now on
    sched.add(seq("a", 10))
    sched.add(seq("b", 6))
    assert sched.pending_prefill_tokens() == 16 and sched.pending_prefill_tokens(["b"]) == 6
    out = sched.schedule(max_prefill_tokens=7)  # the decode is not counted: 7 prompt tokens
    assert [(c.seq_id, c.start, c.num_tokens) for c in out.chunks] == [("d", 2, 1), ("a", 0, 7)]
    sched.update(out, {"d": 1})
    assert sched.pending_prefill_tokens() == 3 + 6
    out = sched.schedule(max_prefill_tokens=5)  # a's rest, then b's first 2 tokens
    assert [(c.seq_id, c.start, c.num_tokens) for c in out.chunks] == [("d", 3, 1), ("a", 7, 3), ("b", 0, 2)]
    sched.update(out, {"d": 1, "a": 1})
    out = sched.schedule(max_prefill_tokens=0)  # nothing granted: decodes only
    assert [(c.seq_id, c.num_tokens) for c in out.chunks] == [("d", 1), ("a", 1)]
    sched.update(out, {"d": 1, "a": 1})
    out = sched.schedule()  # no cap: the step budget alone
    assert [(c.seq_id, c.start, c.num_tokens) for c in out.chunks] == [("d", 5, 1), ("a", 11, 1), ("b", 2, 4)]
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        sched.schedule(max_prefill_tokens=-1)


def test_unchunked_prefill_under_a_cap_goes_whole_first_then_only_while_it_fits():
    sched = Scheduler(cfg(max_num_seqs=4, max_num_batched_tokens=16, enable_chunked_prefill=False))
    for name in ("a", "b", "c"):
        sched.add(seq(name, 4, max_tokens=3))
    out = sched.schedule(max_prefill_tokens=2)  # a cannot be split: it goes whole, nothing beside it
    assert [(c.seq_id, c.num_tokens) for c in out.chunks] == [("a", 4)]
    sched.update(out, {"a": 1})
    out = sched.schedule(max_prefill_tokens=9)
    assert [(c.seq_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 4), ("c", 4)]


def test_pending_prefill_tokens_count_a_preempted_request_whole():
    sched = Scheduler(cfg(max_num_seqs=2, max_num_batched_tokens=16, block_size=2, num_blocks=3))
    a, b = seq("a", 2, max_tokens=4), seq("b", 2, max_tokens=4)
    sched.add(a)
    sched.add(b)
    assert sched.pending_prefill_tokens() == 4
    for token in range(100, 140):
        out = sched.schedule()
        if out.preempted:
            break
        sched.update(out, {c.seq_id: token for c in out.chunks if c.samples})
        assert sched.pending_prefill_tokens() == 0  # both decode
    assert out.preempted == ["b"]  # its KV is gone: prompt + outputs are prefilled again
    assert sched.pending_prefill_tokens() == sched.pending_prefill_tokens(["b"]) == b.num_tokens > 2


# ---------------------------------------------------------------------------- preemption


def test_forced_preemption_recomputes_youngest_and_keeps_tokens():
    # 4 blocks of 2 tokens = 8 positions; two sequences of 3-token prompts that generate 4 each
    # cannot both hold 6-7 positions: the younger one is preempted, later recomputed.
    config = cfg(max_num_seqs=2, max_num_batched_tokens=8, block_size=2, num_blocks=4)
    requests = [
        Request("old", [1, 2, 3], SamplingParams(max_tokens=5, temperature=0)),
        Request("young", [4, 5, 6], SamplingParams(max_tokens=5, temperature=0)),
    ]
    engine = FakeEngine(config)
    result = check_against_reference(engine, requests)
    preempted = [sid for out in result.outputs_log for sid in out.preempted]
    assert preempted and set(preempted) == {"young"}  # the oldest is never preempted
    assert result.num_preemptions == len(preempted)
    # The trace described in docs/scheduler.md.
    trace = [[(c.seq_id, c.start, c.num_tokens) for c in out.chunks] for out in result.outputs_log]
    assert trace == [
        [("old", 0, 3), ("young", 0, 3)],
        [("old", 3, 1), ("young", 3, 1)],
        [("old", 4, 1)],
        [("old", 5, 1)],
        [("old", 6, 1)],
        [("young", 0, 5)],
        [("young", 5, 1)],
        [("young", 6, 1)],
    ]
    assert result.outputs_log[2].preempted == ["young"]


def test_preempted_sequence_is_recomputed_whole_and_samples_only_new_tokens():
    sched = Scheduler(cfg(max_num_seqs=2, max_num_batched_tokens=16, block_size=2, num_blocks=3))
    a, b = seq("a", 2, max_tokens=4), seq("b", 2, max_tokens=4)
    sched.add(a)
    sched.add(b)
    token = 100
    preempted_at = None
    for step in range(40):
        out = sched.schedule()
        if out.preempted and preempted_at is None:
            assert out.preempted == ["b"]
            preempted_at = step
            outputs_before = list(b.output_token_ids)
            assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and not b.block_table
        for c in out.chunks:
            if c.seq_id == "b" and c.start == 0 and preempted_at is not None:
                # Recompute covers prompt + all generated tokens; it samples the next new token.
                assert c.num_tokens == 2 + len(outputs_before) and c.samples
                assert c.token_ids == [1, 2, *outputs_before]
        token += 1
        for s in sched.update(out, {c.seq_id: token for c in out.chunks if c.samples}):
            if s.num_output_tokens >= 4:
                sched.finish(s.seq_id, "length")
        if not sched.has_unfinished():
            break
    assert preempted_at is not None
    assert a.num_output_tokens == 4 and b.num_output_tokens == 4
    assert len(set(b.output_token_ids)) == 4  # no token emitted twice


def test_admission_of_an_older_preempted_request_preempts_younger_ones():
    # The oldest request keeps priority when it comes back from a preemption.
    config = cfg(max_num_seqs=3, max_num_batched_tokens=12, block_size=1, num_blocks=12)
    requests = [
        Request("a", [1] * 4, SamplingParams(max_tokens=6, temperature=0)),
        Request("b", [2] * 4, SamplingParams(max_tokens=6, temperature=0)),
        Request("c", [3] * 3, SamplingParams(max_tokens=6, temperature=0), arrival_step=1),
    ]
    result = check_against_reference(FakeEngine(config), requests)
    assert "a" not in {sid for out in result.outputs_log for sid in out.preempted}


def test_single_request_that_fills_the_whole_cache_completes():
    # max_model_len is capped to the cache, so a request can always run alone to its end.
    config = cfg(max_num_seqs=2, max_num_batched_tokens=4, block_size=4, num_blocks=3)
    requests = [Request("x", list(range(10)), SamplingParams(max_tokens=50, temperature=0))]
    result = check_against_reference(FakeEngine(config), requests)
    assert result.reasons["x"] == "length" and len(result.outputs["x"]) == 2  # 10 + 2 = 12 = capacity


def test_large_request_is_not_starved_by_a_stream_of_small_ones():
    config = cfg(max_num_seqs=4, max_num_batched_tokens=8, block_size=4, num_blocks=12)
    requests = [Request("big", list(range(40)), SamplingParams(max_tokens=3, temperature=0), arrival_step=2)]
    requests += [
        Request(f"s{i}", [i % 17, 1], SamplingParams(max_tokens=4, temperature=0), arrival_step=i)
        for i in range(60)
    ]
    result = check_against_reference(FakeEngine(config), requests)
    log = result.outputs_log
    first_big = next(i for i, out in enumerate(log) if any(c.seq_id == "big" for c in out.chunks))
    assert first_big < 15


def test_every_request_progresses_under_memory_pressure():
    # Many requests, a cache that holds about one of them: lots of preemption, all finish right.
    config = cfg(max_num_seqs=6, max_num_batched_tokens=12, block_size=2, num_blocks=9)
    requests = [
        Request(
            f"r{i}",
            [(i * 5 + j) % 17 for j in range(3 + i % 7)],
            SamplingParams(max_tokens=4 + i % 5, temperature=0),
            arrival_step=i // 3,
        )
        for i in range(20)
    ]
    result = check_against_reference(FakeEngine(config), requests)
    assert result.num_preemptions > 0


def test_new_request_is_not_admitted_only_to_be_preempted_next_step():
    # block_size 1: every decode needs a new block. B would fit now, but the block A's next decode
    # needs would then be gone and B (the youngest) preempted at once; the lookahead makes B wait.
    config = cfg(max_num_seqs=4, max_num_batched_tokens=8, block_size=1, num_blocks=6)
    requests = [
        Request("A", [1, 2], SamplingParams(max_tokens=3, temperature=0)),
        Request("B", [3, 4, 5], SamplingParams(max_tokens=2, temperature=0), arrival_step=1),
    ]
    result = check_against_reference(FakeEngine(config), requests)
    assert result.num_preemptions == 0
    started = [i for i, out in enumerate(result.outputs_log) if any(c.seq_id == "B" for c in out.chunks)]
    assert started[0] == 3  # after A finished


# ---------------------------------------------------------------------------- shared by both orders


@pytest.mark.parametrize(
    ("num_tokens", "budget", "prefill_left", "chunked", "first_prefill", "runs_alone", "expected"),
    [
        (10, 6, 8, True, True, False, 6),  # chunked: what the budget leaves
        (10, 8, 3, True, False, False, 3),  # ... and the grant
        (4, 8, 8, True, False, False, 4),  # the whole rest
        (6, 8, 8, False, False, False, 6),  # unchunked: whole ...
        (9, 8, 20, False, True, False, None),  # ... or it waits for the budget
        (20, 8, 20, False, True, True, 20),  # longer than a step's budget with nothing running: alone
        (6, 8, 4, False, True, False, 6),  # the step's first prefill goes whole beyond the grant
        (6, 8, 4, False, False, False, None),  # a later one waits for the next grant
    ],
)
def test_chunk_tokens_sizes_a_prefill_chunk_or_makes_it_wait(
    num_tokens, budget, prefill_left, chunked, first_prefill, runs_alone, expected
):
    got = _chunk_tokens(num_tokens, budget, prefill_left, chunked, first_prefill, runs_alone)
    assert got == expected


def test_outranks_by_rank_or_by_class_only():
    online_old, online_young = seq("o0", 2), seq("o1", 2)
    batch = Sequence("b", [1, 2], SamplingParams(max_tokens=2, priority=1))
    online_old.arrival, online_young.arrival, batch.arrival = 0, 2, 1
    assert _outranks(online_young, online_old) and not _outranks(online_old, online_young)
    assert _outranks(batch, online_young) and not _outranks(online_young, batch)
    assert not _outranks(online_young, online_old, larger_class_only=True)
    assert _outranks(batch, online_old, larger_class_only=True)


@pytest.mark.parametrize("deadline_order", [False, True])
def test_both_orders_admit_under_the_same_limits(deadline_order):
    """Without deadlines the deadline order serves in arrival order: the same steps as first come first
    served, through the same chunk sizing and admission checks (slots, budget, grant, blocks)."""

    def make(**kw) -> Scheduler:
        return Scheduler(cfg(deadline_order=deadline_order, **kw))

    def step(sched: Scheduler, cap: int | None = None) -> list[tuple[str, int]]:
        out = sched.schedule(max_prefill_tokens=cap, now=0.0)
        for s in sched.update(out, {c.seq_id: 1 for c in out.chunks if c.samples}):
            if s.num_output_tokens >= s.params.max_tokens:
                sched.finish(s.seq_id, "length")
        return [(c.seq_id, c.num_tokens) for c in out.chunks]

    sched = make(max_num_seqs=2, max_num_batched_tokens=64)  # slots
    for i in range(3):
        sched.add(seq(f"s{i}", 3))
    assert step(sched) == [("s0", 3), ("s1", 3)]

    sched = make(max_num_batched_tokens=10, block_size=4, num_blocks=64)  # chunked: budget and grant
    sched.add(seq("a", 7))
    sched.add(seq("b", 7))
    assert step(sched) == [("a", 7), ("b", 3)]
    assert step(sched, cap=2) == [("a", 1), ("b", 2)]

    sched = make(max_num_batched_tokens=10, enable_chunked_prefill=False)  # unchunked: whole or waits
    sched.add(seq("a", 6, max_tokens=5))
    sched.add(seq("b", 6, max_tokens=5))
    assert step(sched) == [("a", 6)]
    assert step(sched) == [("a", 1), ("b", 6)]

    sched = make(max_num_batched_tokens=16, enable_chunked_prefill=False)  # unchunked under a grant
    for name in ("a", "b", "c"):
        sched.add(seq(name, 4, max_tokens=3))
    assert step(sched, cap=2) == [("a", 4)]
    assert step(sched, cap=9) == [("a", 1), ("b", 4), ("c", 4)]

    sched = make(max_num_batched_tokens=8, enable_chunked_prefill=False)  # longer than a step: alone
    sched.add(seq("a", 3, max_tokens=2))
    sched.add(seq("big", 20, max_tokens=2))
    assert [step(sched) for _ in range(3)] == [[("a", 3)], [("a", 1)], [("big", 20)]]

    # blocks: B is not admitted while its blocks would take the one A's next decode needs (block_size 1)
    sched = make(max_num_batched_tokens=8, block_size=1, num_blocks=6)
    sched.add(seq("A", 2, max_tokens=3))
    assert step(sched) == [("A", 2)]
    sched.add(seq("B", 3, max_tokens=2))
    assert [step(sched) for _ in range(3)] == [[("A", 1)], [("A", 1)], [("B", 3)]]


def test_sequence_token_views():
    s = Sequence("s", [1, 2, 3], SamplingParams(), output_token_ids=[4, 5])
    assert s.all_token_ids == [1, 2, 3, 4, 5] and s.num_tokens == 5 and s.last_token_id == 5
    assert s.token_ids_range(0, 2) == [1, 2]
    assert s.token_ids_range(3, 5) == [4, 5]
    assert s.token_ids_range(1, 4) == [2, 3, 4]
    for a in range(6):
        for b in range(a, 6):
            assert s.token_ids_range(a, b) == s.all_token_ids[a:b]
