"""The zygote: a process that has imported everything a worker needs and forks workers on request.

`import torch` and the rest of a worker's imports cost seconds (3.4 s of torch alone on the H100 host,
DESIGN §6); a fork of a process that has already paid them costs milliseconds. `lorafn zygote serve
--socket S` imports torch, tokenizers, safetensors, Redis and lorafn's runtime (never initializing CUDA:
a CUDA context does not survive fork), then listens on the Unix socket `S` (0600, peers of another uid
refused). One connection per worker:

  client -> zygote   ForkRequest (argv, env, cwd, log path), one JSON line
  zygote -> client   Forked (pid) with a pidfd of the child attached (SCM_RIGHTS), or Refused (reason)
  zygote -> client   Exited (pid, code) when the zygote reaps the child; then the connection closes

The child does what a plain `python -P -m lorafn.cli ARGS` process would: a new session, stdio on the
log file, exactly the requested environment, and the same click/typer command line (`lorafn.cli.app`),
so the worker parses the command line the executor built, not a copy of its options. What a fresh
interpreter would read from the environment at start-up and a forked one cannot is redone by hand:
torch's CPU thread count (`OMP_NUM_THREADS`, read by OpenMP when torch loaded) and the random seeds.

The client side (the local executor's) is `lorafn.local.zygote`; it falls back to a plain spawn when the
zygote is absent, dead or refuses. This module imports torch only inside `serve`, so the protocol types
below are importable without torch.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import os
import runpy
import select
import signal
import socket
import struct
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import typer
from pydantic import BaseModel, Field, TypeAdapter

log = logging.getLogger("lorafn.zygote")

# The argv prefix of every lorafn component (`lorafn.local.procs.lorafn_argv`): what follows it is
# the command line the child parses.
CLI_MODULE = "lorafn.cli"

# What a worker imports on its way to serving; importing it here is the point of the zygote. Optional
# ones (triton: GPU hosts only) are skipped when missing.
PREIMPORTS = (
    "torch",
    "tokenizers",
    "safetensors",
    "safetensors.torch",
    "redis",
    "numpy",
    "lorafn.cli",
    "lorafn.api",
    "lorafn.store.registry",
    "lorafn.runtime.config",
    "lorafn.runtime.engine",
    "lorafn.runtime.model_runner",
    "lorafn.runtime.cuda_graphs",
    "lorafn.runtime.lora",
    "lorafn.runtime.worker",
    "lorafn.runtime.standby",
    "lorafn.api.tokenizer",
    "lorafn.backbone_server.client",
)
OPTIONAL_PREIMPORTS = ("triton", "triton.language")
# What Triton imports on its first compile (or cache lookup) in a process; gluon alone was 0.16 s of a
# fresh worker's first prefill on the H100 host
TRITON_LAZY_IMPORTS = (
    "triton.experimental.gluon",
    "triton.compiler.compiler",
    "triton.runtime.cache",
    "triton.tools.tensor_descriptor",
    "lorafn.runtime.models.triton_ops",
    "lorafn.runtime.models.fused_decode",
)

MAX_REQUEST_BYTES = 1 << 20
_CHILD_BLOCKED = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD}

# torch's thread count with no OMP_NUM_THREADS in the environment (the zygote is started without it)
_default_threads = 0


# -- the wire protocol ---------------------------------------------------------------------------------
class ForkRequest(BaseModel):
    type: Literal["fork"] = "fork"
    argv: list[str] = Field(description="the full command line, as for a plain spawn")
    env: dict[str, str] = Field(description="the child's whole environment")
    cwd: str
    log_path: str = Field(description="stdout and stderr go here (appended)")


class Forked(BaseModel):
    type: Literal["forked"] = "forked"
    pid: int


class Refused(BaseModel):
    type: Literal["refused"] = "refused"
    reason: str


class Exited(BaseModel):
    type: Literal["exited"] = "exited"
    pid: int
    code: int = Field(description="as subprocess reports it: the exit status, or -N for signal N")


Message = Annotated[ForkRequest | Forked | Refused | Exited, Field(discriminator="type")]
_MESSAGE = TypeAdapter(Message)


def encode(message: BaseModel) -> bytes:
    return message.model_dump_json().encode() + b"\n"


def decode(line: bytes) -> ForkRequest | Forked | Refused | Exited:
    """One message; ValueError (pydantic's ValidationError is one) for anything else."""
    return _MESSAGE.validate_json(line)


def exit_code(status: int) -> int:
    """A wait status as subprocess.Popen.returncode reports it."""
    return os.waitstatus_to_exitcode(status)


def cli_args(argv: list[str], executable: str = sys.executable) -> list[str] | None:
    """The `lorafn ...` arguments of a component command line this zygote can run, else None.

    Only `EXE [-P] -m lorafn.cli ARGS` with this interpreter: anything else is a different program, which
    a fork of this one cannot become."""
    rest = list(argv)
    if not rest or os.path.realpath(rest[0]) != os.path.realpath(executable):
        return None
    rest = rest[1:]
    if rest[:1] == ["-P"]:
        rest = rest[1:]
    if rest[:2] != ["-m", CLI_MODULE]:
        return None
    return rest[2:]


# -- the zygote ----------------------------------------------------------------------------------------
def preimport() -> float:
    """Import what a worker imports (no CUDA); the seconds it took."""
    t0 = time.perf_counter()
    for name in PREIMPORTS:
        importlib.import_module(name)
    for name in OPTIONAL_PREIMPORTS:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    return time.perf_counter() - t0


def warm_triton() -> float:
    """Triton's once-per-process set-up that needs no GPU, done before forking so no child pays it: the
    hash of its own sources and libraries (`triton_key`, cached per process; 0.43 s of a fresh worker's
    first prefill on the H100 host, 0.39 s on the 2-core CPU VM) and the modules its compiler imports on
    first use. The seconds it took (0 without Triton)."""
    t0 = time.perf_counter()
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        return 0.0
    triton_key()
    for name in TRITON_LAZY_IMPORTS:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    # the NVIDIA backend's cached subprocess probes (`ldconfig -p` for libcuda, `ptxas --version`): no CUDA
    with contextlib.suppress(Exception):
        from triton.backends.nvidia.driver import libcuda_dirs

        libcuda_dirs()
    with contextlib.suppress(Exception):
        from triton.backends.nvidia.compiler import get_ptxas_version

        get_ptxas_version()
    return time.perf_counter() - t0


def fork_blockers() -> list[str]:
    """Why forking now would hand a child a broken process (empty: safe)."""
    out = []
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        out.append("CUDA is initialized in the zygote (a CUDA context does not survive fork)")
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    if threads > 1:
        # A thread's locks (allocator, OpenMP pool, tokenizers' rayon pool) would be copied held.
        out.append(f"the zygote runs {threads} threads")
    return out


@dataclass
class _Conn:
    sock: socket.socket
    buf: bytes = b""
    pid: int | None = None  # the child forked for this connection


class Zygote:
    """The server loop: accept, fork on request, reap children and report their exits."""

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self.listener = _listen(socket_path)
        self.conns: dict[int, _Conn] = {}  # fileno -> connection
        self.by_pid: dict[int, _Conn] = {}
        self.children: set[int] = set()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._stopping = False
        self.no_cuda = ""  # why a forked child cannot use CUDA here (probe_cuda), "" when it can

    def install_signal_handlers(self) -> None:
        # SIGCHLD wakes the select (set_wakeup_fd) so an exit is reported at once; SIGTERM/SIGINT end
        # the zygote (its children live on: `lorafn up` is their subreaper and reaps them then).
        signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)

    def _stop(self, *_: object) -> None:
        self._stopping = True

    def serve_forever(self) -> None:
        parent = os.getppid()
        try:
            while not self._stopping:
                self.step(timeout_s=1.0)
                if os.getppid() != parent:  # `lorafn up` is gone: nobody will ask for workers again
                    log.warning("the parent process (pid %d) is gone; the zygote ends", parent)
                    break
        finally:
            self.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.socket_path.unlink()
        self.listener.close()
        for conn in list(self.conns.values()):
            conn.sock.close()
        self.conns.clear()

    def step(self, timeout_s: float) -> None:
        readable = [self.listener, self._wake_r, *(c.sock for c in self.conns.values())]
        try:
            ready, _, _ = select.select(readable, [], [], timeout_s)
        except InterruptedError:
            ready = []
        for sock in ready:
            if sock is self.listener:
                self._accept()
            elif sock is self._wake_r:
                with contextlib.suppress(BlockingIOError):
                    while self._wake_r.recv(4096):
                        pass
            else:
                self._read(self.conns[sock.fileno()])
        self._reap()

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except BlockingIOError:
            return
        uid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
        if uid != os.getuid():
            log.warning("refused a connection from uid %d", uid)
            sock.close()
            return
        sock.setblocking(False)
        self.conns[sock.fileno()] = _Conn(sock)

    def _drop(self, conn: _Conn) -> None:
        self.conns.pop(conn.sock.fileno(), None)
        conn.sock.close()

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the client went away; its child (if any) is still reaped
            self._drop(conn)
            return
        conn.buf += data
        if conn.pid is not None or b"\n" not in conn.buf:
            if len(conn.buf) > MAX_REQUEST_BYTES:
                self._drop(conn)
            return
        line, _, conn.buf = conn.buf.partition(b"\n")
        try:
            request = decode(line)
            if not isinstance(request, ForkRequest):
                raise ValueError(f"type: expected a fork request, got {request.type!r}")
        except ValueError as e:
            self._send(conn, encode(Refused(reason=f"bad request: {e}")))
            self._drop(conn)
            return
        self._fork(conn, request)

    def _send(self, conn: _Conn, data: bytes, fds: list[int] | None = None) -> bool:
        try:
            conn.sock.setblocking(True)
            conn.sock.settimeout(5.0)
            if fds:
                socket.send_fds(conn.sock, [data], fds)
            else:
                conn.sock.sendall(data)
            conn.sock.setblocking(False)
            return True
        except OSError:
            return False

    def _fork(self, conn: _Conn, request: ForkRequest) -> None:
        args = cli_args(request.argv)
        blockers = fork_blockers() + ([self.no_cuda] if self.no_cuda else [])
        if args is None:
            blockers.append(f"argv: {request.argv[:4]} is not `{sys.executable} [-P] -m {CLI_MODULE} ...`")
        if blockers:
            log.warning("refused a fork: %s", "; ".join(blockers))
            self._send(conn, encode(Refused(reason="; ".join(blockers))))
            self._drop(conn)
            return
        assert args is not None
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        # A SIGTERM that reaches the child before it has reset the zygote's handlers would run the
        # zygote's handler there and be lost: signals stay blocked until `run_child` has reset them.
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _CHILD_BLOCKED)
        pid = os.fork()
        if pid != 0:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        if pid == 0:  # the child: never returns into the zygote's loop
            code = 1
            try:
                inherited = [
                    self.listener,
                    self._wake_r,
                    self._wake_w,
                    *(c.sock for c in self.conns.values()),
                ]
                code = run_child(request, args, inherited)
            except BaseException:
                with contextlib.suppress(Exception):
                    traceback.print_exc()
            finally:
                with contextlib.suppress(Exception):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(code)
        self.children.add(pid)
        conn.pid = pid
        self.by_pid[pid] = conn
        pidfd = os.pidfd_open(pid)  # the child cannot be reaped before this: only we wait for it
        try:
            sent = self._send(conn, encode(Forked(pid=pid)), [pidfd])
        finally:
            os.close(pidfd)
        log.info("forked pid %d: %s", pid, " ".join(args[:4]))
        if not sent:
            log.warning("the client of pid %d went away before the reply", pid)

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                self.children.clear()
                return
            if pid == 0:
                return
            self.children.discard(pid)
            code = exit_code(status)
            log.info("pid %d exited with code %d", pid, code)
            conn = self.by_pid.pop(pid, None)
            if conn is not None and conn.sock.fileno() in self.conns:
                self._send(conn, encode(Exited(pid=pid, code=code)))
                self._drop(conn)


