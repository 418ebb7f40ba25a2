"""The model with its GEMM inputs computed inside the skinny GEMMs (EngineConfig.gemm_prologue_rows: the
residual add + RMSNorm before q/k/v and gate/up, SiLU·up before down) against the plain torch forward: the
CUDA model code run on CPU tensors with Triton's interpreter, float32, base model and two adapter shapes
(all-linear r16, q/v only r8: groups without an adapter beside ones with). gemm_prologue_check.py does the
work in a child (TRITON_INTERPRET must be set before triton is imported); ~3-5 minutes on a 2-core VM."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.runtime.engine_helpers import write_hf_model, write_peft_adapter

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.timeout(1200)  # interpreted Triton, CPU-bound (as test_lora_grouped.py)

ADAPTERS = {
    "r16-all-linear": dict(r=16, lora_alpha=32, target_modules="all-linear"),
    "r8-qv": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
}


def test_gemm_prologue_equals_torch(tiny_model_dir: Path, tmp_path: Path) -> None:
    if not (sys.platform == "linux" and platform.machine() == "x86_64"):
        pytest.skip("Triton wheels exist for Linux x86-64 only")
    import triton  # noqa: F401  (a dev dependency on Linux x86-64: its absence is a failure there)

    model = write_hf_model(tmp_path / "m", tiny_model_dir, "llama")
    args = [str(model)]
    for i, (name, kwargs) in enumerate(ADAPTERS.items()):
        args.append(f"{name}={write_peft_adapter(model, tmp_path / name, seed=31 + i, **kwargs)}")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.integration.runtime.gemm_prologue_check", *args],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=1150,
        cwd=ROOT,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (
        proc.stdout[-2000:] + proc.stderr[-4000:]
    )
    for name in ("base", *ADAPTERS):
        assert f"{name} gemm_prologue_rows=64: as the torch forward" in proc.stdout, proc.stdout
        assert f"{name} gemm_prologue_rows=1: as the torch forward (the one-row step alone" in proc.stdout
    for name in ADAPTERS:
        line = f"{name} gemm_prologue_rows=64, expands in the per-row kernels: as the torch forward, none"
        assert line in proc.stdout, proc.stdout
