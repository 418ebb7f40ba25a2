"""Decode CUDA graphs restored in another process (issue 11 item 2): the probe bench/graph_restore.py captures
in one child process, restores in another (no capture there), and both run the same greedy decode steps.
Restored graphs must give the captured graphs' logits bit for bit, the same tokens as eager, pass the
self-check (every bucket; an extra restore child checks only the smallest), and a changed key or a damaged
file must be refused naming why (a further child: an archive with another key is refused with a warning
naming the field and the graphs are captured instead)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("rope_in_attention", [False, True])
def test_restored_decode_graphs_replay_like_captured_ones(tmp_path: Path, rope_in_attention: bool) -> None:
    """(rope_in_attention: the decode graphs' attention launches rotate q, k and write K/V themselves: another
    variant of the split kernel, under the same function name, to restore.)"""
    pytest.importorskip("cuda.bindings", reason="graph materialization uses cuda-bindings (the gpu extra)")
    out = tmp_path / "summary.json"
    cmd = [
        sys.executable,
        "bench/graph_restore.py",
        "--preset",
        "tiny",
        "--device",
        "cuda",
        "--capture-runs",
        "1",
        "--buckets",
        "1,4,32",  # a fused-decode bucket, one with padding rows' kernels, one on the cuBLAS path
        "--steps",
        "4",
        "--replays",
        "5",
        "--workdir",
        str(tmp_path / "work"),
        "--out",
        str(out),
        *(["--rope-in-attention"] if rope_in_attention else []),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200, check=False)
    log = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert out.exists(), log
    s = json.loads(out.read_text())
    for role in ("capture", "restore"):
        r = s[role]
        assert r.get("ok"), f"{role} failed at {r.get('failed_stage')}: {r.get('error')}\n{log}"
    assert s["restore"]["restore_report"]["selfcheck"] == {"1": True, "4": True, "32": True}, log
    # the extra restore child with the one-bucket self-check (times only) checked the smallest bucket
    assert s["restore_alt"]["one"]["restore_report"]["selfcheck"] == {"1": True}, log
    assert s["restore_alt"]["one/t4"]["restore_report"]["selfcheck"] == {"1": True}, log  # 4 threads
    assert s["restore_alt"]["cover"]["restore_report"]["selfcheck"].get("1") is True, log
    assert set(s["ready_s"]) == {"all", "one", "cover", "one/t4", "none"}
    assert set(s["buckets"]) == {"1", "4", "32"}
    for bucket, r in s["buckets"].items():
        assert r["restored_vs_captured_logits_bitwise"], (bucket, r)
        assert r["restored_vs_captured_tokens_equal"], (bucket, r)
        assert r["restored_vs_eager_tokens_equal"], (bucket, r)
    assert "driver:" in s["restore"]["refused_key"]
    assert "checksum mismatch" in s["restore"]["refused_corrupt"]
    fallback = s["fallback"]["fallback"]  # an archive with another key: refused naming it, then captured
    assert fallback["mode"] == "captured" and any("torch:" in w for w in fallback["warnings"]), fallback
    assert s["ok"], log
