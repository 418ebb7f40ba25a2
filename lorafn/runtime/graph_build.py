"""The C graph builder (`graph_build.c`, issue 11 item 2): one call per archived graph turns its NodeTable
(graph_archive.py) into a CUgraph. No torch here: the CPU test drives it against a stand-in libcuda.

The C file is compiled at run time with the system C compiler (as arena.py builds arena_alloc.c) against
the cuda.h that Triton ships for its launchers (`triton/backends/nvidia/include`), so the driver's structs
are the header's own; the library lands in `<cache_dir>/graph_build/<hash of the source and header>/`.
The capturing process builds it too, so a restoring process finds it compiled.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import numpy as np

from lorafn.runtime.arena import compile_c
from lorafn.runtime.graph_archive import ATTR_VALUE_BYTES, NodeTable

_SOURCE = Path(__file__).with_name("graph_build.c")


class GraphBuildError(RuntimeError):
    """The builder could not be compiled or loaded, or a driver call failed (the message names the node)."""


def cuda_include_dir() -> Path:
    """The directory with the cuda.h Triton compiles its launchers against ($LORAFN_CUDA_INCLUDE first)."""
    env = os.environ.get("LORAFN_CUDA_INCLUDE")
    if env:
        return Path(env)
    import importlib.util

    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        raise GraphBuildError(
            "graph builder: no cuda.h (Triton is not installed and LORAFN_CUDA_INCLUDE unset)"
        )
    return Path(spec.origin).parent / "backends" / "nvidia" / "include"


class _Spec(ctypes.Structure):
    _fields_ = [
        ("n", ctypes.c_int64),
        ("kind", ctypes.c_void_p),
        ("aux", ctypes.c_void_p),
        ("dims", ctypes.c_void_p),
        ("node_param", ctypes.c_void_p),
        ("param_bound", ctypes.c_void_p),
        ("param_blob", ctypes.c_void_p),
        ("node_attr", ctypes.c_void_p),
        ("attr_id", ctypes.c_void_p),
        ("attr_value", ctypes.c_void_p),
        ("memset_rows", ctypes.c_void_p),
        ("memcpy_rows", ctypes.c_void_p),
        ("node_dep", ctypes.c_void_p),
        ("dep", ctypes.c_void_p),
        ("funcs", ctypes.c_void_p),
        ("nfuncs", ctypes.c_int64),
    ]


class GraphBuilder:
    """The compiled builder, loaded once per process (`GraphBuilder.load(cache_dir)`)."""

    _loaded: ClassVar[dict[Path, GraphBuilder]] = {}

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        lib.lorafn_graph_error.restype = ctypes.c_char_p
        lib.lorafn_graph_warning.restype = ctypes.c_char_p
        lib.lorafn_graph_spec_size.restype = ctypes.c_int64
        lib.lorafn_graph_attr_value_size.restype = ctypes.c_int64
        lib.lorafn_graph_instantiate.argtypes = [
            ctypes.c_uint64,
            ctypes.c_uint64,
            ctypes.POINTER(ctypes.c_uint64),
        ]
        lib.lorafn_graph_build.argtypes = [
            ctypes.POINTER(_Spec),
            ctypes.POINTER(ctypes.c_uint64),
            ctypes.POINTER(ctypes.c_int64),
        ]
        if lib.lorafn_graph_spec_size() != ctypes.sizeof(_Spec):
            raise GraphBuildError(
                f"graph builder: spec is {lib.lorafn_graph_spec_size()} bytes in C, "
                f"{ctypes.sizeof(_Spec)} here"
            )
        if lib.lorafn_graph_attr_value_size() != ATTR_VALUE_BYTES:
            raise GraphBuildError(
                f"graph builder: CUlaunchAttributeValue is {lib.lorafn_graph_attr_value_size()} bytes "
                f"in this cuda.h, the archive keeps {ATTR_VALUE_BYTES}"
            )
        self.path, self._lib = path, lib

    @classmethod
    def load(cls, cache_dir: str | os.PathLike[str]) -> GraphBuilder:
        include = cuda_include_dir()
        header = include / "cuda.h"
        if not header.exists():
            raise GraphBuildError(f"graph builder: {header} does not exist")
        try:
            path = compile_c(
                _SOURCE, Path(cache_dir), "graph_build", "libgraphbuild.so", (f"-I{include}",), (header,)
            )
        except RuntimeError as exc:
            raise GraphBuildError(f"graph builder: {exc}") from exc
        if path not in cls._loaded:
            cls._loaded[path] = cls(path)
        return cls._loaded[path]

    def build(self, table: NodeTable, funcs: Sequence[int]) -> tuple[int, int, str]:
        """(CUgraph handle, launch attributes the driver refused, the first refusal's message) for `table`,
        `funcs[i]` the CUfunction of its function index i. The table must have passed `validate()`."""
        if len(funcs) != len(table.funcs):
            raise GraphBuildError(f"graph builder: {len(funcs)} functions for {len(table.funcs)} indices")
        a = table.arrays
        keep = {k: np.ascontiguousarray(v) for k, v in a.items()}
        blob = np.frombuffer(table.param_blob, dtype=np.uint8) if table.param_blob else np.zeros(1, np.uint8)
        fn = np.asarray(list(funcs) or [0], dtype=np.uint64)

        def ptr(x: np.ndarray) -> int:
            return int(x.ctypes.data)

        spec = _Spec(
            n=len(table),
            kind=ptr(keep["kind"]),
            aux=ptr(keep["aux"]),
            dims=ptr(keep["dims"]),
            node_param=ptr(keep["node_param"]),
            param_bound=ptr(keep["param_bound"]),
            param_blob=ptr(blob),
            node_attr=ptr(keep["node_attr"]),
            attr_id=ptr(keep["attr_id"]),
            attr_value=ptr(keep["attr_value"]),
            memset_rows=ptr(keep["memset"]),
            memcpy_rows=ptr(keep["memcpy"]),
            node_dep=ptr(keep["node_dep"]),
            dep=ptr(keep["dep"]),
            funcs=ptr(fn),
            nfuncs=len(table.funcs),
        )
        out, failures = ctypes.c_uint64(), ctypes.c_int64()
        if self._lib.lorafn_graph_build(ctypes.byref(spec), ctypes.byref(out), ctypes.byref(failures)) != 0:
            raise GraphBuildError((self._lib.lorafn_graph_error() or b"").decode(errors="replace"))
        warning = (self._lib.lorafn_graph_warning() or b"").decode(errors="replace")
        del keep, blob, fn  # the driver copied what it needs
        return int(out.value), int(failures.value), warning

    def instantiate(self, ctx: int, graph: int) -> int:
        """cuGraphInstantiateWithFlags(graph, 0) with `ctx` made current in the calling thread (any thread:
        ctypes lets go of the GIL, so a pool instantiates several graphs at once); the CUgraphExec handle."""
        out = ctypes.c_uint64()
        if self._lib.lorafn_graph_instantiate(int(ctx), int(graph), ctypes.byref(out)) != 0:
            raise GraphBuildError((self._lib.lorafn_graph_error() or b"").decode(errors="replace"))
        return int(out.value)
