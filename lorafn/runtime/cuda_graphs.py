"""Decode CUDA graphs: all capture code lives here; static buffers and bucket logic are pure functions.

A decode step of B sequences (B <= the largest bucket) runs as the replay of the graph captured for
the smallest bucket >= B. Inputs are copied into static buffers first; rows B..bucket-1 are padding:
token 0 at position 0, K/V written to the KV cache's scratch slot, a block table of scratch blocks and
a context length of 1, so they compute garbage that nobody reads and touch no real sequence.

The graph materialization issue builds on `DecodeGraphRunner`: what it captures depends only on the
model, the adapter shape, the buckets and `max_blocks_per_seq` (never on context lengths).

Prefill graphs (`PrefillGraphRunner`, `EngineConfig.prefill_graph_tokens`) take the other common step: one
prompt's first chunk alone (no decodes, from position 0), padded to a token bucket. Padding rows come after
the real ones, and attention is causal, so no real row attends to them; their K/V go to the scratch slot.
A prefill of the 7B is host-bound in eager mode (~940 launches for 512 tokens, 13 ms of GPU work in a
25 ms TTFT on the H100): one replay launches it all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

# (input rows [m], their tokens [m]) on the device: tokens a step still queued sampled (ModelRunner.execute)
Fill = tuple["torch.Tensor", "torch.Tensor"]


def bucket_for(batch_size: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket >= batch_size, or None when the batch is larger than every bucket."""
    return next((b for b in sorted(buckets) if b >= batch_size), None)


def graph_buckets(sizes: Sequence[int], max_batch: int) -> list[int]:
    """The buckets worth capturing for batches of at most ``max_batch``: every size below it and the
    smallest at or above it (so that a full batch still replays a graph); [1] when ``sizes`` is empty."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    ordered = sorted(set(sizes))
    below = [b for b in ordered if b < max_batch]
    top = bucket_for(max_batch, ordered)
    return below + ([top] if top is not None else []) or [1]


def prefill_buckets(configured: Sequence[int], max_chunk: int) -> list[int]:
    """The configured prefill buckets a first chunk of at most ``max_chunk`` tokens can need: every one below
    it and the smallest at or above it (larger ones would never be the smallest that fits)."""
    ordered = sorted(set(configured))
    return [b for b in ordered if b < max_chunk] + [b for b in ordered if b >= max_chunk][:1]


@dataclass
class DecodeInputs:
    """Host arrays of one decode step, padded to a bucket: [bucket] int64 ids/positions/slots,
    [bucket, max_blocks] int32 block tables, [bucket] int32 context lengths."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    block_tables: np.ndarray
    context_lens: np.ndarray


def pad_decode_inputs(
    token_ids: Sequence[int],
    positions: Sequence[int],
    slots: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    bucket: int,
    max_blocks: int,
    scratch_block: int,
    block_size: int,
) -> DecodeInputs:
    """Lay out n <= bucket decodes for a bucket (pure; see the module docstring for the padding)."""
    n = len(token_ids)
    if n > bucket:
        raise ValueError(f"{n} decodes do not fit in bucket {bucket}")
    ids = np.zeros(bucket, dtype=np.int64)
    pos = np.zeros(bucket, dtype=np.int64)
    slot = np.full(bucket, scratch_block * block_size, dtype=np.int64)
    tables = np.full((bucket, max_blocks), scratch_block, dtype=np.int32)
    ctx = np.ones(bucket, dtype=np.int32)
    ids[:n], pos[:n], slot[:n] = token_ids, positions, slots
    for row, table in enumerate(block_tables):
        if len(table) > max_blocks:
            raise ValueError(f"block table of {len(table)} blocks exceeds max_blocks {max_blocks}")
        tables[row, : len(table)] = table
    ctx[:n] = np.asarray(positions, dtype=np.int32) + 1
    return DecodeInputs(ids, pos, slot, tables, ctx)


def pad_prefill_inputs(
    token_ids: Sequence[int], slots: Sequence[int], bucket: int, scratch_slot: int
) -> tuple[np.ndarray, np.ndarray]:
    """[bucket] int64 token ids and KV slots of one prompt's first chunk of n <= bucket tokens: the padding
    rows read token 0 and write their K/V to the scratch slot (a previous replay's real slots must not be
    left in the tail: its rows would overwrite that sequence's cache)."""
    n = len(token_ids)
    if n > bucket:
        raise ValueError(f"a chunk of {n} tokens does not fit in prefill bucket {bucket}")
    if len(slots) != n:
        raise ValueError(f"{len(slots)} KV slots for {n} tokens")
    ids = np.zeros(bucket, dtype=np.int64)
    slot = np.full(bucket, scratch_slot, dtype=np.int64)
    ids[:n], slot[:n] = token_ids, slots
    return ids, slot


