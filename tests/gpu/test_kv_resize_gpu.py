"""Resizing the KV cache on CUDA while requests run (docs/batch.md#kv-from-idle-memory, issue 17): a grow in
the middle of a generation (decode graphs captured before it, dropped and captured again after) keeps every
greedy token of a run that never resized (same batch composition: the cache is large enough for every
sequence either way); the device's free memory drops by the grant; resizing back gives it to the driver again,
cycle after cycle (no leak).

Run (H100; the 7B case reads LORAFN_LLAMA2_7B_DIR, else writes the random preset, ~13.5 GB):
    LORAFN_LLAMA2_7B_DIR=/tmp/llama-2-7b python3 -m pytest -q -s -m gpu tests/gpu/test_kv_resize_gpu.py
Each case prints one `resize:` line (MiB and ms) for docs/batch.md.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

import pytest
import torch

from lorafn.runtime import Engine, EngineConfig, SamplingParams
from tests.gpu.test_park_gpu import MIB, PROMPTS, _free_bytes

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def _run(engine: Engine, grow_to: int | None = None) -> list[list[int]]:
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    outputs = [engine.get_output(i) for i in ids]
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps == 8 and grow_to is not None:
            assert engine.runner.graphs is not None and engine.runner.graphs.graphs, (
                "no graph before the grow"
            )
            engine.resize_kv(grow_to)
    return [o.token_ids for o in outputs]


def _resize_cycle(config: EngineConfig, grow_to: int, label: str) -> None:
    reference = _run(Engine(config))
    gc.collect()
    torch.cuda.empty_cache()
    engine = Engine(config)
    start_kv = engine.runner.kv_cache.nbytes
    _run(engine)  # graphs captured, allocator settled
    free0, reserved0 = _free_bytes(), int(torch.cuda.memory_reserved())
    t0 = time.perf_counter()
    assert _run(engine, grow_to=grow_to) == reference
    grown_kv = engine.runner.kv_cache.nbytes
    free1 = _free_bytes()
    assert grow_to - engine.kv_block_bytes <= grown_kv <= grow_to
    assert free0 - free1 >= grown_kv - start_kv - 64 * MIB  # the driver sees the grant held
    assert engine.runner.graphs is not None and engine.runner.graphs.graphs, "graphs not captured again"
    run_ms = (time.perf_counter() - t0) * 1000
    t0 = time.perf_counter()
    assert engine.resize_kv(start_kv) == start_kv
    shrink_ms = (time.perf_counter() - t0) * 1000
    free2 = _free_bytes()
    assert free2 - free1 >= grown_kv - start_kv - 64 * MIB  # and has it back after the return
    assert _run(engine) == reference
    for _ in range(3):  # no leak over grow/return cycles
        engine.resize_kv(grow_to)
        engine.resize_kv(start_kv)
        assert _run(engine) == reference
    assert int(torch.cuda.memory_reserved()) <= reserved0 + 64 * MIB
    print(
        f"\nresize: {label} kv {start_kv / MIB:.0f} -> {grown_kv / MIB:.0f} MiB, driver free -"
        f"{(free0 - free1) / MIB:.0f} then +{(free2 - free1) / MIB:.0f} MiB; run with the grow "
        f"{run_ms:.0f} ms, return {shrink_ms:.1f} ms"
    )
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def test_tiny_engine_resizes_its_kv_cache_on_cuda(tiny_model_dir: Path) -> None:
    config = EngineConfig(
        model=tiny_model_dir, device="cuda", dtype="bfloat16", max_num_seqs=8,
        kv_cache_memory_bytes=64 * MIB, cuda_graph_batch_sizes=(1, 2, 4, 8),
    )  # fmt: skip
    _resize_cycle(config, 512 * MIB, "tiny")


def test_7b_engine_resizes_its_kv_cache_on_cuda(llama7b_dir: Path) -> None:
    config = EngineConfig(
        model=llama7b_dir, device="cuda", dtype="bfloat16", max_num_seqs=16, kv_cache_memory_bytes=2048 * MIB
    )
    _resize_cycle(config, 8192 * MIB, "llama-2-7b")
