"""Materialized decode CUDA graphs (issue 11 item 2): the archive's key, format and refusals. Pure: no torch,
no CUDA (the GPU side is `graph_restore.py`).

An archive holds, for each batch bucket, one captured decode graph as data: every node (kind, kernel name
and which module it lives in, grid/block/shared memory, the raw bytes of each kernel parameter, launch
attributes) and the dependency edges, in a topological order; plus the images of the Triton kernels
(cubins) so a restoring process loads them without Triton's JIT, and where each graph's output lives.
Kernel parameters are kept as opaque bytes, never parsed (cuBLAS on Hopper passes one 1720-byte blob):
they stay valid because every pointer in them is into W or the worker's arena A, both at fixed virtual
addresses (DESIGN §6).

What must hold in the restoring process for the bytes to be right, and who checks it:
- the same software and hardware (the key: GPU model, driver, CUDA, torch, Triton, our model code) and the
  same graph inputs (model layout, dtype, adapter shape, buckets, KV blocks, table width, arena address):
  `check_key` refuses any difference, naming the field;
- the same arena layout for the state it rebuilds (weights when in A, RoPE tables, LoRA buffers, KV cache,
  static inputs): `layout["state_log"]` against the restoring process's own allocation log;
- the same memory contents only where the restoring process fills them itself (weights, LoRA, KV, inputs).
  No bytes of the arena are archived: a graph reads its intermediates only after writing them in the same
  replay, and the cuBLAS workspace is scratch.

File: MAGIC, u64 header length, the header (JSON, padded to 8 bytes), the blob section, and a 32-byte
blake2b of everything before it (a corrupted file is refused, never half-used). Since format 2 each graph's
nodes are a `NodeTable`: flat arrays in the blob (kind, function index, dims, parameter and dependency
offsets, launch attributes, memset/memcpy rows), read with `np.frombuffer` without a per-node Python object
and handed as they are to the C builder (`graph_build.c`): format 1's per-node JSON took ~46 ms to decode
for the 7B's 4300 nodes, format 2 ~1 ms plus the checksum.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"LFGRAPH\x00"
FORMAT_VERSION = 2  # 2: packed node tables, the self-check digest computed on the GPU (graph_restore)
_DIGEST = 32

# What a graph archive depends on. Order = the order refusals are reported in.
KEY_FIELDS: tuple[str, ...] = (
    "format_version",
    "gpu",  # device name, e.g. "NVIDIA H100 80GB HBM3"
    "capability",  # "9.0"
    "driver",  # cuDriverGetVersion, e.g. 13000
    "cuda",  # torch.version.cuda
    "torch",
    "triton",
    "code",  # fingerprint of the model/forward source files (kernels and launch sequence)
    "model_layout",  # config.json + safetensors headers: shapes, dtypes, order (not the weight values)
    "dtype",
    "adapter_shape",  # LoRAWeights.shape_key or None
    "fused_decode",
    "lora_expand",
    "skinny_gemm_rows",
    "decode_attention",  # EngineConfig.decode_attention: the attention kernel's form
    "expand_in_gemm",  # EngineConfig.expand_in_gemm
    "gemm_prologue_rows",  # EngineConfig.gemm_prologue_rows
    "lora_shrink",  # EngineConfig.lora_shrink
    "rope_in_attention",  # EngineConfig.rope_in_attention
    "buckets",
    "max_blocks_per_seq",
    "block_size",
    "num_kv_blocks",
    "arena_base",
    "arena_reserved",
    "weights_in",  # "arena" (weights allocated in A) or "W@0x..." (mapped by the backbone server)
)

NODE_KINDS = ("kernel", "memset", "memcpy", "empty")  # NodeTable.kind codes 0..3 (graph_build.c too)
# CUDA_MEMCPY3D's fields a device-to-device memcpy node keeps, in the order of a NodeTable memcpy row
# (graph_build.c reads them in this order)
MEMCPY_FIELDS: tuple[str, ...] = (
    "srcXInBytes",
    "srcY",
    "srcZ",
    "srcLOD",
    "srcPitch",
    "srcHeight",
    "dstXInBytes",
    "dstY",
    "dstZ",
    "dstLOD",
    "dstPitch",
    "dstHeight",
    "WidthInBytes",
    "Height",
    "Depth",
    "srcMemoryType",
    "srcDevice",
    "dstMemoryType",
    "dstDevice",
)
ATTR_VALUE_BYTES = 64  # sizeof(CUlaunchAttributeValue): a union padded to 64 bytes


class ArchiveError(ValueError):
    """A graph archive cannot be used here; the message says which field or check."""


class ArchiveMismatch(ArchiveError):
    """The archive was made for something else (another key, another arena layout)."""


class ArchiveCorrupt(ArchiveError):
    """The file is not a whole, intact archive."""


# ---------------------------------------------------------------------------------------------- key


def check_key(archived: Mapping[str, Any], current: Mapping[str, Any], source: str = "archive") -> None:
    """Refuse an archive whose key differs from the current one: ArchiveMismatch naming every differing
    field (first in KEY_FIELDS order), with both values."""
    missing = [f for f in KEY_FIELDS if f not in current]
    if missing:
        raise ValueError(f"current key: fields {missing} missing")
    diffs = [
        f"{f}: {archived.get(f, '<absent>')!r} in the {source}, {current[f]!r} here"
        for f in KEY_FIELDS
        if _norm(archived.get(f, "<absent>")) != _norm(current[f])
    ]
    if diffs:
        raise ArchiveMismatch(f"graph {source} refused: " + "; ".join(diffs))


def _norm(value: Any) -> Any:
    """JSON round-trip form (tuples become lists), so a key read from a file compares with a live one."""
    return json.loads(json.dumps(value, sort_keys=True))


def key_digest(key: Mapping[str, Any]) -> str:
    """A stable short hash of a key: the archive's file name under the cache directory."""
    body = json.dumps({f: _norm(key[f]) for f in KEY_FIELDS}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()[:24]


def archive_path(cache_dir: str | os.PathLike[str], key: Mapping[str, Any]) -> Path:
    return Path(cache_dir) / "graphs" / f"{key_digest(key)}.lfgraph"


def model_layout_fingerprint(model_dir: str | os.PathLike[str]) -> str:
    """sha256 over config.json and each *.safetensors file's name and header (tensor names, dtypes, shapes,
    offsets): what decides the weights' allocation sizes and order and the kernels' shapes. Weight values
    are not read (a graph does not depend on them; the restoring process loads its own)."""
    model_dir = Path(model_dir)
    h = hashlib.sha256()
    h.update((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            h.update(path.name.encode())
            h.update(f.read(n))
    return h.hexdigest()[:24]


def files_fingerprint(paths: Iterable[str | os.PathLike[str]]) -> str:
    """sha256 over the named files' names and bytes, in sorted name order (the `code` key field)."""
    h = hashlib.sha256()
    for path in sorted(Path(p) for p in paths):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:24]


# --------------------------------------------------------------------------------------------- model


@dataclass
class KernelNode:
    """A kernel launch. `func` names the kernel: ("module", module_id) for an archived image (Triton),
    ("name", mangled name) for a kernel the restoring process already has (ATen, cuBLAS)."""

    func: tuple[str, str]
    name: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared: int
    params: list[bytes]
    attrs: dict[int, bytes] = field(default_factory=dict)  # launch attribute id -> raw 64-byte value
    kind: str = "kernel"


@dataclass
class MemsetNode:
    dst: int
    pitch: int
    value: int
    element_size: int
    width: int
    height: int
    kind: str = "memset"


@dataclass
class MemcpyNode:
    fields: dict[str, int]  # CUDA_MEMCPY3D's numeric fields by name (device to device only); absent = 0
    kind: str = "memcpy"

    def __post_init__(self) -> None:
        unknown = sorted(set(self.fields) - set(MEMCPY_FIELDS))
        if unknown:
            raise ValueError(f"MemcpyNode.fields: {unknown} are not among {MEMCPY_FIELDS}")
        self.fields = {f: int(self.fields.get(f, 0)) for f in MEMCPY_FIELDS}


@dataclass
class EmptyNode:
    kind: str = "empty"


Node = KernelNode | MemsetNode | MemcpyNode | EmptyNode


@dataclass
class TensorRef:
    """Where a graph's output lives (inside the arena) and how to view it."""

    ptr: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str  # torch dtype name, e.g. "float32"


_TABLE_ARRAYS: dict[str, tuple[str, int]] = {  # name -> (dtype, row width or 0 for 1-D)
    "kind": ("u1", 0),
    "aux": ("<i4", 0),  # kernel: function index; memset/memcpy: row of its table; empty: -1
    "dims": ("<u4", 7),  # grid x, y, z, block x, y, z, dynamic shared bytes (zeros when not a kernel)
    "node_param": ("<i8", 0),  # [n + 1]: node i's parameters are params node_param[i] .. node_param[i+1]
    "param_bound": ("<i8", 0),  # [P + 1]: parameter j is param_blob[param_bound[j] : param_bound[j+1]]
    "node_attr": ("<i8", 0),  # [n + 1]: node i's launch attributes (CSR, as parameters)
    "attr_id": ("<i4", 0),
    "attr_value": ("u1", ATTR_VALUE_BYTES),
    "memset": ("<u8", 6),  # dst, pitch, value, element size, width, height
    "memcpy": ("<u8", len(MEMCPY_FIELDS)),
    "node_dep": ("<i8", 0),  # [n + 1]: node i depends on dep[node_dep[i] : node_dep[i+1]] (all < i)
    "dep": ("<i4", 0),
}


@dataclass(eq=False)
class NodeTable:
    """One graph's nodes as flat arrays (the archive's form, and what graph_build.c reads): no Python object
    per node, so a restore decodes and rebuilds 4000+ nodes without a per-node Python step. `funcs[i]` is
    (ref kind, ref id, kernel name) of function index i: ("module", module id, name) for an archived image,
    ("name", mangled name, name) for a kernel the restoring process finds itself."""

    arrays: dict[str, np.ndarray]
    param_blob: bytes
    funcs: list[tuple[str, str, str]]

    def __len__(self) -> int:
        return len(self.arrays["kind"])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, NodeTable):
            return NotImplemented
        return (
            self.funcs == other.funcs
            and bytes(self.param_blob) == bytes(other.param_blob)
            and self.arrays.keys() == other.arrays.keys()
            and all(np.array_equal(v, other.arrays[k]) for k, v in self.arrays.items())
        )

    @classmethod
    def from_nodes(cls, nodes: Sequence[Node], deps: Sequence[Sequence[int]]) -> NodeTable:
        """Pack nodes in topological order (deps[i]: indices < i). ValueError names a bad node or edge."""
        if len(deps) != len(nodes):
            raise ValueError(f"deps: {len(deps)} lists for {len(nodes)} nodes")
        funcs: list[tuple[str, str, str]] = []
        func_index: dict[tuple[str, str], int] = {}
        kind, aux, dims = [], [], []
        node_param, param_bound, blob = [0], [0], bytearray()
        node_attr, attr_id, attr_value = [0], [], bytearray()
        memset, memcpy, node_dep, dep = [], [], [0], []
        for i, node in enumerate(nodes):
            bad = [d for d in deps[i] if not 0 <= d < i]
            if bad:
                raise ValueError(f"deps[{i}]: {bad} are not earlier nodes (topological order)")
            dep.extend(sorted(set(deps[i])))
            node_dep.append(len(dep))
            d7 = [0] * 7
            if isinstance(node, KernelNode):
                kind.append(0)
                if node.func not in func_index:
                    func_index[node.func] = len(funcs)
                    funcs.append((node.func[0], node.func[1], node.name))
                aux.append(func_index[node.func])
                d7 = [*node.grid, *node.block, node.shared]
                for prm in node.params:
                    blob += prm
                    param_bound.append(len(blob))
                for aid, raw in sorted(node.attrs.items()):
                    if len(raw) != ATTR_VALUE_BYTES:
                        raise ValueError(
                            f"node {i}: attribute {aid} has {len(raw)} bytes, not {ATTR_VALUE_BYTES}"
                        )
                    attr_id.append(aid)
                    attr_value += raw
            elif isinstance(node, MemsetNode):
                kind.append(1)
                aux.append(len(memset))
                memset.append([node.dst, node.pitch, node.value, node.element_size, node.width, node.height])
            elif isinstance(node, MemcpyNode):
                kind.append(2)
                aux.append(len(memcpy))
                memcpy.append([node.fields[f] for f in MEMCPY_FIELDS])
            elif isinstance(node, EmptyNode):
                kind.append(3)
                aux.append(-1)
            else:
                raise ValueError(f"node {i}: {type(node).__name__} is not one of {NODE_KINDS}")
            dims.append(d7)
            node_param.append(len(param_bound) - 1)
            node_attr.append(len(attr_id))
        values = {
            "kind": kind,
            "aux": aux,
            "dims": dims,
            "node_param": node_param,
            "param_bound": param_bound,
            "node_attr": node_attr,
            "attr_id": attr_id,
            "attr_value": np.frombuffer(bytes(attr_value), dtype="u1"),
            "memset": memset,
            "memcpy": memcpy,
            "node_dep": node_dep,
            "dep": dep,
        }
        arrays = {}
        for name, (dtype, width) in _TABLE_ARRAYS.items():
            a = np.asarray(values[name], dtype=dtype)
            arrays[name] = a.reshape(-1, width) if width else a.reshape(-1)
        table = cls(arrays=arrays, param_blob=bytes(blob), funcs=funcs)
        table.validate()
        return table

    def validate(self, source: str = "node table") -> None:
        """Every index in range and every dependency earlier (the C builder trusts these); ValueError
        naming the array. Vectorized: ~0.1 ms for 600 nodes."""
        a = self.arrays
        missing = [k for k in _TABLE_ARRAYS if k not in a]
        if missing:
            raise ValueError(f"{source}: arrays {missing} missing")
        n = len(a["kind"])
        for name, (dtype, width) in _TABLE_ARRAYS.items():
            v = a[name]
            if v.dtype != np.dtype(dtype) or v.ndim != (2 if width else 1) or (width and v.shape[1] != width):
                raise ValueError(
                    f"{source}: {name} is {v.dtype}{list(v.shape)}, not {dtype} of width {width}"
                )
        for name in ("aux", "dims"):
            if len(a[name]) != n:
                raise ValueError(f"{source}: {name} has {len(a[name])} rows for {n} nodes")

        def csr(name: str, total: int) -> None:
            v = a[name]
            if len(v) != n + 1 or v[0] != 0 or v[-1] != total or (n and np.any(np.diff(v) < 0)):
                raise ValueError(f"{source}: {name} is not {n + 1} non-decreasing offsets from 0 to {total}")

        pb = a["param_bound"]
        if len(pb) < 1 or pb[0] != 0 or pb[-1] != len(self.param_blob) or np.any(np.diff(pb) < 0):
            raise ValueError(f"{source}: param_bound does not cover the {len(self.param_blob)}-byte blob")
        csr("node_param", len(pb) - 1)
        csr("node_attr", len(a["attr_id"]))
        csr("node_dep", len(a["dep"]))
        if len(a["attr_value"]) != len(a["attr_id"]):
            raise ValueError(f"{source}: {len(a['attr_value'])} attribute values for {len(a['attr_id'])} ids")
        kind, aux = a["kind"], a["aux"]
        if np.any(kind > 3):
            raise ValueError(f"{source}: node kind {int(kind.max())} is not one of 0..3 {NODE_KINDS}")
        for code, limit, what in (
            (0, len(self.funcs), "function"),
            (1, len(a["memset"]), "memset row"),
            (2, len(a["memcpy"]), "memcpy row"),
        ):
            sel = aux[kind == code]
            if len(sel) and (sel.min() < 0 or sel.max() >= limit):
                raise ValueError(
                    f"{source}: a {NODE_KINDS[code]} node names {what} {int(sel.max())} of {limit}"
                )
        not_kernel = kind != 0
        if np.any(np.diff(a["node_param"])[not_kernel] != 0) or np.any(
            np.diff(a["node_attr"])[not_kernel] != 0
        ):
            raise ValueError(f"{source}: a node that is not a kernel has parameters or attributes")
        owner = np.repeat(np.arange(n, dtype=np.int64), np.diff(a["node_dep"]))
        if len(a["dep"]) and (np.any(a["dep"] < 0) or np.any(a["dep"] >= owner)):
            raise ValueError(f"{source}: dependencies are not in topological order")

    def nodes(self) -> list[Node]:
        """The nodes as objects (tests, tools; a restore never needs them)."""
        a, out = self.arrays, []
        pb, blob = a["param_bound"], self.param_blob
        for i in range(len(self)):
            k, x = int(a["kind"][i]), int(a["aux"][i])
            if k == 0:
                ref_kind, ref_id, name = self.funcs[x]
                d = [int(v) for v in a["dims"][i]]
                p0, p1 = int(a["node_param"][i]), int(a["node_param"][i + 1])
                q0, q1 = int(a["node_attr"][i]), int(a["node_attr"][i + 1])
                out.append(
                    KernelNode(
                        func=(ref_kind, ref_id),
                        name=name,
                        grid=(d[0], d[1], d[2]),
                        block=(d[3], d[4], d[5]),
                        shared=d[6],
                        params=[bytes(blob[int(pb[j]) : int(pb[j + 1])]) for j in range(p0, p1)],
                        attrs={int(a["attr_id"][j]): a["attr_value"][j].tobytes() for j in range(q0, q1)},
                    )
                )
            elif k == 1:
                out.append(MemsetNode(*(int(v) for v in a["memset"][x])))
            elif k == 2:
                out.append(
                    MemcpyNode(fields=dict(zip(MEMCPY_FIELDS, (int(v) for v in a["memcpy"][x]), strict=True)))
                )
            else:
                out.append(EmptyNode())
        return out

    def deps(self) -> list[list[int]]:
        nd, dep = self.arrays["node_dep"], self.arrays["dep"]
        return [[int(d) for d in dep[nd[i] : nd[i + 1]]] for i in range(len(self))]

    def library_names(self) -> set[str]:
        return {ref_id for ref_kind, ref_id, _ in self.funcs if ref_kind == "name"}


@dataclass
class GraphRecord:
    bucket: int
    table: NodeTable  # the nodes in topological order
    output: TensorRef
    selfcheck: str | None = None  # digest of the output after a replay on padding inputs (see restore)

    @classmethod
    def from_nodes(
        cls,
        bucket: int,
        nodes: Sequence[Node],
        deps: Sequence[Sequence[int]],
        output: TensorRef,
        selfcheck: str | None = None,
    ) -> GraphRecord:
        return cls(bucket=bucket, table=NodeTable.from_nodes(nodes, deps), output=output, selfcheck=selfcheck)

    @property
    def nodes(self) -> list[Node]:
        return self.table.nodes()

    @property
    def deps(self) -> list[list[int]]:
        return self.table.deps()

    def __len__(self) -> int:
        return len(self.table)


@dataclass
class ModuleImage:
    """A kernel image the archive carries (a Triton cubin) and the function to take from it."""

    name: str
    image: bytes
    func_attrs: dict[str, int] = field(default_factory=dict)  # CUfunction_attribute name -> value


@dataclass
class Archive:
    key: dict[str, Any]
    layout: dict[str, Any]  # state_top, high_water, state_log, ...
    modules: dict[str, ModuleImage]
    graphs: list[GraphRecord]
    lib_func_attrs: dict[str, dict[str, int]] = field(default_factory=dict)  # by kernel name
    info: dict[str, Any] = field(default_factory=dict)  # not checked: timings, counts, versions

    def graph(self, bucket: int) -> GraphRecord:
        for g in self.graphs:
            if g.bucket == bucket:
                return g
        raise KeyError(f"bucket {bucket} is not in the archive (buckets {[g.bucket for g in self.graphs]})")

    def library_names(self, bucket: int | None = None) -> set[str]:
        """Kernel names the restoring process must find itself (not archived images)."""
        graphs = self.graphs if bucket is None else [self.graph(bucket)]
        return {name for g in graphs for name in g.table.library_names()}


def trigger_buckets(names: Mapping[int, set[str]]) -> list[int]:
    """The fewest buckets (greedy set cover, ascending) whose library kernel names cover every bucket's: a
    restore runs one trigger forward of each (a bucket's trigger launches the kernels its graph names).
    Ties go to the smaller bucket (its trigger forward is the cheapest)."""
    left = set().union(*names.values()) if names else set()
    chosen: list[int] = []
    while left:
        best = min(names, key=lambda b: (-len(names[b] & left), b))
        if not names[best] & left:
            break
        chosen.append(best)
        left -= names[best]
    return sorted(chosen)


# ---------------------------------------------------------------------------------------- topology


def topological_order(num_nodes: int, edges: Sequence[tuple[int, int]]) -> list[int]:
    """Node indices so that every edge (a -> b: b depends on a) goes forward; ties keep index order.
    ValueError on a cycle or an edge naming a node out of range."""
    succ: list[list[int]] = [[] for _ in range(num_nodes)]
    indeg = [0] * num_nodes
    for a, b in edges:
        if not (0 <= a < num_nodes and 0 <= b < num_nodes):
            raise ValueError(f"edges: ({a}, {b}) names a node outside 0..{num_nodes - 1}")
        succ[a].append(b)
        indeg[b] += 1
    import heapq

    ready = [i for i in range(num_nodes) if indeg[i] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for j in succ[i]:
            indeg[j] -= 1
            if indeg[j] == 0:
                heapq.heappush(ready, j)
    if len(order) != num_nodes:
        raise ValueError(f"edges: the graph has a cycle ({num_nodes - len(order)} nodes never become ready)")
    return order


def reorder(nodes: Sequence[Node], edges: Sequence[tuple[int, int]]) -> tuple[list[Node], list[list[int]]]:
    """(nodes in topological order, deps as indices into that order)."""
    order = topological_order(len(nodes), edges)
    pos = {old: new for new, old in enumerate(order)}
    deps: list[list[int]] = [[] for _ in order]
    for a, b in edges:
        deps[pos[b]].append(pos[a])
    return [nodes[i] for i in order], [sorted(set(d)) for d in deps]


# ------------------------------------------------------------------------------- pointer checking


def foreign_pointers(
    data: bytes, foreign: Sequence[tuple[int, int]], align: int = 8
) -> list[tuple[int, int]]:
    """(byte offset, value) of every `align`-aligned little-endian u64 in `data` that falls inside one of
    the `foreign` [start, end) ranges (sorted, disjoint): device memory the restoring process will not
    have at that address (torch segments outside the arena and W)."""
    if not foreign:
        return []
    import bisect

    starts = [s for s, _ in foreign]
    hits = []
    for off in range(0, len(data) - 7, align):
        (v,) = struct.unpack_from("<Q", data, off)
        i = bisect.bisect_right(starts, v) - 1
        if i >= 0 and v < foreign[i][1]:
            hits.append((off, v))
    return hits


# ------------------------------------------------------------------------------------ read / write


class _Blobs:
    """The blob section: parts at 8-byte aligned offsets (np.frombuffer views, read by C)."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0

    def add(self, data: bytes) -> list[int]:
        ref = [self.size, len(data)]
        pad = -len(data) % 8
        self.parts.append(bytes(data) + bytes(pad))
        self.size += len(data) + pad
        return ref


def _table_to_json(table: NodeTable, blobs: _Blobs) -> dict[str, Any]:
    return {
        "funcs": [list(f) for f in table.funcs],
        "params": blobs.add(table.param_blob),
        "arrays": {
            name: [*blobs.add(np.ascontiguousarray(table.arrays[name]).tobytes()), len(table.arrays[name])]
            for name in _TABLE_ARRAYS
        },
    }


def _table_from_json(d: dict[str, Any], blob: memoryview, source: str) -> NodeTable:
    arrays = {}
    for name, (dtype, width) in _TABLE_ARRAYS.items():
        off, nbytes, rows = (int(x) for x in d["arrays"][name])
        dt = np.dtype(dtype)
        if off < 0 or off + nbytes > len(blob) or nbytes != rows * dt.itemsize * max(1, width):
            raise ArchiveCorrupt(f"{source}: array {name} ({nbytes} bytes at {off}) does not fit")
        a = np.frombuffer(blob, dtype=dt, count=nbytes // dt.itemsize, offset=off)
        arrays[name] = a.reshape(rows, width) if width else a
    off, n = (int(x) for x in d["params"])
    if off < 0 or off + n > len(blob):
        raise ArchiveCorrupt(f"{source}: parameter bytes ({n} at {off}) beyond the blob")
    table = NodeTable(
        arrays=arrays, param_blob=bytes(blob[off : off + n]), funcs=[tuple(f) for f in d["funcs"]]
    )
    try:
        table.validate(source)
    except ValueError as exc:
        raise ArchiveCorrupt(str(exc)) from None
    return table


def encode(archive: Archive) -> bytes:
    blobs = _Blobs()
    header = {
        "format": "lorafn-graph-archive",
        "format_version": FORMAT_VERSION,
        "key": _norm(archive.key),
        "layout": _norm(archive.layout),
        "info": _norm(archive.info),
        "modules": {
            mid: {"name": m.name, "image": blobs.add(m.image), "func_attrs": m.func_attrs}
            for mid, m in archive.modules.items()
        },
        "lib_func_attrs": archive.lib_func_attrs,
        "graphs": [
            {
                "bucket": g.bucket,
                "table": _table_to_json(g.table, blobs),
                "output": {
                    "ptr": g.output.ptr,
                    "shape": list(g.output.shape),
                    "stride": list(g.output.stride),
                    "dtype": g.output.dtype,
                },
                "selfcheck": g.selfcheck,
            }
            for g in archive.graphs
        ],
    }
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    head += b" " * (-(len(MAGIC) + 8 + len(head)) % 8)  # the blob starts 8-byte aligned
    body = MAGIC + struct.pack("<Q", len(head)) + head + b"".join(blobs.parts)
    return body + hashlib.blake2b(body, digest_size=_DIGEST).digest()


def decode(data: bytes, source: str = "archive") -> Archive:
    """The archive in `data`; ArchiveCorrupt when it is truncated, altered or of another format. The node
    tables are views of `data` (no copy)."""
    if len(data) < len(MAGIC) + 8 + _DIGEST or not data.startswith(MAGIC):
        raise ArchiveCorrupt(f"{source}: not a lorafn graph archive (magic or size)")
    view = memoryview(data)
    body, digest = view[:-_DIGEST], view[-_DIGEST:]
    if hashlib.blake2b(body, digest_size=_DIGEST).digest() != digest:
        raise ArchiveCorrupt(f"{source}: checksum mismatch (truncated or altered)")
    (n,) = struct.unpack_from("<Q", body, len(MAGIC))
    start = len(MAGIC) + 8
    try:
        header = json.loads(bytes(body[start : start + n]))
    except ValueError as exc:
        raise ArchiveCorrupt(f"{source}: header is not JSON: {exc}") from None
    if header.get("format") != "lorafn-graph-archive" or header.get("format_version") != FORMAT_VERSION:
        raise ArchiveMismatch(
            f"{source}: format_version: {header.get('format_version')!r} in the archive, "
            f"{FORMAT_VERSION} here"
        )
    blob = body[start + n :]
    try:
        modules = {
            mid: ModuleImage(
                name=m["name"],
                image=bytes(blob[m["image"][0] : m["image"][0] + m["image"][1]]),
                func_attrs=m["func_attrs"],
            )
            for mid, m in header["modules"].items()
        }
        graphs = [
            GraphRecord(
                bucket=int(g["bucket"]),
                table=_table_from_json(g["table"], blob, f"{source}: bucket {g['bucket']}"),
                output=TensorRef(
                    ptr=int(g["output"]["ptr"]),
                    shape=tuple(g["output"]["shape"]),
                    stride=tuple(g["output"]["stride"]),
                    dtype=g["output"]["dtype"],
                ),
                selfcheck=g.get("selfcheck"),
            )
            for g in header["graphs"]
        ]
    except (KeyError, TypeError, IndexError, ValueError) as exc:
        if isinstance(exc, ArchiveError):
            raise
        raise ArchiveCorrupt(f"{source}: malformed header ({type(exc).__name__}: {exc})") from None
    return Archive(
        key=header["key"],
        layout=header["layout"],
        modules=modules,
        graphs=graphs,
        lib_func_attrs=header.get("lib_func_attrs", {}),
        info=header.get("info", {}),
    )


def write_archive(path: str | os.PathLike[str], archive: Archive) -> Path:
    """Write atomically (temporary file + rename): a concurrent reader sees the old file or the new one.
    The temporary file has a unique name (mkstemp), not one made of the pid: workers of several pods share
    a node's archive directory and their pids can be equal."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(encode(archive))
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600: other workers of the node must read it
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def read_archive(path: str | os.PathLike[str]) -> Archive:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ArchiveError(f"graph archive {path}: cannot read: {exc}") from None
    return decode(data, source=f"archive {path}")


def check_layout(archived: Mapping[str, Any], state_top: int, state_log: Sequence[Sequence[int]]) -> None:
    """Refuse when this process's state allocations in the arena differ from the capturing process's:
    every pointer into them would be wrong. Names the first differing allocation."""
    want = [tuple(x) for x in archived["state_log"]]
    have = [tuple(x) for x in state_log]
    for i, (a, b) in enumerate(zip(want, have, strict=False)):  # lengths compared below
        if a != b:
            raise ArchiveMismatch(
                f"arena layout: state allocation #{i} is (offset, bytes) {a} in the archive, {b} here "
                "(the state is built in another order or with other sizes)"
            )
    if len(want) != len(have) or int(archived["state_top"]) != state_top:
        raise ArchiveMismatch(
            f"arena layout: state_top: {archived['state_top']} after {len(want)} allocations in the archive, "
            f"{state_top} after {len(have)} here"
        )
