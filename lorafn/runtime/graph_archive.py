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

File: MAGIC, u64 header length, the header (JSON), the blob section (parameter bytes, cubins), and a
32-byte blake2b of everything before it (a corrupted file is refused, never half-used).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAGIC = b"LFGRAPH\x00"
FORMAT_VERSION = 1
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
    "buckets",
    "max_blocks_per_seq",
    "block_size",
    "num_kv_blocks",
    "arena_base",
    "arena_reserved",
    "weights_in",  # "arena" (weights allocated in A) or "W@0x..." (mapped by the backbone server)
)

NODE_KINDS = ("kernel", "memset", "memcpy", "empty")


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
    fields: dict[str, int]  # CUDA_MEMCPY3D's numeric fields by name (device to device only)
    kind: str = "memcpy"


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


@dataclass
class GraphRecord:
    bucket: int
    nodes: list[Node]  # topological order
    deps: list[list[int]]  # deps[i]: indices (< i) of the nodes node i depends on
    output: TensorRef
    selfcheck: str | None = None  # blake2b of the output after a replay on padding inputs (see restore)


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
        return {
            n.func[1] for g in graphs for n in g.nodes if isinstance(n, KernelNode) and n.func[0] == "name"
        }


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


def _node_to_json(node: Node, blobs: _Blobs) -> dict[str, Any]:
    if isinstance(node, KernelNode):
        return {
            "kind": "kernel",
            "func": list(node.func),
            "name": node.name,
            "grid": list(node.grid),
            "block": list(node.block),
            "shared": node.shared,
            "params": blobs.add(b"".join(node.params)),
            "param_sizes": [len(p) for p in node.params],
            "attrs": {str(k): v.hex() for k, v in node.attrs.items()},
        }
    if isinstance(node, MemsetNode):
        return {
            "kind": "memset",
            "dst": node.dst,
            "pitch": node.pitch,
            "value": node.value,
            "element_size": node.element_size,
            "width": node.width,
            "height": node.height,
        }
    if isinstance(node, MemcpyNode):
        return {"kind": "memcpy", "fields": dict(node.fields)}
    return {"kind": "empty"}


def _node_from_json(d: dict[str, Any], blob: bytes) -> Node:
    kind = d.get("kind")
    if kind == "kernel":
        off, n = d["params"]
        raw = blob[off : off + n]
        params, at = [], 0
        for size in d["param_sizes"]:
            params.append(raw[at : at + size])
            at += size
        if at != n:
            raise ArchiveCorrupt(f"kernel {d['name']}: parameter sizes add up to {at}, blob holds {n}")
        return KernelNode(
            func=(d["func"][0], d["func"][1]),
            name=d["name"],
            grid=tuple(d["grid"]),  # type: ignore[arg-type]
            block=tuple(d["block"]),  # type: ignore[arg-type]
            shared=int(d["shared"]),
            params=params,
            attrs={int(k): bytes.fromhex(v) for k, v in d.get("attrs", {}).items()},
        )
    if kind == "memset":
        return MemsetNode(d["dst"], d["pitch"], d["value"], d["element_size"], d["width"], d["height"])
    if kind == "memcpy":
        return MemcpyNode(fields={k: int(v) for k, v in d["fields"].items()})
    if kind == "empty":
        return EmptyNode()
    raise ArchiveCorrupt(f"node kind {kind!r} is not one of {NODE_KINDS}")


class _Blobs:
    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0

    def add(self, data: bytes) -> list[int]:
        ref = [self.size, len(data)]
        self.parts.append(data)
        self.size += len(data)
        return ref


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
                "nodes": [_node_to_json(n, blobs) for n in g.nodes],
                "deps": g.deps,
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
    body = MAGIC + struct.pack("<Q", len(head)) + head + b"".join(blobs.parts)
    return body + hashlib.blake2b(body, digest_size=_DIGEST).digest()


def decode(data: bytes, source: str = "archive") -> Archive:
    """The archive in `data`; ArchiveCorrupt when it is truncated, altered or of another format."""
    if len(data) < len(MAGIC) + 8 + _DIGEST or not data.startswith(MAGIC):
        raise ArchiveCorrupt(f"{source}: not a lorafn graph archive (magic or size)")
    body, digest = data[:-_DIGEST], data[-_DIGEST:]
    if hashlib.blake2b(body, digest_size=_DIGEST).digest() != digest:
        raise ArchiveCorrupt(f"{source}: checksum mismatch (truncated or altered)")
    (n,) = struct.unpack_from("<Q", body, len(MAGIC))
    start = len(MAGIC) + 8
    try:
        header = json.loads(body[start : start + n])
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
                image=blob[m["image"][0] : m["image"][0] + m["image"][1]],
                func_attrs=m["func_attrs"],
            )
            for mid, m in header["modules"].items()
        }
        graphs = [
            GraphRecord(
                bucket=int(g["bucket"]),
                nodes=[_node_from_json(d, blob) for d in g["nodes"]],
                deps=[list(d) for d in g["deps"]],
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
    except (KeyError, TypeError, IndexError) as exc:
        raise ArchiveCorrupt(f"{source}: malformed header ({type(exc).__name__}: {exc})") from None
    for g in graphs:
        if len(g.deps) != len(g.nodes) or any(d >= i for i, ds in enumerate(g.deps) for d in ds):
            raise ArchiveCorrupt(f"{source}: bucket {g.bucket}: dependencies are not in topological order")
    return Archive(
        key=header["key"],
        layout=header["layout"],
        modules=modules,
        graphs=graphs,
        lib_func_attrs=header.get("lib_func_attrs", {}),
        info=header.get("info", {}),
    )


def write_archive(path: str | os.PathLike[str], archive: Archive) -> Path:
    """Write atomically (temporary file + rename): a concurrent reader sees the old file or the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(encode(archive))
    tmp.replace(path)
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
