"""The zygote as real processes: it forks workers for the local executor, which reaps, stops and reads
them as it does spawned ones; a dead zygote means plain spawns until it is back.

Workers here run the gateway tests' fake engine (`tests.integration.gateway.harness:fake_engine`), so
these tests measure the process plumbing, not the model; `test_up_forked_and_spawned_workers_answer_alike`
runs the real engine through `lorafn up`.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lorafn.api.sizing import MiB
from lorafn.controller.driver import Exit
from lorafn.controller.policy.actions import Start
from lorafn.local.executor import LocalExecutor
from lorafn.local.procs import Child, ProcessGroup
from lorafn.local.zygote import ZYGOTE_NAME, ZygoteKeeper
from lorafn.store import Keys, Store
from tests.integration.gateway.harness import (
    client,
    expected_text,
    fake_engine,
    gateway,
    register,
    wait_live_workers,
)
from tests.signals import sigint_default

pytestmark = pytest.mark.slow

PREFIX = "zy"
FUNCTION = "t/echo"


def _parent_pid(pid: int) -> int:
    # /proc/PID/stat: "pid (comm) state ppid ..."; comm may hold spaces, so split after its ')'
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


class Rig:
    """A process group, a zygote keeper and the executor over them, reaped as `LocalPlatform._reap` does."""

    def __init__(
        self, tmp: Path, redis_url: str, zygote: bool = True, extra_env: dict[str, str] | None = None
    ) -> None:
        self.procs = ProcessGroup(tmp / "logs")
        self.keeper = ZygoteKeeper(tmp / "sockets" / "zygote.sock", enabled=zygote)
        env = {
            "LORAFN_REDIS_URL": redis_url,
            "LORAFN_KEY_PREFIX": PREFIX,
            "LORAFN_ENGINE_FACTORY": "tests.integration.gateway.harness:fake_engine",
            "LORAFN_HEARTBEAT_S": "0.2",
            "LORAFN_HEARTBEAT_TTL_S": "2.0",
            **(extra_env or {}),
        }
        self.executor = LocalExecutor(
            self.procs,
            "cpu",
            env=lambda: env,
            backbone_socket=lambda _b, _g: None,
            backbone_bytes=lambda _b: 0,
            resident=lambda _g: [],
            kv_budget=lambda _a: 64 * MiB,
            zygote=self.keeper,
        )
        self.exits: list[Exit] = []

    def start(self, worker_id: str) -> None:
        action = Start(
            gpu="local/0", backbone="tiny", shape=None, function=FUNCTION, mem_bytes=MiB, reason="t"
        )
        self.executor.start(action, worker_id)

    def reap(self) -> None:
        for child in self.procs.reap():
            if child.name.startswith("worker/"):
                self.executor.note_exit(child)
            elif child.name == ZYGOTE_NAME:
                self.executor.zygote_exited(child)
        self.exits += self.executor.exits()

    def wait_exit(self, worker_id: str, timeout_s: float = 20) -> Exit:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.reap()
            for e in self.exits:
                if e.worker_id == worker_id:
                    return e
            time.sleep(0.05)
        raise AssertionError(f"no exit of {worker_id} seen in {timeout_s} s")

    def child(self, worker_id: str) -> Child:
        return self.procs.children[f"worker/{worker_id}"]


@pytest.fixture
def rig(tmp_path: Path, redis_server: str) -> Iterator[Rig]:
    rig = Rig(tmp_path, redis_server)
    register(Store(redis_server), Keys(PREFIX), FUNCTION, ["k"])
    try:
        yield rig
    finally:
        rig.procs.stop_all(order=("worker/",), timeout_s=10)


def _answer(url: str, prompt: str) -> str:
    with client(url, "k") as c:
        r = c.post("/v1/completions", json={"model": FUNCTION, "prompt": prompt, "max_tokens": 4})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]


def test_a_forked_worker_serves_and_its_stop_and_kill_are_seen(rig: Rig, redis_server: str) -> None:
    store, keys = Store(redis_server), Keys(PREFIX)
    rig.executor.start_zygote()
    assert rig.executor.wait_zygote(120)
    zygote_pid = rig.procs.children[ZYGOTE_NAME].pid
    assert rig.keeper.socket_path.stat().st_mode & 0o777 == 0o600

    rig.start("w1")
    w1 = rig.child("w1")
    assert w1.forked, "the worker was spawned, not forked"
    assert _parent_pid(w1.pid) == zygote_pid
    wait_live_workers(None, store, keys, FUNCTION, 1, timeout=30)
    with gateway(redis_server, PREFIX) as url:
        assert _answer(url, "hello") == expected_text("hello", 4)
    assert "worker w1" in w1.log_path.read_text() or w1.log_path.stat().st_size > 0  # its log is ours to read
    assert [w.id for w in rig.executor.starting()] == ["w1"]

    rig.executor.stop("w1")  # SIGTERM through the pidfd: the worker drains and exits 0
    assert rig.wait_exit("w1").code == 0
    assert not rig.executor.starting()

    rig.start("w2")
    w2 = rig.child("w2")
    assert w2.forked
    wait_live_workers(None, store, keys, FUNCTION, 1, timeout=30)
    os.kill(w2.pid, signal.SIGKILL)  # dies on its own: a failure the controller must see
    assert rig.wait_exit("w2").code == -signal.SIGKILL


def freeze_probe_engine(settings: Any, record: Any) -> Any:
    """engine_factory: writes how many objects the worker process holds frozen when its engine is made
    (before the worker's own `gc.freeze()`) to LORAFN_TEST_FREEZE_FILE, then makes the fake engine."""
    from triton.runtime.cache import triton_key

    # and whether Triton's per-process source hash is computed already (the zygote's warm_triton)
    cached = triton_key.cache_info().currsize
    Path(os.environ["LORAFN_TEST_FREEZE_FILE"]).write_text(f"{gc.get_freeze_count()} {cached}")
    return fake_engine(settings, record)


def test_a_forked_worker_starts_on_the_zygotes_frozen_heap_and_serves(
    tmp_path: Path, redis_server: str
) -> None:
    """The zygote freezes what its imports made before it serves forks (copy-on-write pages stay shared,
    the children's collections skip them) and has done Triton's per-process set-up; a child inherits
    both and still serves."""
    probe = tmp_path / "frozen.txt"
    factory = "tests.integration.local.test_zygote:freeze_probe_engine"
    rig = Rig(
        tmp_path, redis_server,
        extra_env={"LORAFN_ENGINE_FACTORY": factory, "LORAFN_TEST_FREEZE_FILE": str(probe)},
    )  # fmt: skip
    store, keys = Store(redis_server), Keys(PREFIX)
    register(store, keys, FUNCTION, ["k"])
    try:
        rig.executor.start_zygote()
        assert rig.executor.wait_zygote(120)
        rig.start("w1")
        assert rig.child("w1").forked
        wait_live_workers(None, store, keys, FUNCTION, 1, timeout=30)
        frozen, triton_cached = map(int, probe.read_text().split())
        # torch alone is far more than 10k objects; 0 before the zygote froze its heap
        assert frozen > 10_000
        assert triton_cached == 1  # hashed once in the zygote (~0.4 s a child no longer pays)
        with gateway(redis_server, PREFIX) as url:
            assert _answer(url, "frozen") == expected_text("frozen", 4)
    finally:
        rig.procs.stop_all(order=("worker/",), timeout_s=10)


def test_a_dead_zygote_means_spawns_until_it_is_back(rig: Rig, redis_server: str) -> None:
    store, keys = Store(redis_server), Keys(PREFIX)
    rig.executor.start_zygote()
    assert rig.executor.wait_zygote(120)
    rig.start("w1")
    w1 = rig.child("w1")
    assert w1.forked
    wait_live_workers(None, store, keys, FUNCTION, 1, timeout=30)

    zygote = rig.procs.children[ZYGOTE_NAME]
    zygote.proc.kill()
    zygote.proc.wait()
    rig.reap()  # the reaper sees the zygote's end and starts a new one
    assert rig.procs.children[ZYGOTE_NAME].pid != zygote.pid
    rig.start("w2")  # the new zygote is still importing: a plain spawn
    w2 = rig.child("w2")
    assert not w2.forked
    wait_live_workers(None, store, keys, FUNCTION, 2, timeout=60)
    with gateway(redis_server, PREFIX) as url:
        assert _answer(url, "still there") == expected_text("still there", 4)

    # w1 outlived its zygote: reparented to us (the subreaper), its exit code is still read
    assert w1.alive()
    assert _parent_pid(w1.pid) == os.getpid()
    rig.executor.stop("w1")
    assert rig.wait_exit("w1").code == 0

    assert rig.executor.wait_zygote(120)
    rig.start("w3")
    assert rig.child("w3").forked
    rig.executor.stop("w3")  # at once: maybe before its drain handler, never lost
    rig.executor.stop("w2")
    assert rig.wait_exit("w3").code in (0, -signal.SIGTERM)
    assert rig.wait_exit("w2").code == 0


def test_zygote_off_spawns(tmp_path: Path, redis_server: str) -> None:
    rig = Rig(tmp_path, redis_server, zygote=False)
    rig.executor.start_zygote()
    assert ZYGOTE_NAME not in rig.procs.children
    try:
        rig.start("w1")
        assert not rig.child("w1").forked
        rig.executor.stop("w1")
        assert rig.wait_exit("w1").code in (
            0,
            -signal.SIGTERM,
        )  # stopped before its drain handler, or drained
    finally:
        rig.procs.stop_all()


# -- through `lorafn up`, the real engine ------------------------------------------------------------
def _lorafn(*args: str, state_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lorafn.cli", *args, "--state-dir", str(state_dir)],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip


def _with_up(tmp: Path, zygote: bool, device: str, body: Callable[[Path], None]) -> str:
    """Run `lorafn up` (no warm pool) with `zygote` on or off around `body(state_dir)`; its log."""
    state_dir = tmp / f"state-{zygote}"
    cfg = tmp / f"up-{zygote}.yaml"
    cfg.write_text(f"zygote: {str(zygote).lower()}\ngateway_port: 0\n")
    log = tmp / f"up-{zygote}.log"
    with log.open("w") as out:
        up = subprocess.Popen(
            [sys.executable, "-m", "lorafn.cli", "up", "--config", str(cfg), "--state-dir", str(state_dir),
             "--device", device],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            preexec_fn=sigint_default,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while not (state_dir / "platform.json").exists():
                assert up.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            json.loads((state_dir / "platform.json").read_text())
            body(state_dir)
        finally:
            up.send_signal(signal.SIGINT)
            try:
                up.wait(timeout=60)
            except subprocess.TimeoutExpired:
                up.kill()
                raise
    assert up.returncode == 0, log.read_text()
    return log.read_text()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_up_forked_and_spawned_workers_answer_alike(
    tiny_model_dir: Path, tmp_path: Path, device: str
) -> None:
    """On `cuda` the forked child is the first to initialize CUDA (the zygote never does)."""
    from tests.integration.runtime.engine_helpers import write_peft_adapter

    adapter = write_peft_adapter(
        tiny_model_dir, tmp_path / "adapter", r=4, lora_alpha=8, target_modules="all-linear"
    )
    manifest = tmp_path / "fn.yaml"
    dtype = "bfloat16" if device == "cuda" else "float32"
    manifest.write_text(
        f"apiVersion: lorafn.io/v1alpha1\nkind: Backbone\nmetadata: {{name: tiny}}\n"
        f"spec: {{model: {{uri: 'file://{tiny_model_dir}'}}, dtype: {dtype}, "
        "warmPool: {minStandby: 0, maxStandby: 0}}\n---\n"
        "apiVersion: lorafn.io/v1alpha1\nkind: LoRAFunction\nmetadata: {name: echo, namespace: t}\n"
        f"spec: {{backbone: tiny, adapter: {{uri: 'file://{adapter}'}}, "
        "scaling: {keepAliveSeconds: 300}}\n"
    )
    answers: dict[bool, list[str]] = {}

    def body(state_dir: Path, zygote: bool) -> None:
        applied = _lorafn("apply", "-f", str(manifest), "--api-key", "k", state_dir=state_dir)
        assert applied.returncode == 0, applied.stderr
        got = []
        for prompt, stream in (("hello there", False), ("a longer prompt about zygotes", True)):
            done = _lorafn(
                "invoke", FUNCTION, prompt, "--api-key", "k", "--max-tokens", "12", "--raw",
                *(["--stream"] if stream else []), state_dir=state_dir,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
            got.append(done.stdout)
        answers[zygote] = got
        logs = _lorafn("logs", FUNCTION, state_dir=state_dir)  # the worker's log is read as before
        assert logs.returncode == 0 and "serving t/echo" in logs.stdout, logs.stdout + logs.stderr

    forked_log = _with_up(tmp_path, True, device, lambda s: body(s, True))
    spawned_log = _with_up(tmp_path, False, device, lambda s: body(s, False))
    assert "zygote ready: workers are forked from it" in forked_log
    assert "forked from the zygote" in forked_log and " spawned, pid" not in forked_log, forked_log
    assert " spawned, pid" in spawned_log and "forked from the zygote" not in spawned_log
    assert answers[True] == answers[False]
    assert all(a.strip() for a in answers[True]), answers
