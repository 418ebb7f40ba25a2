"""Driving a real `lorafn up` from tests: the CLI as a subprocess, waiting on a condition while the
platform runs, the workers' heartbeat records, one invocation."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import redis


def lorafn(*args: str, state_dir: Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lorafn.cli", *args, "--state-dir", str(state_dir)],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def wait_for(what: str, check: Any, timeout_s: float, up: subprocess.Popen[str]) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if up.poll() is not None:
            raise AssertionError(f"lorafn up exited ({up.returncode}) while waiting for {what}")
        got = check()
        if got:
            return got
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


def workers(r: redis.Redis) -> dict[str, dict[str, str]]:
    out = {}
    for wid in r.zrange("lorafn:workers", 0, -1):
        h = r.hgetall(f"lorafn:worker:{wid}")
        if h:
            out[wid] = h
    return out


def invoke(state_dir: Path, function: str, key: str) -> subprocess.CompletedProcess[str]:
    return lorafn(
        "invoke", function, "hello", "--api-key", key, "--max-tokens", "4", "--raw", state_dir=state_dir
    )
