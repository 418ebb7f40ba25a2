"""Parking on CUDA (docs/runtime.md#parking, issue 16): `Engine.park` gives the KV cache, the decode graphs
and their pool back to the driver (the device's free memory grows by at least the KV bytes; torch's reserved
memory drops by what park reports), and after `unpark` (graphs captured again on first need) greedy tokens
equal those before the park; park/unpark cycles leak nothing.

Run (H100; the 7B case reads LORAFN_LLAMA2_7B_DIR, else writes the random preset, ~13.5 GB):
    LORAFN_LLAMA2_7B_DIR=/tmp/llama-2-7b python3 -m pytest -q -s -m gpu tests/gpu/test_park_gpu.py
Each case prints one `park:` line (bytes and ms) for docs/benchmarks.md.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

import pytest
import torch

from lorafn.runtime import Engine, EngineConfig, SamplingParams

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = ["one two three four five six seven eight nine ten " * 6, "Hello", "The quick brown fox", "lorafn"]
MIB = 1 << 20


def _free_bytes() -> int:
    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


def _park_cycle(engine: Engine, label: str) -> None:
    before = engine.generate(PROMPTS, GREEDY)
    runner = engine.runner
    assert runner.graphs is not None and runner.graphs.graphs, "decode graphs were not captured"
    kv_bytes = runner.kv_cache.nbytes
    estimate = engine.park_release_bytes()
    free0, reserved0 = _free_bytes(), int(torch.cuda.memory_reserved())

    t0 = time.perf_counter()
    released = engine.park()
    park_ms = (time.perf_counter() - t0) * 1000
    free1, reserved1 = _free_bytes(), int(torch.cuda.memory_reserved())
    assert engine.parked and runner.graphs is None and runner.kv_cache is None
    assert released == reserved0 - reserved1  # what park reports is what torch gave back
    assert released >= kv_bytes  # the KV cache at least (+ graph pool, static inputs, cached activations)
    assert free1 - free0 >= kv_bytes  # and the driver has it: the device's free memory grew by that much
    assert engine.park() == released  # idempotent

    t0 = time.perf_counter()
    assert engine.unpark() == kv_bytes
    unpark_ms = (time.perf_counter() - t0) * 1000
    assert runner.graphs is not None and not runner.graphs.graphs  # pending: captured on first need
    after = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in after] == [o.token_ids for o in before]
    assert runner.graphs.graphs, "no decode graph was captured again after the unpark"
    print(
        f"\npark: {label} kv={kv_bytes / MIB:.1f} MiB estimate={estimate / MIB:.1f} MiB "
        f"released={released / MIB:.1f} MiB driver_free_delta={(free1 - free0) / MIB:.1f} MiB "
        f"park_ms={park_ms:.1f} unpark_ms={unpark_ms:.1f} graphs_again={sorted(runner.graphs.graphs)}"
    )

    # no leak: parking again (graphs captured again meanwhile) returns to the same reserved memory, cycle
    # after cycle (each lazy capture runs on another pool stream: its cuBLAS workspace goes with the park)
    for _ in range(3):
        engine.park()
        assert int(torch.cuda.memory_reserved()) <= reserved1 + 2 * MIB
        engine.unpark()
        assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == [o.token_ids for o in before]


def test_tiny_engine_parks_and_unparks_on_cuda(tiny_model_dir: Path) -> None:
    engine = Engine(
        EngineConfig(
            model=tiny_model_dir,
            device="cuda",
            dtype="bfloat16",
            max_num_seqs=8,
            kv_cache_memory_bytes=256 * MIB,
            cuda_graph_batch_sizes=(1, 2, 4, 8),
        )
    )
    try:
        _park_cycle(engine, "tiny")
    finally:
        del engine
        gc.collect()
        torch.cuda.empty_cache()


def test_7b_engine_parks_and_unparks_on_cuda(llama7b_dir: Path) -> None:
    engine = Engine(
        EngineConfig(
            model=llama7b_dir,
            device="cuda",
            dtype="bfloat16",
            max_num_seqs=16,
            kv_cache_memory_bytes=2048 * MIB,
        )
    )
    try:
        _park_cycle(engine, "llama-2-7b")
    finally:
        del engine
        gc.collect()
        torch.cuda.empty_cache()
