"""`lorafn up`'s side of the zygote (`lorafn.runtime.zygote`): start it, ask it for workers, watch them.

A worker forked by the zygote is the zygote's child, not ours, so it is watched through what the zygote
hands over: a pidfd (signals without pid-reuse races, and readable once the worker has ended) and the
connection on which the zygote reports the exit code when it reaps the worker. `ForkedProcess` wraps the
two in the part of `subprocess.Popen`'s interface that `ProcessGroup` and the executor use, so a forked
worker is stopped, reaped and reported exactly like a spawned one.

If the zygote dies, its workers live on: `lorafn up` is made their child subreaper (Linux
`PR_SET_CHILD_SUBREAPER`), so they become its children and their exit codes are still read (waitpid).
The zygote is restarted in the background; meanwhile, and whenever it cannot fork (not started yet,
dead, refused, disabled with `zygote: false`), workers are spawned as plain processes, logged.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import select
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from lorafn.runtime.zygote import Exited, Forked, ForkRequest, Refused, decode, encode

log = logging.getLogger("lorafn.up")

ZYGOTE_NAME = "zygote"
UNKNOWN_EXIT = 255  # a forked worker ended while nobody could read its status (no subreaper)
_PR_SET_CHILD_SUBREAPER = 36
CONNECT_TIMEOUT_S = 5.0


class ZygoteUnavailable(Exception):
    """The zygote cannot fork this worker now (the reason is the message): spawn it plainly."""


def become_subreaper() -> bool:
    """Orphaned descendants (a dead zygote's workers) become this process's children; False if refused."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class ForkedProcess:
    """A worker the zygote forked, with `Popen`'s pid/poll/wait/send_signal/terminate/kill/returncode."""

    def __init__(self, pid: int, pidfd: int, conn: socket.socket, argv: Sequence[str]) -> None:
        self.pid, self.args = pid, list(argv)
        self.returncode: int | None = None
        self._pidfd: int | None = pidfd
        self._conn: socket.socket | None = conn
        self._buf = b""
        self._gone_at: float | None = None  # when the pidfd said the worker had ended

    def _exit_report(self, timeout_s: float) -> int | None:
        """The exit code the zygote reported, or None (not yet, or the zygote is gone)."""
        if self._conn is None:
            return None
        if not select.select([self._conn], [], [], timeout_s)[0]:
            return None
        try:
            data = self._conn.recv(4096)
        except OSError:
            data = b""
        if not data:
            self._conn.close()
            self._conn = None
        self._buf += data
        if b"\n" in self._buf:
            message = decode(self._buf.partition(b"\n")[0])
            if isinstance(message, Exited) and message.pid == self.pid:
                return message.code
        return None

    def _ended(self) -> bool:
        return self._pidfd is None or bool(select.select([self._pidfd], [], [], 0)[0])

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        code = self._exit_report(0)
        if code is None and self._ended():
            # Ended: the zygote's report follows at once, or (zygote dead) we are its subreaper now.
            self._gone_at = self._gone_at or time.monotonic()
            code = self._exit_report(0.5)
            if code is None and self._conn is None:
                code = self._waitpid()
                if code is None and time.monotonic() - self._gone_at > 2.0:
                    log.warning("worker pid %d ended; its exit code is unknown", self.pid)
                    code = UNKNOWN_EXIT
        if code is not None:
            self._finish(code)
        return self.returncode

    def _waitpid(self) -> int | None:
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:  # not (yet) reparented to us
            return None
        return os.waitstatus_to_exitcode(status) if pid else None

    def _finish(self, code: int) -> None:
        self.returncode = code
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            if self._pidfd is not None:
                select.select([self._pidfd], [], [], 0.05)
            else:
                time.sleep(0.05)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None and self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork_via(socket_path: Path, argv: Sequence[str], env: Mapping[str, str], log_path: Path) -> ForkedProcess:
    """Ask the zygote at `socket_path` for `argv`; ZygoteUnavailable (with the reason) when it cannot."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(CONNECT_TIMEOUT_S)
    try:
        conn.connect(str(socket_path))
        request = ForkRequest(argv=list(argv), env=dict(env), cwd=os.getcwd(), log_path=str(log_path))
        conn.sendall(encode(request))
        data, fds, _flags, _addr = socket.recv_fds(conn, 65536, 1)
        while data and b"\n" not in data:
            more = conn.recv(65536)
            if not more:
                break
            data += more
    except OSError as e:
        conn.close()
        raise ZygoteUnavailable(f"no answer from the zygote at {socket_path}: {e}") from None
    try:
        reply = decode(data.partition(b"\n")[0])
    except ValueError as e:
        for fd in fds:
            os.close(fd)
        conn.close()
        raise ZygoteUnavailable(f"the zygote answered nonsense: {e}") from None
    if isinstance(reply, Refused) or not isinstance(reply, Forked) or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        conn.close()
        reason = reply.reason if isinstance(reply, Refused) else f"unexpected reply {reply.type}"
        raise ZygoteUnavailable(f"the zygote refused: {reason}")
    conn.setblocking(False)
    return ForkedProcess(reply.pid, fds[0], conn, argv)


class ZygoteKeeper:
    """Keeps one zygote running as a child of the process group and forks through it when it can.

    A zygote that keeps dying soon after its start is given up after `give_up_after` quick failures in a
    row: workers are then spawned plainly (logged once), and `lorafn up` goes on."""

    def __init__(
        self, socket_path: Path, quick_s: float = 60.0, give_up_after: int = 3, enabled: bool = True
    ) -> None:
        self.socket_path = socket_path
        self.quick_s, self.give_up_after = quick_s, give_up_after
        self.enabled = enabled
        self.quick_failures = 0
        self.started_at = 0.0
        self.forks = self.spawns = 0

    def argv(self) -> list[str]:
        from lorafn.local.procs import lorafn_argv

        return lorafn_argv("zygote", "serve", "--socket", str(self.socket_path))

    def ready(self) -> bool:
        """The zygote listens (its imports are done)."""
        if not self.socket_path.exists():
            return False
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            try:
                probe.connect(str(self.socket_path))
            except OSError:
                return False
        return True

    def exited(self, code: int | None, ran_s: float) -> bool:
        """The zygote ended; True when it should be started again."""
        self.quick_failures = self.quick_failures + 1 if ran_s < self.quick_s else 0
        if self.quick_failures >= self.give_up_after:
            log.error(
                "the zygote died %d times soon after starting (last code %s); workers are spawned plainly",
                self.quick_failures,
                code,
            )
            self.enabled = False
        return self.enabled

    def fork(self, argv: Sequence[str], env: Mapping[str, str], log_path: Path) -> ForkedProcess:
        if not self.enabled:
            raise ZygoteUnavailable("the zygote is off")
        if not self.socket_path.exists():
            raise ZygoteUnavailable("the zygote is not listening (starting, or restarting)")
        return fork_via(self.socket_path, argv, env, log_path)


__all__ = [
    "UNKNOWN_EXIT",
    "ZYGOTE_NAME",
    "ForkedProcess",
    "ZygoteKeeper",
    "ZygoteUnavailable",
    "become_subreaper",
    "fork_via",
]
