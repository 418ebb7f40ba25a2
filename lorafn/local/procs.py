"""Child processes of the local platform: started with their own log file, stopped in order.

Each component of `lorafn up` (gateway, backbone servers, workers) is a real process started from
the `lorafn` command line, exactly as a pod would start it; this module only spawns, watches and
stops them. Logs go to `<state dir>/logs/<name>.log`, so a crash leaves its traceback on disk.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes]
    started_at: float = field(default_factory=time.monotonic)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def log_tail(self, num_bytes: int = 4000) -> str:
        try:
            with self.log_path.open("rb") as log:
                log.seek(0, os.SEEK_END)
                log.seek(max(0, log.tell() - num_bytes))
                return log.read().decode(errors="replace")
        except OSError:
            return ""


def lorafn_argv(*args: str) -> list[str]:
    """The command line that runs `lorafn ARGS` with this interpreter (no reliance on PATH)."""
    return [sys.executable, "-m", "lorafn.cli", *args]


class ProcessGroup:
    """The platform's children. Stopping sends SIGTERM to all, waits, then SIGKILLs stragglers."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.children: dict[str, Child] = {}
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None) -> Child:
        if name in self.children and self.children[name].alive():
            raise ValueError(f"a process named {name!r} is already running (pid {self.children[name].pid})")
        log_path = self.log_dir / f"{name.replace('/', '_')}.log"
        log = log_path.open("ab")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        # A new session: Ctrl-C in the terminal reaches only `lorafn up`, which then stops the
        # children in order (workers drain before the gateway and Redis go away).
        proc = subprocess.Popen(
            list(argv), stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )
        log.close()
        child = Child(name=name, argv=list(argv), log_path=log_path, proc=proc)
        self.children[name] = child
        return child

    def wait_until(
        self, child: Child, ready: Callable[[], bool], timeout_s: float, poll_s: float = 0.1
    ) -> None:
        """Wait until `ready()` is true; raise with the child's log tail if it dies or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not child.alive():
                raise RuntimeError(
                    f"{child.name} exited with code {child.exit_code()} while starting; "
                    f"log {child.log_path}:\n{child.log_tail()}"
                )
            if ready():
                return
            time.sleep(poll_s)
        raise TimeoutError(
            f"{child.name} was not ready after {timeout_s:.0f} s; log {child.log_path}:\n{child.log_tail()}"
        )

    def reap(self) -> list[Child]:
        """Remove and return the children that have exited."""
        exited = [c for c in self.children.values() if not c.alive()]
        for child in exited:
            del self.children[child.name]
        return exited

    def stop(self, name: str, timeout_s: float = 10.0) -> None:
        child = self.children.pop(name, None)
        if child is not None:
            _terminate([child], timeout_s)

    def stop_all(self, order: Sequence[str] = (), timeout_s: float = 10.0) -> None:
        """Stop the children whose names start with each prefix of `order` in turn, then the rest."""
        for prefix in [*order, ""]:
            batch = [c for n, c in list(self.children.items()) if n.startswith(prefix)]
            for child in batch:
                del self.children[child.name]
            _terminate(batch, timeout_s)


def _terminate(children: list[Child], timeout_s: float) -> None:
    for child in children:
        if child.alive():
            child.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for child in children:
        remaining = max(0.0, deadline - time.monotonic())
        try:
            child.proc.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()
