"""The life of a `lorafn up` process: who owns a state dir, whether its port is free, whether the gateway
that answers is its own, starting it in the background (`up --detach`) and stopping it (`lorafn down`).

A state dir has one owner: `<state dir>/lorafn.lock` holds the owner's pid under an exclusive `flock`.
The kernel drops the lock when the process ends (however it ends), so a stale file never blocks a new
start, and a second `lorafn up` is refused before it touches anything of the running one.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

LOCK_NAME = "lorafn.lock"
DETACHED_LOG = "up.log"


def lock_path(state_dir: Path) -> Path:
    return state_dir / LOCK_NAME


class StateLock:
    """The exclusive ownership of a state dir by this process (released on `release()` or exit)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    @classmethod
    def acquire(cls, state_dir: Path) -> StateLock:
        """Own `state_dir`, or raise ValueError naming the `lorafn up` that owns it."""
        state_dir.mkdir(parents=True, exist_ok=True)
        path = lock_path(state_dir)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            pid = _read_pid(path)
            raise ValueError(
                f"state dir {state_dir} is in use by a running `lorafn up` (pid {pid if pid else '?'}); "
                f"stop it with `lorafn down --state-dir {state_dir}`, or start another with a different "
                "--state-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        return cls(path, fd)

    def release(self) -> None:
        if self._fd < 0:
            return
        # Emptied before unlocking: a reader never sees this pid as the owner once it is released.
        os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = -1


def _read_pid(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def owner(state_dir: Path) -> int | None:
    """The pid of the `lorafn up` that owns `state_dir` (its lock is held), or None."""
    path = lock_path(state_dir)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return _read_pid(path)  # held: someone owns it
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def check_port_free(host: str, port: int) -> None:
    """Raise ValueError when another process listens on `host:port` (the gateway could not bind it).

    SO_REUSEADDR as uvicorn binds: a port left in TIME_WAIT by a previous run counts as free.
    """
    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ValueError(
                f"port {port} on {host} is not available ({exc.strerror}): another process uses it; "
                "stop it, or start with --port N (--port 0: any free port)"
            ) from None


def gateway_answers(url: str, instance_id: str, timeout_s: float = 1.0) -> bool:
    """True when the gateway at `url` is the one started with `instance_id` and it is ready (Redis
    answers): another process on the port is never taken for ours."""
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=timeout_s) as reply:
            if json.loads(reply.read()).get("instance") != instance_id:
                return False
        with urllib.request.urlopen(f"{url}/readyz", timeout=timeout_s) as reply:
            return 200 <= reply.status < 300
    except (OSError, ValueError, AttributeError):
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (our own exited child, not yet waited for) counts as gone.
    with contextlib.suppress(OSError):
        if ") Z " in Path(f"/proc/{pid}/stat").read_text():
            return False
    return True


def stop_platform(state_dir: Path, timeout_s: float = 60.0) -> int:
    """SIGTERM the `lorafn up` owning `state_dir` and wait until it has stopped everything; its pid.

    Raises ValueError when none owns it, TimeoutError when it is still running after `timeout_s`.
    """
    pid = owner(state_dir)
    if pid is None:
        raise ValueError(f"no local platform is running on state dir {state_dir}")
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    released = False
    while time.monotonic() < deadline:
        if not _alive(pid):
            return pid
        # it unlocks once everything is stopped and exits a moment later: wait for that too, so that the
        # caller never sees it alive after `down` (a test saw the pid alive right after the unlock)
        released = released or owner(state_dir) != pid
        time.sleep(0.05 if released else 0.1)
    if released:
        return pid
    raise TimeoutError(f"lorafn up (pid {pid}) is still stopping after {timeout_s:.0f} s")


def start_detached(argv: Sequence[str], state_dir: Path, env: dict[str, str], timeout_s: float) -> int:
    """Start `argv` (a `lorafn up` without --detach) in its own session, its output in
    `<state dir>/logs/up.log`; return its pid once it has written `platform.json`.

    Raises RuntimeError with the end of its output when it exits first, TimeoutError after `timeout_s`.
    """
    from lorafn.local.config import PlatformState

    log_path = state_dir / "logs" / DETACHED_LOG
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        start_at = log.tell()
        proc = subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            with log_path.open("rb") as log:
                log.seek(start_at)
                output = log.read().decode(errors="replace").strip()
            raise RuntimeError(f"lorafn up exited with code {code}:\n{output[-3000:]}")
        with contextlib.suppress(ValueError):
            if PlatformState.read(state_dir).pid == proc.pid:
                return proc.pid
        time.sleep(0.2)
    raise TimeoutError(f"lorafn up (pid {proc.pid}) was not up after {timeout_s:.0f} s; see {log_path}")
