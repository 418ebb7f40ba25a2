"""Decode CUDA graphs materialized (issue 11 item 2): walk captured graphs into an archive, and rebuild them
in another process without capturing. The pure parts (key, format, refusals) are `graph_archive.py`.

Capture side (`archive_graphs`): the graphs were captured by `DecodeGraphRunner.capture` with the arena's
pools (`arena.py`), so every address they name is in the arena A (or in W). Each graph is walked with the
CUDA driver API (cuda-bindings): node types, kernel params (`cuGraphKernelNodeGetParams`; each
parameter's size from `cuFuncGetParamInfo`, bytes kept opaque), launch attributes, memset/memcpy
parameters, edges. Triton kernels are recognised by their CUfunction handle among Triton's loaded
`CompiledKernel`s and archived with their cubin; every other kernel (ATen, cuBLAS) by its name.

Restore side (`restore_graphs`): the same arena at the same address, the same state allocations (checked
against the archived allocation log), the rest of the capture's arena range backed (`reserve_until`),
then: Triton cubins loaded with `cuModuleLoadData` (no Triton JIT); the other kernels' handles harvested
from ONE *trigger*: the model's forward for one layer at the fewest buckets whose graphs name every
library kernel, eagerly then under one stream capture, with every Triton launch turned into a no-op (the
trigger graph is walked for names, never run); then per bucket the C builder (`graph_build.c`) adds the
archived NodeTable's nodes in one call, `cuGraphInstantiate`, and either the self-check replay (padding
inputs; a digest of the output computed on the GPU, compared with the capturing process's; valid when
both hold the same weights and LoRA values, e.g. a standby's zeroed buffers on one backbone) or
`cuGraphUpload`. The GPU replays one bucket's check while the CPU builds the next; one read-back at the end.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import gc
import hashlib
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lorafn.runtime.arena import Arena, tensor_at
from lorafn.runtime.config import (
    DEFAULT_DECODE_ATTENTION,
    DEFAULT_EXPAND_IN_GEMM,
    DEFAULT_GEMM_PROLOGUE_ROWS,
    DEFAULT_LORA_SHRINK,
    DEFAULT_ROPE_IN_ATTENTION,
    DEFAULT_SKINNY_GEMM_ROWS,
)
from lorafn.runtime.graph_archive import (
    ATTR_VALUE_BYTES,
    FORMAT_VERSION,
    MEMCPY_FIELDS,
    Archive,
    ArchiveError,
    EmptyNode,
    GraphRecord,
    KernelNode,
    MemcpyNode,
    MemsetNode,
    ModuleImage,
    Node,
    TensorRef,
    check_key,
    check_layout,
    files_fingerprint,
    foreign_pointers,
    model_layout_fingerprint,
    reorder,
    trigger_buckets,
)
from lorafn.runtime.graph_build import GraphBuilder, GraphBuildError

log = logging.getLogger(__name__)

_RUNTIME = Path(__file__).parent
# The sources that decide which kernels a decode step launches, with which arguments, in which order,
# and where the arena puts things: an edit to any of them invalidates archives (the `code` key field).
CODE_FILES = (
    _RUNTIME / "models" / "llama.py",
    _RUNTIME / "models" / "fused_decode.py",
    _RUNTIME / "models" / "triton_ops.py",
    _RUNTIME / "attention" / "__init__.py",
    _RUNTIME / "attention" / "triton_decode.py",
    _RUNTIME / "attention" / "reference.py",
    _RUNTIME / "cuda_graphs.py",
    _RUNTIME / "lora.py",
    _RUNTIME / "kv_cache.py",
    _RUNTIME / "model_runner.py",  # the order a worker builds its decode state in (graph_cache.py)
    _RUNTIME / "graph_cache.py",
    _RUNTIME / "arena_alloc.c",
    _RUNTIME / "graph_build.c",
)
# Function attributes a library or Triton may have set before launching, restored on the new handles.
FUNC_ATTRS = (
    "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES",
    "CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT",
    "CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED",
)
_MEMCPY_INTS = MEMCPY_FIELDS[:15]  # the numeric fields; the memory types and addresses follow
SELFCHECK_MODES = ("all", "cover", "one", "none")


class GraphRestoreError(RuntimeError):
    """A CUDA call or a step of walking/rebuilding failed; the message names the call and the node."""


def _cu() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver  # cuda-python before the cuda.bindings layout
        except ImportError as exc:
            raise GraphRestoreError(
                "graph materialization needs cuda-bindings (the `gpu` extra: cuda-python)"
            ) from exc
    return driver


def _ok(result: Any, what: str) -> tuple:
    """cuda-bindings returns (CUresult, *values): the values, or GraphRestoreError naming the call."""
    cu = _cu()
    err, *rest = result
    if err != cu.CUresult.CUDA_SUCCESS:
        raise GraphRestoreError(f"{what} failed: {getattr(err, 'name', err)} ({int(err)})")
    return tuple(rest)


# ---------------------------------------------------------------------------------------------- state


@dataclass(frozen=True)
class DecodeStateSpec:
    """What a decode graph set is captured over (the same spec in the capturing and restoring process)."""

    model_dir: str
    dtype: str = "bfloat16"
    lora_shape: str | None = None
    buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    num_kv_blocks: int = 512
    block_size: int = 16
    max_model_len: int = 1024
    fused_decode: bool = True
    lora_expand: str = "per_projection"
    skinny_gemm_rows: int = DEFAULT_SKINNY_GEMM_ROWS
    decode_attention: str = DEFAULT_DECODE_ATTENTION
    expand_in_gemm: bool = DEFAULT_EXPAND_IN_GEMM
    gemm_prologue_rows: int = DEFAULT_GEMM_PROLOGUE_ROWS
    lora_shrink: str = DEFAULT_LORA_SHRINK
    rope_in_attention: bool = DEFAULT_ROPE_IN_ATTENTION
    # the backbone server's socket: weights are its read-only mapping W at its fixed address (the worker's
    # real set-up); None: weights loaded from model_dir into the arena's state pool
    backbone_socket: str | None = None


@dataclass
class DecodeState:
    spec: DecodeStateSpec
    model_config: Any
    model: Any
    lora: Any
    kv_cache: Any
    runner: Any  # DecodeGraphRunner (static inputs allocated, nothing captured)
    state_top: int
    state_log: list[tuple[int, int]]
    build_s: float
    weights_in: str = "arena"  # or "W@0x...": the key field of the same name
    weight_source: Any = None


def build_decode_state(spec: DecodeStateSpec, arena: Arena) -> DecodeState:
    """The model (weights in the arena), zeroed LoRA buffers of `spec.lora_shape` (a standby's), the KV
    cache and the graphs' static inputs, all in `arena.state_pool`, in one fixed order (ModelRunner's):
    the same spec gives the same addresses in every process (the allocation log proves it)."""
    from lorafn.runtime.block_manager import blocks_for_tokens
    from lorafn.runtime.config import ModelConfig
    from lorafn.runtime.cuda_graphs import DecodeGraphRunner
    from lorafn.runtime.kv_cache import KVCache
    from lorafn.runtime.local_weights import SafetensorsWeightSource
    from lorafn.runtime.lora import zero_lora
    from lorafn.runtime.models.llama import LlamaModel

    t0 = time.perf_counter()
    if arena.bump != 0:
        raise GraphRestoreError(f"arena: the state must be its first allocations (bump is {arena.bump})")
    mc = ModelConfig.from_dir(spec.model_dir)
    dtype = getattr(torch, spec.dtype)
    device = arena.device
    shared = None
    weights_in = "arena"
    if spec.backbone_socket:
        from lorafn.backbone_server.client import SharedWeightSource

        # attached before the state pool is routed: W is mapped by the client, not allocated by torch
        shared = SharedWeightSource(spec.backbone_socket, device=str(device), name="decode-graphs")
        weights_in = f"W@0x{int(shared.manifest['w_addr']):x}"
    gc.collect()
    gc.disable()  # a collection mid-build could free a temporary at another point: other addresses
    try:
        with torch.cuda.use_mem_pool(arena.state_pool):
            source = shared if shared is not None else SafetensorsWeightSource(spec.model_dir)
            lora = zero_lora(spec.lora_shape, mc, device, dtype) if spec.lora_shape else None
            model = LlamaModel(
                mc,
                source,
                device,
                dtype,
                lora,
                max_position=spec.max_model_len,
                use_triton_attention=True,
                fused_decode=spec.fused_decode,
                lora_expand=spec.lora_expand,
                skinny_gemm_rows=spec.skinny_gemm_rows,
                decode_attention=spec.decode_attention,
                expand_in_gemm=spec.expand_in_gemm,
                gemm_prologue_rows=spec.gemm_prologue_rows,
                lora_shrink=spec.lora_shrink,
                rope_in_attention=spec.rope_in_attention,
            )
            kv = KVCache(mc, spec.num_kv_blocks, spec.block_size, device, dtype)
            runner = DecodeGraphRunner(
                model, kv, spec.buckets, blocks_for_tokens(spec.max_model_len, spec.block_size)
            )
        torch.cuda.synchronize()
    finally:
        gc.enable()
    return DecodeState(
        spec=spec,
        model_config=mc,
        model=model,
        lora=lora,
        kv_cache=kv,
        runner=runner,
        state_top=arena.bump,
        state_log=arena.allocation_log(),
        build_s=time.perf_counter() - t0,
        weights_in=weights_in,
        weight_source=shared,
    )


def state_key(state: DecodeState, arena: Arena) -> dict[str, Any]:
    spec = state.spec
    return current_key(
        model_dir=spec.model_dir,
        dtype=getattr(torch, spec.dtype),
        adapter_shape=state.lora.shape_key if state.lora is not None else None,
        fused_decode=spec.fused_decode,
        lora_expand=spec.lora_expand,
        skinny_gemm_rows=spec.skinny_gemm_rows,
        decode_attention=spec.decode_attention,
        expand_in_gemm=spec.expand_in_gemm,
        gemm_prologue_rows=spec.gemm_prologue_rows,
        lora_shrink=spec.lora_shrink,
        rope_in_attention=spec.rope_in_attention,
        buckets=state.runner.buckets,
        max_blocks_per_seq=state.runner.max_blocks,
        block_size=spec.block_size,
        num_kv_blocks=spec.num_kv_blocks,
        arena=arena,
        weights_in=state.weights_in,
    )


# ------------------------------------------------------------------------------------------------ key


def current_key(
    *,
    model_dir: str | Path,
    dtype: torch.dtype,
    adapter_shape: str | None,
    fused_decode: bool,
    lora_expand: str,
    buckets: Sequence[int],
    skinny_gemm_rows: int = DEFAULT_SKINNY_GEMM_ROWS,
    decode_attention: str = DEFAULT_DECODE_ATTENTION,
    expand_in_gemm: bool = DEFAULT_EXPAND_IN_GEMM,
    gemm_prologue_rows: int = DEFAULT_GEMM_PROLOGUE_ROWS,
    lora_shrink: str = DEFAULT_LORA_SHRINK,
    rope_in_attention: bool = DEFAULT_ROPE_IN_ATTENTION,
    max_blocks_per_seq: int,
    block_size: int,
    num_kv_blocks: int,
    arena: Arena,
    weights_in: str = "arena",
) -> dict[str, Any]:
    """This process's graph-archive key (graph_archive.KEY_FIELDS)."""
    import triton

    cu = _cu()
    props = torch.cuda.get_device_properties(arena.device)
    (driver,) = _ok(cu.cuDriverGetVersion(), "cuDriverGetVersion")
    return {
        "format_version": FORMAT_VERSION,
        "gpu": props.name,
        "capability": f"{props.major}.{props.minor}",
        "driver": int(driver),
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "code": files_fingerprint(p for p in CODE_FILES if p.exists()),
        "model_layout": model_layout_fingerprint(model_dir),
        "dtype": str(dtype).removeprefix("torch."),
        "adapter_shape": adapter_shape,
        "fused_decode": bool(fused_decode),
        "lora_expand": lora_expand,
        "skinny_gemm_rows": int(skinny_gemm_rows),
        "decode_attention": decode_attention,
        "expand_in_gemm": bool(expand_in_gemm),
        "gemm_prologue_rows": int(gemm_prologue_rows),
        "lora_shrink": lora_shrink,
        "rope_in_attention": bool(rope_in_attention),
        "buckets": sorted(int(b) for b in buckets),
        "max_blocks_per_seq": int(max_blocks_per_seq),
        "block_size": int(block_size),
        "num_kv_blocks": int(num_kv_blocks),
        "arena_base": arena.base,
        "arena_reserved": arena.reserved,
        "weights_in": weights_in,
    }


