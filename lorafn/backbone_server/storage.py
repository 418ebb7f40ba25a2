"""Where the backbone bytes live, and tensors over them without a copy.

CPU mode: one sealed memfd (shared memory, like /dev/shm). The server writes it once through a
temporary writable mapping, unmaps that, then seals it (F_SEAL_WRITE | GROW | SHRINK | SEAL): from
then on no process can write it or map it writable, and workers map it `PROT_READ`. A write into a
backbone tensor is a SIGSEGV in the writing process only.

GPU mode: VMM allocations exportable as POSIX fds (lorafn._ipc), mapped read-write in the server for
loading; workers import them read-only at a fixed virtual address (W), see client.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import queue
import threading
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lorafn.api.safetensors import DTYPE_NAMES
from lorafn.backbone_server.manifest import Layout, ModelDir, align_up

if TYPE_CHECKING:
    import torch

PAGE = mmap.PAGESIZE
log = logging.getLogger("lorafn.backbone_server")
DEFAULT_W_ADDR = 0x1000_0000_0000  # 16 TiB: where every worker maps W (docs/backbone_server.md)


def torch_dtype(code: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype code (lorafn.api.safetensors.DTYPE_NAMES)."""
    import torch

    name = DTYPE_NAMES.get(code)
    dt = getattr(torch, name, None) if name is not None else None
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"dtype {code!r} has no torch equivalent in torch {torch.__version__}")
    return dt


