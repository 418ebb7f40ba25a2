"""The backbone server: loads a model directory once, exports it read-only to workers over a Unix socket.

Lifetimes:
  - The server owns the memory (a sealed memfd on CPU, VMM allocations on GPU). Every attached worker
    holds its own mapping, which keeps the memory alive even when the server exits or crashes.
  - A lease lives as long as the worker's connection: attach -> lease id; heartbeats on the same
    connection; it ends on detach, on the connection closing (a worker that crashed), or when no
    heartbeat came within `lease_ttl_s` (a worker that hangs). Leases are bookkeeping (metrics, the
    controller's view); ending one never unmaps anything in a worker.
  - SIGTERM/SIGINT: stop accepting, close connections, remove the socket file, release the server's
    own reference to the memory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import signal
import socket
import stat
import struct
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorafn import __version__
from lorafn.backbone_server import protocol as proto
from lorafn.backbone_server.manifest import (
    ModelDir,
    build_manifest,
    content_hash,
    open_model_dir,
    plan_layout,
)
from lorafn.backbone_server.metrics import HealthServer, ServerMetrics
from lorafn.backbone_server.storage import DEFAULT_W_ADDR

log = logging.getLogger("lorafn.backbone_server")


@dataclass
class ServerConfig:
    model_dir: Path
    socket_path: Path
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N"
    http_host: str = "127.0.0.1"
    http_port: int | None = None  # None: no HTTP endpoint; 0: any free port
    lease_ttl_s: float = 15.0
    heartbeat_interval_s: float = 3.0
    handshake_timeout_s: float = 10.0
    max_workers: int = 0  # 0: no limit
    w_addr: int = DEFAULT_W_ADDR
    segment_bytes: int = 4 << 30
    chunk_bytes: int = 64 << 20
    num_streams: int = 4
    loader: str = "auto"  # GPU: "hostreg" (DMA from the page cache), "staging" (pinned buffers), "auto"
    load_threads: int = 4
    full_hash: bool = False
    measure_bandwidth: bool = True
    socket_mode: int = 0o660


@dataclass
class Lease:
    lease_id: str
    pid: int
    uid: int
    name: str
    gpu_uuid: str | None
    attached_at: float
    last_heartbeat: float
    conn: socket.socket = field(repr=False)

    def info(self) -> dict[str, Any]:
        now = time.time()
        return {
            "lease_id": self.lease_id,
            "pid": self.pid,
            "uid": self.uid,
            "name": self.name,
            "gpu_uuid": self.gpu_uuid,
            "attached_s": round(now - self.attached_at, 3),
            "since_heartbeat_s": round(now - self.last_heartbeat, 3),
        }


def _peer_cred(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the peer, from the kernel (not from what the peer claims)."""
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return struct.unpack("3i", raw)
    except OSError:
        return (-1, -1, -1)


def software_versions(driver_version: int | None) -> dict[str, Any]:
    import torch

    return {
        "protocol": proto.PROTOCOL_VERSION,
        "lorafn": __version__,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_driver": driver_version,
        "python": platform.python_version(),
    }