# ---------------------------------------------------------------------------------------- walking


def triton_kernels() -> dict[int, Any]:
    """Triton's loaded kernels by CUfunction handle (every `CompiledKernel` alive in this process)."""
    out: dict[int, Any] = {}
    for obj in gc.get_objects():
        cls = type(obj)
        if cls.__name__ == "CompiledKernel" and cls.__module__.startswith("triton"):
            fn = getattr(obj, "function", None)
            if fn:
                out[int(fn)] = obj
    return out


def _func_attrs(func: int) -> dict[str, int]:
    cu = _cu()
    out = {}
    for name in FUNC_ATTRS:
        attr = getattr(cu.CUfunction_attribute, name, None)
        if attr is None:
            continue
        err, value = cu.cuFuncGetAttribute(attr, func)
        if err == cu.CUresult.CUDA_SUCCESS:
            out[name] = int(value)
    return out


def _param_layout(func: int, cache: dict[int, list[tuple[int, int]]]) -> list[tuple[int, int]]:
    """(offset, size) of each parameter of `func`, from cuFuncGetParamInfo (CUDA >= 12.4)."""
    if func in cache:
        return cache[func]
    cu = _cu()
    out = []
    for i in range(4096):
        err, off, size = cu.cuFuncGetParamInfo(func, i)
        if err != cu.CUresult.CUDA_SUCCESS:
            break
        out.append((int(off), int(size)))
    cache[func] = out
    return out


