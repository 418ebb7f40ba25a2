"""Driving a real `lorafn up` from tests: the platform as a subprocess (`local_platform`), the CLI,
waiting on a condition while the platform runs, the workers' heartbeat records, one invocation, the order of
worker starts in its logs (`worker_starts`, `check_start_order`), and a managed platform serving one function
(`one_function`)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from tests.signals import sigint_default


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


# One simulated CPU device of 600 MiB (552 granted): a worker is 64 MiB overhead + 16 MiB KV + LoRA.
SMALL_DEVICE = (
    "device: cpu\ndevices: 1\ndevice_memory_mib: 600\nworker_overhead_mib: 64\ndefault_kv_mib: 16\n"
    "gateway_port: 0\n"
)


@dataclass
class LocalUp:
    """A running `lorafn up`: its process, state directory, `platform.json` and a Redis client. `log` is
    its whole output, read once it has stopped (`local_platform` fills it in)."""

    up: subprocess.Popen[str]
    state_dir: Path
    state: dict[str, Any]
    redis: redis.Redis
    log: str = ""

    def apply(self, docs: list[str], keys: list[str | None], tmp_path: Path) -> None:
        """`lorafn apply` of each document from its own file (a key opens one function), with its API key
        (None: none); each must succeed."""
        for i, (doc, key) in enumerate(zip(docs, keys, strict=True)):
            manifest = tmp_path / f"doc{i}.yaml"
            manifest.write_text(doc)
            applied = lorafn(
                "apply", "-f", str(manifest), *(["--api-key", key] if key else []), state_dir=self.state_dir
            )
            assert applied.returncode == 0, applied.stderr


@contextmanager
def local_platform(tmp_path: Path, config: str, cold_start_timeout_s: float) -> Iterator[LocalUp]:
    """`lorafn up --config` (the YAML text `config`) on this machine with its state under `tmp_path`,
    until `platform.json` names it; on exit SIGINT, its output printed (shown when a test fails: the
    controller's decisions) and kept in `LocalUp.log`, and, when the body passed, a clean exit (0)."""
    state_dir = tmp_path / "state"
    config_file = tmp_path / "up.yaml"
    config_file.write_text(config)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LORAFN_COLD_START_TIMEOUT_S": f"{cold_start_timeout_s:g}"}
    command = [sys.executable, "-m", "lorafn.cli", "up", "--config", str(config_file)]
    up = subprocess.Popen(
        [*command, "--state-dir", str(state_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, preexec_fn=sigint_default,
    )  # fmt: skip
    running: LocalUp | None = None
    try:
        wait_for("platform.json", lambda: (state_dir / "platform.json").exists(), 120, up)
        state = json.loads((state_dir / "platform.json").read_text())
        client = redis.Redis.from_url(state["redis_url"], decode_responses=True)
        running = LocalUp(up, state_dir, state, client)
        yield running
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=90)
        except subprocess.TimeoutExpired:
            up.kill()
            raise
        log = up.stdout.read() if up.stdout else ""
        if running is not None:
            running.log = log
        print(log)
    assert up.returncode == 0


# -- the order of worker starts, from the logs `lorafn up` leaves (its own output and each worker's log) -----
_STAMP = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})"


@dataclass
class WorkerStart:
    """One worker process `lorafn up`'s controller started: a standby (``function`` None) or a fresh worker
    of a function; ``began``/``ended`` are the log stamps of its start and of its end of starting (a standby
    ready, a fresh worker serving, or the process gone; None: never), as strings that sort by time."""

    worker: str
    function: str | None
    began: str
    ended: str | None


def worker_starts(up_log: str, logs_dir: Path) -> list[WorkerStart]:
    """Every worker start in ``up_log`` (the controller's `start <id> on <gpu> standby|for <function>` lines),
    with when each stopped starting, from the worker's own log (`standby <id> ready`, `worker <id> serving`)
    or `lorafn up`'s exit line for it."""
    starts = []
    line = rf"^{_STAMP} \S+ INFO controller: start (\S+) on \S+ (standby|for (\S+):)"
    for m in re.finditer(line, up_log, re.M):
        stamp, wid, function = m.group(1), m.group(2), m.group(4)
        path = logs_dir / f"worker_{wid}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        done = re.search(rf"^{_STAMP} .*(standby {wid} ready|worker {wid} serving)", text, re.M)
        gone = re.search(rf"^{_STAMP} .*worker {wid} (exited|died)", up_log, re.M)
        ends = [x.group(1) for x in (done, gone) if x is not None]
        starts.append(WorkerStart(wid, function, stamp, min(ends) if ends else None))
    return starts