def _slot_buffer(model, rows: int):
    """The static [rows] int64 adapter-slot input of a model with adapter slots (lora.py), else None."""
    import torch

    lora = getattr(model, "lora", None)
    if lora is None or lora.num_slots == 1:
        return None
    return torch.zeros(rows, dtype=torch.int64, device=model.device)


_CAPTURE_STREAMS: dict = {}


def capture_stream(device):
    """The side stream every capture without an arena runs on, one per device for the process. cuBLAS keeps
    a workspace per stream it ran a GEMM on (32 MiB on the H100) until the workspaces are cleared (a park
    does), so a new stream per capture left one more behind each time a capture ran a cuBLAS GEMM: a lazy 7B
    worker's idle captures of buckets 32 and 64 (1-16 run the Triton skinny GEMM) held 62 MiB more than with
    one stream, and each prefill-graph capture 32 MiB (docs/benchmarks.md "Prefill CUDA graphs"). An
    archive's capture takes a fresh stream instead: its warm-ups make that stream's workspace in the arena,
    where its graphs must find it."""
    import torch

    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    stream = _CAPTURE_STREAMS.get(index)
    if stream is None:
        stream = _CAPTURE_STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


def capture_forward(model, kv_cache, batch, pool, stream, warmup_pool=None, keep_graph: bool = False):
    """(graph, its output): model.forward(batch) captured on ``stream`` into ``pool``, after two warm-up
    forwards on that stream (lazy module loads, Triton compiles, cuBLAS workspaces; in ``warmup_pool`` when
    given). With ``keep_graph`` the cudaGraph_t is kept for walking (graph_restore.py), instantiated here."""
    import contextlib

    import torch

    stream.wait_stream(torch.cuda.current_stream())
    routed = contextlib.nullcontext() if warmup_pool is None else torch.cuda.use_mem_pool(warmup_pool)
    with torch.cuda.stream(stream), routed:
        for _ in range(2):
            model.forward(batch, kv_cache.layers)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph(keep_graph=True) if keep_graph else torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        output = model.forward(batch, kv_cache.layers)
    if keep_graph:
        graph.instantiate()
    return graph, output