def _node_function(p: Any, what: str) -> int:
    """The CUfunction of a kernel node's params: `func`, or (launched as a CUkernel, CUDA >= 12) the
    context's function of `kern`; 0 when neither is set."""
    func = int(p.func)
    kern = getattr(p, "kern", None)  # CUDA_KERNEL_NODE_PARAMS_v2 (cuda-bindings 12.x may give v1)
    if not func and kern is not None and int(kern):
        (f,) = _ok(_cu().cuKernelGetFunction(kern), f"cuKernelGetFunction({what})")
        func = int(f)
    return func


def _read_params(p: Any, layout: list[tuple[int, int]], what: str) -> list[bytes]:
    if not layout:
        return []
    addr = int(p.kernelParams)
    if addr:
        ptrs = (ctypes.c_void_p * len(layout)).from_address(addr)
        out = []
        for i, (_off, size) in enumerate(layout):
            if not ptrs[i]:
                raise GraphRestoreError(f"{what}: kernelParams[{i}] is NULL")
            out.append(ctypes.string_at(ptrs[i], size))
        return out
    extra = int(p.extra)
    if not extra:
        raise GraphRestoreError(f"{what}: {len(layout)} parameters but neither kernelParams nor extra")
    words = ctypes.cast(extra, ctypes.POINTER(ctypes.c_void_p))
    buf = size_ptr = None
    for i in range(0, 64, 2):  # CU_LAUNCH_PARAM_END 0, BUFFER_POINTER 1, BUFFER_SIZE 2
        k = words[i] or 0
        if k == 0:
            break
        if k == 1:
            buf = words[i + 1]
        elif k == 2:
            size_ptr = words[i + 1]
    if not buf:
        raise GraphRestoreError(f"{what}: extra has no CU_LAUNCH_PARAM_BUFFER_POINTER")
    total = ctypes.c_size_t.from_address(size_ptr).value if size_ptr else None
    out = []
    for off, size in layout:
        if total is not None and off + size > total:
            raise GraphRestoreError(f"{what}: parameter at {off}+{size} beyond the {total}-byte buffer")
        out.append(ctypes.string_at(buf + off, size))
    return out


def _launch_attrs(node: Any) -> dict[int, bytes]:
    """Launch attributes of a kernel node whose value is not all zeros, as raw 64-byte values."""
    cu = _cu()
    out = {}
    for attr in cu.CUkernelNodeAttrID:
        if attr.name.endswith("IGNORE"):
            continue
        err, value = cu.cuGraphKernelNodeGetAttribute(node, attr)
        if err != cu.CUresult.CUDA_SUCCESS or value is None:
            continue
        raw = ctypes.string_at(value.getPtr(), ATTR_VALUE_BYTES)
        if any(raw):
            out[int(attr)] = raw
    return out


def _nodes_and_edges(graph: Any) -> tuple[list[Any], list[tuple[int, int]]]:
    cu = _cu()
    _nodes, n = _ok(cu.cuGraphGetNodes(graph, 0), "cuGraphGetNodes(count)")
    nodes, n2 = _ok(cu.cuGraphGetNodes(graph, int(n)), "cuGraphGetNodes")
    nodes = list(nodes)[: int(n2)]
    index = {int(h): i for i, h in enumerate(nodes)}
    # cuda-bindings 13: cuGraphGetEdges returns edge data too; 12.x: without (a graph with programmatic
    # edges then answers CUDA_ERROR_LOSSY_QUERY) and cuGraphGetEdges_v2 with. Edge data is not archived:
    # a programmatic edge becomes a full dependency (stricter, so still correct).
    get_edges = cu.cuGraphGetEdges
    if cu.cuGraphGetEdges(graph, 0)[0] != cu.CUresult.CUDA_SUCCESS and hasattr(cu, "cuGraphGetEdges_v2"):
        get_edges = cu.cuGraphGetEdges_v2
    res = _ok(get_edges(graph, 0), "cuGraphGetEdges(count)")
    num = int(res[-1])
    edges: list[tuple[int, int]] = []
    if num:
        res = _ok(get_edges(graph, num), "cuGraphGetEdges")
        for a, b in zip(res[0][:num], res[1][:num], strict=True):
            edges.append((index[int(a)], index[int(b)]))
    return nodes, edges


