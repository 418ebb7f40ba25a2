"""The model runner: all GPU work of one worker (nano-vllm's split), one `execute` per engine step.

It owns the model (backbone views from a `WeightSource` + the private unmerged LoRA), the paged KV cache
(its size: given, from a byte budget, or profiled once and saved, see kv_cache.py) and the decode CUDA
graphs; `execute(plan)` turns one `SchedulerOutput` into one forward and returns the logits of the
chunks that sample. The `Engine` keeps the request table, the step loop, the scheduler, sampling and
detokenization, and never touches a tensor of the model.

Batch layout: single-token chunks first (paged decode attention: the scheduler's decodes, plus any
other one-token chunk, e.g. a one-token prompt), then multi-token chunks (SDPA over cached prefix +
chunk). A step of the scheduler's decodes only (`SchedulerOutput.num_decodes` == every chunk) replays
the CUDA graph of its batch bucket instead, on CUDA; a step of one prompt's first chunk alone replays a
prefill graph of its token bucket when `EngineConfig.prefill_graph_tokens` asks for them (captured with the
decode graphs, or in idle time by a lazy worker; never on a request's path).

What the graphs capture depends on the model, the adapter's shape, the buckets and
`max_blocks_per_seq`, so an adapter bound later means new LoRA weights in `self.lora`/`self.model.lora`
and one more `capture_graphs()`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lorafn.runtime.block_manager import blocks_for_tokens, slot_mapping
from lorafn.runtime.config import EngineConfig, ModelConfig
from lorafn.runtime.cuda_graphs import (
    DecodeGraphRunner,
    Fill,
    PrefillGraphRunner,
    bucket_for,
    graph_buckets,
    prefill_buckets,
)
from lorafn.runtime.kv_cache import (
    KVCache,
    block_bytes,
    blocks_for_budget,
    cpu_default_blocks,
    kv_init_key,
    load_kv_init,
    save_kv_init,
)
from lorafn.runtime.local_weights import SafetensorsWeightSource
from lorafn.runtime.lora import (
    LoRAWeights,
    clear_lora_slot,
    copy_lora,
    copy_lora_slot,
    fits_shape,
    load_lora,
    zero_lora,
)
from lorafn.runtime.models.llama import ForwardBatch, LlamaModel, PrefillSpan
from lorafn.runtime.outputs import ParkRefused
from lorafn.runtime.scheduler import ScheduledChunk, SchedulerOutput

if TYPE_CHECKING:
    from lorafn.runtime.graph_cache import ArchivedGraphs

log = logging.getLogger(__name__)

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class PendingTokens:
    """Tokens a step still queued on the device sampled, not read back yet (the engine's overlapped
    steps): a later step's input at such a position reads its token from ``tokens`` on the device.
    ``tokens`` [S] int64; ``where``: seq_id -> (position in the sequence, row of ``tokens``). The host's
    copy of such a position holds a placeholder until the engine reads the step back."""

    tokens: torch.Tensor
    where: dict[str, tuple[int, int]]


def pending_rows(
    chunks: list[ScheduledChunk], where: dict[str, tuple[int, int]]
) -> tuple[list[int], list[int]]:
    """(input rows, rows of the pending tokens) for the positions of ``chunks`` (in the step's input
    order, one row per token) whose token is pending; the rows of one input are the chunks' tokens one
    after another."""
    rows: list[int] = []
    sources: list[int] = []
    offset = 0
    for c in chunks:
        entry = where.get(c.seq_id)
        if entry is not None and c.start <= entry[0] < c.end:
            rows.append(offset + entry[0] - c.start)
            sources.append(entry[1])
        offset += c.num_tokens
    return rows, sources


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _TORCH_DTYPES[dtype]


def set_cuda_stack_limit(device: torch.device, num_bytes: int) -> None:
    """Lower the per-thread stack the CUDA context reserves local memory for (the driver default, 1 KiB
    x 2048 threads x every SM, is ~270 MiB on an H100; docs/benchmarks.md "Per-worker memory"). A kernel
    that needs more grows it at launch. Through libcuda directly: no cuda-python needed."""
    import ctypes

    torch.zeros(1, device=device)  # the context exists and is current
    libcuda = ctypes.CDLL("libcuda.so.1")
    cu_limit_stack_size = 0
    err = libcuda.cuCtxSetLimit(ctypes.c_int(cu_limit_stack_size), ctypes.c_size_t(int(num_bytes)))
    if err != 0:
        raise RuntimeError(f"cuda_stack_bytes: cuCtxSetLimit({num_bytes}) failed with CUDA error {err}")
    log.info("CUDA stack limit set to %d bytes per thread", num_bytes)


class _StageClock:
    """Seconds between laps into ``out`` (the device synchronized first: CUDA work is asynchronous)."""

    def __init__(self, out: dict[str, float], device: torch.device) -> None:
        import time

        self.out, self.device, self.now = out, device, time.perf_counter
        self.t = self.now()

    def lap(self, stage: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t = self.now()
        self.out[stage] = t - self.t
        self.t = t


class ModelRunner:
    """The model, its KV cache and its decode graphs on one device; `execute` runs one step's forward."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
    ) -> None:
        self.config, self.model_config = config, model_config
        self.device, self.dtype, self.max_model_len = device, dtype, max_model_len
        # seconds per start-up stage, in order (a fresh worker's start, bench/coldstart.py, issue 11)
        self.startup_s: dict[str, float] = {}
        clock = _StageClock(self.startup_s, device)
        if device.type == "cuda" and config.cuda_stack_bytes is not None:
            set_cuda_stack_limit(device, config.cuda_stack_bytes)
        elif device.type == "cuda":
            torch.zeros(1, device=device)
        clock.lap("context")
        if device.type == "cuda" and not config.cudnn_attention:
            # process-wide (one engine per worker process): SDPA then picks flash or memory-efficient
            # attention, which need no per-shape plan (see EngineConfig.cudnn_attention)
            torch.backends.cuda.enable_cudnn_sdp(False)
        self.weight_source = config.weight_source or SafetensorsWeightSource(Path(config.model))
        # graph archives (graph_cache.py): the decode state below is built in the arena's state pool
        self.archives: ArchivedGraphs | None = None
        if device.type == "cuda" and config.use_cuda_graphs and config.graph_archives:
            from lorafn.runtime.graph_cache import ArchivedGraphs

            archive_dir = Path(config.graph_archive_dir or config.resolved_cache_dir)
            self.archives = ArchivedGraphs(device, config.resolved_cache_dir, archive_dir)
        in_state: Callable[[], AbstractContextManager[object]] = (
            self.archives.state if self.archives is not None else contextlib.nullcontext
        )
        try:
            # A standby holds zeroed buffers of its prepared shape (graphs are captured over them; a bind
            # copies the adapter in); a bound worker its adapter; a base-model engine none.
            self.lora: LoRAWeights | None = None
            if config.adapter_slots > 1 or config.adapters:
                self.lora = self._slot_buffers()
            elif config.adapter:
                loaded = load_lora(config.adapter, model_config, device, dtype)
                if self.archives is None:
                    self.lora = loaded
                else:  # buffers of its shape in the state, as a standby's (the same layout), then the values
                    with in_state():
                        self.lora = zero_lora(loaded.shape_key, model_config, device, dtype)
                    copy_lora(self.lora, loaded)
                    del loaded
            elif config.lora_shape:
                with in_state():
                    self.lora = zero_lora(config.lora_shape, model_config, device, dtype)
            one_slot = self.num_adapter_slots == 1
            self.prepared = config.adapter is None and config.lora_shape is not None and one_slot
            clock.lap("adapter")
            use_triton = device.type == "cuda" and _triton_available()
            with in_state():
                self.model = LlamaModel(
                    model_config,
                    self.weight_source,
                    device,
                    dtype,
                    self.lora,
                    # a prefill graph's padding rows run at positions up to its bucket, past the
                    # longest sequence maybe: their RoPE rows must exist (their outputs are never read)
                    max_position=max(max_model_len, *config.prefill_graph_tokens, 0),
                    use_triton_attention=use_triton,
                    fused_decode=use_triton and config.fused_decode,
                    lora_expand=config.lora_expand,
                    skinny_gemm_rows=config.skinny_gemm_rows,
                    decode_attention=config.decode_attention,
                    expand_in_gemm=config.expand_in_gemm,
                    gemm_prologue_rows=config.gemm_prologue_rows,
                    lora_shrink=config.lora_shrink,
                    rope_in_attention=config.rope_in_attention,
                )
            clock.lap("backbone")  # the weight views (the shared backbone mapped, or loaded)
            self.kv_blocks_from = ""  # how the KV cache size was decided (see _num_kv_blocks)
            self.num_blocks = self._num_kv_blocks()
            with in_state():
                self.kv_cache = KVCache(model_config, self.num_blocks, config.block_size, device, dtype)
            self.graphs: DecodeGraphRunner | None = None
            self.prefill_graphs: PrefillGraphRunner | None = None
            if self.archives is not None:
                self._archived_state(use_triton)
        except BaseException:
            if self.archives is not None:  # gc back on (the state build turned it off), nothing archived
                self.archives.abandon("the decode state was not built")
            raise
        clock.lap("kv_cache")
        self.graph_capture_s = 0.0
        self.max_blocks_per_seq = 0
        # parking (park/unpark): what the last park released, and whether unparking re-creates graphs
        self.parked_kv_bytes = self.parked_release_bytes = 0
        self.park_s = self.unpark_s = self.resize_s = 0.0
        self._graphs_on_unpark = False

    def _slot_buffers(self) -> LoRAWeights:
        """Adapter slots (EngineConfig.adapter_slots): buffers of `lora_shape` (else the first adapter's
        shape) for every slot, `adapters` copied into slots 0, 1, ... (each refused with the slot named when
        it does not fit the shape)."""
        cfg, mc = self.config, self.model_config
        loaded = [load_lora(a, mc, self.device, self.dtype) for a in cfg.adapters]
        shape = cfg.lora_shape or loaded[0].shape_key
        buffers = zero_lora(shape, mc, self.device, self.dtype, num_slots=cfg.adapter_slots)
        for slot, adapter in enumerate(loaded):
            if not fits_shape(adapter, buffers):
                raise ValueError(
                    f"adapters[{slot}]: {cfg.adapters[slot]}: shape {adapter.shape_key!r} does not fit the "
                    f"slots' {shape!r} (every adapter of a slot engine needs its projections, ranks at most)"
                )
            copy_lora_slot(buffers, adapter, slot)
        return buffers

    def load_adapter(self, slot: int, adapter_dir: str | Path | None) -> str:
        """Put an adapter into slot `slot` in place (None: empty it, zeros); graphs unchanged. The engine
        checks that no running request uses the slot."""
        lora = self.lora
        if lora is None or lora.num_slots == 1:
            raise ValueError("load_adapter: this engine has no adapter slots (EngineConfig.adapter_slots)")
        if adapter_dir is None:
            clear_lora_slot(lora, slot)
            return f"slot {slot} emptied"
        loaded = load_lora(adapter_dir, self.model_config, self.device, self.dtype)
        copy_lora_slot(lora, loaded, slot)
        return f"{loaded.shape_key} into slot {slot} of {lora.num_slots}"

    @property
    def num_adapter_slots(self) -> int:
        return self.lora.num_slots if self.lora is not None else 1

    def _buckets(self) -> list[int]:
        # No batch is larger than the KV cache has blocks (one per sequence at least): a small budget
        # captures few buckets, and their graph pool (activations) stays small.
        cfg = self.config
        return graph_buckets(cfg.cuda_graph_batch_sizes, min(cfg.max_num_seqs, self.num_blocks))

    def _archived_state(self, use_triton: bool) -> None:
        """The last part of the decode state (the graphs' static inputs) in the arena, then its key."""
        from lorafn.runtime.graph_restore import current_key

        assert self.archives is not None
        cfg = self.config
        # what the engine passes to capture_graphs: the scheduler caps the longest sequence to the cache
        longest = min(self.max_model_len, self.num_blocks * cfg.block_size)
        max_blocks = blocks_for_tokens(longest, cfg.block_size)
        with self.archives.state():
            self.graphs = DecodeGraphRunner(self.model, self.kv_cache, self._buckets(), max_blocks)
        manifest = getattr(self.weight_source, "manifest", None)
        weights_in = f"W@0x{int(manifest['w_addr']):x}" if manifest and "w_addr" in manifest else "arena"
        self.archives.state_built(
            current_key(
                model_dir=cfg.model,
                dtype=self.dtype,
                adapter_shape=self.lora.shape_key if self.lora is not None else None,
                fused_decode=use_triton and cfg.fused_decode,
                lora_expand=cfg.lora_expand,
                skinny_gemm_rows=cfg.skinny_gemm_rows,
                decode_attention=cfg.decode_attention,
                expand_in_gemm=cfg.expand_in_gemm,
                gemm_prologue_rows=cfg.gemm_prologue_rows,
                lora_shrink=cfg.lora_shrink,
                rope_in_attention=cfg.rope_in_attention,
                buckets=self.graphs.buckets,
                max_blocks_per_seq=max_blocks,
                block_size=cfg.block_size,
                num_kv_blocks=self.num_blocks,
                arena=self.archives.arena,
                weights_in=weights_in,
            )
        )

    def capture_graphs(self, max_blocks_per_seq: int) -> None:
        """Capture the decode CUDA graphs (CUDA and `use_cuda_graphs` only; else nothing to do).

        Called once the scheduler has fixed the longest sequence (`max_blocks_per_seq` block-table
        entries); calling it again re-captures, e.g. after the LoRA weights changed."""
        cfg = self.config
        self.max_blocks_per_seq = max_blocks_per_seq
        if self.device.type != "cuda" or not cfg.use_cuda_graphs:
            return
        archives = self.archives
        if archives is not None and archives.usable and self.graphs is not None:
            if self.graphs.max_blocks == max_blocks_per_seq and not self.graphs.graphs:
                if not cfg.lazy_graphs:  # a standby: restored when an archive of its key exists
                    import time

                    t0 = time.perf_counter()
                    if not archives.restore(self.graphs):
                        archives.capture(self.graphs)
                    self.graph_capture_s = time.perf_counter() - t0
                else:
                    archives.outcome = "lazy"
                self.startup_s.setdefault("graphs", self.graph_capture_s)
                self._new_prefill_graphs()
                return
            archives.abandon(
                f"decode graphs recaptured outside the arena (max_blocks_per_seq {max_blocks_per_seq}, "
                f"the state's {self.graphs.max_blocks}; or graphs captured already)"
            )
        self.graphs = DecodeGraphRunner(self.model, self.kv_cache, self._buckets(), max_blocks_per_seq)
        self.graph_capture_s = 0.0 if cfg.lazy_graphs else self.graphs.capture()
        self.startup_s.setdefault("graphs", self.graph_capture_s)  # the first capture (a start's)
        self._new_prefill_graphs()

    def _new_prefill_graphs(self, capture: bool | None = None) -> None:
        """Prefill graphs over the current model, adapter buffers and KV cache (the old ones released):
        captured now (`capture`, default: unless `lazy_graphs`) or left pending for idle time."""
        self._drop_prefill_graphs()
        cfg = self.config
        buckets = prefill_buckets(
            cfg.prefill_graph_tokens, min(cfg.max_num_batched_tokens, self.max_model_len)
        )
        if self.device.type != "cuda" or not self.config.use_cuda_graphs or not buckets:
            return
        self.prefill_graphs = PrefillGraphRunner(self.model, self.kv_cache, buckets)
        if capture if capture is not None else not self.config.lazy_graphs:
            seconds = self.prefill_graphs.capture()
            self.startup_s.setdefault("prefill_graphs", seconds)

    def _drop_prefill_graphs(self) -> None:
        if self.prefill_graphs is not None:
            self.prefill_graphs.release()
            self.prefill_graphs = None

    def _capture_bucket(self, bucket: int) -> tuple[float, str]:
        """One pending bucket's graph (a lazy worker's), or every bucket from the archive when one of this
        state's key exists and nothing is captured yet; (seconds, what was done) for the log."""
        import time

        g, archives = self.graphs, self.archives
        assert g is not None
        if archives is None or not archives.usable:
            return g.capture(buckets=[bucket]), "captured"
        t0 = time.perf_counter()
        if not g.graphs and archives.available and archives.restore(g):
            return time.perf_counter() - t0, f"restored with {len(g.graphs) - 1} more"
        return archives.capture(g, [bucket]), "captured"

    def ensure_graph(self, num_decodes: int) -> None:
        """Before a decode step of ``num_decodes`` rows: capture its bucket's graph if it is still pending
        (`EngineConfig.lazy_graphs`; nothing when it is captured or the batch is larger than every bucket)."""
        g = self.graphs
        if g is None or not g.pending:
            return
        bucket = bucket_for(num_decodes, g.buckets)
        if bucket is not None and bucket not in g.graphs:
            seconds, how = self._capture_bucket(bucket)
            self.graph_capture_s += seconds
            log.info("decode graph for batch %d %s on first need in %.0f ms", bucket, how, seconds * 1000)

    def capture_pending_graph(self) -> bool:
        """Capture one pending decode graph, the largest (a lazily started worker's idle time); False when
        none is left."""
        g = self.graphs
        if g is None or not g.pending:
            return self._capture_pending_prefill_graph()
        bucket = g.pending[-1]
        seconds, how = self._capture_bucket(bucket)
        self.graph_capture_s += seconds
        log.info(
            "decode graph for batch %d %s while idle in %.0f ms (%d left)",
            bucket, how, seconds * 1000, len(g.pending),
        )  # fmt: skip
        return True

    def _capture_pending_prefill_graph(self) -> bool:
        """One pending prefill graph, the largest (after every decode graph); False when none is left."""
        pg = self.prefill_graphs
        if pg is None or not pg.pending:
            return False
        bucket = pg.pending[-1]
        seconds = pg.capture([bucket])
        log.info(
            "prefill graph for %d tokens captured while idle in %.0f ms (%d left)",
            bucket, seconds * 1000, len(pg.pending),
        )  # fmt: skip
        return True

    @property
    def graphs_pending(self) -> bool:
        pending = self.graphs is not None and bool(self.graphs.pending)
        return pending or (self.prefill_graphs is not None and bool(self.prefill_graphs.pending))

    def bind_adapter(self, adapter_dir: str | Path) -> str:
        """Load an adapter into a standby's runner; how it went, for the log.

        Into the prepared buffers when it fits their shape (a copy: tensors and captured graphs stay);
        otherwise as new LoRA weights, and the decode graphs are captured again over them."""
        if self.num_adapter_slots > 1:
            raise ValueError("bind_adapter: an engine with adapter slots takes load_adapter(slot, dir)")
        loaded = load_lora(adapter_dir, self.model_config, self.device, self.dtype)
        if self.prepared and self.lora is not None and fits_shape(loaded, self.lora):
            copy_lora(self.lora, loaded)
            self.prepared = False
            return f"copied into the prepared {self.lora.shape_key} buffers"
        self.lora = self.model.lora = loaded
        self.prepared = False
        if self.archives is not None:  # the new buffers are outside the arena: graphs as without archives
            self.archives.abandon(f"bound to {loaded.shape_key}, not the state's shape")
        if self.graphs is not None:
            self.capture_graphs(self.max_blocks_per_seq)
        return f"loaded {loaded.shape_key}" + (
            f"; graphs captured in {self.graph_capture_s:.2f} s" if self.graphs else ""
        )

    def memory_parts(self) -> tuple[int, int]:
        """(KV cache bytes, LoRA tensor bytes): the parts of this worker that its function's spec sizes
        (KV 0 while parked)."""
        tensors = self.lora.tensors() if self.lora is not None else []
        cache = self.kv_cache  # once: the heartbeat thread reads this while the loop may park
        return (cache.nbytes if cache is not None else 0), sum(t.numel() * t.element_size() for t in tensors)

    def reserved_bytes(self) -> int:
        """What this runner holds on its device besides the shared backbone: KV cache + LoRA tensors
        (+ on CUDA, everything torch's allocator reserved: activations and graph pools too)."""
        kv, lora = self.memory_parts()
        if self.device.type == "cuda":
            return max(kv + lora, int(torch.cuda.memory_reserved(self.device)))
        return kv + lora

    # ------------------------------------------------------------------ parking (docs/runtime.md#parking)
    # A parked runner holds no KV cache and no decode graphs (nor their pool and static inputs): on CUDA
    # that memory goes back to the driver, while the process, its context, the backbone mapping and the
    # adapter stay. Unparking allocates a cache of the same number of blocks; the graphs come back lazily
    # (`ensure_graph` on need, `capture_pending_graph` in idle time), as in a `lazy_graphs` start.

    @property
    def parked(self) -> bool:
        return self.kv_cache is None

    def park(self) -> int:
        """Release the KV cache and the decode graphs; the bytes released (on CUDA what torch's allocator
        gave back to the driver, `memory_reserved` before - after; on CPU the KV bytes). Parking a parked
        runner releases nothing more and answers the first park's bytes. The caller makes sure that no
        sequence holds blocks (`Engine.park`). Raises ParkRefused with graph archives (the decode state
        lives in the arena, which this does not remap yet)."""
        import time

        if self.archives is not None:
            raise ParkRefused("graph archives")
        if self.kv_cache is None:
            return self.parked_release_bytes
        t0 = time.perf_counter()
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)  # nothing in flight reads what goes
            before = int(torch.cuda.memory_reserved(self.device))
        kv_bytes = self.kv_cache.nbytes
        self._graphs_on_unpark = self.graphs is not None
        if self.graphs is not None:
            self.graphs.release()  # graphs reset, outputs (in the pool) and static inputs dropped
            self.graphs = None
        self._drop_prefill_graphs()  # they name the cache too; back pending on unpark
        self.kv_cache = None
        if cuda:
            # cuBLAS workspaces (one per stream that ran a GEMM: each lazy capture's side stream made one)
            # are allocator blocks held outside the cache; no graph that names them is left, and the next
            # GEMM makes a new one. Then the pool's and the cache's segments go back to the driver
            clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear_workspaces is not None:
                clear_workspaces()
            torch.cuda.empty_cache()
            released = max(0, before - int(torch.cuda.memory_reserved(self.device)))
        else:
            released = kv_bytes
        self.parked_kv_bytes, self.parked_release_bytes = kv_bytes, released
        self.park_s = time.perf_counter() - t0
        return released

    def unpark(self) -> int:
        """A new KV cache of the same number of blocks (zeros, as at start); decode graphs pending, captured
        lazily. Returns the KV bytes; unparking an unparked runner does nothing (the same answer)."""
        import time

        if self.kv_cache is not None:
            return self.kv_cache.nbytes
        t0 = time.perf_counter()
        cfg = self.config
        self.kv_cache = KVCache(self.model_config, self.num_blocks, cfg.block_size, self.device, self.dtype)
        if self._graphs_on_unpark:
            self.graphs = self._pending_graphs()
            self._new_prefill_graphs(capture=False)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.unpark_s = time.perf_counter() - t0
        return self.kv_cache.nbytes

    def _pending_graphs(self) -> DecodeGraphRunner:
        """Decode graphs over the current KV cache, none captured yet (captured on need and in idle time, as
        after a `lazy_graphs` start): the buckets a cache of this size allows, the same block-table width."""
        return DecodeGraphRunner(self.model, self.kv_cache, self._buckets(), self.max_blocks_per_seq)

    def park_release_bytes(self) -> int:
        """What parking frees now, or (parked) what unparking takes back: the bytes the last park released
        (the KV cache at once, graph pools and cached activations as the worker captures and serves again).
        Unparked on CUDA: the KV cache, the graphs' tensors and everything the allocator holds unused (the
        graph pool, cached activations), which `empty_cache` returns; on CPU the KV bytes."""
        # each attribute read once: the heartbeat thread asks while the serving loop may be parking
        cache, g, pg = self.kv_cache, self.graphs, self.prefill_graphs
        if cache is None:
            return self.parked_release_bytes
        kv = cache.nbytes
        if self.device.type != "cuda":
            return kv
        held = [t for runner in (g, pg) if runner is not None for t in runner.held_tensors()]
        graph_tensors = sum(t.numel() * t.element_size() for t in held)
        unused = int(torch.cuda.memory_reserved(self.device)) - int(torch.cuda.memory_allocated(self.device))
        return max(kv, kv + graph_tensors + unused)

    # ------------------------------------------------------------------ resizing the KV cache
    # (docs/runtime.md#resizing-the-kv-cache): a grant of more KV for an offline batch, and its return.

    def resize_kv(self, num_blocks: int) -> int:
        """A KV cache of ``num_blocks`` blocks holding the current one's first blocks (the engine checks that
        no block in use is dropped); the decode graphs (they name the old cache) are dropped and captured
        again on need, as after an unpark. Returns the new KV bytes. Refused (ParkRefused) while parked and
        with graph archives (the decode state lives in the arena at fixed addresses)."""
        import time

        if self.archives is not None:
            raise ParkRefused("graph archives")
        if self.kv_cache is None:
            raise ParkRefused("parked")
        if num_blocks == self.num_blocks:
            return self.kv_cache.nbytes
        t0 = time.perf_counter()
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)  # nothing in flight reads the old cache
        had_graphs = self.graphs is not None
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
        self._drop_prefill_graphs()
        self.kv_cache = self.kv_cache.resized(num_blocks)
        self.num_blocks = num_blocks
        if had_graphs:
            self.graphs = self._pending_graphs()
            self._new_prefill_graphs(capture=False)
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # the old cache and the graphs' pool go back to the driver
        self.resize_s = time.perf_counter() - t0
        return self.kv_cache.nbytes

    # ------------------------------------------------------------------ KV-cache size

    def _num_kv_blocks(self) -> int:
        cfg, mc = self.config, self.model_config
        per_block = block_bytes(mc, cfg.block_size, self.dtype)
        useful = cfg.max_num_seqs * blocks_for_tokens(self.max_model_len, cfg.block_size)
        self.kv_blocks_from = "num_kv_blocks"
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        self.kv_blocks_from = "kv_cache_memory_bytes"
        if cfg.kv_cache_memory_bytes is not None:
            # the cache holds one scratch block beyond those handed out (kv_cache.py): it counts too
            n = blocks_for_budget(cfg.kv_cache_memory_bytes, per_block) - 1
            if n < 1:
                raise ValueError(
                    f"kv_cache_memory_bytes: {cfg.kv_cache_memory_bytes} is less than two KV blocks "
                    f"({per_block} bytes each: one usable, one scratch)"
                )
            return min(n, useful)
        self.kv_blocks_from = "cpu_default"
        if self.device.type != "cuda":
            return cpu_default_blocks(cfg.max_num_seqs, self.max_model_len, cfg.block_size, per_block)
        fields = self._kv_init_fields()
        key = kv_init_key(fields)
        n = load_kv_init(cfg.resolved_cache_dir, key)
        self.kv_blocks_from = "saved"
        if n is None:
            self.kv_blocks_from = "profiled"
            n = min(self._profile_kv_blocks(per_block), useful)
            save_kv_init(cfg.resolved_cache_dir, key, n, fields)
            log.info("KV cache: profiled %d blocks, saved under %s", n, cfg.resolved_cache_dir)
        else:
            log.info("KV cache: %d blocks from a previous start (no profiling forward)", n)
        return n

    def _kv_init_fields(self) -> dict:
        cfg = self.config
        model_dir = Path(cfg.model).resolve()
        props = torch.cuda.get_device_properties(self.device)
        weights = sorted((p.name, p.stat().st_size) for p in model_dir.glob("*.safetensors"))
        return {
            "model": str(model_dir),
            "config": (model_dir / "config.json").read_text(),
            "weights": weights,
            "dtype": str(self.dtype),
            "device": props.name,
            "total_memory": props.total_memory,
            "gpu_memory_utilization": cfg.gpu_memory_utilization,
            "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "max_num_seqs": cfg.max_num_seqs,
            "max_model_len": self.max_model_len,
            "block_size": cfg.block_size,
            "adapter_shape": self.lora.shape_key if self.lora else None,
            "torch": torch.__version__,
        }

    def _profile_kv_blocks(self, per_block: int) -> int:
        """One forward of max_num_batched_tokens prompt tokens; what is left under the budget is KV."""
        cfg = self.config
        tokens = min(cfg.max_num_batched_tokens, self.max_model_len)
        scratch = KVCache(
            self.model_config,
            blocks_for_tokens(tokens, cfg.block_size),
            cfg.block_size,
            self.device,
            self.dtype,
        )
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        batch = ForwardBatch(
            input_ids=torch.zeros(tokens, dtype=torch.int64, device=self.device),
            positions=torch.arange(tokens, device=self.device),
            slot_mapping=torch.arange(tokens, device=self.device),
            num_decodes=0,
            block_tables=None,
            context_lens=None,
            prefills=[PrefillSpan(0, tokens, 0)],
            logits_indices=torch.tensor([tokens - 1], device=self.device),
        )
        self.model.forward(batch, scratch.layers)
        torch.cuda.synchronize(self.device)
        activation_peak = torch.cuda.max_memory_allocated(self.device) - before
        del scratch, batch
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        used_elsewhere = total - free
        graph_margin = 512 << 20  # decode graphs' pool (kept also without graphs: one key for both)
        budget = int(total * cfg.gpu_memory_utilization) - used_elsewhere - activation_peak - graph_margin
        n = blocks_for_budget(budget, per_block)
        if n < 1:
            raise ValueError(
                f"gpu_memory_utilization: {cfg.gpu_memory_utilization} leaves no memory for the KV cache "
                f"(total {total}, in use {used_elsewhere}, activations {activation_peak})"
            )
        return n

    # ------------------------------------------------------------------ one step

    def execute(
        self, plan: SchedulerOutput, pending: PendingTokens | None = None
    ) -> tuple[list[ScheduledChunk], torch.Tensor]:
        """Run one step's forward; returns the chunks that sample and their logits [S, vocab] float32,
        row i for chunk i. ``pending``: tokens of a step still on the device that this step's inputs read
        (their host copies are placeholders); they are copied into the inputs on the device, before the
        forward, in stream order after the step that samples them."""
        chunks = self._ordered(plan)
        sampling = [c for c in chunks if c.samples]
        fill = self._pending_fill(chunks, pending)
        if self.graphs is not None and plan.num_decodes == len(chunks):
            self.ensure_graph(len(chunks))
        if self.graphs is not None and plan.num_decodes == len(chunks) and self.graphs.can_run(len(chunks)):
            bs = self.config.block_size
            logits = self.graphs.run(
                [c.seq.token_ids_range(c.start, c.start + 1)[0] for c in chunks],
                [c.start for c in chunks],
                [slot_mapping(c.seq.block_table, c.start, 1, bs)[0] for c in chunks],
                [c.seq.block_table for c in chunks],
                [c.seq.adapter_slot for c in chunks],
                fill=fill,
            )
            return sampling, logits  # every decode samples
        pg = self.prefill_graphs
        if pg is not None and len(chunks) == 1 and chunks[0].start == 0 and pg.can_run(chunks[0].num_tokens):
            c = chunks[0]
            slots = slot_mapping(c.seq.block_table, 0, c.num_tokens, self.config.block_size)
            return sampling, pg.run(
                c.seq.token_ids_range(0, c.end), slots, c.samples, c.seq.adapter_slot, fill=fill
            )
        batch = self._build_batch(chunks)
        if fill is not None:
            batch.input_ids.index_copy_(0, *fill)
        return sampling, self.model.forward(batch, self.kv_cache.layers)

    def _pending_fill(self, chunks: list[ScheduledChunk], pending: PendingTokens | None) -> Fill | None:
        """(input rows [m], their tokens [m]) on the device, for the inputs whose tokens are ``pending``; None
        when there are none. One small host-to-device copy, one gather."""
        if pending is None:
            return None
        rows, sources = pending_rows(chunks, pending.where)
        if not rows:
            return None
        index = torch.tensor([rows, sources], dtype=torch.int64).to(self.device, non_blocking=True)
        return index[0], pending.tokens.index_select(0, index[1])

    @staticmethod
    def _ordered(plan: SchedulerOutput) -> list[ScheduledChunk]:
        """Single-token chunks first (paged decode path), then multi-token chunks; stable. The
        scheduler's decodes lead already; a one-token chunk that is no decode (a one-token prompt)
        joins them."""
        return [c for c in plan.chunks if c.num_tokens == 1] + [c for c in plan.chunks if c.num_tokens > 1]

    def _build_batch(self, chunks: list[ScheduledChunk]) -> ForwardBatch:
        bs, device = self.config.block_size, self.device
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        spans: list[PrefillSpan] = []
        sample_rows: list[int] = []
        row_slots: list[int] = []  # adapter slots only
        slotted = self.num_adapter_slots > 1
        num_decodes = 0
        for c in chunks:
            offset = len(ids)
            ids += c.seq.token_ids_range(c.start, c.end)
            if slotted:
                row_slots += [c.seq.adapter_slot] * c.num_tokens
            positions += range(c.start, c.end)
            slots += slot_mapping(c.seq.block_table, c.start, c.num_tokens, bs)
            if c.num_tokens == 1:
                num_decodes += 1
            else:
                kv_slots = None
                if c.start > 0:
                    kv_slots = torch.tensor(slot_mapping(c.seq.block_table, 0, c.end, bs), device=device)
                spans.append(PrefillSpan(offset, c.num_tokens, c.start, kv_slots))
            if c.samples:
                sample_rows.append(len(ids) - 1)
        block_tables = context_lens = None
        if num_decodes:
            decodes = chunks[:num_decodes]
            width = max(len(c.seq.block_table) for c in decodes)
            table = torch.full((num_decodes, width), self.kv_cache.scratch_block, dtype=torch.int32)
            for row, c in enumerate(decodes):
                table[row, : len(c.seq.block_table)] = torch.tensor(c.seq.block_table, dtype=torch.int32)
            block_tables = table.to(device)
            context_lens = torch.tensor([c.end for c in decodes], dtype=torch.int32, device=device)
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            num_decodes=num_decodes,
            block_tables=block_tables,
            context_lens=context_lens,
            prefills=spans,
            logits_indices=torch.tensor(sample_rows, dtype=torch.int64, device=device),
            adapter_slots=torch.tensor(row_slots, dtype=torch.int64, device=device) if slotted else None,
        )


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        log.warning("triton is not installed: paged decode attention falls back to the torch reference")
        return False
    return True
