"""Local mode as a user lives in it, real processes throughout: `lorafn up --detach` from a folder that
holds a `lorafn/` directory, apply, get, invoke, status, logs, delete, down, and the start-up refusals
(a state dir in use, a port in use, an API key of another function). One platform for the module."""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from lorafn.local.config import PlatformState
from lorafn.local.lifecycle import gateway_answers
from lorafn.local.status import collect_status
from tests.integration.runtime.engine_helpers import write_peft_adapter
from tests.signals import sigint_default

pytestmark = pytest.mark.slow

KEY = "key-of-echo"


@dataclass
class Up:
    state_dir: Path
    cwd: Path
    tmp: Path
    pid: int
    adapter: Path
    model_dir: Path


def lorafn(up: Up | Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """`lorafn ARGS --state-dir S` as a user types it, from a folder that holds a `lorafn/` directory."""
    state_dir, cwd = (up.state_dir, up.cwd) if isinstance(up, Up) else (up, up.parent)
    return subprocess.run(
        [sys.executable, "-P", "-m", "lorafn.cli", *args, "--state-dir", str(state_dir)],
        capture_output=True, text=True, timeout=timeout, cwd=cwd,
    )  # fmt: skip


def _descendants(pid: int) -> set[int]:
    """Processes started by `pid`, at any depth (its children run in sessions of their own)."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        p, pp = (int(x) for x in line.split())
        children.setdefault(pp, []).append(p)
    found, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.add(c)
            todo.append(c)
    return found


def _alive(pid: int) -> bool:
    try:
        return ") Z " not in Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False


def _manifest(model_dir: Path, adapter: Path, name: str) -> str:
    return (
        f"apiVersion: lorafn.io/v1alpha1\nkind: Backbone\nmetadata: {{name: tiny}}\n"
        f"spec: {{model: {{uri: 'file://{model_dir}'}}, dtype: float32}}\n---\n"
        f"apiVersion: lorafn.io/v1alpha1\nkind: LoRAFunction\nmetadata: {{name: {name}, namespace: t}}\n"
        f"spec: {{backbone: tiny, adapter: {{uri: 'file://{adapter}'}}, "
        "scaling: {keepAliveSeconds: 300}}\n"
    )


@pytest.fixture(scope="module")
def up(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    tmp = tmp_path_factory.mktemp("lifecycle")
    cwd = tmp / "work"
    (cwd / "lorafn").mkdir(parents=True)  # bug 1: a `lorafn/` folder where the user stands
    adapter = write_peft_adapter(
        tiny_model_dir, tmp / "adapter", r=4, lora_alpha=8, target_modules="all-linear"
    )
    state_dir = tmp / "state"
    done = subprocess.run(
        [sys.executable, "-P", "-m", "lorafn.cli", "up", "--detach", "--port", "0", "--device", "cpu",
         "--state-dir", str(state_dir)],
        capture_output=True, text=True, timeout=300, cwd=cwd,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "lorafn down" in done.stdout  # it says how to stop it
    pid = PlatformState.read(state_dir).pid
    yield Up(state_dir, cwd, tmp, pid, adapter, tiny_model_dir)
    if _alive(pid):  # a test failed before `down`: leave nothing running
        everything = _descendants(pid)
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        for p in everything:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


def test_up_runs_from_a_folder_holding_a_lorafn_dir(up: Up) -> None:
    state = PlatformState.read(up.state_dir)
    gateway_log = (up.state_dir / "logs" / "gateway.log").read_text()
    assert "ImportError" not in gateway_log
    # The gateway that answers is the one `lorafn up` started (it checked the instance id it gave it).
    assert not gateway_answers(state.gateway_url, "another-instance")
    with urllib.request.urlopen(f"{state.gateway_url}/healthz", timeout=10) as reply:
        health = json.loads(reply.read())
    assert health["status"] == "ok" and health["instance"]


def test_a_second_up_on_the_state_dir_is_refused_and_harms_nothing(up: Up) -> None:
    before = (up.state_dir / "platform.json").read_text()
    sockets = sorted((up.state_dir / "sockets").iterdir())
    for extra in ([], ["--detach"]):
        second = lorafn(up, "up", "--port", "0", "--device", "cpu", *extra, timeout=60)
        assert second.returncode == 1, second.stdout + second.stderr
        assert f"in use by a running `lorafn up` (pid {up.pid})" in second.stderr
        assert "lorafn is up" not in second.stdout
    assert (up.state_dir / "platform.json").read_text() == before
    assert sorted((up.state_dir / "sockets").iterdir()) == sockets
    assert lorafn(up, "get", "backbones").returncode == 0


class _AnswersEverything(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b'{"status": "ok"}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_port_in_use_is_refused_before_anything_starts(up: Up) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _AnswersEverything)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        # Another process answers 200 on every path: it must never pass for our gateway.
        assert not gateway_answers(f"http://127.0.0.1:{port}", "any")
        state_dir = up.tmp / "state-port"
        started = time.monotonic()
        done = lorafn(state_dir, "up", "--port", str(port), "--device", "cpu", timeout=60)
        assert done.returncode == 1, done.stdout + done.stderr
        assert f"port {port} on 127.0.0.1 is not available" in done.stderr
        assert "lorafn is up" not in done.stdout and "gateway ready" not in done.stdout + done.stderr
        assert time.monotonic() - started < 30
        assert not (state_dir / "platform.json").exists()
    finally:
        server.shutdown()
        server.server_close()


def test_apply_invoke_and_an_api_key_of_another_function(up: Up) -> None:
    manifest = up.tmp / "echo.yaml"
    manifest.write_text(_manifest(up.model_dir, up.adapter, "echo"))
    applied = lorafn(up, "apply", "-f", str(manifest), "--api-key", KEY)
    assert applied.returncode == 0, applied.stderr
    assert "backbone/tiny created" in applied.stdout and "lorafunction/t/echo created" in applied.stdout
    again = lorafn(up, "apply", "-f", str(manifest), "--api-key", KEY)
    assert "lorafunction/t/echo configured" in again.stdout, again.stderr

    answer = lorafn(up, "invoke", "t/echo", "hello there", "--api-key", KEY, "--max-tokens", "6", "--raw")
    assert answer.returncode == 0 and answer.stdout.strip(), answer.stderr
    no_key = lorafn(up, "invoke", "t/echo", "hello")
    assert no_key.returncode != 0 and "missing API key" in no_key.stderr, no_key.stderr

    other = up.tmp / "other.yaml"
    other.write_text(_manifest(up.model_dir, up.adapter, "other"))
    taken = lorafn(up, "apply", "-f", str(other), "--api-key", KEY)
    assert taken.returncode != 0
    assert "already opens function t/echo" in taken.stderr
    assert "Traceback" not in taken.stderr and len(taken.stderr.strip().splitlines()) == 1
    listed = json.loads(lorafn(up, "get", "functions", "-o", "json").stdout)
    assert [f["name"] for f in listed["items"]] == ["t/echo"]  # nothing of other.yaml was registered
    # the backbone document of other.yaml (already there) was not re-written either: still one
    assert lorafn(up, "invoke", "t/echo", "hi", "--api-key", KEY, "--max-tokens", "2").returncode == 0


def test_status_and_get_tell_the_truth(up: Up) -> None:
    status = collect_status(PlatformState.read(up.state_dir))
    echo = status.function("t/echo")
    assert echo is not None
    assert echo.cold_starts >= 1  # bug 5: the gateway's cold_requests, not an unwritten counter
    assert echo.requests >= 2 and echo.phase == "Ready" and echo.workers
    assert echo.last_cold_start_ms is not None and echo.last_cold_path in ("standby", "fresh")
    assert echo.rank == "4" and "q_proj" in echo.targets

    shown = lorafn(up, "status")
    assert shown.returncode == 0, shown.stderr
    for heading in ("Functions", "Warm pool", "Workers", "running", "last cold start", "not ready because"):
        assert heading in shown.stdout
    table = lorafn(up, "get", "functions")
    assert table.returncode == 0 and "t/echo" in table.stdout and "Ready" in table.stdout
    assert f"{echo.last_cold_path})" in table.stdout
    as_yaml = lorafn(up, "get", "fn", "t/echo", "-o", "yaml")
    assert "rank: '4'" in as_yaml.stdout and "phase: Ready" in as_yaml.stdout, as_yaml.stdout
    bbs = json.loads(lorafn(up, "get", "backbones", "-o", "json").stdout)
    assert bbs["items"][0]["name"] == "tiny" and bbs["items"][0]["functions"] == 1
    missing = lorafn(up, "get", "functions", "t/nope")
    assert missing.returncode == 1 and 'function "t/nope" not found' in missing.stderr


def test_logs_of_a_function_the_gateway_and_the_backbone(up: Up) -> None:
    echo = collect_status(PlatformState.read(up.state_dir)).function("t/echo")
    assert echo is not None
    fn_logs = lorafn(up, "logs", "t/echo")
    assert fn_logs.returncode == 0, fn_logs.stderr
    assert f"{echo.workers[0]} serving t/echo" in fn_logs.stdout  # its worker's own log
    gateway = lorafn(up, "logs", "gateway")
    assert gateway.returncode == 0 and gateway.stdout.strip()
    assert lorafn(up, "logs", "backbone").returncode == 0
    assert lorafn(up, "logs", "up").stdout.strip()  # the detached `lorafn up` logs there
    nothing = lorafn(up, "logs", "t/nobody")
    assert nothing.returncode == 1 and "no worker of t/nobody" in nothing.stderr

    follow = subprocess.Popen(
        [sys.executable, "-P", "-m", "lorafn.cli", "logs", "gateway", "-f", "--tail", "0", "--state-dir",
         str(up.state_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=up.cwd, preexec_fn=sigint_default,
    )  # fmt: skip
    try:
        time.sleep(3)
        with (up.state_dir / "logs" / "gateway.log").open("a") as log:
            log.write("a line written while following\n")
        time.sleep(2)
    finally:
        follow.send_signal(signal.SIGINT)
        out, _ = follow.communicate(timeout=20)
    assert out == "a line written while following\n"  # --tail 0: only what came after


def test_delete_then_down_leave_nothing_behind(up: Up) -> None:
    missing = lorafn(up, "delete", "t/nope")
    assert missing.returncode == 1 and "not found: lorafunction/t/nope" in missing.stderr
    in_use = up.tmp / "bb-only.yaml"
    in_use.write_text(_manifest(up.model_dir, up.adapter, "echo").split("---")[0])
    refused = lorafn(up, "delete", "-f", str(in_use))
    assert refused.returncode == 1 and "backbone/tiny is used by t/echo" in refused.stderr

    deleted = lorafn(up, "delete", "-f", str(up.tmp / "echo.yaml"))
    assert deleted.returncode == 0, deleted.stderr
    assert 'lorafunction "t/echo" deleted' in deleted.stdout and 'backbone "tiny" deleted' in deleted.stdout
    assert json.loads(lorafn(up, "get", "functions", "-o", "json").stdout)["items"] == []
    gone = lorafn(up, "invoke", "t/echo", "hi", "--api-key", KEY)
    assert gone.returncode != 0

    everything = _descendants(up.pid)
    assert len(everything) >= 3  # redis-server, gateway, backbone server, workers
    down = lorafn(up, "down", timeout=120)
    assert down.returncode == 0, down.stderr
    assert f"lorafn (pid {up.pid}) stopped" in down.stdout
    assert not _alive(up.pid)
    left = [p for p in everything if _alive(p)]
    assert not left, subprocess.run(["ps", "-o", "pid,cmd", "-p", ",".join(map(str, left))],
                                    capture_output=True, text=True).stdout  # fmt: skip
    assert not (up.state_dir / "platform.json").exists()
    after = lorafn(up, "status")
    assert after.returncode != 0 and "start one with `lorafn up`" in after.stderr
    again = lorafn(up, "down")
    assert again.returncode == 1 and "no local platform is running" in again.stderr
