"""Decode graphs restored from an archive inside real engines (issue 11 item 2 wired into the runtime):
the first process of a key captures and writes the archive; later processes (a standby, a lazily started
bound worker, another adapter of the same shape) restore every bucket instead of capturing and produce the
same tokens as engines that capture and as engines without archives, through every bucket's graph and for
two adapter shapes (all-linear r8; q/v r4); a damaged archive is refused and the
engine captures instead. Also over the backbone server's read-only W at its fixed address (a worker's
real set-up). Each engine runs in its own process (bench/graph_cache.py's `child`), as workers do."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from lorafn.runtime.config import ModelConfig
from lorafn.runtime.lora import write_random_adapter
from tests.integration.backbone_server.helpers import ServerProc
from tests.integration.runtime.engine_helpers import mixed_prompts

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from graph_cache import run_child  # noqa: E402  (bench/graph_cache.py: one engine per process)


def _child(cfg: dict) -> dict:
    return run_child(cfg, timeout=600)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    mc = ModelConfig.from_dir(tiny_model_dir)
    base = tmp_path_factory.mktemp("adapters")
    return [
        write_random_adapter(mc, base / f"a{seed}", rank=8, seed=seed, b_std=0.5, dtype=torch.float32)
        for seed in (1, 2)
    ] + [
        write_random_adapter(
            mc,
            base / "qv",
            rank=4,
            target_modules=["q_proj", "v_proj"],
            seed=3,
            b_std=0.5,
            dtype=torch.float32,
        )
    ]


def test_archived_graphs_restore_in_standbys_and_lazy_workers(
    tiny_model_dir: Path, adapters: list[Path], tmp_path: Path
) -> None:
    a1, a2 = str(adapters[0]), str(adapters[1])
    prompts = mixed_prompts(seed=3, lengths=(5, 19, 33, 2, 11, 7, 3, 25, 14), vocab=1000)
    # 1 MiB of KV holds 1024 tokens of the tiny bf16 model, fewer than its 2048 positions: the scheduler caps
    # the longest sequence to the cache, and the state's block tables must be sized as the engine asks
    common = {
        "model": str(tiny_model_dir),
        "cache_dir": str(tmp_path / "cache"),
        "prompts": prompts,
        "kv_mib": 1,
        "batches": [1, 2, 3, 5, 9],  # decode batches replaying buckets 1, 2, 4, 8, 16 (max_num_seqs 16)
    }
    reference = _child({**common, "adapter": a1, "archives": False})
    shape = reference["shape"]
    # 1. the first standby of the key captures and writes the archive
    first = _child({**common, "lora_shape": shape, "bind": a1})
    assert first["at_start"] == "captured" and first["written"], first["log"]
    assert Path(first["path"]).exists()
    # 2. the next standby restores every bucket at start, and after binding serves the same tokens
    second = _child({**common, "lora_shape": shape, "bind": a1})
    assert second["at_start"] == "restored", second["log"]
    assert second["buckets"] == first["buckets"]
    # 3. a lazily started bound worker restores at its first decode step
    lazy = _child({**common, "adapter": a1, "lazy": True})
    assert lazy["at_start"] == "lazy" and lazy["outcome"] == "restored", lazy["log"]
    assert first["buckets"] == [1, 2, 4, 8, 16]
    for run in (first, second, lazy):
        assert run["tokens"] == reference["tokens"] and run["single"] == reference["single"], run["log"]
        assert run["per_batch"] == reference["per_batch"], run["log"]
    # 4. another adapter of the same shape: its own tokens, through the restored graphs
    other_ref = _child({**common, "adapter": a2, "archives": False})
    other = _child({**common, "adapter": a2, "lazy": True})
    assert other["outcome"] == "restored", other["log"]
    assert other["tokens"] == other_ref["tokens"] and other["single"] == other_ref["single"]
    assert other["tokens"] != reference["tokens"]  # the adapters differ: the check can tell
    # 5. a second adapter shape (q/v, rank 4): its own archive, restored, the same tokens
    qv = str(adapters[2])
    qv_ref = _child({**common, "adapter": qv, "archives": False})
    assert qv_ref["shape"] != shape
    qv_first = _child({**common, "lora_shape": qv_ref["shape"], "bind": qv})
    qv_lazy = _child({**common, "adapter": qv, "lazy": True})
    assert qv_first["at_start"] == "captured" and qv_first["path"] != first["path"], qv_first["log"]
    assert qv_lazy["outcome"] == "restored", qv_lazy["log"]
    for run in (qv_first, qv_lazy):
        assert run["tokens"] == qv_ref["tokens"] and run["per_batch"] == qv_ref["per_batch"], run["log"]
    # 6. a damaged archive is refused, named in the log, and the engine captures instead
    path = Path(first["path"])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    damaged = _child({**common, "lora_shape": shape, "bind": a1})
    assert damaged["at_start"].startswith("refused"), damaged["log"]
    assert "not used" in damaged["log"]
    assert damaged["tokens"] == reference["tokens"]
    # 7. prefill graphs beside archived decode graphs (float32: a padded prefill must give the eager tokens):
    # the standby restores its decode graphs, captures its prefill ones outside the arena; the prompts run
    # alone (the two "single" ones, 5 and 19 tokens, and the batch of one, 5) replay buckets 8, 32 and 8
    f32 = {**common, "dtype": "float32"}
    ref32 = _child({**f32, "adapter": a1, "archives": False})
    for expected in ("captured", "restored"):
        pg = _child({**f32, "lora_shape": shape, "bind": a1, "prefill_tokens": [8, 32]})
        assert pg["at_start"] == expected, pg["log"]
        assert (pg["tokens"], pg["single"], pg["prefill_replays"]) == (ref32["tokens"], ref32["single"], 3)


def test_archived_graphs_over_the_shared_backbone(
    tiny_model_dir: Path, adapters: list[Path], tmp_path: Path
) -> None:
    srv = ServerProc(tiny_model_dir, tmp_path / "bb.sock", "cuda:0")
    try:
        srv.wait_ready(180)
        prompts = mixed_prompts(seed=4, lengths=(7, 23, 3), vocab=1000)
        common = {
            "model": str(tiny_model_dir),
            "cache_dir": str(tmp_path / "cache"),
            "prompts": prompts,
            "dtype": "float32",  # the server's copy is the file's dtype
            "backbone_socket": str(srv.sock),
        }
        reference = _child({**common, "adapter": str(adapters[0]), "archives": False})
        shape = reference["shape"]
        first = _child({**common, "lora_shape": shape, "bind": str(adapters[0])})
        assert first["at_start"] == "captured" and first["written"], first["log"]
        second = _child({**common, "adapter": str(adapters[0]), "lazy": True})
        assert second["outcome"] == "restored", second["log"]
        assert first["tokens"] == second["tokens"] == reference["tokens"]
        assert first["single"] == second["single"] == reference["single"]
    finally:
        srv.stop()