@dataclass
class Walk:
    """What walking captured graphs found: the records and the images/attributes they need."""

    graphs: list[GraphRecord]
    modules: dict[str, ModuleImage] = field(default_factory=dict)
    lib_func_attrs: dict[str, dict[str, int]] = field(default_factory=dict)
    foreign: list[str] = field(default_factory=list)  # references to memory outside A and W
    counts: dict[str, int] = field(default_factory=dict)


def _foreign_segments(arena: Arena) -> list[tuple[int, int]]:
    """torch's segments outside the arena: memory a restoring process will not have at that address."""
    segs = []
    try:
        snapshot = torch.cuda.memory_snapshot()
    except Exception as exc:  # the check is a diagnosis; without it the self-check still guards
        log.warning("decode graphs: no memory snapshot (%s): references outside the arena not checked", exc)
        return []
    for s in snapshot:
        start, size = int(s["address"]), int(s["total_size"])
        if not arena.contains(start):
            segs.append((start, start + size))
    return sorted(segs)


def walk_graph(
    raw_graph: int,
    bucket: int,
    output: torch.Tensor,
    triton: Mapping[int, Any],
    walk: Walk,
    foreign: Sequence[tuple[int, int]],
) -> GraphRecord:
    """One captured graph (a cudaGraph_t handle) as a GraphRecord; adds Triton images to `walk.modules`."""
    cu = _cu()
    T = cu.CUgraphNodeType
    graph = cu.CUgraph(raw_graph)
    handles, edges = _nodes_and_edges(graph)
    layouts: dict[int, list[tuple[int, int]]] = {}
    nodes: list[Node] = []
    for i, h in enumerate(handles):
        (kind,) = _ok(cu.cuGraphNodeGetType(h), f"cuGraphNodeGetType(node {i})")
        if kind == T.CU_GRAPH_NODE_TYPE_KERNEL:
            (p,) = _ok(cu.cuGraphKernelNodeGetParams(h), f"cuGraphKernelNodeGetParams(node {i})")
            func = _node_function(p, f"node {i}")
            if not func:
                raise GraphRestoreError(f"bucket {bucket} node {i}: a kernel node with no function")
            (raw_name,) = _ok(cu.cuFuncGetName(func), f"cuFuncGetName(node {i})")
            name = raw_name.decode(errors="replace") if raw_name else f"<unnamed 0x{func:x}>"
            what = f"bucket {bucket} node {i} ({name})"
            params = _read_params(p, _param_layout(func, layouts), what)
            for j, prm in enumerate(params):
                for off, value in foreign_pointers(prm, foreign):
                    walk.foreign.append(f"{what} param {j} byte {off}: 0x{value:x}")
            ck = triton.get(func)
            if ck is not None:
                image = bytes(ck.kernel)
                mid = f"{name}-{hashlib.sha256(image).hexdigest()[:16]}"
                if mid not in walk.modules:
                    walk.modules[mid] = ModuleImage(name=name, image=image, func_attrs=_func_attrs(func))
                ref = ("module", mid)
                walk.counts["triton"] = walk.counts.get("triton", 0) + 1
            else:
                walk.lib_func_attrs.setdefault(name, _func_attrs(func))
                ref = ("name", name)
                walk.counts["library"] = walk.counts.get("library", 0) + 1
            nodes.append(
                KernelNode(
                    func=ref,
                    name=name,
                    grid=(int(p.gridDimX), int(p.gridDimY), int(p.gridDimZ)),
                    block=(int(p.blockDimX), int(p.blockDimY), int(p.blockDimZ)),
                    shared=int(p.sharedMemBytes),
                    params=params,
                    attrs=_launch_attrs(h),
                )
            )
        elif kind == T.CU_GRAPH_NODE_TYPE_MEMSET:
            (m,) = _ok(cu.cuGraphMemsetNodeGetParams(h), f"cuGraphMemsetNodeGetParams(node {i})")
            node = MemsetNode(
                int(m.dst), int(m.pitch), int(m.value), int(m.elementSize), int(m.width), int(m.height)
            )
            if foreign_pointers(node.dst.to_bytes(8, "little"), foreign):
                walk.foreign.append(f"bucket {bucket} node {i} (memset): dst 0x{node.dst:x}")
            nodes.append(node)
            walk.counts["memset"] = walk.counts.get("memset", 0) + 1
        elif kind == T.CU_GRAPH_NODE_TYPE_MEMCPY:
            (c,) = _ok(cu.cuGraphMemcpyNodeGetParams(h), f"cuGraphMemcpyNodeGetParams(node {i})")
            fields = {f: int(getattr(c, f)) for f in _MEMCPY_INTS}
            for side in ("src", "dst"):
                mtype = int(getattr(c, f"{side}MemoryType"))
                if mtype not in (
                    int(cu.CUmemorytype.CU_MEMORYTYPE_DEVICE),
                    int(cu.CUmemorytype.CU_MEMORYTYPE_UNIFIED),
                ):
                    raise GraphRestoreError(
                        f"bucket {bucket} node {i}: a memcpy with {side} memory type {mtype}: only device "
                        "memory can be archived (host addresses are per process)"
                    )
                fields[f"{side}MemoryType"] = mtype
                fields[f"{side}Device"] = int(getattr(c, f"{side}Device"))
                if foreign_pointers(fields[f"{side}Device"].to_bytes(8, "little"), foreign):
                    walk.foreign.append(
                        f"bucket {bucket} node {i} (memcpy): {side} 0x{fields[side + 'Device']:x}"
                    )
            nodes.append(MemcpyNode(fields=fields))
            walk.counts["memcpy"] = walk.counts.get("memcpy", 0) + 1
        elif kind == T.CU_GRAPH_NODE_TYPE_EMPTY:
            nodes.append(EmptyNode())
            walk.counts["empty"] = walk.counts.get("empty", 0) + 1
        else:
            raise GraphRestoreError(
                f"bucket {bucket} node {i}: node type {getattr(kind, 'name', kind)} cannot be archived "
                f"(kernel, memset, memcpy and empty nodes can)"
            )
    ordered, deps = reorder(nodes, edges)
    out = TensorRef(
        ptr=int(output.data_ptr()),
        shape=tuple(output.shape),
        stride=tuple(output.stride()),
        dtype=str(output.dtype).removeprefix("torch."),
    )
    return GraphRecord.from_nodes(bucket, ordered, deps, out)


