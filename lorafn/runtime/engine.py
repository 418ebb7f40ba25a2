"""The Engine: one worker's model + adapter + paged KV cache + scheduler + sampler, one step at a time.

Data flow of one `step()`:
  1. `Scheduler.schedule()` plans the step: decodes, then partial prefills, then new requests, under
     the token budget (pure policy, scheduler.py).
  2. The chunks become one flattened batch: single-token chunks first (paged decode attention), then
     multi-token chunks (SDPA over cached prefix + chunk). A step of decodes only, on CUDA, replays
     the CUDA graph of its batch bucket instead (cuda_graphs.py).
  3. Logits of the chunks that sample (a decode, or a prompt's last chunk) -> `sample()`; one host
     sync per step to read the tokens.
  4. `Scheduler.update()` advances the sequences; each new token goes through the request's
     detokenizer + stop checker, which yields the text delta and maybe a finish reason.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from lorafn.runtime.block_manager import blocks_for_tokens, slot_mapping
from lorafn.runtime.config import EngineConfig, ModelConfig
from lorafn.runtime.cuda_graphs import DecodeGraphRunner
from lorafn.runtime.detokenizer import IncrementalOutput
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
from lorafn.runtime.lora import LoRAWeights, load_lora
from lorafn.runtime.models.llama import ForwardBatch, LlamaModel, PrefillSpan
from lorafn.runtime.outputs import RequestOutput, StreamDelta
from lorafn.runtime.sampling import make_generator, sample
from lorafn.runtime.sampling_params import SamplingParams
from lorafn.runtime.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, SchedulerOutput
from lorafn.runtime.sequence import Sequence as Seq

log = logging.getLogger(__name__)

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class _Request:
    seq: Seq
    output: RequestOutput
    incremental: IncrementalOutput
    generator: torch.Generator | None


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _TORCH_DTYPES[dtype]


class Engine:
    """`generate` for batches, `add_request` + `step` for a serving loop, `stream` for one request."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device: {config.device!r} but CUDA is not available here")
        self.dtype = resolve_dtype(config.dtype, self.device)
        model_dir = Path(config.model)
        self.model_config = mc = ModelConfig.from_dir(model_dir)
        limit = (
            mc.max_position_embeddings
            if mc.sliding_window is None
            else min(mc.max_position_embeddings, mc.sliding_window)
        )
        self.max_model_len = min(config.max_model_len or limit, limit)

        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(config.tokenizer or model_dir))
        eos = set(mc.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = sorted(eos)

        self.weight_source = config.weight_source or SafetensorsWeightSource(model_dir)
        self.lora: LoRAWeights | None = (
            load_lora(config.adapter, mc, self.device, self.dtype) if config.adapter else None
        )
        use_triton = self.device.type == "cuda" and _triton_available()
        self.model = LlamaModel(
            mc,
            self.weight_source,
            self.device,
            self.dtype,
            self.lora,
            max_position=self.max_model_len,
            use_triton_attention=use_triton,
        )

        num_blocks = self._num_kv_blocks()
        self.kv_cache = KVCache(mc, num_blocks, config.block_size, self.device, self.dtype)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=max(config.max_num_batched_tokens, config.max_num_seqs),
                block_size=config.block_size,
                num_blocks=num_blocks,
                enable_chunked_prefill=config.enable_chunked_prefill,
                max_model_len=self.max_model_len,
            )
        )
        self.max_blocks_per_seq = blocks_for_tokens(self.scheduler.max_model_len, config.block_size)
        self.graphs: DecodeGraphRunner | None = None
        self.graph_capture_s = 0.0
        if self.device.type == "cuda" and config.use_cuda_graphs:
            buckets = [b for b in config.cuda_graph_batch_sizes if b <= config.max_num_seqs] or [1]
            self.graphs = DecodeGraphRunner(self.model, self.kv_cache, buckets, self.max_blocks_per_seq)
            self.graph_capture_s = self.graphs.capture()
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self.num_preemptions = 0

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
            n = blocks_for_budget(cfg.kv_cache_memory_bytes, per_block)
            if n < 1:
                raise ValueError(
                    f"kv_cache_memory_bytes: {cfg.kv_cache_memory_bytes} is less than one KV block "
                    f"({per_block} bytes)"
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

    # ------------------------------------------------------------------ requests

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue a request (text, or token ids); it joins the running batch at the next step."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            prompt_text: str | None = prompt
            token_ids = self.tokenizer.encode(prompt)
        else:
            prompt_text, token_ids = None, [int(t) for t in prompt]
        if not token_ids:
            raise ValueError("prompt: empty (it has no tokens)")
        vocab = self.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"prompt: token ids must be in [0, {vocab})")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        seq = Seq(seq_id=request_id, prompt_token_ids=token_ids, params=params)
        self.scheduler.add(seq)  # raises ValueError for a prompt longer than max_model_len
        self._requests[request_id] = _Request(
            seq=seq,
            output=RequestOutput(request_id, prompt_text, list(token_ids), arrival_time=time.perf_counter()),
            incremental=IncrementalOutput(self.tokenizer, token_ids, params, eos_token_id=self.eos_token_ids),
            generator=make_generator(params.seed, self.device),
        )
        return request_id

    def abort(self, request_id: str) -> bool:
        """Drop a request; True when it was running."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.abort(request_id)
        self._finish(req, "abort", req.incremental.finish("abort").text)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def get_output(self, request_id: str) -> RequestOutput | None:
        req = self._requests.get(request_id)
        return None if req is None else req.output

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion (alongside whatever else is queued); outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params: {len(params)} given for {len(prompts)} prompts")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        outputs = {i: self._requests[i].output for i in ids}
        while any(not o.finished for o in outputs.values()):
            self.step()
        return [outputs[i] for i in ids]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Deltas of one request as they are generated (other queued requests advance too)."""
        request_id = self.add_request(prompt, params)
        output = self._requests[request_id].output
        try:
            while not output.finished:
                for delta in self.step():
                    if delta.request_id == request_id:
                        yield delta
        finally:
            if not output.finished:
                self.abort(request_id)

    # ------------------------------------------------------------------ one iteration

    def step(self) -> list[StreamDelta]:
        """Run one iteration of the batch; returns the deltas of the requests that advanced."""
        out = self.scheduler.schedule()
        self.num_preemptions += len(out.preempted)
        deltas: list[StreamDelta] = []
        for seq in out.finished:  # the scheduler's max_model_len safety net
            req = self._requests.pop(seq.seq_id, None)
            if req is not None:
                deltas.append(self._finish(req, "length", req.incremental.finish("length").text))
        if out.is_empty:
            return deltas
        sampling = [c for c in self._ordered(out) if c.samples]
        sampled: dict[str, int] = {}
        if sampling:
            logits = self._execute(out)
            reqs = [self._requests[c.seq_id] for c in sampling]
            tokens = sample(logits, [r.seq.params for r in reqs], [r.generator for r in reqs]).tolist()
            sampled = {c.seq_id: t for c, t in zip(sampling, tokens, strict=True)}
        else:
            self._execute(out)
        now = time.perf_counter()
        for seq in self.scheduler.update(out, sampled):
            req = self._requests[seq.seq_id]
            token = seq.output_token_ids[-1]
            delta = req.incremental.push(token)
            text, reason = delta.text, delta.finish_reason
            if reason is None and self.scheduler.reached_max_model_len(seq):
                reason = "length"
                text += req.incremental.finish(reason).text
            out_ = req.output
            out_.token_ids.append(token)
            if out_.first_token_time is None:
                out_.first_token_time = now
            if reason is None:
                out_.text += text
                deltas.append(StreamDelta(seq.seq_id, [token], text))
            else:
                self.scheduler.finish(seq.seq_id, reason)
                del self._requests[seq.seq_id]
                deltas.append(self._finish(req, reason, text, [token]))
        return deltas

    def _finish(
        self, req: _Request, reason: str, text: str, token_ids: list[int] | None = None
    ) -> StreamDelta:
        out = req.output
        out.text += text
        out.finish_reason = reason
        out.finish_time = time.perf_counter()
        return StreamDelta(
            out.request_id,
            token_ids or [],
            text,
            True,
            reason,
            prompt_tokens=len(out.prompt_token_ids),
            completion_tokens=len(out.token_ids),
        )

    @staticmethod
    def _ordered(out: SchedulerOutput) -> list[ScheduledChunk]:
        """Single-token chunks first (paged decode path), then multi-token chunks; stable."""
        return [c for c in out.chunks if c.num_tokens == 1] + [c for c in out.chunks if c.num_tokens > 1]

    def _execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Logits [S, vocab] float32 of the sampling chunks, in `_ordered` order."""
        chunks = self._ordered(out)
        bs = self.config.block_size
        singles = [c for c in chunks if c.num_tokens == 1]
        if self.graphs is not None and len(singles) == len(chunks) and self.graphs.can_run(len(chunks)):
            positions = [c.start for c in chunks]
            logits = self.graphs.run(
                [c.seq.token_ids_range(c.start, c.start + 1)[0] for c in chunks],
                positions,
                [slot_mapping(c.seq.block_table, c.start, 1, bs)[0] for c in chunks],
                [c.seq.block_table for c in chunks],
            )
            rows = [i for i, c in enumerate(chunks) if c.samples]
            return logits if len(rows) == len(chunks) else logits[rows]
        return self.model.forward(self._build_batch(chunks), self.kv_cache.layers)

    def _build_batch(self, chunks: list[ScheduledChunk]) -> ForwardBatch:
        bs, device = self.config.block_size, self.device
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        spans: list[PrefillSpan] = []
        sample_rows: list[int] = []
        num_decodes = 0
        for c in chunks:
            offset = len(ids)
            ids += c.seq.token_ids_range(c.start, c.end)
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
        )


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        log.warning("triton is not installed: paged decode attention falls back to the torch reference")
        return False
    return True
