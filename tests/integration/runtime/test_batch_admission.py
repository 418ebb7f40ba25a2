"""Offline batch requests have no deadline in the GPU's cross-function admission (docs/batch.md): a real
engine (tiny CPU model) with only batch requests to prefill asks the real script (redis-server) with
deadline `none`; with an online request waiting, the deadline is that request's, not an older batch one's."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

from lorafn.runtime import Engine, EngineConfig, SamplingParams
from lorafn.runtime.batching import Batching, BatchingConfig
from lorafn.store import Keys, Store
from lorafn.store import admission as adm

GPU = "local/0"


def test_batch_only_prefills_ask_without_a_deadline_and_online_ones_set_it(
    redis_server: str, tiny_model_dir: Path
) -> None:
    store, keys = Store(redis_server), Keys(f"t{uuid.uuid4().hex[:8]}")
    config = BatchingConfig(gpu=GPU, gpu_admission=True, ttft_ms=1000.0, backbone="tiny")
    batching = Batching(store, keys, "w-1", "ns/fn", config)
    # another worker holds the whole budget: w-1's ask waits, and its waiter entry shows its deadline
    assert store.run(
        adm.ask(keys, GPU, "holder", "ns/other", deadline_ms=0, t_ms=0, lease_ms=60_000,
                waiter_ttl_ms=60_000, active_ttl_ms=60_000, budget=4096, tokens=4096)
    ).granted  # fmt: skip
    engine = Engine(EngineConfig(model=tiny_model_dir, device="cpu", dtype="float32"))
    batch = SamplingParams(max_tokens=4, priority=1)
    old = time.time() * 1000 - 60_000  # a batch request enqueued a minute ago
    waiting = {engine.add_request([5, 6, 7], batch, "b-1"): old}
    assert engine.num_pending_online_prefills == 0 and engine.priority_of("b-1") == 1
    assert batching.allow_prefill(engine, waiting, set(waiting)) is False
    entry = store.client.hget(keys.gpu_waiting(GPU), "w-1")
    assert entry.startswith("none|"), entry  # no deadline: never urgent, behind every online waiter

    now = time.time() * 1000
    waiting[engine.add_request([8, 9], SamplingParams(max_tokens=4), "o-1")] = now
    assert engine.num_pending_online_prefills == 1 and engine.priority_of("o-1") == 0
    assert batching.allow_prefill(engine, waiting, set(waiting)) is False
    deadline = float(store.client.hget(keys.gpu_waiting(GPU), "w-1").split("|")[0])
    assert now + 1000 - 5 <= deadline <= now + 1000 + 5  # the online request's, not the batch one's
