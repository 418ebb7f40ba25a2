"""The README's main job: `lorafn up --demo --once` on SmolLM2 with the example adapters."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.local.platform_helpers import check_start_order

pytestmark = pytest.mark.slow


def test_demo_once_invokes_every_example_function(smollm2_dir: Path, tmp_path: Path) -> None:
    # smollm2_dir: the model is pulled (or found) in the cache first, so the demo's own pull is a copy.
    done = subprocess.run(
        [sys.executable, "-m", "lorafn.cli", "up", "--demo", "--once", "--port", "0", "--device", "cpu",
         "--state-dir", str(tmp_path / "state")],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    out = done.stdout
    assert "all invocations succeeded" in out
    for function in ("demo/french", "demo/gsm8k"):
        assert out.count(function) >= 2, out  # a cold and a warm call each
    assert "####" in out  # the GSM8K-format adapter's answer format
    assert not (tmp_path / "state" / "platform.json").exists()
    # the first answer comes fast: standbys warmed one at a time, none while a cold request's worker started
    # (four at once beside demo/french's fresh worker made its first token take 16.7 s on the 2-core VM)
    check_start_order(done.stdout + done.stderr, tmp_path / "state" / "logs")