def tensor_views(base: torch.Tensor, tensors: dict[str, dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Views into `base` (a 1-D uint8 tensor over W), one per manifest entry. No copy."""
    out = {}
    for name, e in tensors.items():
        off, n = int(e["offset"]), int(e["nbytes"])
        flat = base[off : off + n].view(torch_dtype(e["dtype"]))
        out[name] = flat.as_strided(tuple(e["shape"]), tuple(e["stride"]))
    return out


def _pread_into(fd: int, view: memoryview, offset: int, path: str) -> None:
    """Fill `view` from file offset `offset` (pread returns at most ~2 GiB per call)."""
    done, total = 0, len(view)
    while done < total:
        n = os.preadv(fd, [view[done : done + (1 << 30)]], offset + done)
        if n <= 0:
            raise OSError(
                f"{path}: unexpected end of file at byte {offset + done} (file changed while loading?)"
            )
        done += n


# ---- CPU: sealed memfd ----------------------------------------------------------------------------


class CpuBackbone:
    """The backbone in one sealed memfd. `fds()` are sent to workers; they map it PROT_READ."""

    mode = "cpu"

    def __init__(self, model: ModelDir, layout: Layout, num_threads: int = 4):
        self.size = align_up(layout.used_bytes, PAGE)
        self.segments = [self.size]
        t0 = time.perf_counter()
        fd = os.memfd_create("lorafn-backbone", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, self.size)
            mm = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            try:
                mv = memoryview(mm)
                try:
                    self._fill(model, layout, mv, num_threads)
                finally:
                    mv.release()
            finally:
                mm.close()
            # No writable mapping is left: seal, so nobody (server included) can write it again.
            fcntl.fcntl(
                fd,
                fcntl.F_ADD_SEALS,
                fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL,
            )
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.load_seconds = time.perf_counter() - t0
        self.load_info: dict[str, Any] = {
            "seconds": round(self.load_seconds, 4),
            "gbps": round(layout.used_bytes / max(self.load_seconds, 1e-9) / 1e9, 3),
            "threads": num_threads,
        }

    @staticmethod
    def _fill(model: ModelDir, layout: Layout, mv: memoryview, num_threads: int) -> None:
        jobs = [(t.file, t.data_start, layout.offsets[t.name], t.nbytes) for t in model.tensors if t.nbytes]
        errors: list[BaseException] = []
        lock = threading.Lock()
        it = iter(jobs)
        fds: dict[str, int] = {}

        def work() -> None:
            local: dict[str, int] = {}
            try:
                while True:
                    with lock:
                        job = next(it, None)
                    if job is None or errors:
                        return
                    path, start, dst, n = job
                    key = str(path)
                    if key not in local:
                        local[key] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                    _pread_into(local[key], mv[dst : dst + n], start, key)
            except BaseException as exc:
                errors.append(exc)
            finally:
                for f in local.values():
                    os.close(f)

        threads = [threading.Thread(target=work, daemon=True) for _ in range(max(1, num_threads))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        del fds
        if errors:
            raise errors[0]

    def fds(self) -> list[int]:
        return [self.fd]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # workers' mappings keep the memory alive
            self.fd = -1


def map_cpu_readonly(fd: int, size: int) -> tuple[mmap.mmap, torch.Tensor]:
    """Map a backbone memfd PROT_READ and return (mapping, 1-D uint8 tensor over it, no copy).

    The tensor holds a buffer export of the mmap, so the mapping stays until the last view is freed.
    """
    import torch

    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    with warnings.catch_warnings():
        # torch warns that the buffer is not writable: that is the point (writes fault).
        warnings.simplefilter("ignore", UserWarning)
        base = torch.frombuffer(mm, dtype=torch.uint8)
    return mm, base


# ---- GPU: VMM allocations -------------------------------------------------------------------------


def native() -> Any:
    """lorafn._ipc, or a clear error when the extension was not built."""
    try:
        from lorafn import _ipc
    except ImportError as exc:  # pragma: no cover - depends on the build
        raise ImportError(
            "the native extension lorafn._ipc is not built; run `pip install -e .` in the repository "
            f"(needs a C compiler, no CUDA toolkit): {exc}"
        ) from exc
    return _ipc


class _CudaBytes:
    """A 1-D byte array exposing __cuda_array_interface__; it keeps `mapping` alive.

    torch.as_tensor() holds a reference to this object for the storage's lifetime, so every view
    of the resulting tensor keeps the mapping (and its VMM ranges) alive.
    """

    def __init__(self, mapping: Any, ptr: int, nbytes: int):
        self._mapping = mapping
        # torch refuses the read-only flag of the interface; read-only is enforced by the driver
        # (cuMemSetAccess PROT_READ), not by this flag.
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 2,
            "strides": None,
        }


def cuda_bytes_tensor(mapping: Any, device_index: int) -> torch.Tensor:
    import torch

    return torch.as_tensor(
        _CudaBytes(mapping, int(mapping.ptr), int(mapping.size)), device=f"cuda:{device_index}"
    )


@dataclass
class Bandwidth:
    h2d_gbps: float | None = None
    read_gbps: float | None = None


def measure_h2d(device_index: int, nbytes: int = 1 << 30, repeats: int = 3) -> float:
    """Pinned host -> device copy bandwidth in GB/s (one stream, best of `repeats`)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device_index}")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device_index)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device_index)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return nbytes / best / 1e9


def measure_read(model: ModelDir, max_bytes: int, num_threads: int, chunk: int) -> float:
    """Page-cache read bandwidth in GB/s into host buffers, with the loader's thread count."""
    import numpy as np

    jobs: list[tuple[str, int, int]] = []
    left = max_bytes
    for f in model.files:
        off = 0
        while off < f.size and left > 0:
            n = min(chunk, f.size - off, left)
            jobs.append((str(f.file), off, n))
            off += n
            left -= n
    total = sum(j[2] for j in jobs)
    q: queue.SimpleQueue[tuple[str, int, int] | None] = queue.SimpleQueue()
    for j in jobs:
        q.put(j)

    def work() -> None:
        buf = np.empty(chunk, dtype=np.uint8)
        mv = memoryview(buf)
        fds: dict[str, int] = {}
        while (j := q.get()) is not None:
            path, off, n = j
            if path not in fds:
                fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            os.preadv(fds[path], [mv[:n]], off)
        for fd in fds.values():
            os.close(fd)

    threads = [threading.Thread(target=work, daemon=True) for _ in range(num_threads)]
    for _ in threads:
        q.put(None)
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return total / max(time.perf_counter() - t0, 1e-9) / 1e9


class _RegisterFailed(RuntimeError):
    pass


class GpuBackbone:
    """The backbone in VMM allocations on one GPU, exportable as POSIX fds.

    Loading: `num_streams` threads, each with its own CUDA stream and two pinned staging buffers of
    `chunk_bytes`; a thread reads a chunk of a file into one buffer (pread, GIL released) while the
    copy from its other buffer runs, so disk/page-cache reads and host->device copies overlap.
    """

    mode = "cuda"

    def __init__(
        self,
        model: ModelDir,
        layout: Layout,
        device_index: int,
        *,
        segment_bytes: int = 4 << 30,
        chunk_bytes: int = 64 << 20,
        num_streams: int = 4,
        measure: bool = True,
        loader: str = "auto",
    ):
        import torch

        from lorafn.backbone_server.manifest import split_segments

        ipc = native()
        if not ipc.available():
            raise RuntimeError(f"GPU mode needs the CUDA driver: {ipc.unavailable_reason()}")
        torch.cuda.init()
        torch.cuda.set_device(device_index)
        torch.zeros(1, device=f"cuda:{device_index}")  # the primary context, made by torch
        self.device_index = device_index
        self.gpu_uuid: str = ipc.device_uuid(device_index)
        self.device_name = torch.cuda.get_device_name(device_index)
        self.driver_version: int = ipc.driver_version()
        self.granularity: int = ipc.granularity(device_index)
        self.segments = split_segments(layout.used_bytes, segment_bytes, self.granularity)
        self.bounds = Bandwidth()
        if measure:
            self.bounds.h2d_gbps = measure_h2d(device_index)
            self.bounds.read_gbps = measure_read(
                model, min(layout.used_bytes, 2 << 30), num_streams, chunk_bytes
            )
        self.mapping = ipc.create_exportable(device_index, self.segments)
        self.base = cuda_bytes_tensor(self.mapping, device_index)
        t0 = time.perf_counter()
        used = "staging"
        if loader in ("auto", "hostreg"):
            try:
                self._fill_registered(model, layout)
                used = "hostreg"
            except _RegisterFailed as exc:
                if loader == "hostreg":
                    raise RuntimeError(f"loader 'hostreg' failed: {exc}") from None
                log.warning("registering the page cache failed (%s); loading through pinned staging", exc)
        if used == "staging":
            self._fill(model, layout, chunk_bytes, num_streams)
        self.load_seconds = time.perf_counter() - t0
        self._fds: list[int] = self.mapping.export_fds()
        gbps = layout.used_bytes / max(self.load_seconds, 1e-9) / 1e9
        self.load_info = {
            "seconds": round(self.load_seconds, 4),
            "gbps": round(gbps, 3),
            "h2d_gbps": None if self.bounds.h2d_gbps is None else round(self.bounds.h2d_gbps, 3),
            "read_gbps": None if self.bounds.read_gbps is None else round(self.bounds.read_gbps, 3),
            "fraction_of_h2d": None if not self.bounds.h2d_gbps else round(gbps / self.bounds.h2d_gbps, 3),
            "loader": used,
            "streams": num_streams if used == "staging" else 2,
            "chunk_bytes": chunk_bytes,
        }

    def _fill_registered(self, model: ModelDir, layout: Layout, num_threads: int = 2) -> None:
        """DMA straight from the page cache: mmap each file PROT_READ, register it with
        cudaHostRegister(ReadOnly) and copy its tensors with cudaMemcpyAsync: no CPU copy at all.

        `num_threads` threads take whole files; each registers its file, issues the copies on its own
        stream and unregisters a file once its copies are done (at most two files in flight per
        thread), so registering one file overlaps the copies out of another. Measured on H200 with
        2 GB files: ~25 GB/s with one thread, ~32 GB/s with two; more threads do not help (page
        pinning in the kernel does not scale further).
        """
        import torch

        rt = torch.cuda.cudart()
        by_file: dict[str, list[Any]] = {}
        for t in model.tensors:
            by_file.setdefault(str(t.file), []).append(t)
        jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        for item in by_file.items():
            jobs.put(item)
        errors: list[str] = []
        base = self.base
        dev = f"cuda:{self.device_index}"

        def release(event: Any, mm: mmap.mmap, src: Any, ptr: int) -> None:
            event.synchronize()
            rt.cudaHostUnregister(ptr)
            del src
            with contextlib.suppress(BufferError):
                mm.close()

        def work() -> None:
            torch.cuda.set_device(self.device_index)
            stream = torch.cuda.Stream(device=dev)
            pending: list[Any] = []
            try:
                while not errors:
                    try:
                        path, tensors = jobs.get_nowait()
                    except queue.Empty:
                        break
                    size = os.path.getsize(path)
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                    try:
                        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
                    finally:
                        os.close(fd)
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", UserWarning)
                        src = torch.frombuffer(mm, dtype=torch.uint8)
                    ptr = src.data_ptr()
                    err = rt.cudaHostRegister(ptr, size, 8)  # 8: cudaHostRegisterReadOnly
                    if int(getattr(err, "value", err)) != 0:
                        errors.append(f"cudaHostRegister({path}, {size} bytes, ReadOnly): {err}")
                        del src
                        mm.close()
                        break
                    with torch.cuda.stream(stream):
                        for t in tensors:
                            if t.nbytes:
                                dst = layout.offsets[t.name]
                                base[dst : dst + t.nbytes].copy_(
                                    src[t.data_start : t.data_end], non_blocking=True
                                )
                        event = torch.cuda.Event()
                        event.record(stream)
                    pending.append((event, mm, src, ptr))
                    del src
                    while len(pending) > 1:
                        release(*pending.pop(0))
            except BaseException as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
            finally:
                for item in pending:
                    release(*item)

        threads = [threading.Thread(target=work, daemon=True) for _ in range(max(1, num_threads))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        torch.cuda.synchronize(self.device_index)
        if errors:
            raise _RegisterFailed(errors[0])

    def _fill(self, model: ModelDir, layout: Layout, chunk: int, num_streams: int) -> None:
        import torch

        # Chunks of contiguous file bytes, each with the copies (src offset in chunk, dst in W, n).
        chunks: list[tuple[str, int, int, list[tuple[int, int, int]]]] = []
        cur: tuple[str, int, int, list[tuple[int, int, int]]] | None = None
        for t in model.tensors:
            pos = 0
            while pos < t.nbytes:
                start = t.data_start + pos
                if cur is None or cur[0] != str(t.file) or start < cur[2] or start - cur[1] >= chunk:
                    if cur is not None:
                        chunks.append(cur)
                    cur = (str(t.file), start, start, [])
                room = chunk - (start - cur[1])
                n = min(t.nbytes - pos, room)
                cur[3].append((start - cur[1], layout.offsets[t.name] + pos, n))
                cur = (cur[0], cur[1], start + n, cur[3])
                pos += n
        if cur is not None:
            chunks.append(cur)

        q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        for c in chunks:
            q.put(c)
        errors: list[BaseException] = []
        base = self.base
        dev = f"cuda:{self.device_index}"

        def work() -> None:
            try:
                torch.cuda.set_device(self.device_index)
                stream = torch.cuda.Stream(device=dev)
                slots = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
                views = [memoryview(s.numpy()) for s in slots]
                events = [torch.cuda.Event() for _ in range(2)]
                used = [False, False]
                fds: dict[str, int] = {}
                i = 0
                while not errors:
                    c = q.get()
                    if c is None:
                        break
                    path, begin, end, copies = c
                    k = i % 2
                    if used[k]:
                        events[k].synchronize()  # the copy out of this buffer has finished
                    if path not in fds:
                        fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                    _pread_into(fds[path], views[k][: end - begin], begin, path)
                    with torch.cuda.stream(stream):
                        for src, dst, n in copies:
                            base[dst : dst + n].copy_(slots[k][src : src + n], non_blocking=True)
                        events[k].record(stream)
                    used[k] = True
                    i += 1
                stream.synchronize()
                for fd in fds.values():
                    os.close(fd)
                for v in views:
                    v.release()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, daemon=True) for _ in range(max(1, num_streams))]
        for _ in threads:
            q.put(None)
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        torch.cuda.synchronize(self.device_index)
        if errors:
            raise errors[0]

    def fds(self) -> list[int]:
        return list(self._fds)

    def close(self) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []
        # Dropping the last reference unmaps; workers' imports keep the physical memory alive.
        self.base = None  # type: ignore[assignment]
        self.mapping = None
