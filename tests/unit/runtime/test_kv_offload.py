"""KV offload (Vasuki): the pure swap-or-recompute policy, and the scheduler swapping preempted sequences
out to host memory and back (the fake engine checks every restored slot and compares the tokens with a
run without any scheduler, and with the same run preempting by recompute)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lorafn.runtime.kv_offload import (
    OffloadConfig,
    OffloadPolicy,
    recompute_seconds,
    should_swap,
    swap_seconds,
)
from lorafn.runtime.sampling_params import SamplingParams
from lorafn.runtime.scheduler import Scheduler, SchedulerConfig
from lorafn.runtime.sequence import Sequence

from .sched_harness import FakeEngine, Request
from .test_scheduler import check_against_reference, work_bound, workloads

GB = 1e9


# ---------------------------------------------------------------------------- the pure policy


def test_swap_is_chosen_when_the_copy_is_faster_than_the_prefill() -> None:
    # 7B: 512 KiB of KV per token; at 25 GB/s the copy out and in costs ~42 us per token
    per_token = 512 << 10
    assert swap_seconds(per_token * 1000, 25 * GB) == pytest.approx(2 * per_token * 1000 / 25e9)
    assert recompute_seconds(1000, 50e-6) == pytest.approx(0.05)
    assert should_swap(1000, per_token * 1000, 1 << 40, 25 * GB, 50e-6)  # 42 ms < 50 ms
    assert not should_swap(1000, per_token * 1000, 1 << 40, 25 * GB, 30e-6)  # 42 ms > 30 ms
    assert should_swap(1000, per_token * 1000, 1 << 40, 200 * GB, 30e-6)  # NVLink-C2C: 5 ms


def test_over_the_host_budget_recomputes() -> None:
    assert should_swap(100, 1000, 1000, 1e9, 1.0)
    assert not should_swap(100, 1001, 1000, 1e9, 1.0)
    assert not should_swap(0, 0, 1000, 1e9, 1.0)  # nothing computed: nothing to save


def test_policy_accounts_host_blocks_and_counts() -> None:
    p = OffloadPolicy(OffloadConfig(host_budget_bytes=10 * 100, host_link_bytes_per_s=1e9), block_bytes=100)
    assert p.num_host_blocks == 10
    assert p.should_swap(num_tokens=40, num_blocks=10)
    p.take(6)
    assert p.host_free_blocks == 4 and not p.should_swap(num_tokens=40, num_blocks=5)
    with pytest.raises(RuntimeError, match="host KV budget"):
        p.take(5)
    p.give(6, swapped_in=True)
    p.give(0, swapped_in=False)
    p.recomputed()
    assert p.stats.as_fields() == {
        "kv_swaps_out": 1,
        "kv_swaps_in": 1,
        "kv_swap_out_bytes": 600,
        "kv_swap_in_bytes": 600,
        "kv_recomputes": 1,
    }
    assert OffloadPolicy(OffloadConfig(host_budget_bytes=0), block_bytes=100).num_host_blocks == 0


def test_the_recompute_cost_is_learned_from_measured_prefill_steps() -> None:
    p = OffloadPolicy(OffloadConfig(prefill_s_per_token=1e-3, min_measured_tokens=64, smoothing=0.5), 1)
    p.observe_prefill(10, 1.0)  # too few tokens: fixed costs would dominate
    assert p.prefill_s_per_token == 1e-3 and not p.measured
    p.observe_prefill(100, 0.001)  # the first measurement replaces the prior
    assert p.prefill_s_per_token == pytest.approx(1e-5)
    p.observe_prefill(100, 0.003)
    assert p.prefill_s_per_token == pytest.approx(2e-5)


@pytest.mark.parametrize(
    "field,value",
    [
        ("host_budget_bytes", -1),
        ("host_budget_bytes", 1.5),
        ("host_link_bytes_per_s", 0),
        ("prefill_s_per_token", float("nan")),
        ("min_measured_tokens", 0),
        ("smoothing", 0),
        ("min_priority", 2),
    ],
)
def test_bad_settings_are_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        OffloadConfig(**{field: value})  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- the scheduler swaps


def always_swap(num_host_blocks: int = 1 << 20, min_priority: int = 0) -> OffloadPolicy:
    """Host link infinitely fast, recompute slow: every preemption that fits the budget swaps (online
    ones too with ``min_priority`` 0)."""
    cfg = OffloadConfig(
        host_budget_bytes=num_host_blocks,
        host_link_bytes_per_s=1e30,
        prefill_s_per_token=1.0,
        min_priority=min_priority,
    )
    return OffloadPolicy(cfg, block_bytes=1)


def seq(seq_id: str, n_prompt: int, priority: int = 0, max_tokens: int = 8) -> Sequence:
    return Sequence(
        seq_id, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens, priority=priority)
    )


def test_a_preempted_batch_request_is_swapped_out_and_goes_on_from_where_it_stopped() -> None:
    s = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=4, num_blocks=4), always_swap()
    )
    s.add(seq("b0", 7, priority=1))
    s.add(seq("b1", 7, priority=1))
    out = s.schedule()
    s.update(out, {"b0": 9, "b1": 9})  # both hold 2 blocks, 7 positions computed
    b1_blocks = list(s.get("b1").block_table)  # type: ignore[union-attr]
    s.add(seq("on", 7))
    out = s.schedule()
    assert out.preempted == ["b1"]
    assert out.swap_out == [("b1", b1_blocks)]  # copied out before the online prefill reuses them
    b1 = s.get("b1")
    assert b1 is not None and b1.swapped_tokens == 7 and b1.num_computed_tokens == 0
    assert s.offload is not None and s.offload.host_blocks_used == 2
    s.update(out, {c.seq_id: 9 for c in out.chunks if c.samples})
    s.finish("on", "stop")
    s.finish("b0", "stop")
    out = s.schedule()
    assert [sid for sid, _ in out.swap_in] == ["b1"]
    assert out.swap_in[0][1] == b1.block_table[:2]
    chunk = next(c for c in out.chunks if c.seq_id == "b1")
    assert (chunk.start, chunk.num_tokens, chunk.is_decode) == (7, 1, True)  # a decode, not a prefill of 8
    assert out.num_decodes == 1
    assert s.offload.host_blocks_used == 0
    assert s.offload.stats.swaps_out == 1 and s.offload.stats.swaps_in == 1


def test_by_default_only_batch_requests_are_swapped() -> None:
    p = always_swap(min_priority=1)
    assert p.should_swap(num_tokens=8, num_blocks=2, priority=1)
    assert not p.should_swap(num_tokens=8, num_blocks=2, priority=0)  # online: recompute, no host copies
    assert OffloadConfig().min_priority == 1
    # an online request preempted by an older online one is recomputed
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=4, num_blocks=4)
    s = Scheduler(config, always_swap(min_priority=1))
    s.add(seq("o0", 7))
    s.add(seq("o1", 7))
    out = s.schedule()
    s.update(out, {"o0": 9, "o1": 9})
    s.update(s.schedule(), {"o0": 9, "o1": 9})  # 8 tokens computed each: both need a third block next
    out = s.schedule()
    assert out.preempted == ["o1"] and out.swap_out == []
    assert s.offload is not None and s.offload.stats.recomputes == 1


def test_without_host_budget_it_recomputes() -> None:
    s = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=4, num_blocks=4), always_swap(0)
    )
    s.add(seq("b0", 7, priority=1))
    s.add(seq("b1", 7, priority=1))
    out = s.schedule()
    s.update(out, {"b0": 9, "b1": 9})
    s.add(seq("on", 7))
    out = s.schedule()
    assert out.preempted == ["b1"] and out.swap_out == []
    assert s.get("b1").swapped_tokens == 0  # type: ignore[union-attr]
    assert s.offload is not None and s.offload.stats.recomputes == 1


def test_a_swapped_out_request_that_is_aborted_gives_its_host_blocks_back() -> None:
    s = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=4, num_blocks=4), always_swap()
    )
    s.add(seq("b0", 7, priority=1))
    s.add(seq("b1", 7, priority=1))
    s.update(s.schedule(), {"b0": 9, "b1": 9})
    s.add(seq("on", 7))
    s.schedule()
    assert s.offload is not None and s.offload.host_blocks_used == 2
    s.abort("b1")
    assert s.offload.host_blocks_used == 0 and s.offload.stats.swaps_in == 0


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(pressure=True), st.integers(0, 12), st.booleans())
def test_swapping_gives_the_tokens_of_a_run_without_preemption_and_of_recompute(workload, host_blocks, batch):
    # Memory pressure: preemption is common. A small host budget mixes swaps and recomputes.
    config, requests = workload
    if batch:  # every other request is a batch request (online ones preempt them)
        for i, r in enumerate(requests):
            r.params = SamplingParams(**{**r.params.__dict__, "priority": i % 2})
    offload = always_swap(host_blocks)
    swapping = FakeEngine(config, offload)
    result = check_against_reference(swapping, requests)  # every restored slot is checked on read
    recompute = FakeEngine(config).run(requests, work_bound(requests))
    assert result.outputs == recompute.outputs and result.reasons == recompute.reasons
    assert offload.stats.swaps_in == swapping.num_swaps_in
    assert offload.stats.swaps_out + offload.stats.recomputes >= offload.stats.swaps_in


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(aborts=True))
def test_swapping_with_aborts_leaks_nothing(workload):
    config, requests = workload
    check_against_reference(FakeEngine(config, always_swap()), requests)


def test_swaps_happen_in_a_pressured_workload() -> None:
    """The property tests above must exercise swapping: a fixed workload that preempts."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, block_size=2, num_blocks=12)
    requests = [
        Request(
            f"r{i}", list(range(i, i + 9)), SamplingParams(max_tokens=12, temperature=0.0), arrival_step=i
        )
        for i in range(5)
    ]
    offload = always_swap()
    engine = FakeEngine(config, offload)
    check_against_reference(engine, requests)
    assert offload.stats.swaps_out >= 1 and engine.num_swaps_in == offload.stats.swaps_out
