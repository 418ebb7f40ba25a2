"""The worker's start-up line: the stages `default_engine` timed before the runner (CUDA context, backbone
attach and map) come first, in order, then the runner's, then the engine total."""

from __future__ import annotations

import logging
import re
import time
from types import SimpleNamespace

import pytest

from lorafn.runtime.worker import WorkerSettings, log_startup


def test_startup_line_splits_the_time_before_the_runner(caplog: pytest.LogCaptureFixture) -> None:
    engine = SimpleNamespace(
        pre_runner_s={"cuda_context": 0.412, "backbone_attach": 0.9, "backbone_map": 0.0305},
        runner=SimpleNamespace(startup_s={"context": 0.0, "adapter": 0.45, "backbone": 0.03}),
    )
    settings = WorkerSettings(function="default/echo", spawned_at_ms=int(time.time() * 1000) - 500)
    with caplog.at_level(logging.INFO, logger="lorafn.worker"):
        log_startup(engine, settings, built_at_ms=time.time() * 1000 - 200)
    (line,) = [r.getMessage() for r in caplog.records if "worker start-up" in r.getMessage()]
    keys = re.findall(r"(\w+)_ms=", line)
    assert keys == [
        "before_engine",
        "cuda_context",
        "backbone_attach",
        "backbone_map",
        "context",
        "adapter",
        "backbone",
        "engine",
    ]
    assert "cuda_context_ms=412 backbone_attach_ms=900 backbone_map_ms=30 " in line


def test_startup_line_without_pre_runner_stages(caplog: pytest.LogCaptureFixture) -> None:
    engine = SimpleNamespace(runner=SimpleNamespace(startup_s={"context": 1.5}))  # a local-weights engine
    with caplog.at_level(logging.INFO, logger="lorafn.worker"):
        log_startup(engine, WorkerSettings(function="default/echo"), built_at_ms=time.time() * 1000)
    (line,) = [r.getMessage() for r in caplog.records if "worker start-up" in r.getMessage()]
    assert re.findall(r"(\w+)_ms=", line) == ["context", "engine"]
    assert "context_ms=1500" in line