def _listen(path: Path) -> socket.socket:
    """A Unix socket only this user can connect to (0600, created so: never briefly wider)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(64)
    sock.setblocking(False)
    return sock


def probe_cuda(timeout_s: float = 120.0) -> str:
    """On a host with an NVIDIA driver: fork a child that initializes CUDA and runs one kernel. "" when it
    could; else why not (something in the zygote touched the driver: every fork is then refused, and
    workers are spawned). `torch.cuda.is_available()` is not asked here: it initializes the driver."""
    if not os.path.exists("/dev/nvidiactl"):
        return ""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            import torch

            torch.zeros(1, device="cuda").add_(1)
            torch.cuda.synchronize()
            code = 0
        except BaseException:
            with contextlib.suppress(Exception):
                traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return f"a forked child did not initialize CUDA within {timeout_s:.0f} s"
        time.sleep(0.05)
    code = exit_code(status)
    if code != 0:
        return f"a forked child could not initialize CUDA (exit code {code}; traceback above in this log)"
    log.info("a forked child initialized CUDA in %.2f s", time.perf_counter() - t0)
    return ""


# -- the child -----------------------------------------------------------------------------------------
def run_child(request: ForkRequest, args: list[str], inherited: list[socket.socket]) -> int:
    """Become `lorafn ARGS` as a fresh process would be; the exit code."""
    for sock in inherited:
        sock.close()
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as CPython sets it at start-up
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    os.setsid()  # as a plain spawn with start_new_session: Ctrl-C reaches only `lorafn up`
    fd = os.open(request.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.env)
    _redo_startup_from_env()
    # exactly what `python -m lorafn.cli ARGS` runs (the module as __main__, over the imported packages)
    sys.argv = [CLI_MODULE, *args]
    try:
        runpy.run_module(CLI_MODULE, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code
        print(e.code, file=sys.stderr)
        return 1
    return 0


def _redo_startup_from_env() -> None:
    """What a new interpreter takes from its environment and a fork inherited from the zygote's."""
    # The zygote's logging setup (its handler) is not the worker's: the worker configures its own.
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in list(log.handlers):
        log.removeHandler(handler)
    log.propagate = True
    # OpenMP read OMP_NUM_THREADS when torch loaded in the zygote; the child's value must still count.
    import torch

    threads = os.environ.get("OMP_NUM_THREADS") or os.environ.get("MKL_NUM_THREADS")
    if threads and threads.strip().isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    elif _default_threads:
        torch.set_num_threads(_default_threads)  # the zygote runs without OMP_NUM_THREADS: the default
    # Seeds: `random` reseeds itself after fork; numpy's global state would be every child's same copy.
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