def archive_graphs(
    runner: Any,
    arena: Arena,
    key: dict[str, Any],
    state_top: int,
    state_log: Sequence[tuple[int, int]],
    selfcheck: bool = True,
    allow_foreign: bool = False,
) -> Archive:
    """Walk `runner`'s graphs (captured with keep_graph=True in the arena's pools) into an Archive.
    Refuses (GraphRestoreError) graphs that name torch memory outside the arena, unless `allow_foreign`
    (a probe that wants to see what the restore then does): logged and kept in `info["foreign"]`.
    Also compiles the C graph builder into the arena's cache directory, so a restoring process finds it."""
    try:
        GraphBuilder.load(arena.cache_dir)
    except GraphBuildError as exc:  # the restore will say it again; the archive itself is still good
        log.warning("decode graphs: the graph builder does not compile here: %s", exc)
    triton = triton_kernels()
    foreign = _foreign_segments(arena)
    walk = Walk(graphs=[])
    for bucket in runner.buckets:
        output = runner.outputs[bucket]
        if not arena.contains(int(output.data_ptr())):
            raise GraphRestoreError(f"bucket {bucket}: the graph's output is outside the arena")
        raw = runner.graphs[bucket].raw_cuda_graph()
        walk.graphs.append(walk_graph(raw, bucket, output, triton, walk, foreign))
    if walk.foreign:
        message = (
            f"the graphs name {len(walk.foreign)} addresses in torch memory outside the arena (a restoring "
            f"process would not have them): {'; '.join(walk.foreign[:8])}"
        )
        if not allow_foreign:
            raise GraphRestoreError(message)
        log.warning("decode graphs: %s", message)
    if selfcheck:  # enqueued back to back, read back once
        with lora_pattern(runner.model.lora):
            graphs = runner.graphs
            launched = [selfcheck_launch(runner, r.bucket, graphs[r.bucket].replay) for r in walk.graphs]
            digests = selfcheck_collect(launched)
        for record, digest in zip(walk.graphs, digests, strict=True):
            record.selfcheck = digest
    torch.cuda.synchronize()
    layout = {
        "state_top": state_top,
        "state_log": [list(x) for x in state_log],
        "high_water": arena.bump,
    }
    info = {
        "counts": walk.counts,
        "modules": len(walk.modules),
        "triton_loaded": len(triton),
        "foreign": walk.foreign[:20],
    }
    return Archive(
        key=key,
        layout=layout,
        modules=walk.modules,
        graphs=walk.graphs,
        lib_func_attrs=walk.lib_func_attrs,
        info=info,
    )


# -------------------------------------------------------------------------------------- self-check
# A replay of each checked graph on padding inputs; its output's digest must equal the capturing process's.
# The digest is computed on the GPU right after the replay, in stream order (the graphs share one pool: a
# later replay may overwrite an earlier graph's output), and read back once for all buckets: two
# position-weighted sums mod 2^64 of the output's 32-bit words (odd weights: any single changed word
# changes both sums; integer sums do not depend on the reduction order). Format 1's blake2b of the output
# on the host cost a device-to-host copy, a synchronize and ~8 ms of hashing per bucket.

_DIGEST_NAME = "words64x2"
_DIGEST_K = ((0x9E3779B97F4A7C15, 0x632BE59BD9B4E019), (0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9))
_MASK64 = (1 << 64) - 1


def _signed64(v: int) -> int:
    v &= _MASK64
    return v - (1 << 64) if v >> 63 else v


def output_digest(out: torch.Tensor) -> torch.Tensor:
    """[2] int64 on the output's device, enqueued on the current stream (no synchronize)."""
    data = out.detach().contiguous().view(-1).view(torch.uint8)
    words = data.view(torch.int32) if data.numel() % 4 == 0 else data
    x = words.to(torch.int64)
    idx = torch.arange(x.numel(), dtype=torch.int64, device=x.device)
    sums = []
    for mul, add in _DIGEST_K:
        w = torch.bitwise_or(idx * _signed64(mul) + _signed64(add), 1)  # int64 arithmetic wraps mod 2^64
        sums.append((x * w).sum())
    return torch.stack(sums)


@contextlib.contextmanager
def lora_pattern(lora: Any) -> Iterator[None]:
    """The LoRA buffers hold one deterministic pattern inside (their values are put back after): the
    self-check's digests then depend on the weights and the adapter *shape* only, so an archive written by a
    worker bound to one adapter checks in a standby holding zeros or another adapter of the shape. Small
    non-zero values (|v| <= 0.01): every LoRA kernel's output reaches the digest. Built on the device by
    elementwise ops only: the same bits in every process."""
    tensors = lora.tensors() if lora is not None else []
    saved = [t.clone() for t in tensors]
    try:
        for i, t in enumerate(tensors):
            n = t.numel()
            idx = torch.arange(n, device=t.device, dtype=torch.float32)
            t.copy_(((idx * 0.6180339887 + 0.137 * (i % 7)).remainder(1.0) - 0.5).mul(0.02).view_as(t))
        yield
    finally:
        for t, v in zip(tensors, saved, strict=True):
            t.copy_(v)


def reset_static_inputs(runner: Any) -> None:
    """The static inputs as DecodeGraphRunner makes them: every row padding (token 0 at position 0, K/V
    to the scratch slot, context 1): the output then depends only on the weights and the LoRA values."""
    runner.input_ids.zero_()
    runner.positions.zero_()
    runner.slot_mapping.fill_(runner.kv_cache.scratch_slot)
    runner.block_tables.fill_(runner.kv_cache.scratch_block)
    runner.context_lens.fill_(1)


def selfcheck_launch(runner: Any, bucket: int, replay: Any) -> torch.Tensor:
    """Enqueue one self-check: padding inputs, the replay, the digest of `runner.outputs[bucket]`."""
    reset_static_inputs(runner)
    replay()
    return output_digest(runner.outputs[bucket])


