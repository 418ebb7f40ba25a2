"""What this process holds on its GPU, as the driver counts it (NVML), for the controller's account.

torch's allocator knows only its own reservations; the CUDA context (per-thread stack reservation,
loaded kernel modules, cuBLAS workspaces) is several hundred MiB more and differs by GPU, driver and
settings (docs/benchmarks.md "Per-worker memory"). A worker reports the driver's figure for its own pid,
and the controller learns a worker's real overhead from it instead of assuming one.

NVML is read through `libnvidia-ml.so.1` with ctypes (no extra dependency). None wherever the figure
cannot be had: no NVML library, a CPU device, or a container whose pid namespace hides this process
from the driver's list (NVML lists host pids).
"""

from __future__ import annotations

import ctypes
import logging
import os
from functools import lru_cache
from typing import Any

log = logging.getLogger("lorafn.worker")

_NVML_SUCCESS = 0
_NVML_ERROR_INSUFFICIENT_SIZE = 7


class _ProcessInfo(ctypes.Structure):
    # nvmlProcessInfo_t (the _v2/_v3 list calls): pid, used bytes, MIG instance ids
    _fields_ = [
        ("pid", ctypes.c_uint),
        ("usedGpuMemory", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


@lru_cache(maxsize=1)
def _nvml() -> Any | None:
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if lib.nvmlInit_v2() != _NVML_SUCCESS:
        return None
    return lib


@lru_cache(maxsize=8)
def _handle(uuid: str) -> Any | None:
    lib = _nvml()
    if lib is None:
        return None
    handle = ctypes.c_void_p()
    if lib.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(handle)) != _NVML_SUCCESS:
        return None
    return handle


def device_uuid(device: Any) -> str | None:
    """The NVML UUID (`GPU-...`) of a torch CUDA device, or None."""
    import torch

    try:
        uuid = torch.cuda.get_device_properties(device).uuid
    except (AttributeError, RuntimeError):
        return None
    text = str(uuid)
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


def cuda_uuid(device: Any) -> str | None:
    """The NVML UUID of ``device`` where it is a torch CUDA device (None for a CPU device, None, or no UUID):
    what the ``*_on`` readings take."""
    if getattr(device, "type", "cpu") != "cuda":
        return None
    return device_uuid(device)


def _nvml_device(uuid: str) -> tuple[Any, Any] | None:
    """The NVML library and the device handle of the GPU ``uuid``, or None (no NVML, unknown device)."""
    lib, handle = _nvml(), _handle(uuid)
    return None if lib is None or handle is None else (lib, handle)


def process_bytes_on(uuid: str, pid: int | None = None) -> int | None:
    """Bytes the driver counts for process ``pid`` (default: this one) on the GPU ``uuid``, or None."""
    nvml = _nvml_device(uuid)
    if nvml is None:
        return None
    lib, handle = nvml
    pid = os.getpid() if pid is None else pid
    call = getattr(lib, "nvmlDeviceGetComputeRunningProcesses_v3", None) or getattr(
        lib, "nvmlDeviceGetComputeRunningProcesses_v2", None
    )
    if call is None:
        return None
    count = ctypes.c_uint(0)
    rc = call(handle, ctypes.byref(count), None)
    if rc not in (_NVML_SUCCESS, _NVML_ERROR_INSUFFICIENT_SIZE):
        return None
    for _ in range(3):  # processes may come and go between the two calls
        size = count.value + 8
        infos = (_ProcessInfo * size)()
        count = ctypes.c_uint(size)
        rc = call(handle, ctypes.byref(count), infos)
        if rc == _NVML_SUCCESS:
            for info in infos[: count.value]:
                if info.pid == pid:
                    return int(info.usedGpuMemory)
            return None
        if rc != _NVML_ERROR_INSUFFICIENT_SIZE:
            return None
    return None


class _MemoryInfo(ctypes.Structure):
    # nvmlMemory_t (nvmlDeviceGetMemoryInfo): total, free, used bytes
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def device_free_bytes_on(uuid: str) -> int | None:
    """The free bytes of the GPU ``uuid`` as the driver counts them (every process's), or None."""
    nvml = _nvml_device(uuid)
    if nvml is None:
        return None
    lib, handle = nvml
    info = _MemoryInfo()
    if lib.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(info)) != _NVML_SUCCESS:
        return None
    return int(info.free)


def device_free_bytes(device: Any) -> int | None:
    """The free bytes of a torch CUDA ``device`` as the driver counts them (the controller's second guard
    under its account), or None (CPU, no NVML)."""
    uuid = cuda_uuid(device)
    return device_free_bytes_on(uuid) if uuid else None


def process_bytes(device: Any) -> int | None:
    """This process's bytes on a torch CUDA ``device`` as the driver counts them, or None."""
    uuid = cuda_uuid(device)
    return process_bytes_on(uuid) if uuid else None


__all__ = [
    "cuda_uuid",
    "device_free_bytes",
    "device_free_bytes_on",
    "device_uuid",
    "process_bytes",
    "process_bytes_on",
]