class BackboneServer:
    def __init__(self, config: ServerConfig):
        self.cfg = config
        self.metrics = ServerMetrics()
        self.manifest: dict[str, Any] | None = None
        self.storage: Any = None
        self.model: ModelDir | None = None
        self.leases: dict[str, Lease] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._health: HealthServer | None = None
        self._bound = False

    # ---- lifecycle --------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self._bound and self.manifest is not None and not self._stop.is_set()

    def _info(self) -> dict[str, Any]:
        m = self.manifest or {}
        return {
            "mode": m.get("mode"),
            "gpu_uuid": m.get("gpu_uuid"),
            "attached_workers": len(self.leases),
            "content_hash": m.get("content_hash"),
        }

    def start_http(self) -> int | None:
        if self.cfg.http_port is None:
            return None
        self._health = HealthServer(
            self.cfg.http_host, self.cfg.http_port, self.metrics, lambda: self.ready, self._info
        )
        log.info(
            "health endpoint on http://%s:%d (/healthz /readyz /metrics)",
            self.cfg.http_host,
            self._health.port,
        )
        return self._health.port

    @property
    def http_port(self) -> int | None:
        return None if self._health is None else self._health.port

    def load(self) -> dict[str, Any]:
        """Check the model directory, load it into shared memory / the GPU, build the manifest."""
        cfg = self.cfg
        model = open_model_dir(cfg.model_dir)  # ModelDirError names the bad file
        layout = plan_layout(model)
        digest = content_hash(model, full=cfg.full_hash)
        if cfg.device == "cpu":
            from lorafn.backbone_server.storage import CpuBackbone

            store = CpuBackbone(model, layout, num_threads=cfg.load_threads)
            manifest = build_manifest(
                model,
                layout,
                mode="cpu",
                segments=store.segments,
                content=digest,
                versions=software_versions(None),
                load=store.load_info,
            )
        elif cfg.device.startswith("cuda"):
            from lorafn.backbone_server.storage import GpuBackbone

            index = int(cfg.device.split(":", 1)[1]) if ":" in cfg.device else 0
            store = GpuBackbone(
                model,
                layout,
                index,
                segment_bytes=cfg.segment_bytes,
                chunk_bytes=cfg.chunk_bytes,
                num_streams=cfg.num_streams,
                measure=cfg.measure_bandwidth,
                loader=cfg.loader,
            )
            manifest = build_manifest(
                model,
                layout,
                mode="cuda",
                segments=store.segments,
                content=digest,
                versions=software_versions(store.driver_version),
                gpu_uuid=store.gpu_uuid,
                device_name=store.device_name,
                w_addr=cfg.w_addr,
                load=store.load_info,
            )
            if store.bounds.h2d_gbps:
                self.metrics.h2d_gbps.set(store.bounds.h2d_gbps)
        else:
            raise ValueError(f"device {cfg.device!r}: use 'cpu', 'cuda' or 'cuda:N'")
        self.model, self.storage, self.manifest = model, store, manifest
        self.metrics.bytes_loaded.set(layout.used_bytes)
        self.metrics.mapped_bytes.set(sum(store.segments))
        self.metrics.load_seconds.set(store.load_info["seconds"])
        self.metrics.load_gbps.set(store.load_info["gbps"])
        log.info(
            "loaded %s: %d tensors, %.3f GB in %.3f s (%s)",
            model.path,
            len(model.tensors),
            layout.used_bytes / 1e9,
            store.load_info["seconds"],
            store.load_info,
        )
        return manifest

    def bind(self) -> None:
        path = self.cfg.socket_path
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() or path.is_symlink():
            if not stat.S_ISSOCK(path.lstat().st_mode):
                raise FileExistsError(f"{path}: exists and is not a socket; refusing to replace it")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(path))
            except OSError:
                path.unlink()  # stale socket of a server that died
            else:
                probe.close()
                raise RuntimeError(f"{path}: another backbone server is listening there")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        os.chmod(path, self.cfg.socket_mode)
        listener.listen(128)
        listener.settimeout(0.25)
        self._listener = listener
        self._bound = True
        self.metrics.ready.set(1)
        log.info("serving on %s", path)

    def serve_forever(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    break
                raise
            conn.settimeout(None)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._handle, args=(conn,), name="backbone-conn", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        """Release everything this server holds; attached workers keep their mappings."""
        self._stop.set()
        self.metrics.ready.set(0)
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.close()
            self._listener = None
        if self._bound:
            with contextlib.suppress(FileNotFoundError):
                self.cfg.socket_path.unlink()
            self._bound = False
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        if self._health is not None:
            self._health.close()
            self._health = None
        if self.storage is not None:
            self.storage.close()
            self.storage = None

    def run(self) -> None:
        """start HTTP, load, bind, serve until SIGTERM/SIGINT, clean up."""

        def on_signal(signum: int, _frame: Any) -> None:
            log.info("signal %d: shutting down", signum)
            self._stop.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        try:
            self.start_http()
            self.load()
            self.bind()
            self.serve_forever()
        finally:
            self.close()

    # ---- one connection ------------------------------------------------------------------------
    def _refuse(self, conn: socket.socket, code: str, message: str) -> None:
        self.metrics.refusals.labels(reason=code).inc()
        log.warning("refused (%s): %s", code, message)
        with contextlib.suppress(OSError):
            proto.send_message(conn, proto.error(code, message))

    def _handle(self, conn: socket.socket) -> None:
        lease: Lease | None = None
        end_reason = "disconnected"
        pid, uid, _gid = _peer_cred(conn)
        try:
            while not self._stop.is_set():
                conn.settimeout(self.cfg.lease_ttl_s if lease else self.cfg.handshake_timeout_s)
                try:
                    msg, _ = proto.recv_message(conn, proto.MAX_REQUEST_BYTES, 0)
                except TimeoutError:
                    if lease is not None:
                        end_reason = "expired"
                        log.warning(
                            "lease %s (pid %d) expired: no heartbeat in %.1f s",
                            lease.lease_id,
                            lease.pid,
                            self.cfg.lease_ttl_s,
                        )
                    break
                except proto.PeerClosed:
                    break
                except proto.ProtocolError as exc:
                    self._refuse(conn, exc.code, exc.message)
                    end_reason = "protocol_error"
                    break  # framing is lost: close this connection only
                except OSError:
                    break
                op = msg.get("op")
                if op == "hello":
                    proto.send_message(
                        conn, proto.ok(server=self._info(), versions=(self.manifest or {}).get("versions"))
                    )
                elif op == "stats":
                    proto.send_message(conn, proto.ok(stats=self.stats()))
                elif op == "attach":
                    if lease is not None:
                        self._refuse(
                            conn, "already_attached", f"this connection already holds lease {lease.lease_id}"
                        )
                        continue
                    lease = self._attach(conn, msg, pid, uid)
                elif op == "heartbeat":
                    if lease is None or msg.get("lease_id") != lease.lease_id:
                        self._refuse(
                            conn, "unknown_lease", f"no lease {msg.get('lease_id')!r} on this connection"
                        )
                        continue
                    lease.last_heartbeat = time.time()
                    self.metrics.heartbeats.inc()
                    proto.send_message(conn, proto.ok(lease_ttl_s=self.cfg.lease_ttl_s))
                elif op == "detach":
                    if lease is None or msg.get("lease_id") != lease.lease_id:
                        self._refuse(
                            conn, "unknown_lease", f"no lease {msg.get('lease_id')!r} on this connection"
                        )
                        continue
                    self._end(lease, "detached")
                    lease = None
                    proto.send_message(conn, proto.ok())
                else:
                    self._refuse(
                        conn, "unknown_op", f"unknown op {op!r} (hello, attach, heartbeat, detach, stats)"
                    )
        except Exception:  # a bug here must not take the server down: log, drop this connection
            log.exception("connection handler failed")
            end_reason = "server_error"
        finally:
            if lease is not None:
                self._end(lease, end_reason)
            with self._lock:
                self._conns.discard(conn)
            with contextlib.suppress(OSError):
                conn.close()

    def _attach(self, conn: socket.socket, msg: dict[str, Any], pid: int, uid: int) -> Lease | None:
        manifest = self.manifest
        if manifest is None or self.storage is None:
            self._refuse(conn, "not_ready", "the backbone is not loaded")
            return None
        worker = msg.get("worker")
        if not isinstance(worker, dict):
            self._refuse(conn, "bad_request", "attach needs a 'worker' object")
            return None
        mode = worker.get("mode")
        gpu_uuid = worker.get("gpu_uuid")
        if mode != manifest["mode"]:
            self._refuse(
                conn,
                "mode_mismatch",
                f"worker asks for a {mode!r} backbone; this server holds a {manifest['mode']!r} one",
            )
            return None
        if manifest["mode"] == "cuda" and gpu_uuid != manifest["gpu_uuid"]:
            self._refuse(
                conn,
                "gpu_mismatch",
                f"worker is on GPU {gpu_uuid!r} but the backbone lives on GPU {manifest['gpu_uuid']}: "
                "a worker can only map the backbone of its own physical GPU",
            )
            return None
        expect = msg.get("expect_content_hash")
        if expect is not None and expect != manifest["content_hash"]:
            self._refuse(
                conn,
                "content_mismatch",
                f"worker expects content {expect}, this server holds {manifest['content_hash']}",
            )
            return None
        with self._lock:
            if self.cfg.max_workers and len(self.leases) >= self.cfg.max_workers:
                over = True
            else:
                over = False
                now = time.time()
                lease = Lease(
                    uuid.uuid4().hex, pid, uid, str(worker.get("name", ""))[:200], gpu_uuid, now, now, conn
                )
                self.leases[lease.lease_id] = lease
        if over:
            self._refuse(conn, "capacity", f"{self.cfg.max_workers} workers are attached already")
            return None
        try:
            proto.send_message(
                conn,
                proto.ok(
                    lease_id=lease.lease_id,
                    lease_ttl_s=self.cfg.lease_ttl_s,
                    heartbeat_interval_s=self.cfg.heartbeat_interval_s,
                    manifest=manifest,
                ),
                fds=self.storage.fds(),
            )
        except OSError:
            with self._lock:
                self.leases.pop(lease.lease_id, None)
            raise
        self.metrics.attaches.inc()
        self.metrics.attached.set(len(self.leases))
        log.info("attached %s (pid %d, %s)", lease.lease_id, pid, lease.name)
        return lease

    def _end(self, lease: Lease, reason: str) -> None:
        with self._lock:
            gone = self.leases.pop(lease.lease_id, None)
            n = len(self.leases)
        if gone is not None:
            self.metrics.detaches.labels(reason=reason).inc()
            self.metrics.attached.set(n)
            log.info("lease %s (pid %d) ended: %s", lease.lease_id, lease.pid, reason)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            leases = [lease.info() for lease in self.leases.values()]
        m = self.manifest or {}
        return {
            "ready": self.ready,
            "mode": m.get("mode"),
            "gpu_uuid": m.get("gpu_uuid"),
            "total_bytes": m.get("total_bytes"),
            "mapped_bytes": m.get("mapped_bytes"),
            "content_hash": m.get("content_hash"),
            "load": m.get("load"),
            "leases": leases,
        }
