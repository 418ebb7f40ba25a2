"""Runs a model check (a `tests.integration.runtime.*_check` module) in a child with Triton's interpreter
(TRITON_INTERPRET must be set before triton is imported): a tiny llama written with transformers and real PEFT
adapters, passed as `MODEL_DIR NAME=ADAPTER_DIR ...`."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.runtime.engine_helpers import write_hf_model, write_peft_adapter

ROOT = Path(__file__).resolve().parents[3]


def run_model_check(
    module: str, tiny_model_dir: Path, tmp_path: Path, adapters: dict, flags: list[str], seed: int
) -> str:
    """`python -m module *flags MODEL_DIR NAME=ADAPTER_DIR ...` (adapter i written with seed + i); its
    stdout, which must end in "ok" with exit status 0. Skips off Linux x86-64 (no Triton wheels there)."""
    if not (sys.platform == "linux" and platform.machine() == "x86_64"):
        pytest.skip("Triton wheels exist for Linux x86-64 only")
    import triton  # noqa: F401  (a dev dependency on Linux x86-64: its absence is a failure there)

    model = write_hf_model(tmp_path / "m", tiny_model_dir, "llama")
    args = [*flags, str(model)]
    for i, (name, kwargs) in enumerate(adapters.items()):
        args.append(f"{name}={write_peft_adapter(model, tmp_path / name, seed=seed + i, **kwargs)}")
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=1150,
        cwd=ROOT,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (
        proc.stdout[-2000:] + proc.stderr[-4000:]
    )
    return proc.stdout
