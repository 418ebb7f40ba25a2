"""The first-steps profiler of a worker: records exactly the first N steps, writes table and trace once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lorafn.runtime.step_profile import StepProfiler
from lorafn.runtime.worker import WorkerSettings


def test_the_first_steps_are_recorded_and_written_once(tmp_path: Path) -> None:
    prof = StepProfiler(2, tmp_path / "p", "w-1")
    x = torch.randn(64, 64)
    for _ in range(3):  # the third is past the profile: not recorded, nothing rewritten
        with prof.step():
            (x @ x).sum()
    table, trace = prof.written
    assert table == tmp_path / "p" / "w-1.steps.txt" and trace.exists()
    text = table.read_text()
    first = text.splitlines()[0]
    assert first.startswith("worker w-1: first 2 engine steps, wall ms: ")
    assert len(first.split("wall ms: ")[1].split(", ")) == 2
    assert "lorafn_step_0" in text and "lorafn_step_1" in text and "lorafn_step_2" not in text
    assert "aten::mm" in text
    assert not prof.active


def test_off_by_default_and_refuses_a_negative_count(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    prof = StepProfiler(0, tmp_path, "w")
    with prof.step():
        pass
    assert prof.written == [] and not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="profile_steps"):
        StepProfiler(-1, tmp_path, "w")
    assert WorkerSettings().profile_steps == 0
    monkeypatch.setenv("LORAFN_PROFILE_STEPS", "3")
    monkeypatch.setenv("LORAFN_PROFILE_DIR", str(tmp_path))
    settings = WorkerSettings()
    assert (settings.profile_steps, settings.profile_dir) == (3, str(tmp_path))
