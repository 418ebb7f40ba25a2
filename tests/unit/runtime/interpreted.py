"""Runs a small Triton check (Python source that prints "ok" last) in a child with Triton's interpreter on CPU
tensors (TRITON_INTERPRET must be set before triton is imported), for the kernel unit tests; and skips where
no Triton wheel exists."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def require_triton() -> None:
    """Skip off Linux x86-64 (no Triton wheels); there, Triton is a dev dependency and must import."""
    if not (sys.platform == "linux" and platform.machine() == "x86_64"):
        pytest.skip("Triton wheels exist for Linux x86-64 only")
    import triton  # noqa: F401  (its absence on Linux x86-64 is a failure)


def run_interpreted(check: str, timeout: float = 600) -> None:
    """Runs `check` interpreted; fails with its stderr's tail unless it exits 0 with "ok" printed last."""
    require_triton()
    proc = subprocess.run(
        [sys.executable, "-c", check],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