def selfcheck_collect(digests: Sequence[torch.Tensor]) -> list[str]:
    """The digests as strings, with one read back (and so one wait) for all of them."""
    if not digests:
        return []
    values = torch.stack(list(digests)).cpu().tolist()
    return [f"{_DIGEST_NAME}:" + "".join(f"{v & _MASK64:016x}" for v in row) for row in values]


def selfcheck_digest(runner: Any, bucket: int, replay: Any) -> str:
    (digest,) = selfcheck_collect([selfcheck_launch(runner, bucket, replay)])
    return digest


def selfcheck_buckets(
    mode: str | bool, buckets: Sequence[int], functions: Mapping[int, set[Any]] | None = None
) -> list[int]:
    """The buckets a restore checks: "all", "one" (the smallest: the cheapest replay), "cover" (ascending,
    each bucket whose graph names a function, Triton image or library kernel, that no smaller checked
    bucket's does: every function of the archive replayed at least once; `functions` per bucket) or
    "none"."""
    if mode is True:
        mode = "all"
    elif mode is False:
        mode = "none"
    if mode not in SELFCHECK_MODES:
        raise ValueError(f"selfcheck: {mode!r} is not one of {SELFCHECK_MODES}")
    ordered = sorted(buckets)
    if mode == "cover":
        if functions is None:
            raise ValueError("selfcheck 'cover' needs the functions of each bucket")
        seen: set[Any] = set()
        chosen = []
        for b in ordered:
            if functions.get(b, set()) - seen:
                chosen.append(b)
                seen |= functions[b]
        return chosen
    return ordered if mode == "all" else ordered[:1] if mode == "one" else []


# ------------------------------------------------------------------------------------------ harvest


@contextlib.contextmanager
def triton_launches_disabled() -> Iterator[None]:
    """Every Triton kernel launch becomes a no-op (the wrappers still allocate their outputs)."""
    from triton.runtime.jit import JITFunction

    original = JITFunction.run
    JITFunction.run = lambda self, *args, **kwargs: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        JITFunction.run = original  # type: ignore[method-assign]


def _model_view(model: Any, layers: int | None) -> Any:
    """The model with only its first `layers` decoder layers (same kernels: every layer has the same
    shapes), or the model itself."""
    if layers is None or layers >= len(model.layers):
        return model
    view = copy.copy(model)
    view.layers = model.layers[:layers]
    if model.lora is not None:
        lora = copy.copy(model.lora)
        lora.layers = model.lora.layers[:layers]
        view.lora = lora
    return view


def harvest_library_functions(
    runner: Any, buckets: Sequence[int], layers: int | None = 1, times: dict[str, float] | None = None
) -> dict[str, int]:
    """Kernel name -> CUfunction of the non-Triton kernels that decode steps of `buckets` launch in this
    process: one eager pass over the buckets' steps (first `layers` layers; lazy module loads, cuBLAS set-up
    and heuristics), then ONE throwaway stream capture of the same steps, walked, never run. Triton
    launches are no-ops throughout. The capture is begun directly, not through `torch.cuda.graph`, whose
    entry synchronizes the device and empties torch's cache (cudaFree of every cached block; before torch
    2.9 it also ran gc.collect()); Python's cyclic GC is off during it, as torch.cuda.graph does since
    (a collection mid-capture may finalize an object whose destructor calls CUDA: pytorch#161037).
    `times` gets the seconds of the eager pass, the capture and the walk."""
    cu = _cu()
    model = _model_view(runner.model, layers)
    kv = runner.kv_cache.layers if model is runner.model else runner.kv_cache.layers[: len(model.layers)]
    batches = [runner._batch(b) for b in buckets]
    stream = torch.cuda.Stream()
    out: dict[str, int] = {}
    t0 = time.perf_counter()
    with triton_launches_disabled():
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for batch in batches:
                model.forward(batch, kv)
        stream.synchronize()
        t1 = time.perf_counter()
        trigger = torch.cuda.CUDAGraph(keep_graph=True)
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.stream(stream):
                trigger.capture_begin(capture_error_mode="relaxed")
                try:
                    for batch in batches:
                        model.forward(batch, kv)
                finally:
                    trigger.capture_end()
        finally:
            if collecting:
                gc.enable()
    t2 = time.perf_counter()
    handles, _edges = _nodes_and_edges(cu.CUgraph(trigger.raw_cuda_graph()))
    for h in handles:
        (kind,) = _ok(cu.cuGraphNodeGetType(h), "cuGraphNodeGetType(trigger)")
        if kind != cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
            continue
        (p,) = _ok(cu.cuGraphKernelNodeGetParams(h), "cuGraphKernelNodeGetParams(trigger)")
        func = _node_function(p, "trigger")
        (raw_name,) = _ok(cu.cuFuncGetName(func), "cuFuncGetName(trigger)")
        out[raw_name.decode(errors="replace")] = func
    del trigger
    if times is not None:
        times["eager"] = times.get("eager", 0.0) + t1 - t0
        times["capture"] = times.get("capture", 0.0) + t2 - t1
        times["walk"] = times.get("walk", 0.0) + time.perf_counter() - t2
    return out


def harvest_for(
    archive: Archive, runner: Any, layers: int | None, times: dict[str, float] | None = None
) -> tuple[dict[str, int], list[int]]:
    """The archive's library kernels by name in this process, and the buckets whose steps were triggered:
    one trigger over the fewest buckets whose graphs name them all (graph_archive.trigger_buckets); a
    bucket still missing a name gets its own trigger, then one over the whole model. GraphRestoreError
    names what is still missing."""
    names = {g.bucket: g.table.library_names() for g in archive.graphs}
    first = trigger_buckets(names)
    found = harvest_library_functions(runner, first, layers, times) if first else {}
    triggered = list(first)
    for bucket in sorted(names):
        missing = names[bucket] - found.keys()
        if not missing:
            continue
        triggered.append(bucket)
        found.update(harvest_library_functions(runner, [bucket], layers, times))
        missing -= found.keys()
        if missing and layers is not None:
            found.update(harvest_library_functions(runner, [bucket], None, times))  # the whole model
            missing -= found.keys()
        if missing:
            raise GraphRestoreError(
                f"bucket {bucket}: kernels not found in this process: {sorted(missing)[:6]} "
                f"(found {len(found)} names)"
            )
    return found, triggered


