"""A real `redis-server` process owned by the local platform (or by a test).

lorafn never embeds a fake Redis: local mode starts the `redis-server` binary from PATH, with its data
directory under the platform's state directory, and stops it on exit.

Security (issue 15): without a password any local user could `HSET lorafn:fn:<f> public 1` and call a
function without a key. The server requires a password generated once and kept in `<data dir>/redis.password`
(0600; reused on restart, so the AOF's data stays reachable), passed through a 0600 config file (never on the
command line, which `ps` shows), and the data directory (AOF: prompts, replies, the key salt) is 0700. `url`
carries the password, so every client built from it authenticates.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import quote


class RedisNotInstalledError(RuntimeError):
    """`redis-server` is not on PATH."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _ping(host: str, port: int, timeout: float, password: str | None = None) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            if password is not None:
                sock.sendall(f"AUTH {password}\r\n".encode())
                if not sock.recv(64).startswith(b"+OK"):
                    return False
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def write_private(path: Path, text: str) -> None:
    """Write `text` to a file only its owner can read (created 0600, never briefly wider)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)  # an existing file keeps its old mode through O_CREAT


def stored_password(data_dir: Path) -> str:
    """The server's password, generated on first use and kept in `data_dir/redis.password` (0600)."""
    path = data_dir / "redis.password"
    if path.is_file():
        password = path.read_text().strip()
        if password:
            os.chmod(path, 0o600)
            return password
    password = secrets.token_urlsafe(32)
    write_private(path, password + "\n")
    return password


@dataclass
class RedisProcess:
    """`redis-server` on 127.0.0.1:`port`, data (AOF) in `data_dir`, log in `data_dir/redis.log`,
    password in `data_dir/redis.password` (see the module doc; `auth=False` for none)."""

    data_dir: Path
    port: int = 0
    host: str = "127.0.0.1"
    appendonly: bool = True
    auth: bool = True
    password: str | None = field(default=None, repr=False)
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        """The URL clients use, with the password (keep it out of logs: `redacted_url`)."""
        who = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{who}{self.host}:{self.port}/0"

    @property
    def redacted_url(self) -> str:
        return f"redis://{':***@' if self.password else ''}{self.host}:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisProcess:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RedisNotInstalledError(
                "redis-server is not on PATH; install it (Debian/Ubuntu: apt-get install redis-server, "
                "or run scripts/bootstrap.sh)"
            )
        self.data_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.data_dir, 0o700)  # the AOF holds prompts, replies and the API-key salt
        if self.auth and self.password is None:
            self.password = stored_password(self.data_dir)
        config = self.data_dir / "redis.conf"
        write_private(config, f"requirepass {self.password}\n" if self.password else "")
        if self.port == 0:
            self.port = free_port(self.host)
        args = [
            binary,
            str(config),
            "--bind", self.host,
            "--port", str(self.port),
            "--dir", str(self.data_dir),
            "--appendonly", "yes" if self.appendonly else "no",
            "--save", "",
            "--logfile", str(self.data_dir / "redis.log"),
            "--protected-mode", "yes",
        ]  # fmt: skip
        # stderr to a file, not a pipe nobody reads (a full pipe would block the server)
        stderr_path = self.data_dir / "redis.stderr"
        with open(stderr_path, "ab") as stderr:
            self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=stderr)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = stderr_path.read_text(errors="replace")[-2000:]
                log = (
                    (self.data_dir / "redis.log").read_text(errors="replace")[-2000:]
                    if (self.data_dir / "redis.log").exists()
                    else ""
                )
                raise RuntimeError(
                    f"redis-server exited with code {self._proc.returncode} on port {self.port}: {err}{log}"
                )
            if _ping(self.host, self.port, timeout=0.2, password=self.password):
                return self
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"redis-server on port {self.port} did not answer PING within {timeout_s} s")

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def answers(self, timeout_s: float = 1.0) -> bool:
        """The server answers PING (with the password) within `timeout_s`."""
        return _ping(self.host, self.port, timeout=timeout_s, password=self.password)

    def exit_code(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    def log_tail(self, num_bytes: int = 2000) -> str:
        path = self.data_dir / "redis.log"
        return path.read_text(errors="replace")[-num_bytes:] if path.exists() else ""

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def stop(self, timeout_s: float = 5.0) -> None:
        if self._proc is None or self._proc.poll() is not None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def kill(self) -> None:
        """SIGKILL, for failure tests: the AOF keeps what was fsynced."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def __enter__(self) -> RedisProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


RedisVerdict = Literal["ok", "wait", "restart"]


@dataclass
class RedisWatch:
    """When the supervisor restarts the platform's redis-server (pure bookkeeping; issue 15).

    A server that exited is restarted at once (from its AOF, same port, password and directory). One that
    runs but has not answered PING for `hang_s` (stopped, wedged) is killed and restarted; before that the
    supervisor waits (a server loading a large AOF answers LOADING, not PONG, for a while).
    """

    hang_s: float = 15.0
    unanswered_since: float | None = None

    def verdict(self, alive: bool, answers: bool, now: float) -> RedisVerdict:
        if answers:
            self.unanswered_since = None
            return "ok"
        if not alive:
            self.unanswered_since = None
            return "restart"
        if self.unanswered_since is None:
            self.unanswered_since = now
        if now - self.unanswered_since >= self.hang_s:
            self.unanswered_since = None
            return "restart"
        return "wait"
