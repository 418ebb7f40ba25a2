"""Child processes of the local platform: started with their own log file, stopped in order.

Each component of `lorafn up` (gateway, backbone servers, workers) is a real process started from
the `lorafn` command line, exactly as a pod would start it; this module only spawns, watches and
stops them. Logs go to `<state dir>/logs/<name>.log`, so a crash leaves its traceback on disk.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

log = logging.getLogger("lorafn.up")


class Proc(Protocol):
    """What is used of a child process: `subprocess.Popen`, or a worker the zygote forked
    (`lorafn.local.zygote.ForkedProcess`)."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


# Forks `argv` with the whole environment `env`, output appended to the log file; raises
# `lorafn.local.zygote.ZygoteUnavailable` (with the reason) when it cannot.
Forker = Callable[[Sequence[str], Mapping[str, str], Path], Proc]


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    proc: Proc
    started_at: float = field(default_factory=time.monotonic)
    forked: bool = False  # from the zygote (else a plain spawn)

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

    def last_line(self) -> str:
        """The last non-empty line of the log (most often the error that ended the process)."""
        return (self.log_tail(2000).strip().splitlines() or [""])[-1].strip()


def _log_name(name: str) -> str:
    return f"{name.replace('/', '_')}.log"


def lorafn_argv(*args: str) -> list[str]:
    """The command line that runs `lorafn ARGS` with this interpreter (no reliance on PATH).

    `-P`: the child's current directory is not put on sys.path, so a `lorafn/` folder where the user
    stands (the clone, seen from its parent) cannot shadow the package; `child_env()` puts the parent's
    own copy first when it is not the interpreter's installed one.
    """
    return [sys.executable, "-P", "-m", "lorafn.cli", *args]


def package_root() -> Path:
    """The directory holding the `lorafn` package this process runs."""
    import lorafn

    return Path(lorafn.__file__).resolve().parent.parent


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a child that must import the same `lorafn` as this process.

    An installed package (site-packages) is found by the child as it is; a copy found another way
    (an editable install's finder, PYTHONPATH) goes first on PYTHONPATH. site-packages itself is never
    put there: ahead of the standard library it could shadow stdlib modules with backports.
    """
    import site

    out = {**os.environ, **(env or {})}
    root = str(package_root())
    installed = {str(Path(p).resolve()) for p in [*site.getsitepackages(), site.getusersitepackages()]}
    if root not in installed:
        rest = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p and p != root]
        out["PYTHONPATH"] = os.pathsep.join([root, *rest])
    return out


@dataclass
class _Restarts:
    """Quick failures of one component name in a row (a start that died within `QUICK_S`)."""

    count: int = 0
    last_line: str = ""


class RestartPolicy:
    """Exponential backoff for a component that keeps dying soon after it starts.

    Pure bookkeeping: `delay_s(name)` says how long to wait before starting `name` again; after
    `give_up_after` quick failures in a row with the same last log line, `give_up(name)` is the reason
    (the same error each time: a start-up error, such as a port in use, that a restart will not fix).
    A component that ran longer than `quick_s` starts over from no delay.
    """

    def __init__(
        self, base_s: float = 0.5, cap_s: float = 30.0, quick_s: float = 30.0, give_up_after: int = 5
    ):
        self.base_s, self.cap_s, self.quick_s, self.give_up_after = base_s, cap_s, quick_s, give_up_after
        self._by_name: dict[str, _Restarts] = {}

    def exited(self, name: str, ran_s: float, last_line: str) -> None:
        if ran_s > self.quick_s:
            self._by_name.pop(name, None)
            return
        seen = self._by_name.setdefault(name, _Restarts())
        seen.count = seen.count + 1 if last_line == seen.last_line or seen.count == 0 else 1
        seen.last_line = last_line

    def delay_s(self, name: str) -> float:
        seen = self._by_name.get(name)
        if seen is None or seen.count == 0:
            return 0.0
        return min(self.cap_s, self.base_s * 2 ** (seen.count - 1))

    def give_up(self, name: str) -> str | None:
        seen = self._by_name.get(name)
        if seen is None or seen.count < self.give_up_after:
            return None
        return (
            f"{name} failed {seen.count} times in a row soon after starting, each time with: {seen.last_line}"
        )


class ProcessGroup:
    """The platform's children. Stopping sends SIGTERM to all, waits, then SIGKILLs stragglers."""

    def __init__(self, log_dir: Path, restarts: RestartPolicy | None = None) -> None:
        self.log_dir = log_dir
        self.children: dict[str, Child] = {}
        self.restarts = restarts or RestartPolicy()
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        fork: Forker | None = None,
    ) -> Child:
        """Start `name`; one that keeps dying at start waits out its backoff first, and after the same
        failure `give_up_after` times in a row this raises RuntimeError with that failure.

        With `fork` (the zygote's), the process is forked from it; where it cannot, spawned (logged)."""
        if name in self.children and self.children[name].alive():
            raise ValueError(f"a process named {name!r} is already running (pid {self.children[name].pid})")
        reason = self.restarts.give_up(name)
        if reason is not None:
            raise RuntimeError(f"{reason} (log {self.log_dir / _log_name(name)})")
        time.sleep(self.restarts.delay_s(name))
        log_path = self.log_dir / _log_name(name)
        full_env = child_env({"PYTHONUNBUFFERED": "1", **(env or {})})
        if fork is not None:
            from lorafn.local.zygote import ZygoteUnavailable

            try:
                forked = fork(list(argv), full_env, log_path)
            except ZygoteUnavailable as e:
                log.info("%s: %s; spawning it as a new process", name, e)
            else:
                child = Child(name=name, argv=list(argv), log_path=log_path, proc=forked, forked=True)
                self.children[name] = child
                return child
        log_file = log_path.open("ab")
        # A new session: Ctrl-C in the terminal reaches only `lorafn up`, which then stops the
        # children in order (workers drain before the gateway and Redis go away).
        proc = subprocess.Popen(
            list(argv), stdout=log_file, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )
        log_file.close()
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
                    f"{child.name} exited with code {child.exit_code()} while starting: {child.last_line()}\n"
                    f"(log {child.log_path}, last lines:)\n{child.log_tail(2000)}"
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
            if child.exit_code() != 0:
                ran_s = time.monotonic() - child.started_at
                self.restarts.exited(child.name, ran_s, child.last_line())
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