# ------------------------------------------------------------------------------------------ rebuild


def _set_func_attrs(func: int, attrs: Mapping[str, int], what: str) -> None:
    cu = _cu()
    for name, value in attrs.items():
        attr = getattr(cu.CUfunction_attribute, name, None)
        if attr is None:
            continue
        err, cur = cu.cuFuncGetAttribute(attr, func)
        if err == cu.CUresult.CUDA_SUCCESS and int(cur) == int(value):
            continue
        _ok(cu.cuFuncSetAttribute(func, attr, int(value)), f"cuFuncSetAttribute({what}, {name}={value})")


def load_modules(archive: Archive) -> dict[str, int]:
    """module id -> CUfunction for every archived image (cuModuleLoadData + cuModuleGetFunction)."""
    cu = _cu()
    out = {}
    for mid, m in archive.modules.items():
        (mod,) = _ok(cu.cuModuleLoadData(m.image), f"cuModuleLoadData({mid}, {len(m.image)} bytes)")
        (func,) = _ok(cu.cuModuleGetFunction(mod, m.name.encode()), f"cuModuleGetFunction({m.name})")
        _set_func_attrs(int(func), m.func_attrs, m.name)
        out[mid] = int(func)
    return out


class RestoredGraph:
    """An instantiated rebuilt graph; `replay()` launches it on torch's current stream (as CUDAGraph)."""

    def __init__(self, graph: Any, exec_: Any, bucket: int) -> None:
        self.graph, self.exec, self.bucket = graph, exec_, bucket

    def replay(self) -> None:
        cu = _cu()
        stream = torch.cuda.current_stream().cuda_stream
        _ok(cu.cuGraphLaunch(self.exec, stream), f"cuGraphLaunch(bucket {self.bucket})")

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            cu = _cu()
            cu.cuGraphExecDestroy(self.exec)
            cu.cuGraphDestroy(self.graph)


@dataclass
class RestoreReport:
    """Seconds per stage and what was done (printed by the probe, logged by a worker)."""

    stages: dict[str, float] = field(default_factory=dict)
    detail: dict[str, float] = field(default_factory=dict)  # sub-stage seconds (harvest eager/capture/walk)
    nodes: int = 0
    modules: int = 0
    library_functions: int = 0
    triggers: list[int] = field(default_factory=list)
    selfcheck: dict[int, bool] = field(default_factory=dict)
    selfcheck_mode: str = "all"
    warnings: list[str] = field(default_factory=list)

    @property
    def total_s(self) -> float:
        return sum(self.stages.values())


@contextlib.contextmanager
def _stage(report: RestoreReport, name: str) -> Iterator[None]:
    """Times a stage (adding up when a stage is entered more than once, as rebuild/instantiate per bucket)."""
    t0 = time.perf_counter()
    try:
        yield
    except (ArchiveError, GraphRestoreError):
        raise
    except Exception as exc:
        raise GraphRestoreError(f"restore stage {name!r}: {type(exc).__name__}: {exc}") from exc
    finally:
        report.stages[name] = report.stages.get(name, 0.0) + time.perf_counter() - t0


