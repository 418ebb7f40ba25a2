"""Faults under a running `lorafn up` (CPU, the tiny model), real processes throughout (issue 15).

- kill -9 of the platform's redis-server: `lorafn up` keeps running, restarts it from its AOF (same port,
  password, data), and serves again; requests in flight get an answer or an explicit JSON error, and no
  entry stays pending in the request streams.
- an adapter that breaks after `lorafn apply`: the client gets the loader's reason as soon as the start
  fails, and `lorafn get` shows AdapterReady=False with it.
- chaos: during a load of mixed requests (completions and chat, streamed and not, two functions) a worker,
  Redis and the controller are killed; every request is answered or explicitly refused (a 4xx/503 JSON
  error or an SSE error event, never a 500, never hung), nothing is pending afterwards, and the platform
  serves again without a restart. The controller runs inside `lorafn up`: it is "killed" with SIGUSR1,
  which makes `lorafn up` drop it and start a fresh one under a new lease holder, what a crashed and
  restarted controller process is (no memory of its binds, events or stops; the new one waits for the
  old lease to lapse and rebuilds its view from Redis). Killing `lorafn up` itself kills the supervisor of
  every process: not a fault the platform can heal without a restart.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tests.integration.runtime.engine_helpers import write_peft_adapter
from tests.signals import sigint_default

pytestmark = pytest.mark.slow

FUNCTIONS = {"t/fa": "key-fa", "t/fb": "key-fb"}


@dataclass
class Up:
    proc: subprocess.Popen[bytes]
    state_dir: Path
    log: Path
    gateway: str
    r: redis.Redis
    lines_seen: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def _wait(what: str, check: Callable[[], Any], timeout_s: float, up: Up | None = None) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if up is not None and up.proc.poll() is not None:
            raise AssertionError(f"lorafn up exited ({up.proc.returncode}) while waiting for {what}")
        try:
            got = check()
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, httpx.HTTPError):
            got = None
        if got:
            return got
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def _lorafn(state_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lorafn.cli", *args, "--state-dir", str(state_dir)],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip


@pytest.fixture(scope="module")
def up(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    tmp = tmp_path_factory.mktemp("chaos")
    state_dir = tmp / "state"
    config = tmp / "up.yaml"
    config.write_text("device: cpu\ndevices: 1\ngateway_port: 0\nheartbeat_ttl_s: 3\n")
    log = tmp / "up.log"
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "LORAFN_HEARTBEAT_TTL_S": "3",
        "LORAFN_COLD_START_TIMEOUT_S": "60",
        "LORAFN_QUEUE_TIMEOUT_S": "30",
        "LORAFN_REQUEST_TIMEOUT_S": "120",
    }
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lorafn.cli", "up", "--config", str(config),
             "--state-dir", str(state_dir)],
            stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=sigint_default,
        )  # fmt: skip
    try:
        state_path = state_dir / "platform.json"
        deadline = time.monotonic() + 120
        while not state_path.exists():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.25)
        state = json.loads(state_path.read_text())
        r = redis.Redis.from_url(state["redis_url"], decode_responses=True, socket_timeout=5)
        u = Up(proc, state_dir, log, state["gateway_url"], r, extra={"tmp": tmp, "model": tiny_model_dir})
        docs = [
            "apiVersion: lorafn.io/v1alpha1\nkind: Backbone\nmetadata: {name: tiny}\n"
            f"spec: {{model: {{uri: 'file://{tiny_model_dir}'}}, dtype: float32}}\n"
        ]
        for i, name in enumerate(FUNCTIONS):
            adapter = write_peft_adapter(
                tiny_model_dir, tmp / f"adapter{i}", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                seed=i,
            )  # fmt: skip
            docs.append(
                "apiVersion: lorafn.io/v1alpha1\nkind: LoRAFunction\n"
                f"metadata: {{name: {name.split('/')[1]}, namespace: t}}\n"
                f"spec: {{backbone: tiny, adapter: {{uri: 'file://{adapter}'}}, "
                "scaling: {keepAliveSeconds: 600}}\n"
            )
        for i, doc in enumerate(docs):  # one file each: a key opens one function
            manifest = tmp / f"doc{i}.yaml"
            manifest.write_text(doc)
            key = ["--api-key", list(FUNCTIONS.values())[i - 1]] if i else []
            applied = _lorafn(state_dir, "apply", "-f", str(manifest), *key)
            assert applied.returncode == 0, applied.stderr
        time.sleep(1.5)  # the AOF is fsynced every second: the registrations must survive a kill
        for function in FUNCTIONS:  # cold starts, then both are warm
            _wait(f"{function} to answer", lambda f=function: _call(u, f, "completions", False).ok, 180, u)
        yield u
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        print(log.read_text(errors="replace")[-20000:])  # shown when a test fails


@dataclass
class Outcome:
    function: str
    kind: str
    stream: bool
    status: int
    text: str = ""
    error: dict[str, Any] | None = None
    problem: str | None = None  # why this outcome breaks the rules (None: answered or explicitly refused)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.problem is None


def _call(
    up: Up, function: str, kind: str, stream: bool, timeout_s: float = 150, key: str | None = None
) -> Outcome:
    """One request; `problem` says what is wrong with its outcome (a 500, a hang, a non-JSON error...)."""
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    body: dict[str, Any] = {"model": function, "max_tokens": 8, "stream": stream, "temperature": 0}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": "hello there"}]
    else:
        body["prompt"] = "hello there"
    out = Outcome(function, kind, stream, 0)
    headers = {"Authorization": f"Bearer {key or FUNCTIONS[function]}"}
    try:
        with (
            httpx.Client(base_url=up.gateway, timeout=timeout_s, headers=headers) as c,
            c.stream("POST", path, json=body) as reply,
        ):
            out.status = reply.status_code
            if reply.status_code != 200 or not stream:
                raw = reply.read()
                try:
                    payload = json.loads(raw)
                except ValueError:
                    out.problem = f"HTTP {reply.status_code} with a body that is not JSON: {raw[:200]!r}"
                    return out
                if reply.status_code == 200:
                    choice = payload["choices"][0]
                    out.text = choice["message"]["content"] if kind == "chat" else choice["text"]
                else:
                    out.error = payload.get("error")
                    if not isinstance(out.error, dict) or not out.error.get("message"):
                        out.problem = f"HTTP {reply.status_code} without a JSON error: {payload}"
                    elif reply.status_code >= 500 and reply.status_code != 503:
                        out.problem = f"HTTP {reply.status_code}: {out.error}"
                return out
            done = False
            for line in reply.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    out.error = event["error"]
                    if event["error"].get("type") == "server_error":
                        out.problem = f"stream ended with a server error: {event['error']}"
                    return out
                delta = event["choices"][0]
                out.text += (delta.get("delta", {}).get("content") or "") if kind == "chat" else delta["text"]
            if not done:
                out.problem = "the stream ended without [DONE] or an error event"
    except httpx.TimeoutException:
        out.problem = f"no answer within {timeout_s} s (hung)"
    except httpx.HTTPError as e:
        out.problem = f"transport error: {e!r}"
    return out


def _redis_pid(up: Up) -> int:
    return int(up.r.info("server")["process_id"])


def _pending(up: Up) -> dict[str, int]:
    """Entries delivered to a worker and never acknowledged, and entries still queued, per function."""
    out = {}
    for function in FUNCTIONS:
        stream = f"lorafn:fn:{function}:requests"
        held = up.r.xpending(stream, "workers")["pending"] if up.r.exists(stream) else 0
        out[function] = int(held) + int(up.r.xlen(stream))
    return out


def _quiet(up: Up) -> bool:
    return not any(_pending(up).values())


def _load(
    up: Up, num_threads: int, per_thread: int, seed: int, until: threading.Event | None = None
) -> list[Outcome]:
    """`num_threads` clients, each sending up to `per_thread` mixed requests one after another (stopping
    early once `until` is set)."""
    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def run(index: int) -> None:
        rng = random.Random(seed * 100 + index)
        for _ in range(per_thread):
            if until is not None and until.is_set():
                return
            o = _call(
                up, rng.choice(list(FUNCTIONS)), rng.choice(["completions", "chat"]), rng.random() < 0.5
            )
            with lock:
                outcomes.append(o)
            time.sleep(rng.uniform(0.0, 0.3))

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
        assert not t.is_alive(), "a load thread hung"
    return outcomes


def _check_outcomes(outcomes: list[Outcome], expected: int) -> None:
    for o in outcomes:  # shown when the test fails
        print(o.function, o.kind, "stream" if o.stream else "json", o.status, o.error or "", o.problem or "")
    assert len(outcomes) == expected
    bad = [o for o in outcomes if o.problem is not None]
    assert not bad, "\n".join(f"{o.function} {o.kind} stream={o.stream}: {o.problem}" for o in bad)


def _serving_again(up: Up, timeout_s: float = 120) -> None:
    for function in FUNCTIONS:
        for kind, stream in (("completions", False), ("chat", True)):
            _wait(
                f"{function} {kind} to answer again",
                lambda f=function, k=kind, s=stream: _call(up, f, k, s).ok,
                timeout_s,
                up,
            )


def test_redis_killed_under_up_is_restarted_and_the_platform_serves_again(up: Up) -> None:
    before = _redis_pid(up)
    outcomes: list[Outcome] = []
    load = threading.Thread(target=lambda: outcomes.extend(_load(up, 3, 3, seed=1)), daemon=True)
    load.start()
    time.sleep(1.0)  # requests in flight and queued when Redis dies
    os.kill(before, signal.SIGKILL)
    load.join(timeout=600)
    assert not load.is_alive()
    _check_outcomes(outcomes, 9)
    assert up.proc.poll() is None, "lorafn up ended when Redis died"
    after = _wait("a new redis-server", lambda: (pid := _redis_pid(up)) != before and pid, 60, up)
    assert after != before
    # the supervisor logs the restart once the new server answers, which may be after its pid is visible
    _wait("the restart in the log", lambda: "redis-server restarted" in up.log_text(), 60, up)
    _serving_again(up)
    _wait("the request streams to be empty (nothing pending)", lambda: _quiet(up), 90, up)
    status = _lorafn(up.state_dir, "status")
    assert status.returncode == 0, status.stderr
    assert up.proc.poll() is None


def test_a_redis_that_stops_answering_is_killed_and_restarted(up: Up) -> None:
    """SIGSTOP: the process lives but answers nothing; after RedisWatch.hang_s (15 s) the supervisor kills
    it and starts it again from its AOF."""
    before = _redis_pid(up)
    os.kill(before, signal.SIGSTOP)
    try:
        after = _wait("a new redis-server", lambda: (pid := _redis_pid(up)) != before and pid, 90, up)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(before, signal.SIGCONT)
    assert after != before
    assert "stopped answering; killing it" in up.log_text()
    _serving_again(up)
    _wait("the request streams to be empty (nothing pending)", lambda: _quiet(up), 90, up)


def test_a_broken_adapter_is_reported_to_the_client_at_once(up: Up) -> None:
    """An adapter that passed `lorafn apply` and broke afterwards: the client gets the loader's reason as
    soon as the start fails (503 function_start_failed), not after cold_start_timeout_s (60 s here), and
    `lorafn get` shows AdapterReady=False with the reason."""
    tmp, model = up.extra["tmp"], up.extra["model"]
    adapter = write_peft_adapter(model, tmp / "broken", r=4, lora_alpha=8, target_modules=["q_proj"], seed=7)
    manifest = tmp / "broken.yaml"
    manifest.write_text(
        "apiVersion: lorafn.io/v1alpha1\nkind: LoRAFunction\nmetadata: {name: broken, namespace: t}\n"
        f"spec: {{backbone: tiny, adapter: {{uri: 'file://{adapter}'}}}}\n"
    )
    applied = _lorafn(up.state_dir, "apply", "-f", str(manifest), "--api-key", "key-broken")
    assert applied.returncode == 0, applied.stderr
    weights = adapter / "adapter_model.safetensors"
    header = 8 + int.from_bytes(weights.read_bytes()[:8], "little")
    with open(weights, "r+b") as f:  # the header stays readable, the tensors are cut short
        f.truncate(header + 16)
    try:
        t0 = time.monotonic()
        refused = _call(up, "t/broken", "completions", False, timeout_s=120, key="key-broken")
        took = time.monotonic() - t0
        assert refused.problem is None, refused.problem
        assert refused.status == 503, refused
        assert refused.error is not None and refused.error["code"] == "function_start_failed", refused.error
        assert "truncated" in refused.error["message"], refused.error  # the reader's own words
        assert took < 40, f"the reason came after {took:.0f} s (cold_start_timeout_s is 60 s)"
        # a second request, while the controller backs off, is refused with the reason too
        again = _call(up, "t/broken", "chat", True, timeout_s=120, key="key-broken")
        assert again.problem is None and again.error is not None, again
        assert again.error["code"] == "function_start_failed", again.error

        got = _lorafn(up.state_dir, "get", "functions", "-o", "json")
        assert got.returncode == 0, got.stderr
        row = next(i for i in json.loads(got.stdout)["items"] if i["name"] == "t/broken")
        adapter_ready = next(c for c in row["conditions"] if c["type"] == "AdapterReady")
        assert adapter_ready["status"] == "False" and adapter_ready["reason"] == "LoadFailed", row
        assert adapter_ready["message"], row
        assert "truncated" in adapter_ready["message"], row
        healthy = next(i for i in json.loads(got.stdout)["items"] if i["name"] == "t/fa")
        assert next(c for c in healthy["conditions"] if c["type"] == "AdapterReady")["status"] == "True"
    finally:
        deleted = _lorafn(up.state_dir, "delete", "t/broken")
        assert deleted.returncode == 0, deleted.stderr


def _bound_worker(up: Up, function: str) -> tuple[str, int] | None:
    for wid in up.r.zrange("lorafn:workers", 0, -1):
        h = up.r.hgetall(f"lorafn:worker:{wid}")
        if h.get("function") == function and h.get("state") == "serving" and h.get("pid"):
            return wid, int(h["pid"])
    return None


def test_chaos_a_worker_redis_and_the_controller_die_under_mixed_load(up: Up) -> None:
    """Bounded: at most 4 x 15 requests from 4 clients, sent until the faults are over, one kill of each
    kind (a worker, then the controller, then Redis: the dead worker's requests need the new controller
    to start another), about two minutes on CPU."""
    _serving_again(up)  # both functions warm before the load starts
    victim = _bound_worker(up, "t/fa")
    assert victim is not None
    redis_before = _redis_pid(up)
    outcomes: list[Outcome] = []
    faults_over = threading.Event()
    load = threading.Thread(
        target=lambda: outcomes.extend(_load(up, 4, 15, seed=2, until=faults_over)), daemon=True
    )
    load.start()
    try:
        time.sleep(1.0)
        os.kill(victim[1], signal.SIGKILL)  # a worker, mid-load
        time.sleep(1.5)
        up.proc.send_signal(signal.SIGUSR1)  # the controller (see the module doc)
        _wait("the controller to be restarted", lambda: "restarting the controller: SIGUSR1" in up.log_text(),
              30, up)  # fmt: skip
        time.sleep(1.5)
        os.kill(redis_before, signal.SIGKILL)  # the data plane
        _wait("redis to be restarted", lambda: _redis_pid(up) != redis_before, 60, up)
        time.sleep(3.0)  # the load goes on against the restarted Redis and controller
    finally:
        faults_over.set()
    load.join(timeout=600)
    assert not load.is_alive()
    _check_outcomes(outcomes, len(outcomes))
    assert len(outcomes) >= 8, len(outcomes)
    assert any(o.ok for o in outcomes), "nothing was served during the chaos"
    assert up.proc.poll() is None, "lorafn up ended"
    _serving_again(up)
    _wait("the request streams to be empty (nothing pending)", lambda: _quiet(up), 90, up)
    replacement = _bound_worker(up, "t/fa")
    assert replacement is not None and replacement[0] != victim[0]
