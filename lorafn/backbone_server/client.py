"""The worker side: `SharedWeightSource`, the backbone server's shared mapping as a WeightSource.

    source = SharedWeightSource("/run/lorafn/backbone.sock", device="cuda:0")   # or device="cpu"
    engine = Engine(EngineConfig(model=DIR, weight_source=source, ...))

On attach it checks the protocol and software versions and (GPU) the GPU UUID, maps the backbone
read-only (GPU: VMM import at the fixed address W, PROT_READ; CPU: the sealed memfd, PROT_READ),
closes the received fds, and builds every tensor as a view of that one mapping (no copy). A thread
heartbeats the lease; `close()` detaches. Tensors stay valid while referenced, even after close() or
after the server exits: each view holds the mapping.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lorafn import __version__
from lorafn.backbone_server import protocol as proto
from lorafn.backbone_server.manifest import MANIFEST_FORMAT, MANIFEST_VERSION

if TYPE_CHECKING:
    import torch

log = logging.getLogger("lorafn.backbone_server.client")


class BackboneMismatch(RuntimeError):
    """This worker must not use this backbone (another GPU, other versions, other content)."""


class SharedWeightSource:
    """A WeightSource (lorafn.runtime.weights) over the backbone server's read-only mapping."""

    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        device: str = "cpu",
        *,
        name: str = "",
        w_addr: int | None = None,
        expect_content_hash: str | None = None,
        strict_versions: bool = True,
        heartbeat: bool = True,
        connect_timeout_s: float = 30.0,
    ):
        import torch

        self.socket_path = Path(socket_path)
        self.device = torch.device(device)
        self._closed = False
        self._sock: socket.socket | None = None
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._sock_lock = threading.Lock()
        t0 = time.perf_counter()

        gpu_uuid = None
        if self.device.type == "cuda":
            from lorafn.backbone_server.storage import native

            ipc = native()
            if not ipc.available():
                raise RuntimeError(
                    f"device {device!r}: the CUDA driver is not usable here: {ipc.unavailable_reason()}"
                )
            if not torch.cuda.is_available():
                raise RuntimeError(f"device {device!r}: this torch ({torch.__version__}) has no usable CUDA")
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            self.device = torch.device("cuda", index)
            torch.cuda.set_device(index)
            torch.zeros(1, device=self.device)  # torch creates the primary context; the import uses it
            gpu_uuid = ipc.device_uuid(index)
        elif self.device.type != "cpu":
            raise ValueError(f"device {device!r}: a shared backbone is mapped on 'cpu' or 'cuda[:N]'")

        sock = self._connect(connect_timeout_s)
        fds: list[int] = []
        try:
            sock.settimeout(max(connect_timeout_s, 60.0))
            reply, fds = proto.request(
                sock,
                "attach",
                max_fds=proto.MAX_FDS,
                worker={
                    "pid": os.getpid(),
                    "name": name,
                    "mode": self.device.type,
                    "gpu_uuid": gpu_uuid,
                    "lorafn": __version__,
                    "torch": torch.__version__,
                },
                expect_content_hash=expect_content_hash,
            )
            manifest = reply["manifest"]
            self._check(manifest, gpu_uuid, strict_versions)
            if len(fds) != len(manifest["segments"]):
                raise proto.ProtocolError(
                    "bad_reply", f"{len(fds)} fds for {len(manifest['segments'])} segments"
                )
            t_map = time.perf_counter()
            if self.device.type == "cuda":
                from lorafn.backbone_server.storage import cuda_bytes_tensor, native

                addr = int(manifest["w_addr"] if w_addr is None else w_addr)
                mapping = native().import_map(
                    self.device.index, fds, manifest["segments"], addr, read_only=True
                )
                base = cuda_bytes_tensor(mapping, self.device.index)
            else:
                from lorafn.backbone_server.storage import map_cpu_readonly

                mapping, base = map_cpu_readonly(fds[0], manifest["segments"][0])
            self.map_seconds = time.perf_counter() - t_map
        except BaseException:
            sock.close()
            raise
        finally:
            for fd in fds:  # the mapping holds the memory; the fds are no longer needed
                with contextlib.suppress(OSError):
                    os.close(fd)
        from lorafn.backbone_server.storage import tensor_views

        self._mapping = mapping
        self._base = base
        self.manifest: dict[str, Any] = manifest
        self._tensors: dict[str, torch.Tensor] = tensor_views(base, manifest["tensors"])
        self.lease_id: str = reply["lease_id"]
        sock.settimeout(10.0)  # a heartbeat never waits longer on a server that hangs
        self._sock = sock
        self.attach_seconds = time.perf_counter() - t0
        if heartbeat:
            interval = float(reply.get("heartbeat_interval_s", 3.0))
            self._hb_thread = threading.Thread(
                target=self._heartbeat, args=(interval,), name="backbone-heartbeat", daemon=True
            )
            self._hb_thread.start()

    # ---- attach helpers ------------------------------------------------------------------------
    def _connect(self, timeout_s: float) -> socket.socket:
        deadline = time.monotonic() + timeout_s
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(str(self.socket_path))
                return sock
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                sock.close()
                if time.monotonic() >= deadline:
                    raise ConnectionError(
                        f"no backbone server at {self.socket_path} after {timeout_s:.0f} s: {exc}"
                    ) from None
                time.sleep(0.05)

    def _check(self, manifest: dict[str, Any], gpu_uuid: str | None, strict: bool) -> None:
        if manifest.get("format") != MANIFEST_FORMAT or manifest.get("version") != MANIFEST_VERSION:
            raise BackboneMismatch(
                f"manifest {manifest.get('format')!r} v{manifest.get('version')} is not "
                f"{MANIFEST_FORMAT} v{MANIFEST_VERSION}"
            )
        if manifest["mode"] != self.device.type:
            raise BackboneMismatch(
                f"the server holds a {manifest['mode']} backbone; this worker is on {self.device}"
            )
        if self.device.type == "cuda" and manifest.get("gpu_uuid") != gpu_uuid:
            raise BackboneMismatch(
                f"the backbone lives on GPU {manifest.get('gpu_uuid')}; "
                f"this worker's {self.device} is {gpu_uuid}"
            )
        import torch

        versions = manifest.get("versions", {})
        problems = []
        if versions.get("lorafn") != __version__:
            problems.append(f"lorafn {versions.get('lorafn')} (server) vs {__version__} (worker)")
        if self.device.type == "cuda":
            from lorafn.backbone_server.storage import native

            drv = native().driver_version()
            if versions.get("cuda_driver") != drv:
                problems.append(f"CUDA driver {versions.get('cuda_driver')} (server) vs {drv} (worker)")
        if problems and strict:
            raise BackboneMismatch("software versions differ: " + "; ".join(problems))
        for p in problems:
            log.warning("backbone server versions differ: %s", p)
        if versions.get("torch") != torch.__version__:
            # The bytes do not depend on torch; graphs archived against W do (their own key says so).
            log.info("torch %s (server) vs %s (worker)", versions.get("torch"), torch.__version__)

    def _heartbeat(self, interval: float) -> None:
        while not self._hb_stop.wait(interval):
            try:
                with self._sock_lock:
                    if self._sock is None:
                        return
                    proto.request(self._sock, "heartbeat", lease_id=self.lease_id)
            except (OSError, proto.ProtocolError, proto.RemoteError) as exc:
                # The server is gone or ended the lease: the mapping stays valid; only the lease is lost.
                log.warning(
                    "backbone lease %s: heartbeat failed (%s); the mapping stays valid", self.lease_id, exc
                )
                return

    # ---- WeightSource ----------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._tensors)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._tensors))

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def get(self, name: str, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
        """The shared tensor itself (a read-only view) when device and dtype match the mapping; else
        a private converted copy (which costs memory in this worker: ask for the stored dtype)."""
        import torch

        if self._closed:
            raise RuntimeError("SharedWeightSource is closed")
        try:
            t = self._tensors[name]
        except KeyError:
            raise KeyError(
                f"tensor {name!r} is not in the shared backbone ({self.manifest['model_dir']})"
            ) from None
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev == t.device and dtype == t.dtype:
            return t
        return t.to(device=dev, dtype=dtype, copy=True)

    def read_only(self) -> bool:
        return True

    def tensors(self) -> dict[str, torch.Tensor]:
        """All shared tensors by name (read-only views)."""
        return dict(self._tensors)

    @property
    def content_hash(self) -> str:
        return self.manifest["content_hash"]

    def close(self) -> None:
        """Detach the lease. Views already handed out keep the mapping alive until they are freed."""
        if self._closed:
            return
        self._closed = True
        self._hb_stop.set()
        with self._sock_lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.settimeout(2.0)
                proto.request(sock, "detach", lease_id=self.lease_id)
            except (OSError, proto.ProtocolError, proto.RemoteError):
                pass
            finally:
                sock.close()
        self._tensors = {}
        self._base = None
        self._mapping = None

    def __enter__(self) -> SharedWeightSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if not self._closed and self._sock is not None:
                self._hb_stop.set()
                self._sock.close()