def restore_graphs(
    archive: Archive,
    runner: Any,
    arena: Arena,
    key: Mapping[str, Any],
    state_top: int,
    state_log: Sequence[tuple[int, int]],
    selfcheck: str | bool = "all",
    trigger_layers: int | None = 1,
    selfcheck_fatal: bool = True,
    instantiate_threads: int = 1,
) -> RestoreReport:
    """Rebuild the archive's graphs into `runner` (a DecodeGraphRunner over the state built in the arena,
    not captured): after this, `runner.run(...)` replays restored graphs. Raises ArchiveError (key or
    layout differ: nothing was changed) or GraphRestoreError naming the stage and node. `selfcheck`:
    "all" buckets (True), "cover" (every function replayed once), "one" (the smallest) or "none" (False)
    are replayed on padding inputs and must give the capturing process's digest; `selfcheck_fatal` False
    keeps graphs that fail it (a probe that goes on to compare them), with a warning.

    Per bucket (ascending) the graph is built (C), instantiated, and either its self-check replay is
    enqueued or it is uploaded: the GPU replays one bucket's check while the CPU builds the next; the
    digests are read back once at the end (the `selfcheck` stage is that wait). `instantiate_threads` > 1:
    all graphs built first, then instantiated by that many threads at once (the C call lets go of the
    GIL; whether the driver instantiates in parallel is what the probe measures)."""
    report = RestoreReport()
    cu = _cu()
    with _stage(report, "check"):
        check_key(archive.key, key)
        check_layout(archive.layout, state_top, state_log)
        if [g.bucket for g in archive.graphs] != list(runner.buckets):
            raise ArchiveError(
                f"buckets: {[g.bucket for g in archive.graphs]} archived, {list(runner.buckets)} here"
            )
        functions_of = {g.bucket: {(k, i) for k, i, _n in g.table.funcs} for g in archive.graphs}
        checked = set(selfcheck_buckets(selfcheck, runner.buckets, functions_of))
        report.selfcheck_mode = (
            "all" if selfcheck is True else "none" if selfcheck is False else str(selfcheck)
        )
        builder = GraphBuilder.load(arena.cache_dir)  # compiled by the capturing process (same cache dir)
    with _stage(report, "reserve"):
        arena.reserve_until(int(archive.layout["high_water"]))
    with _stage(report, "modules"):
        functions: dict[tuple[str, str], int] = {("module", m): f for m, f in load_modules(archive).items()}
        report.modules = len(archive.modules)
    with _stage(report, "harvest"):
        times: dict[str, float] = {}
        found, report.triggers = harvest_for(archive, runner, trigger_layers, times)
        report.detail.update({f"harvest_{k}": v for k, v in times.items()})
        for name in archive.library_names():
            func = found[name]
            _set_func_attrs(func, archive.lib_func_attrs.get(name, {}), name)
            functions[("name", name)] = func
        report.library_functions = len(archive.library_names())
    with _stage(report, "outputs"):
        outputs = {
            g.bucket: tensor_at(
                arena,
                g.output.ptr,
                g.output.shape,
                g.output.stride,
                getattr(torch, g.output.dtype),
                arena.device,
            )
            for g in archive.graphs
        }
        runner.outputs = outputs
        runner.graphs = {}
        stream = torch.cuda.current_stream().cuda_stream
    (ctx,) = _ok(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
    ordered = sorted(archive.graphs, key=lambda r: r.bucket)
    built: dict[int, int] = {}
    execs: dict[int, int] = {}

    def build(g: GraphRecord) -> None:
        refs = [functions.get((kind, ident)) for kind, ident, _name in g.table.funcs]
        lacking = [g.table.funcs[i][2] for i, f in enumerate(refs) if f is None]
        if lacking:
            raise GraphRestoreError(f"bucket {g.bucket}: no function for {lacking[:4]}")
        try:
            handle, refused, first = builder.build(g.table, [int(f) for f in refs if f is not None])
        except GraphBuildError as exc:
            raise GraphRestoreError(f"bucket {g.bucket}: {exc}") from exc
        if refused:  # reported, not fatal: the comparisons and the self-check show what it changes
            report.warnings.append(f"bucket {g.bucket}: {refused} launch attributes not set ({first})")
        built[g.bucket] = handle
        report.nodes += len(g.table)

    def instantiate(bucket: int) -> int:
        try:
            return builder.instantiate(int(ctx), built[bucket])
        except GraphBuildError as exc:
            raise GraphRestoreError(f"bucket {bucket}: {exc}") from exc

    pending: list[tuple[int, torch.Tensor]] = []

    def ready(g: GraphRecord) -> None:
        """Registered in the runner; its self-check replay enqueued, or (not checked) uploaded."""
        restored = RestoredGraph(cu.CUgraph(built[g.bucket]), cu.CUgraphExec(execs[g.bucket]), g.bucket)
        runner.graphs[g.bucket] = restored
        if g.bucket in checked and g.selfcheck is not None:
            pending.append((g.bucket, selfcheck_launch(runner, g.bucket, restored.replay)))
        else:  # a first replay would upload it; a checked graph's check replay does
            _ok(cu.cuGraphUpload(restored.exec, stream), f"cuGraphUpload(bucket {g.bucket})")

    # the check replays see the pattern the capturing process checked with (lora_pattern)
    with lora_pattern(getattr(runner.model, "lora", None)):
        if instantiate_threads > 1:  # every graph built, then instantiated at once by a pool
            with _stage(report, "rebuild"):
                for g in ordered:
                    build(g)
            with _stage(report, "instantiate"):
                buckets = [g.bucket for g in ordered]
                with ThreadPoolExecutor(min(instantiate_threads, len(buckets))) as pool:
                    execs.update(zip(buckets, pool.map(instantiate, buckets), strict=True))
                for g in ordered:
                    ready(g)
        else:  # per bucket: the GPU runs one bucket's check while the CPU builds the next
            for g in ordered:
                with _stage(report, "rebuild"):
                    build(g)
                with _stage(report, "instantiate"):
                    execs[g.bucket] = instantiate(g.bucket)
                    ready(g)
        with _stage(report, "selfcheck" if pending else "sync"):
            digests = selfcheck_collect([d for _, d in pending])
            torch.cuda.synchronize()
    want = {g.bucket: g.selfcheck for g in archive.graphs}
    report.selfcheck = {b: got == want[b] for (b, _), got in zip(pending, digests, strict=True)}
    bad = [b for b, ok in report.selfcheck.items() if not ok]
    if bad and not selfcheck_fatal:
        report.warnings.append(f"self-check failed for buckets {bad} (kept: selfcheck_fatal=False)")
    elif bad:
        runner.graphs, runner.outputs = {}, {}
        raise GraphRestoreError(
            f"self-check: buckets {bad} replayed to other outputs than in the capturing process "
            "(same weights and adapter shape assumed); the restored graphs were dropped"
        )
    return report


def restore_archived(
    path: Path,
    runner: Any,
    arena: Arena,
    key: Mapping[str, Any],
    state_top: int,
    state_log: Sequence[tuple[int, int]],
    **options: Any,
) -> tuple[RestoreReport | None, str]:
    """`restore_graphs` from the archive file at `path`: (its report, "") or, when the archive is refused
    (unreadable, key, layout, checksum, self-check), (None, why): logged as a warning, `runner` left with no
    graph, so that the caller captures. `options` go to `restore_graphs`."""
    from lorafn.runtime.graph_archive import read_archive

    try:
        return restore_graphs(read_archive(path), runner, arena, key, state_top, state_log, **options), ""
    except (ArchiveError, GraphRestoreError) as exc:
        log.warning("decode graphs: archive %s not used (%s); capturing", path, exc)
        runner.graphs, runner.outputs = {}, {}
        return None, str(exc)


def restore_or_capture(
    state: DecodeState,
    arena: Arena,
    archive_path: str | Path,
    *,
    write: bool = True,
    trigger_layers: int | None = 1,
    selfcheck: str | bool = "all",
    instantiate_threads: int = 1,
) -> tuple[str, float, RestoreReport | None]:
    """The decode graphs of `state.runner`: restored from `archive_path` when it is there, matches and
    passes the self-check; else captured (logged as a warning naming why) and, with `write`, archived
    there for the next process. Returns ("restored" | "captured", seconds, the restore report or None).
    A restore that failed after it reserved the arena's range leaves that range reserved: the capture
    goes above it."""
    from lorafn.runtime.graph_archive import write_archive

    t0 = time.perf_counter()
    path = Path(archive_path)
    key = state_key(state, arena)
    runner = state.runner
    if path.exists():
        report, _why = restore_archived(
            path,
            runner,
            arena,
            key,
            state.state_top,
            state.state_log,
            selfcheck=selfcheck,
            trigger_layers=trigger_layers,
            instantiate_threads=instantiate_threads,
        )
        if report is not None:
            return "restored", time.perf_counter() - t0, report
    runner.capture(pool=arena.graph_pool.id, warmup_pool=arena.scratch_pool, keep_graph=write)
    if write:
        write_archive(path, archive_graphs(runner, arena, key, state.state_top, state.state_log))
    return "captured", time.perf_counter() - t0, None
