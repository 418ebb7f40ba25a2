"""Resizing an Engine's KV cache while requests run (CPU, tiny random Llama; docs/runtime.md#resizing-the-kv-
cache): the blocks in use keep their contents, so greedy outputs equal an engine that never resized; a
larger cache admits more sequences at once; a smaller one is refused while a block above it is in use."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorafn.runtime import Engine, EngineConfig, SamplingParams
from lorafn.runtime.outputs import ParkRefused

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = [f"request number {i}: " + "one two three four five " * (1 + i % 3) for i in range(8)]


def make(model: Path, kv_blocks: int) -> Engine:
    probe = Engine(EngineConfig(model=model, device="cpu", dtype="float32", num_kv_blocks=1))
    per_block = probe.kv_block_bytes
    return Engine(
        EngineConfig(
            model=model, device="cpu", dtype="float32", max_num_seqs=8, max_num_batched_tokens=64,
            max_model_len=128, kv_cache_memory_bytes=(kv_blocks + 1) * per_block,
        )
    )  # fmt: skip


def run(engine: Engine, resize_after: int | None = None, kv_blocks: int = 0) -> tuple[list, int]:
    """Generate PROMPTS; after ``resize_after`` steps resize to ``kv_blocks`` usable blocks. Returns (token
    ids per prompt, most sequences running in one step)."""
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    outputs = {i: engine.get_output(i) for i in ids}  # finished requests leave the engine
    steps = widest = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        widest = max(widest, engine.scheduler.num_running)
        if steps == resize_after:
            engine.resize_kv((kv_blocks + 1) * engine.kv_block_bytes)
    return [outputs[i].token_ids for i in ids], widest


def test_growing_mid_run_keeps_every_token_and_widens_the_batch(tiny_model_dir: Path) -> None:
    small = make(tiny_model_dir, 10)  # 10 blocks of 16 tokens: ~3 of these sequences at once
    reference, widest_small = run(small)
    grown = make(tiny_model_dir, 10)
    tokens, widest = run(grown, resize_after=3, kv_blocks=64)
    assert tokens == reference
    assert grown.runner.kv_cache.num_blocks == grown.scheduler.block_manager.num_blocks == 64
    assert grown.scheduler.config.num_blocks == 64
    assert widest > widest_small  # the grant is what lets more sequences run at once
    grown.scheduler.block_manager.check_invariants([])


def test_shrinking_back_after_the_batch_and_serving_again(tiny_model_dir: Path) -> None:
    engine = make(tiny_model_dir, 10)
    reference, _ = run(make(tiny_model_dir, 64))
    engine.resize_kv(65 * engine.kv_block_bytes)
    assert run(engine)[0] == reference
    before = engine.runner.kv_cache.nbytes
    assert engine.resize_kv(11 * engine.kv_block_bytes) < before  # idle: nothing in use above block 10
    assert engine.scheduler.block_manager.num_free_blocks == 10
    assert run(engine)[0] == reference


def test_shrinking_below_a_block_in_use_is_refused_and_changes_nothing(tiny_model_dir: Path) -> None:
    engine = make(tiny_model_dir, 64)
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    outputs = {i: engine.get_output(i) for i in ids}
    for _ in range(4):
        engine.step()
    manager = engine.scheduler.block_manager
    assert manager.num_used_blocks > 8
    with pytest.raises(ParkRefused, match="busy: num_blocks: 8 would drop"):
        engine.resize_kv(9 * engine.kv_block_bytes)
    assert manager.num_blocks == engine.runner.num_blocks == 64
    while engine.has_unfinished():
        engine.step()
    reference, _ = run(make(tiny_model_dir, 64))
    assert [outputs[i].token_ids for i in ids] == reference


def test_a_cache_too_small_for_one_longest_sequence_is_refused(tiny_model_dir: Path) -> None:
    engine = make(tiny_model_dir, 10)  # max_model_len 128 = 8 blocks
    with pytest.raises(ParkRefused, match="less than one sequence of max_model_len 128"):
        engine.resize_kv(5 * engine.kv_block_bytes)
    engine.park()
    with pytest.raises(ParkRefused, match="parked"):
        engine.resize_kv(20 * engine.kv_block_bytes)
