"""Fresh workers on a GPU (issue 11): a budgeted KV cache (what the controller always grants) is sized
without a profiling forward. (A worker forked from the zygote on a GPU: the `cuda` case of
tests/integration/local/test_zygote.py::test_up_forked_and_spawned_workers_answer_alike.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lorafn.runtime import Engine, EngineConfig
from lorafn.runtime.kv_cache import block_bytes, blocks_for_budget
from lorafn.runtime.model_runner import ModelRunner

pytestmark = pytest.mark.gpu


def test_a_kv_budget_sizes_the_cache_without_a_profiling_forward(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_profiling(self: ModelRunner, per_block: int) -> int:
        raise AssertionError("a profiling forward ran although a KV budget was given")

    monkeypatch.setattr(ModelRunner, "_profile_kv_blocks", no_profiling)
    budget = 64 << 20
    engine = Engine(
        EngineConfig(
            model=tiny_model_dir,
            device="cuda",
            dtype="bfloat16",
            kv_cache_memory_bytes=budget,
            cache_dir=tmp_path,
        )
    )
    runner = engine.runner
    assert runner.kv_blocks_from == "kv_cache_memory_bytes"
    per_block = block_bytes(engine.model_config, engine.config.block_size, torch.bfloat16)
    assert runner.num_blocks <= blocks_for_budget(budget, per_block)
    assert runner.kv_cache.nbytes <= budget + per_block  # + the one scratch block
    assert not (tmp_path / "kv_init").exists()  # nothing profiled, nothing saved
