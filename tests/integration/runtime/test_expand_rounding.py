"""The bf16 roundings of every kernel that adds a LoRA expand (grouped and per row: every lora_expand mode and
the small decode steps): the expand summed in float32, added in float32 and rounded once, as addmm_ does
on a CPU. Triton's interpreter with GPU-like bf16 (triton_bf16.py) in a child process (TRITON_INTERPRET must
be set before triton is imported); expand_rounding_check.py does the work (~25 s on a 2-core VM). The GPU
tests (tests/gpu/test_engine_gpu.py) check the compiled kernels against the same reference."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def test_expand_kernels_round_once_in_bf16() -> None:
    if not (sys.platform == "linux" and platform.machine() == "x86_64"):
        pytest.skip("Triton wheels exist for Linux x86-64 only")
    import triton  # noqa: F401  (a dev dependency on Linux x86-64: its absence is a failure there)

    proc = subprocess.run(
        [sys.executable, "-m", "tests.integration.runtime.expand_rounding_check"],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    out = proc.stdout
    assert proc.returncode == 0 and out.strip().endswith("ok"), out[-2000:] + proc.stderr[-4000:]
    assert out.count("equal to the round-once reference") == 19, out
    for kernel in ("lora_expand", "silu_mul_expand", "silu_mul_lora", "rope_expand_kv", "rope_lora_kv",
                   "add_rms_norm_expand", "add_rms_norm + expand"):  # fmt: skip
        assert f"{kernel} " in out, kernel
