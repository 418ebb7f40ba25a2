"""The worker's arena A: device memory at a fixed virtual address, handed out deterministically.

DESIGN §6 / issue 11 item 2. A CUDA graph captured in one process is valid in another, pointer for
pointer, when everything it touches sits at the same addresses there: the backbone W (mapped at its fixed
address by the backbone server's client) and this arena. The arena is one `cuMemAddressReserve` at
`DEFAULT_ARENA_ADDR` (whole 2 GiB units: the driver honours a fixed address only for those) and a bump
allocator (`arena_alloc.c`, compiled here at run time with the system C compiler, as Triton builds its
launchers: no CUDA toolkit, no pip rebuild) used by torch through `CUDAPluggableAllocator` + `MemPool`s:

- `state_pool`: what a decode graph reads and the restoring process builds itself, in the same order
  (weights when they are not in W, RoPE tables, LoRA buffers, KV cache, the graphs' static inputs);
- `scratch_pool`: the warm-up forwards before capture (and the cuBLAS workspace of the capture stream,
  which torch allocates there on first use and the graphs then name);
- `graph_pool`: the graphs' own memory pool (intermediates and outputs).

The same allocations in the same order give the same addresses (`allocation_log` lets two processes
compare), and a restoring process backs everything above its state with `reserve_until(high_water)`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_ARENA_ADDR = 0x2000_0000_0000  # 32 TiB: W is at 0x1000_0000_0000 (backbone_server.storage)
DEFAULT_ARENA_BYTES = 64 << 30  # virtual only; physical memory is mapped per allocation
_SOURCE = Path(__file__).with_name("arena_alloc.c")
_ALLOC, _FREE = "lorafn_arena_alloc", "lorafn_arena_free"


class ArenaError(RuntimeError):
    """The arena could not be set up or used (the driver's reason is in the message)."""


def compile_c(
    source: Path,
    cache_dir: Path,
    subdir: str,
    name: str,
    extra: tuple[str, ...] = (),
    depends: tuple[Path, ...] = (),
) -> Path:
    """Compile one C file (no toolkit: libcuda is dlopen'ed) once per version of it and of `depends` (a
    header that decides struct layouts: known by path, size and modification time, as make does, since
    hashing Triton's 1.2 MB cuda.h would cost a restore ~2 ms) into `cache_dir/<subdir>/<hash>/<name>`."""
    h = hashlib.sha256(source.read_bytes())
    for dep in depends:
        st = dep.stat()
        h.update(f"{dep.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update(" ".join(extra).encode())
    out = Path(cache_dir) / subdir / h.hexdigest()[:16] / name
    if out.exists():
        return out
    compiler = os.environ.get("CC") or next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    if compiler is None:
        raise ArenaError(f"no C compiler (cc, gcc, clang or $CC) to build {source.name}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = [compiler, "-O2", "-shared", "-fPIC", *extra, "-o", str(tmp), str(source), "-ldl", "-lpthread"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ArenaError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    tmp.replace(out)
    return out


def build_library(cache_dir: Path) -> Path:
    """Compile arena_alloc.c once per source version into `cache_dir/arena/<hash>/libarena.so`."""
    return compile_c(_SOURCE, cache_dir, "arena", "libarena.so")


@dataclass(frozen=True)
class ArenaStats:
    base: int
    reserved: int
    bump: int
    mapped: int
    allocations: int
    frees: int


class Arena:
    """The process's one arena (the C state is global: a second Arena in one process is refused)."""

    _instance: Arena | None = None

    def __init__(
        self,
        device: torch.device,
        cache_dir: Path,
        base: int = DEFAULT_ARENA_ADDR,
        reserve_bytes: int = DEFAULT_ARENA_BYTES,
    ) -> None:
        if Arena._instance is not None:
            raise ArenaError("arena: one per process, and this process has one already")
        if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
            raise ArenaError(
                "arena: torch's MemPool does not support PYTORCH_CUDA_ALLOC_CONF expandable_segments"
            )
        self.device = torch.device(device)
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        torch.cuda.set_device(index)
        torch.zeros(1, device=self.device)  # torch's primary context exists and is current
        self.cache_dir = Path(cache_dir)
        self.path = build_library(cache_dir)
        lib = ctypes.CDLL(str(self.path))
        lib.lorafn_arena_error.restype = ctypes.c_char_p
        for name in ("base", "reserved", "bump", "mapped", "granularity", "allocations", "frees"):
            getattr(lib, f"lorafn_arena_{name}").restype = ctypes.c_ulonglong
        lib.lorafn_arena_init.argtypes = [ctypes.c_int, ctypes.c_ulonglong, ctypes.c_ulonglong]
        lib.lorafn_arena_reserve_until.argtypes = [ctypes.c_ulonglong]
        lib.lorafn_arena_log.argtypes = [
            ctypes.c_ulonglong,
            ctypes.POINTER(ctypes.c_ulonglong),
            ctypes.POINTER(ctypes.c_ulonglong),
        ]
        self._lib = lib
        if lib.lorafn_arena_init(index, int(base), int(reserve_bytes)) != 0:
            raise ArenaError(f"arena: {self.error()}")
        self.base = int(lib.lorafn_arena_base())
        self.reserved = int(lib.lorafn_arena_reserved())
        self.granularity = int(lib.lorafn_arena_granularity())
        if self.base != base:  # the C side checks it too; a wrong base would poison every archive
            raise ArenaError(f"arena: reserved at 0x{self.base:x}, not 0x{base:x}")
        self.allocator = torch.cuda.memory.CUDAPluggableAllocator(str(self.path), _ALLOC, _FREE)
        self.state_pool = self.new_pool()
        self.scratch_pool = self.new_pool()
        self.graph_pool = self.new_pool()
        Arena._instance = self

    def new_pool(self) -> torch.cuda.MemPool:
        return torch.cuda.MemPool(self.allocator.allocator())

    def error(self) -> str:
        return (self._lib.lorafn_arena_error() or b"").decode(errors="replace")

    @property
    def bump(self) -> int:
        """Offset from `base` of the next allocation."""
        return int(self._lib.lorafn_arena_bump())

    def stats(self) -> ArenaStats:
        lib = self._lib
        return ArenaStats(
            base=self.base,
            reserved=self.reserved,
            bump=self.bump,
            mapped=int(lib.lorafn_arena_mapped()),
            allocations=int(lib.lorafn_arena_allocations()),
            frees=int(lib.lorafn_arena_frees()),
        )

    def allocation_log(self) -> list[tuple[int, int]]:
        """(offset, mapped bytes) of every allocation since init, in order (the first 65536)."""
        out = []
        off, size = ctypes.c_ulonglong(), ctypes.c_ulonglong()
        i = 0
        while self._lib.lorafn_arena_log(i, ctypes.byref(off), ctypes.byref(size)) == 0:
            out.append((int(off.value), int(size.value)))
            i += 1
        return out

    def reserve_until(self, top: int) -> None:
        """Back [bump, top) with memory torch never hands out; the bump moves to `top`."""
        if self._lib.lorafn_arena_reserve_until(int(top)) != 0:
            raise ArenaError(f"arena: {self.error()}")

    def contains(self, ptr: int) -> bool:
        return self.base <= ptr < self.base + self.reserved


class _CudaBytes:
    """A 1-D byte array exposing __cuda_array_interface__ (as backbone_server.storage's), holding `owner`."""

    def __init__(self, owner: object, ptr: int, nbytes: int) -> None:
        self._owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


def tensor_at(
    owner: object,
    ptr: int,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """A tensor over device memory at `ptr` that torch did not allocate (a restored graph's output in the
    arena's reserved range); it keeps `owner` alive."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    span = 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) if all(shape) else 0
    base = torch.as_tensor(_CudaBytes(owner, ptr, max(1, span) * itemsize), device=device)
    return base.view(dtype).as_strided(shape, stride)