# -- `lorafn zygote serve` -------------------------------------------------------------------------------
app = typer.Typer(help="Run the zygote: a pre-imported process that forks workers.", no_args_is_help=True)


@app.command("serve")
def serve(
    socket_path: Path = typer.Option(..., "--socket", help="Unix socket to listen on (created 0600)"),
) -> None:
    """Import what workers need (no CUDA), then fork a worker for each request on --socket."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    # Nothing in the zygote may start the tokenizers' thread pool before a fork (the children would
    # inherit it without its threads); a child's own env decides for the child.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # OpenBLAS (numpy's) starts its pool of cores-1 threads when it loads; a fork copies none of them.
    # Workers barely use numpy's BLAS (torch has its own), so the zygote's is single-threaded.
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    # torch's default thread count must be the machine's (a child without OMP_NUM_THREADS gets it), not a
    # value meant for one worker; a child's own OMP_NUM_THREADS is applied after the fork.
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.pop(name, None)
    if "torch" in sys.modules:
        raise RuntimeError("torch was imported before the zygote cleared its thread settings")
    seconds = preimport()
    warmed = warm_triton()
    global _default_threads
    _default_threads = sys.modules["torch"].get_num_threads()
    blockers = fork_blockers()
    if blockers:
        log.error("cannot fork workers: %s", "; ".join(blockers))
        raise typer.Exit(code=3)
    zygote = Zygote(socket_path)
    zygote.no_cuda = probe_cuda()
    if zygote.no_cuda:
        log.error("every fork is refused (workers are spawned instead): %s", zygote.no_cuda)
    zygote.install_signal_handlers()
    # Last, so that what the probe and the server's set-up made is frozen too: a forked child shares these
    # objects copy-on-write, and without the freeze each child's collections would walk them, writing
    # their GC headers (copying their pages into that child) and spending hundreds of ms on its first full
    # collection. The child inherits the frozen generation; nothing in lorafn unfreezes it.
    from lorafn.runtime.standby import settle_heap

    settle_heap()
    frozen = gc.get_freeze_count()
    log.info(
        "zygote ready in %.2f s (imports; Triton's set-up %.2f s), %d objects frozen, listening on %s",
        seconds, warmed, frozen, socket_path,
    )  # fmt: skip
    zygote.serve_forever()


if __name__ == "__main__":  # pragma: no cover
    app()

__all__ = ["Exited", "ForkRequest", "Forked", "Refused", "Zygote", "app", "cli_args", "decode", "encode"]
