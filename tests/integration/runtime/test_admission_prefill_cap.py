"""A step prefills no more than the GPU's admission granted it: a real engine (tiny CPU model) and the real
script (redis-server). The budget counts the tokens a worker asked with; a share handed to it while it
waited holds the tokens of that ask, so requests that arrived since wait for the next grant instead of
riding along uncounted (before, the step prefilled them all and the device held more prefill work than
its budget)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

from lorafn.runtime import Engine, EngineConfig, SamplingParams
from lorafn.runtime.batching import Batching, BatchingConfig
from lorafn.store import Keys, Store, combine
from lorafn.store import admission as adm

GPU = "local/0"


def _hold_budget(store: Store, keys: Keys) -> None:
    assert store.run(
        adm.ask(keys, GPU, "holder", "ns/other", deadline_ms=0, t_ms=0, lease_ms=60_000,
                waiter_ttl_ms=60_000, active_ttl_ms=60_000, budget=4096, tokens=4096)
    ).granted  # fmt: skip


def test_a_share_handed_on_caps_the_step_at_the_tokens_it_was_asked_for(
    redis_server: str, tiny_model_dir: Path
) -> None:
    store, keys = Store(redis_server), Keys(f"t{uuid.uuid4().hex[:8]}")
    config = BatchingConfig(gpu=GPU, gpu_admission=True, ttft_ms=1000.0, backbone="tiny")
    batching = Batching(store, keys, "w-1", "ns/fn", config)
    engine = Engine(EngineConfig(model=tiny_model_dir, device="cpu", dtype="float32"))
    params = SamplingParams(max_tokens=4, temperature=0.0)
    _hold_budget(store, keys)
    now = time.time() * 1000
    waiting = {engine.add_request(list(range(5, 45)), params, "a"): now}  # 40 prompt tokens
    assert batching.allow_prefill(engine, waiting, set(waiting)) is False  # waits, asking for 40
    assert batching.prefill_cap is None
    waiting[engine.add_request(list(range(50, 80)), params, "b")] = now  # 30 more arrive meanwhile
    assert store.run(adm.release(keys, GPU, "holder", 60_000, budget=4096))  # handed to w-1 (40)
    assert batching.allow_prefill(engine, waiting, set(waiting)) is True
    assert batching.prefill_cap == 40
    engine.step(max_prefill_tokens=batching.prefill_cap)
    assert engine.last_prefill_tokens == 40  # a only; uncapped the step prefilled a and b: 70
    assert engine.pending_prefill_tokens() == 30
    batching.after_step(engine.last_step, 1.0, set(waiting), engine.num_pending_prefills)
    store.run(combine(*batching.pipeline_ops(busy=True)))  # as the loop: the share is kept (more to do)
    assert batching.allow_prefill(engine, {"b": now}, set(waiting)) is True  # b's 30, asked afresh
    assert batching.prefill_cap == 30
    engine.step(max_prefill_tokens=batching.prefill_cap)
    assert engine.last_prefill_tokens == 30 and engine.num_pending_prefills == 0
    grants = [g for g in store.run(adm.grants(keys, GPU)) if g.worker == "w-1"]
    assert [g.tokens for g in grants] == [40, 30]


def test_a_preempted_request_is_asked_for_whole(redis_server: str, tiny_model_dir: Path) -> None:
    """A request preempted by recompute has its first token already (it is not among the worker's
    waiting requests) but its prompt and outputs are prefilled again: the ask counts them, so the cap at
    the grant does not starve the recompute (asked for the waiting prompts alone, it got 1 token)."""
    store, keys = Store(redis_server), Keys(f"t{uuid.uuid4().hex[:8]}")
    config = BatchingConfig(gpu=GPU, gpu_admission=True, ttft_ms=1000.0, backbone="tiny")
    batching = Batching(store, keys, "w-1", "ns/fn", config)
    # 3 blocks of 16: two 16-token prompts fit, and when the older needs its third block the younger is
    # preempted (online requests are recomputed, never swapped)
    engine = Engine(EngineConfig(model=tiny_model_dir, device="cpu", dtype="float32", num_kv_blocks=3))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine.add_request(list(range(5, 21)), params, "old")
    engine.add_request(list(range(30, 46)), params, "young")
    for _ in range(40):
        engine.step()
        if engine.num_preemptions:
            break
    young = engine.scheduler.get("young")
    assert engine.num_preemptions == 1 and young is not None and young.num_output_tokens >= 1
    assert engine.num_pending_prefills == 1 and engine.pending_prefill_tokens() == young.num_tokens
    assert batching.allow_prefill(engine, {}, {"old", "young"}) is True  # nothing waits for a first token
    assert batching.prefill_cap == young.num_tokens  # the recompute, whole
