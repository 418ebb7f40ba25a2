"""The skinny GEMM with its input's residual add + RMSNorm or SiLU·up inside
(EngineConfig.gemm_prologue_rows): its outputs against the separate kernels it replaces, in bf16 as the GPU
rounds and in float32, with and without the LoRA expands inside. Triton's interpreter with GPU-like bf16
(triton_bf16.py) in a child process; seg_prologue_check.py does the work. tests/gpu/test_fused_decode_gpu.py
checks the compiled kernel."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def test_seg_linear_prologues_match_the_kernels_they_replace() -> None:
    if not (sys.platform == "linux" and platform.machine() == "x86_64"):
        pytest.skip("Triton wheels exist for Linux x86-64 only")
    import triton  # noqa: F401  (a dev dependency on Linux x86-64: its absence is a failure there)

    proc = subprocess.run(
        [sys.executable, "-m", "tests.integration.runtime.seg_prologue_check"],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    out = proc.stdout
    assert proc.returncode == 0 and out.strip().endswith("ok"), out[-2000:] + proc.stderr[-4000:]
    # 3 cases x 3 prologues x 2 dtypes, each output checked, residuals, torch checks, refusals
    assert out.count("in the GEMM,") >= 3 * 3 * 2, out
    assert out.count("the residual equals add_rms_norm's") == 3 * 2, out
    assert "bad prologues refused" in out
