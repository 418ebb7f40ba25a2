"""`lorafn up` as real processes: redis-server, backbone server, gateway, workers; then a clean stop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.runtime.engine_helpers import write_peft_adapter
from tests.signals import sigint_default

pytestmark = pytest.mark.slow


def _lorafn(*args: str, state_dir: Path, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lorafn.cli", *args, "--state-dir", str(state_dir)],
        capture_output=True, text=True, timeout=180, **kw,
    )  # fmt: skip


def _wait_for_state(
    state_dir: Path, proc: subprocess.Popen[str], timeout_s: float = 120
) -> dict[str, object]:
    path = state_dir / "platform.json"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(
                f"lorafn up exited early ({proc.returncode}):\n{proc.stdout.read() if proc.stdout else ''}"
            )
        if path.exists():
            return json.loads(path.read_text())
        time.sleep(0.2)
    raise AssertionError("lorafn up did not write platform.json in time")


def _pids_of_children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_up_apply_invoke_status_and_clean_stop(tiny_model_dir: Path, tmp_path: Path) -> None:
    adapter = write_peft_adapter(
        tiny_model_dir, tmp_path / "adapter", r=4, lora_alpha=8, target_modules="all-linear"
    )
    state_dir = tmp_path / "state"
    up = subprocess.Popen(
        [sys.executable, "-m", "lorafn.cli", "up", "--state-dir", str(state_dir), "--port", "0",
         "--device", "cpu"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=sigint_default,
    )  # fmt: skip
    try:
        state = _wait_for_state(state_dir, up)
        assert str(state["gateway_url"]).startswith("http://127.0.0.1:")
        manifest = tmp_path / "fn.yaml"
        manifest.write_text(
            f"apiVersion: lorafn.io/v1alpha1\nkind: Backbone\nmetadata: {{name: tiny}}\n"
            f"spec: {{model: {{uri: 'file://{tiny_model_dir}'}}, dtype: float32}}\n---\n"
            "apiVersion: lorafn.io/v1alpha1\nkind: LoRAFunction\nmetadata: {name: echo, namespace: t}\n"
            f"spec: {{backbone: tiny, adapter: {{uri: 'file://{adapter}'}}, "
            "scaling: {keepAliveSeconds: 300}}\n"
        )
        applied = _lorafn("apply", "-f", str(manifest), "--api-key", "secret-key", state_dir=state_dir)
        assert applied.returncode == 0, applied.stderr
        assert "lorafunction/t/echo created" in applied.stdout

        refused = _lorafn("invoke", "t/echo", "hello", "--api-key", "wrong", state_dir=state_dir)
        assert refused.returncode != 0
        assert "401" in refused.stderr

        for stream in (False, True):
            args = [
                "invoke",
                "t/echo",
                "hello there",
                "--api-key",
                "secret-key",
                "--max-tokens",
                "8",
                "--raw",
            ]
            done = _lorafn(*args, *(["--stream"] if stream else []), state_dir=state_dir)
            assert done.returncode == 0, done.stderr + (
                up.stdout.read() if up.poll() is not None and up.stdout else ""
            )
            assert done.stdout.strip(), "the function answered with no text"

        # The worker mapped the backbone server's copy instead of loading its own.
        bb = subprocess.run(
            [sys.executable, "-m", "lorafn.cli", "backbone-server", "stats", "--socket",
             str(state_dir / "sockets" / "tiny.local-0.sock")],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert bb.returncode == 0, bb.stderr
        # every worker process (the bound one, and any standby of the warm pool) maps the one copy
        assert len(json.loads(bb.stdout)["leases"]) >= 1

        status = _lorafn("status", state_dir=state_dir)
        assert status.returncode == 0, status.stderr
        assert "t/echo" in status.stdout and "tiny" in status.stdout
        children = _pids_of_children(up.pid)
        assert len(children) >= 3  # redis-server, gateway, backbone server, worker
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
            raise
    assert up.returncode == 0, up.stdout.read() if up.stdout else ""
    assert not (state_dir / "platform.json").exists()
    for pid in children:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text(), pid
    after = _lorafn("status", state_dir=state_dir)
    assert after.returncode != 0 and "start one with `lorafn up`" in after.stderr


def test_up_refuses_bad_config(tmp_path: Path) -> None:
    bad = tmp_path / "c.yaml"
    bad.write_text("gateway_port: -5\n")
    done = _lorafn("up", "--config", str(bad), state_dir=tmp_path / "s")
    assert done.returncode == 2
    assert "config.gateway_port" in done.stderr
