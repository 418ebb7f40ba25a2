"""Test harness of the data plane: a deterministic fake engine, the gateway on a real port (uvicorn in a
thread), workers in threads or processes, function registration. The fake engine is for tests only."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from lorafn.gateway.app import create_app
from lorafn.gateway.server import uvicorn_config
from lorafn.gateway.settings import GatewaySettings
from lorafn.local.redis_proc import free_port
from lorafn.runtime.outputs import StreamDelta
from lorafn.runtime.worker import ServingConfig, Worker
from lorafn.store import Keys, Store
from lorafn.store import registry as reg

REPO = Path(__file__).resolve().parents[3]


def expected_text(prompt_key: str, n: int, tag: str = "") -> str:
    """What FakeEngine answers: n words derived from the prompt (and, if given, a per-worker tag)."""
    h = zlib.crc32(prompt_key.encode()) % 1000
    return "".join(f"w{h}{tag}-{i} " for i in range(n))


@dataclass
class _Req:
    words: list[str]
    prompt_tokens: int
    sent: int = 0


@dataclass
class FakeEngine:
    """A deterministic engine (tests only): each step emits one word per running request.

    The answer to a prompt is `expected_text(prompt, min(max_tokens, max_output))`; `step_s` sleeps per
    step (slow streams for kill tests); `tag` makes answers differ between workers (divergence tests).
    """

    step_s: float = 0.0
    max_output: int = 8
    tag: str = ""
    reqs: dict[str, _Req] = field(default_factory=dict)

    def add_request(self, prompt: str | list[int], params: Any, request_id: str | None = None) -> str:
        assert request_id is not None, "the serving loop names its requests"
        key = prompt if isinstance(prompt, str) else ",".join(map(str, prompt))
        if isinstance(prompt, str) and "FAIL" in prompt:
            raise ValueError("prompt: the fake engine refuses prompts containing FAIL")
        n = min(params.max_tokens, self.max_output)
        words = expected_text(key, n, self.tag).split(" ")[:-1]
        self.reqs[request_id] = _Req(
            [w + " " for w in words], len(prompt if isinstance(prompt, list) else key.split())
        )
        return request_id

    def step(self) -> list[StreamDelta]:
        if self.step_s:
            time.sleep(self.step_s)
        out = []
        for rid, r in list(self.reqs.items()):
            word = r.words[r.sent]
            r.sent += 1
            done = r.sent == len(r.words)
            out.append(
                StreamDelta(
                    rid,
                    [0],
                    word,
                    done,
                    "length" if done else None,
                    prompt_tokens=r.prompt_tokens if done else 0,
                    completion_tokens=r.sent if done else 0,
                )
            )
            if done:
                del self.reqs[rid]
        return out

    def abort(self, request_id: str) -> bool:
        return self.reqs.pop(request_id, None) is not None

    def has_unfinished(self) -> bool:
        return bool(self.reqs)


def fake_engine(settings: Any, record: Any) -> FakeEngine:
    """engine_factory for worker processes: LORAFN_TEST_STEP_S, LORAFN_TEST_TAG_PID=1."""
    tag = f"p{os.getpid()}" if os.environ.get("LORAFN_TEST_TAG_PID") else ""
    return FakeEngine(step_s=float(os.environ.get("LORAFN_TEST_STEP_S", "0")), tag=tag)


def register(
    store: Store,
    keys: Keys,
    function: str,
    api_keys: list[str],
    model_dir: str = "",
    public: bool = False,
    **record: Any,
) -> None:
    spec = record.pop("spec", {"backbone": "tiny", "adapter": {"uri": "file:///adapters/a"}})
    store.run(
        reg.put_function(
            keys, reg.FunctionRecord(function, spec, model_dir=model_dir, public=public, **record)
        )
    )
    salt = store.run(reg.ensure_salt(keys))
    store.run(reg.set_api_keys(keys, function, [reg.hash_api_key(salt, k) for k in api_keys]))


@contextmanager
def gateway(redis_url: str, prefix: str, **overrides: Any) -> Iterator[str]:
    """The gateway app under uvicorn on a free loopback port, in a thread; yields its base URL."""
    # freeze_heap off: gc.freeze() would act on the whole test process
    settings = GatewaySettings(redis_url=redis_url, key_prefix=prefix, **{"freeze_heap": False, **overrides})
    port = free_port()
    server = uvicorn.Server(
        uvicorn_config(
            create_app(settings), settings, host="127.0.0.1", port=port, log_level="warning", lifespan="on"
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the gateway did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@contextmanager
def worker_thread(
    redis_url: str, prefix: str, function: str, engine: Any = None, **cfg: Any
) -> Iterator[Worker]:
    """A Worker (serving loop) in a thread of this process; drained and joined on exit."""
    w = Worker(
        Store(redis_url),
        Keys(prefix),
        engine or FakeEngine(),
        ServingConfig(function=function, **{"block_ms": 100, **cfg}),
    )
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", w.run()), daemon=True)
    thread.start()
    try:
        yield w
    finally:
        w.drain()
        thread.join(timeout=10)


def start_worker_process(
    redis_url: str, prefix: str, function: str, log: Path, **env: str
) -> subprocess.Popen:
    """`lorafn worker serve` as a real process with the fake engine (tests only)."""
    full_env = {
        **os.environ,
        "LORAFN_REDIS_URL": redis_url,
        "LORAFN_KEY_PREFIX": prefix,
        "LORAFN_FUNCTION": function,
        "LORAFN_ENGINE_FACTORY": "tests.integration.gateway.harness:fake_engine",
        "LORAFN_HEARTBEAT_S": "0.2",
        "LORAFN_HEARTBEAT_TTL_S": "1.0",
        "LORAFN_CLAIM_MIN_IDLE_MS": "300",
        "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        **env,
    }
    out = open(log, "ab")  # noqa: SIM115 - the process owns it
    return subprocess.Popen(
        [sys.executable, "-m", "lorafn.cli", "worker", "serve"],
        cwd=REPO,
        env=full_env,
        stdout=out,
        stderr=subprocess.STDOUT,
    )


def wait_live_workers(
    base_url: str | None, store: Store, keys: Keys, function: str, n: int, timeout: float = 30
) -> None:
    from lorafn.store import workers

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if store.run(workers.count_live_workers(keys, function, 1000)) >= n:
            return
        time.sleep(0.05)
    raise TimeoutError(f"{n} workers of {function} did not come up within {timeout} s")


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def client(base_url: str, key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=base_url, headers=headers, timeout=30)


@dataclass
class RecordingEngine(FakeEngine):
    """A FakeEngine that records, per request id, when it was added, how many tokens it generated and
    whether it was aborted (cancellation tests). Thread-safe enough for one worker thread and a reader."""

    added: list[str] = field(default_factory=list)
    generated: dict[str, int] = field(default_factory=dict)
    aborted: list[str] = field(default_factory=list)

    def add_request(self, prompt: str | list[int], params: Any, request_id: str | None = None) -> str:
        super().add_request(prompt, params, request_id)
        self.added.append(request_id)
        return request_id

    def step(self) -> list[StreamDelta]:
        out = super().step()
        for d in out:
            self.generated[d.request_id] = self.generated.get(d.request_id, 0) + len(d.token_ids)
        return out

    def abort(self, request_id: str) -> bool:
        if request_id in self.reqs:
            self.aborted.append(request_id)
        return super().abort(request_id)
