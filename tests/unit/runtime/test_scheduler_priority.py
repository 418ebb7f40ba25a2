"""Scheduler priority: online requests (priority 0) are admitted before batch ones (priority 1); batch
requests only fill the slots, token budget and KV blocks online ones leave, and are the ones preempted."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lorafn.runtime.sampling_params import SamplingParams
from lorafn.runtime.scheduler import Scheduler, SchedulerConfig, rank
from lorafn.runtime.sequence import Sequence


def seq(seq_id: str, n_prompt: int, priority: int = 0, max_tokens: int = 8) -> Sequence:
    return Sequence(
        seq_id, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens, priority=priority)
    )


def step(s: Scheduler) -> list[str]:
    """Run one step, sampling token 7 for every sampling chunk; ids of the scheduled sequences."""
    out = s.schedule()
    s.update(out, {c.seq_id: 7 for c in out.chunks if c.samples})
    return [c.seq_id for c in out.chunks]


def test_waiting_online_request_is_admitted_before_older_batch_requests() -> None:
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, block_size=4, num_blocks=64))
    for i in range(3):
        s.add(seq(f"b{i}", 4, priority=1))
    s.add(seq("online", 4))
    assert [x.seq_id for x in s.waiting] == ["online", "b0", "b1", "b2"]
    assert step(s) == ["online", "b0"]  # two slots: the online one first, a batch one fills the other


def test_batch_requests_fill_only_the_leftover_token_budget() -> None:
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10, block_size=4, num_blocks=64))
    s.add(seq("b0", 8, priority=1))
    s.add(seq("on", 6))
    out = s.schedule()
    chunks = {c.seq_id: c.num_tokens for c in out.chunks}
    assert chunks == {"on": 6, "b0": 4}  # the online prompt whole, the batch one gets the rest (chunked)


def test_online_request_preempts_batch_requests_for_kv_blocks_never_the_reverse() -> None:
    # 4 blocks of 4 tokens: two batch requests of 8 tokens hold them all
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=4, num_blocks=4))
    s.add(seq("b0", 7, priority=1))
    s.add(seq("b1", 7, priority=1))
    assert step(s) == ["b0", "b1"]
    s.add(seq("on", 7))
    out = s.schedule()
    assert out.preempted == ["b1"]  # the youngest batch request goes, the online one runs
    assert "on" in [c.seq_id for c in out.chunks]
    assert rank(s.get("on")) < rank(s.get("b0"))  # type: ignore[arg-type]
    # a new batch request never preempts: it waits
    s.update(out, {c.seq_id: 7 for c in out.chunks if c.samples})
    s.add(seq("b2", 7, priority=1))
    assert s.schedule().preempted == []


def test_priority_is_validated() -> None:
    with pytest.raises(ValueError, match="priority"):
        SamplingParams(priority=2)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 12), st.sampled_from([0, 1]), st.integers(1, 6)), min_size=1, max_size=12
    )
)
def test_every_request_finishes_and_no_batch_request_is_admitted_while_an_online_one_waits(reqs) -> None:
    s = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=8, block_size=4, num_blocks=12))
    for i, (n, prio, max_tokens) in enumerate(reqs):
        s.add(seq(f"r{i}", n, prio, max_tokens))
    done: set[str] = set()
    for _ in range(2000):
        if not s.has_unfinished():
            break
        online_waiting_before = {x.seq_id for x in s.waiting if x.params.priority == 0}
        out = s.schedule()
        admitted = [c.seq for c in out.chunks if c.start == 0]
        if any(x.params.priority == 1 for x in admitted):
            # a batch request was admitted: every online request that waited was admitted too
            assert online_waiting_before <= {x.seq_id for x in admitted} | set(out.preempted)
        for x in s.update(out, {c.seq_id: 7 for c in out.chunks if c.samples}):
            if x.num_output_tokens >= x.params.max_tokens:
                s.finish(x.seq_id, "length")
                done.add(x.seq_id)
    assert done == {f"r{i}" for i in range(len(reqs))}