def starting_at(starts: list[WorkerStart], moment: str, but: str = "") -> list[WorkerStart]:
    """The workers other than ``but`` still starting at ``moment`` (begun by then, in the same millisecond
    too, and not done)."""
    return [
        s for s in starts if s.worker != but and s.began <= moment and (s.ended is None or s.ended > moment)
    ]


def zygote_environ(state_dir: Path) -> dict[str, str]:
    """The environment the platform's zygote was started with (its forks inherit what OpenMP read from it)."""
    socket = str(state_dir / "sockets" / "zygote.sock")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"zygote" in cmdline and socket.encode() in cmdline:
                pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                return dict(p.decode(errors="replace").split("=", 1) for p in pairs if b"=" in p)
        except OSError:
            continue
    raise AssertionError(f"no zygote process serving {socket}")


def check_start_order(up_log: str, logs_dir: Path) -> None:
    """At most what the platform's log says its cores warm at once were starting whenever a standby start
    began, and no standby start began while a function's fresh worker (started for a waiting request) was
    coming up. Shared with the README demo's test."""
    at_once = re.search(r"at most (\d+) standby start\(s\) at once, none while a request waits", up_log)
    assert at_once is not None, "lorafn up on CPU names its standby start limit"
    limit = int(at_once.group(1))
    starts = worker_starts(up_log, logs_dir)
    pool = [s for s in starts if s.function is None]
    assert pool, "the warm pool started no standby"
    for s in pool:
        beside = starting_at(starts, s.began, but=s.worker)
        assert len(beside) < limit, f"standby {s.worker} began while these were starting: {beside}"
        for fresh in (x for x in starts if x.function is not None):
            assert not (fresh.began <= s.began and (fresh.ended is None or s.began < fresh.ended)), (
                f"standby {s.worker} began while {fresh.function}'s first worker {fresh.worker} was starting"
            )


@dataclass
class OneFunction:
    """A managed `lorafn up` (lorafn.replay.platform) serving one function on CPU: its platform, gateway URL,
    API key and the one bound worker's id and first heartbeat."""

    platform: Any
    gateway_url: str
    key: str
    worker_id: str
    beat: dict[str, str]


@contextmanager
def one_function(
    model_dir: Path, tmp_path: Path, function: str, settings: dict[str, Any], kv_cache_mib: int
) -> Iterator[OneFunction]:
    """`lorafn up` on CPU with ``settings`` (up.yaml; `device`, `devices` and `warm_pool: False` set here),
    one function of the tiny model (a PEFT adapter r4 on q/v, maxReplicas 1, keep-alive an hour,
    minReplicas 1, its workers' KV ``kv_cache_mib``), settled with its one worker bound; stopped on exit."""
    from lorafn.replay.configs import ReplayConfig
    from lorafn.replay.platform import FunctionSetup, ManagedPlatform, manifest, new_keys
    from tests.integration.runtime.engine_helpers import write_peft_adapter

    adapter = write_peft_adapter(
        model_dir, tmp_path / "a0", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], seed=0
    )
    namespace = function.split("/")[0]
    platform = ManagedPlatform(
        tmp_path / "up", {"device": "cpu", "devices": 1, "warm_pool": False, **settings}
    )
    keys = new_keys([function])
    setup = FunctionSetup(slo_ttft_ms=60_000, keep_alive_s=3600, max_replicas=1, kv_cache_mib=kv_cache_mib)
    config = ReplayConfig(namespace, "tests/integration/local", min_replicas=1, warm_pool_fallback=(0, 0))
    try:
        state = platform.start(timeout_s=180)
        platform.apply(
            manifest(
                model_dir, "float32", [function], [adapter], keys, setup, config, True, namespace=namespace
            )
        )
        platform.settle([function], 1, want_standby=False, shared=True, timeout_s=180)
        assert platform.store is not None
        ((wid, beat),) = [(w, h) for w, h in platform.workers().items() if h.get("function") == function]
        yield OneFunction(platform, state.gateway_url, keys[function], wid, beat)
    finally:
        platform.stop()
