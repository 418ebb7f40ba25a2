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


def test_a_worker_process_parks_on_cuda(redis_server: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    """The seam on a GPU: a real `lorafn worker serve --device cuda` (tiny model, 256 MiB KV budget, so its
    heartbeat carries the driver's count of the process, `mem_bytes`): `park` -> `parked` with released bytes
    >= its KV bytes, and the driver's count drops by at least the KV bytes; a request sent while parked is
    answered after `unpark` with the same greedy text as before the park."""
    import uuid

    from lorafn.store import Keys, Store, control, workers
    from tests.integration.gateway.harness import (
        register,
        start_worker_process,
        stop_process,
        wait_live_workers,
    )
    from tests.integration.runtime.test_worker_park import FN, _answer, _Events, _heartbeat, _send, _until

    prefix = f"t{uuid.uuid4().hex[:8]}"
    store, keys = Store(redis_server), Keys(prefix)
    register(store, keys, FN, [], model_dir=str(tiny_model_dir))
    wid = "gpu-parking-worker"
    log = tmp_path / "worker.log"
    proc = start_worker_process(
        redis_server, prefix, FN, log, LORAFN_ENGINE_FACTORY="", LORAFN_WORKER_ID=wid, LORAFN_GPU="local/0",
        LORAFN_KEEP_ALIVE_SECONDS="600", LORAFN_DEVICE="cuda", LORAFN_KV_BUDGET_MIB="256",
    )  # fmt: skip
    try:
        wait_live_workers(None, store, keys, FN, 1, timeout=120)
        prompt = "The quick brown fox jumps over"
        _send(store, keys, "before", prompt)
        before, _ = _answer(store, keys, "before")
        unparked = _until(
            "a heartbeat with the driver's count and no graphs pending",
            lambda: (
                (h := _heartbeat(store, keys, wid)).get("mem_source") == "driver"
                and h.get("graphs_pending") == "0"
                and h
            ),
            timeout=120,
        )
        kv_bytes = int(unparked["kv_bytes"])
        events = _Events(store, keys)
        store.run(workers.send_control(keys, wid, "park"))
        released = int(events.next(control.PARKED, wid)["released_bytes"])
        parked = _until(
            "a parked heartbeat", lambda: (h := _heartbeat(store, keys, wid)).get("parked") == "1" and h
        )
        drop = int(unparked["mem_bytes"]) - int(parked["mem_bytes"])
        print(
            f"\npark: worker kv={kv_bytes / MIB:.1f} MiB released={released / MIB:.1f} MiB "
            f"estimate={int(unparked['park_release_bytes']) / MIB:.1f} MiB driver_drop={drop / MIB:.1f} MiB "
            f"(mem_bytes {int(unparked['mem_bytes']) / MIB:.0f} -> {int(parked['mem_bytes']) / MIB:.0f} MiB)"
        )
        assert released >= kv_bytes > 0 and drop >= kv_bytes
        _send(store, keys, "while-parked", prompt)
        store.run(workers.send_control(keys, wid, "unpark"))
        assert int(events.next(control.UNPARKED, wid)["kv_bytes"]) == kv_bytes
        after, _ = _answer(store, keys, "while-parked")
        assert after == before
    finally:
        code = stop_process(proc)
    assert code == 0, log.read_text()[-3000:]