class DecodeGraphRunner:
    """Captures model.forward for decode batches of each bucket size and replays them."""

    def __init__(self, model, kv_cache, buckets: Sequence[int], max_blocks_per_seq: int) -> None:
        import torch

        self.model, self.kv_cache = model, kv_cache
        self.buckets = tuple(sorted(set(buckets)))
        self.max_blocks = max_blocks_per_seq
        device = model.device
        largest = self.buckets[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), kv_cache.scratch_slot, dtype=torch.int64, device=device)
        self.block_tables = torch.full(
            (largest, self.max_blocks), kv_cache.scratch_block, dtype=torch.int32, device=device
        )
        self.context_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.adapter_slots = _slot_buffer(model, largest)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _batch(self, bucket: int):
        from lorafn.runtime.models.llama import ForwardBatch

        return ForwardBatch(
            input_ids=self.input_ids[:bucket],
            positions=self.positions[:bucket],
            slot_mapping=self.slot_mapping[:bucket],
            num_decodes=bucket,
            block_tables=self.block_tables[:bucket],
            context_lens=self.context_lens[:bucket],
            prefills=[],
            logits_indices=None,
            adapter_slots=self.adapter_slots[:bucket] if self.adapter_slots is not None else None,
        )

    @property
    def pending(self) -> list[int]:
        """Buckets not captured yet, ascending (a lazily started worker captures them on need or idle)."""
        return [b for b in self.buckets if b not in self.graphs]

    def capture(
        self, pool=None, warmup_pool=None, keep_graph: bool = False, buckets: Sequence[int] | None = None
    ) -> float:
        """Capture ``buckets`` (default: every one not captured yet), largest first. Returns seconds taken.

        All graphs share one memory pool, also across calls (`EngineConfig.lazy_graphs` captures one bucket
        at a time): each keeps its output tensor alive and replays never overlap, so a later capture reuses
        only memory that earlier graphs use as scratch.

        For graph materialization (graph_restore.py): `pool` (a pool id, e.g. an arena MemPool's `.id`)
        instead of a new one, `warmup_pool` (a MemPool) for the warm-ups' allocations (the capture
        stream's cuBLAS workspace is made there and named by the graphs), `keep_graph` to keep each
        cudaGraph_t for walking (then instantiated here, as without it)."""
        import time

        import torch

        t0 = time.perf_counter()
        if pool is not None:
            self.pool = pool
        elif self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        todo = self.pending if buckets is None else sorted({b for b in buckets if b not in self.graphs})
        unknown = [b for b in todo if b not in self.buckets]
        if unknown:
            raise ValueError(f"buckets {unknown} are not among this runner's {list(self.buckets)}")
        # an archive's capture (warmup_pool: the arena) on a stream of its own, see `capture_stream`
        stream = torch.cuda.Stream() if warmup_pool is not None else capture_stream(self.model.device)
        for bucket in reversed(todo):
            self.graphs[bucket], self.outputs[bucket] = capture_forward(
                self.model, self.kv_cache, self._batch(bucket), self.pool, stream, warmup_pool, keep_graph
            )
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def release(self) -> None:
        """Drop every graph, its output and the static inputs (a parked worker's, `ModelRunner.park`).

        Each graph is reset (its executable graph destroyed and its use of the shared pool given up, so
        the pool's memory is free to go back with `torch.cuda.empty_cache()` once its tensors are gone),
        then the outputs (allocated inside the pool) and the static inputs (outside it) are dropped. The
        runner is unusable afterwards: an unparked runner builds a new one."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()
        self.input_ids = self.positions = self.slot_mapping = self.block_tables = self.context_lens = None
        self.adapter_slots = None
        self.pool = None
        self.kv_cache = None

    def held_tensors(self) -> list:
        """The runner's tensors outside its pool's scratch: static inputs and the graphs' outputs."""
        held = [self.input_ids, self.positions, self.slot_mapping, self.block_tables, self.context_lens]
        held.append(self.adapter_slots)
        return [t for t in held + list(self.outputs.values()) if t is not None]

    def can_run(self, num_decodes: int) -> bool:
        """Whether a captured graph takes ``num_decodes`` rows (the smallest captured bucket that fits)."""
        return bucket_for(num_decodes, list(self.graphs)) is not None

    def run(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        adapter_slots: Sequence[int] | None = None,
        fill: Fill | None = None,
    ):
        """Logits [n, vocab] (float32, a view of the graph's output) for n decodes; `adapter_slots`: each
        row's, for a model with adapter slots (padding rows take slot 0; their outputs are never read).
        `fill`: (rows, tokens) device tensors copied into the input ids before the replay (tokens still on the
        device, `ModelRunner.execute`)."""
        import torch

        n = len(token_ids)
        bucket = bucket_for(n, list(self.graphs))
        if bucket is None:
            raise ValueError(f"no captured graph takes {n} decodes (captured: {sorted(self.graphs)})")
        inputs = pad_decode_inputs(
            token_ids,
            positions,
            slots,
            block_tables,
            bucket,
            self.max_blocks,
            self.kv_cache.scratch_block,
            self.kv_cache.block_size,
        )
        for static, host in (
            (self.input_ids, inputs.input_ids),
            (self.positions, inputs.positions),
            (self.slot_mapping, inputs.slot_mapping),
            (self.block_tables, inputs.block_tables),
            (self.context_lens, inputs.context_lens),
        ):
            static[:bucket].copy_(torch.from_numpy(host), non_blocking=True)
        if self.adapter_slots is not None:
            slots_host = np.zeros(bucket, dtype=np.int64)
            slots_host[:n] = adapter_slots if adapter_slots is not None else 0
            self.adapter_slots[:bucket].copy_(torch.from_numpy(slots_host), non_blocking=True)
        if fill is not None:
            self.input_ids.index_copy_(0, *fill)
        self.graphs[bucket].replay()
        return self.outputs[bucket][:n]


class PrefillGraphRunner:
    """Captures model.forward for one prompt's first chunk (no decodes, from position 0) at each token
    bucket, and replays it (see the module docstring for the padding). Its own memory pool: the graphs of
    all buckets share it (captured largest first), the decode graphs do not (theirs may be an arena's)."""

    def __init__(self, model, kv_cache, buckets: Sequence[int]) -> None:
        import torch

        from lorafn.runtime.models.llama import PrefillSpan

        self.model, self.kv_cache = model, kv_cache
        self.buckets = tuple(sorted(set(buckets)))
        if not self.buckets or self.buckets[0] < 2:
            raise ValueError(f"prefill graph buckets must be >= 2 tokens, got {list(buckets)}")
        device = model.device
        largest = self.buckets[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.arange(largest, dtype=torch.int64, device=device)  # every chunk starts at 0
        self.slot_mapping = torch.full((largest,), kv_cache.scratch_slot, dtype=torch.int64, device=device)
        self.logits_index = torch.zeros(1, dtype=torch.int64, device=device)  # the chunk's last real row
        self.adapter_slots = _slot_buffer(model, largest)  # every row the prompt's slot
        self._span = PrefillSpan
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.capture_s = 0.0
        self.replays = 0  # steps served by a replay (tests, the worker's log)

    def _batch(self, bucket: int):
        from lorafn.runtime.models.llama import ForwardBatch

        return ForwardBatch(
            input_ids=self.input_ids[:bucket],
            positions=self.positions[:bucket],
            slot_mapping=self.slot_mapping[:bucket],
            num_decodes=0,
            block_tables=None,
            context_lens=None,
            prefills=[self._span(0, bucket, 0, None)],
            logits_indices=self.logits_index,
            adapter_slots=self.adapter_slots[:bucket] if self.adapter_slots is not None else None,
        )

    @property
    def pending(self) -> list[int]:
        """Buckets not captured yet, ascending."""
        return [b for b in self.buckets if b not in self.graphs]

    def capture(self, buckets: Sequence[int] | None = None) -> float:
        """Capture ``buckets`` (default: every pending one), largest first; seconds taken."""
        import time

        import torch

        t0 = time.perf_counter()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        todo = self.pending if buckets is None else sorted({b for b in buckets if b not in self.graphs})
        unknown = [b for b in todo if b not in self.buckets]
        if unknown:
            raise ValueError(f"prefill buckets {unknown} are not among this runner's {list(self.buckets)}")
        stream = capture_stream(self.model.device)
        for bucket in reversed(todo):
            # the warm-ups and the capture run over whatever the static inputs hold: their K/V go to the
            # scratch slot (the tail of slot_mapping is kept at it between replays, see `run`)
            self.slot_mapping.fill_(self.kv_cache.scratch_slot)
            self.logits_index.fill_(bucket - 1)
            self.graphs[bucket], self.outputs[bucket] = capture_forward(
                self.model, self.kv_cache, self._batch(bucket), self.pool, stream
            )
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        self.capture_s += seconds
        return seconds

    def release(self) -> None:
        """Drop every graph, its output and the static inputs (as `DecodeGraphRunner.release`); unusable
        afterwards."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()
        self.input_ids = self.positions = self.slot_mapping = self.logits_index = self.adapter_slots = None
        self.pool = None
        self.kv_cache = None

    def held_tensors(self) -> list:
        """The runner's tensors outside its pool's scratch: static inputs and the graphs' outputs."""
        held = [self.input_ids, self.positions, self.slot_mapping, self.logits_index, self.adapter_slots]
        return [t for t in held + list(self.outputs.values()) if t is not None]

    def can_run(self, num_tokens: int) -> bool:
        """Whether a captured bucket takes a first chunk of ``num_tokens`` tokens (one-token chunks go the
        decode path, `ModelRunner._ordered`)."""
        return num_tokens > 1 and bucket_for(num_tokens, list(self.graphs)) is not None

    def run(
        self,
        token_ids: Sequence[int],
        slots: Sequence[int],
        samples: bool,
        adapter_slot: int = 0,
        fill: Fill | None = None,
    ):
        """Logits [1, vocab] (float32, a view of the graph's output) of the chunk's last token, or [0, vocab]
        when the chunk does not sample (a long prompt's first chunk). `adapter_slot`: the prompt's, for a
        model with adapter slots. `fill`: as `DecodeGraphRunner.run`'s."""
        import torch

        n = len(token_ids)
        bucket = bucket_for(n, list(self.graphs))
        if bucket is None or n < 2:
            raise ValueError(f"no captured prefill graph takes {n} tokens (captured: {sorted(self.graphs)})")
        ids, slot = pad_prefill_inputs(token_ids, slots, bucket, self.kv_cache.scratch_slot)
        self.input_ids[:bucket].copy_(torch.from_numpy(ids), non_blocking=True)
        self.slot_mapping[:bucket].copy_(torch.from_numpy(slot), non_blocking=True)
        self.logits_index.fill_(n - 1)
        if self.adapter_slots is not None:
            self.adapter_slots.fill_(adapter_slot)
        if fill is not None:
            self.input_ids.index_copy_(0, *fill)
        self.graphs[bucket].replay()
        self.replays += 1
        out = self.outputs[bucket]
        return out if samples else out[:0]
