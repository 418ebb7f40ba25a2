"""EngineConfig: the one typed configuration of a worker's engine, and the model's own config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lorafn.api.settings import default_cache_dir
from lorafn.runtime.kv_offload import OffloadConfig

if TYPE_CHECKING:
    from lorafn.runtime.weights import WeightSource

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_CUDA_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
# How a step above 16 rows (prefill chunks, decode batches > 16) adds the LoRA expands y += t·Bᵀ, per step
# (see EngineConfig.lora_expand). Measured on the H100 (bench/engine.py at 3351cf9, llama-2-7b r16
# all-linear, prompt 512): TTFT base 23.1 ms, per_projection 25.4 (1.10x), grouped 29.6, in_kernels 43.0;
# TPOT at batch 64 base 19.10, per_projection 21.06, grouped 20.09, in_kernels 19.94.
LORA_EXPANDS = ("per_projection", "grouped", "in_kernels")
# EngineConfig.lora_expand may also name one mode for the steps with a prefill chunk and one for the steps
# of decodes only, as "PREFILL/DECODE" (e.g. "per_projection/grouped"); "hybrid" is the best pair of the
# figures above: per_projection where a prompt is prefilled (TTFT), in_kernels for decode-only steps (above
# 16 rows their expands run in the per-row kernels that a decode step of <= 16 rows uses: no launch).
LORA_EXPAND_ALIASES = {"hybrid": ("per_projection", "in_kernels")}
# The default of EngineConfig.lora_expand: "grouped" since the twenty-seventh session (H200 at b54daca,
# docs/benchmarks.md "Grouped prefill expands by default"): a 512-token LoRA prefill of the 7B ran 715 kernels
# and 12.2 ms of GPU time against hybrid's 875 and 13.1 ms (base 395, 10.9); TTFT with prefill graphs 13.5 ms
# against 14.5 (base 12.3: 1.099x against 1.186x), eager (host-bound, medians of two rounds) 38.9 against 41.0
# (base 25.2); decode steps of at most skinny_gemm_rows rows are the same in every mode. Until then "hybrid"
# (H100, e7c913f: TTFT base 13.0 ms, per_projection 19.0, grouped 16.1, in_kernels 17.3, hybrid 18.7), kept
# off grouped by a test's bf16 criterion, which the fourteenth session traced to rounding luck of the unfused
# grouped forward it holds it to, not to the kernels (fused grouped is no further from float32 than hybrid).
DEFAULT_LORA_EXPAND = "grouped"
# Steps of at most this many rows run their GEMMs as fused_decode's segmented skinny GEMM (one launch per
# projection group, the LoRA shrink as extra output rows) instead of cuBLAS (EngineConfig.skinny_gemm_rows).
# H100, llama-2-7b groups (bench/gemv_probe.py --rows 16,32,64): the segmented GEMM took 0.77-0.92 of the time
# cuBLAS took for the same group (its projections + the shrink) at 32 and 64 rows, 0.65-0.90 at 16. The engine
# (bench/engine.py --skinny-rows 16 --repeats 3 at 6fc939f, r16 all-linear, hybrid, medians): LoRA TPOT at
# batch 32 14.22 -> 13.28 ms (+3.7% over its base, was +9.3%), at 64 19.88 -> 18.64 (+4.5%, was +8.3%).
SKINNY_GEMM_MAX_ROWS = 64
DEFAULT_SKINNY_GEMM_ROWS = 64
# The paged decode attention kernel of a CUDA engine (EngineConfig.decode_attention; the kernels are
# attention/triton_decode.py's): "simt" (float32 products and sums) or "dot" (the same split kernel on
# tensor cores). "dot" is the default: on an H200 (bench/decode_attention.py at 596bdcc) it took 0.18-0.83x
# simt's time on every shape, batch and context measured (llama-2-7b batch 64 at 512 tokens: 133.6 vs 311.5
# µs a layer, 95% of the copy bandwidth), and the 7B's TPOT (bench/engine.py --attention-kernels dot) fell
# 5% at batch 1, 14% at 8, 29% at 16, 34% at 32 and 40% at 64; its bf16 and fp32 token tests pass.
DECODE_ATTENTION_KERNELS = ("simt", "dot")
DEFAULT_DECODE_ATTENTION = "dot"
# Whether a step whose GEMMs run as fused_decode's skinny GEMM (at most skinny_gemm_rows rows) adds its LoRA
# expands inside that launch (EngineConfig.expand_in_gemm) instead of in the per-row kernels that follow. On
# by default since the twenty-third session: on an H200 its LoRA TPOT was 0.979-0.993x the per-row kernels'
# at batch 1, 16 and 64 in two runs (bench/engine.py --other-expand-place at 84dbada; LoRA over base at 64:
# +2.6-2.7% against +4.8%), its replay 2.1-5.5% faster (bench/decode_profile.py at 33d60cb), and the GPU
# suite passed with it (docs/benchmarks.md). Its first form (9792058: rank by rank after the wait, B not
# prefetched) had been 1.1-7.0% slower.
DEFAULT_EXPAND_IN_GEMM = True
# Steps of at most this many rows whose GEMMs are skinny ones compute each GEMM's input inside it
# (EngineConfig.gemm_prologue_rows): the residual add + RMSNorm before q/k/v and gate/up, SiLU·up before down
# (fused_decode.NormPrologue, SiluMulPrologue), 3 launches a layer fewer (96 of ~290 a 7B decode step). Each
# program reads its input's tiles twice for a norm (the sum of squares, then the product), so it costs L2
# reads that grow with the rows. 0 (off): on an H200 (decode_profile, twenty-fifth session,
# docs/benchmarks.md) the GEMMs with prologues took 2.0x their time at batch 1 and 2-4.7x at 8-64 (255
# registers a thread, spills), far more than the 145 + 48 µs the norm and SiLU kernels took of a 4.15 ms
# replay.
DEFAULT_GEMM_PROLOGUE_ROWS = 0
# How a step above skinny_gemm_rows rows computes each LoRA group's shrink t = x·A_catᵀ
# (EngineConfig.lora_shrink): "cublas" (F.linear: on Hopper a split-K GEMM + a reduce kernel) or "triton"
# (triton_ops.lora_shrink: one launch, its K splits summed by the last to arrive).
LORA_SHRINKS = ("cublas", "triton")
DEFAULT_LORA_SHRINK = "cublas"
# A step of decodes only runs RoPE and its K/V cache writes inside the decode attention launch
# (EngineConfig.rope_in_attention; triton_decode.paged_decode_attention_rope) instead of fused_decode's RoPE
# kernel before it: one launch a layer fewer, and bit for bit the same outputs and K/V. Off: timed on the
# H200 (twenty-ninth session) it saves nothing measurable at batch 1 (TPOT x0.998 on llama-2-7b) and costs
# +2.4% at batch 8 and +37% at batch 64 (its in-loop substitution of the new k / v keeps the attention's
# cache loads from being pipelined; docs/benchmarks.md).
DEFAULT_ROPE_IN_ATTENTION = False


def expand_modes(lora_expand: str) -> tuple[str, str]:
    """(the mode of a step with a prefill chunk, the mode of a step of decodes only) that an
    `EngineConfig.lora_expand` value names: one of LORA_EXPANDS (both), an alias, or "PREFILL/DECODE".
    ValueError naming the field otherwise."""
    if lora_expand in LORA_EXPANDS:
        return lora_expand, lora_expand
    if lora_expand in LORA_EXPAND_ALIASES:
        return LORA_EXPAND_ALIASES[lora_expand]
    prefill, sep, decode = str(lora_expand).partition("/")
    if sep and prefill in LORA_EXPANDS and decode in LORA_EXPANDS:
        return prefill, decode
    raise ValueError(
        f"lora_expand: {lora_expand!r} is not one of {LORA_EXPANDS + tuple(LORA_EXPAND_ALIASES)} nor "
        f"'PREFILL/DECODE' of two of {LORA_EXPANDS}"
    )


@dataclass
class EngineConfig:
    """How to build an Engine. Every field is checked in `__post_init__` (ValueError naming it).

    model: an HF model directory (config.json + *.safetensors + tokenizer files).
    adapter: a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors), or None.
    dtype: "auto" picks float32 on CPU and bfloat16 on CUDA.
    num_kv_blocks / kv_cache_memory_bytes: size the paged KV cache (at most one of the two); with
      neither, CPU gets enough blocks for max_num_seqs full-length sequences (capped at 2 GiB) and CUDA
      profiles one forward of max_num_batched_tokens once and remembers the answer in `cache_dir`.
    weight_source: where backbone tensors come from (default: the model directory's safetensors,
      memory-mapped).
    """

    model: str | Path
    adapter: str | Path | None = None
    # A standby's prepared adapter shape ("q_proj:16,v_proj:16"): zeroed LoRA buffers of that shape (and the
    # decode graphs over them) until `Engine.bind_adapter` copies an adapter in. Only without `adapter`.
    lora_shape: str | None = None
    # Adapter slots (docs/runtime.md#adapter-slots): LoRA buffers for this many adapters of one shape, so
    # that one batch serves the requests of several functions (each request names its slot,
    # `Engine.add_request(adapter_slot=...)`). `adapters` are loaded into slots 0, 1, ... at start (their
    # shape: `lora_shape`, else the first one's); the rest stay empty (zeros: the base model) until
    # `Engine.load_adapter`. 1: one adapter, `adapter` as before. Not with graph archives (an archive holds
    # one slot's graphs).
    adapter_slots: int = 1
    adapters: tuple[str | Path, ...] = ()
    device: str = "cpu"
    dtype: str = "auto"
    tokenizer: str | Path | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.85
    enable_chunked_prefill: bool = True
    use_cuda_graphs: bool = True
    # CUDA: capture each decode graph when a decode step first needs its bucket, and the rest one bucket at
    # a time while the worker is idle, instead of all of them before serving (`ModelRunner.ensure_graph`,
    # `capture_pending_graph`): a fresh worker's first token waits for no capture (~1.2-1.6 s of its
    # ~1.9 s start on the H100, llama-2-7b); its first decode step pays one bucket's. A standby captures at
    # start (it waits anyway).
    lazy_graphs: bool = False
    cuda_graph_batch_sizes: tuple[int, ...] = DEFAULT_CUDA_GRAPH_BATCH_SIZES
    # CUDA: token buckets of prefill graphs (cuda_graphs.PrefillGraphRunner): a step that is one prompt's
    # first chunk alone (no decodes in it, from position 0) replays the graph of the smallest bucket that
    # holds it, padded (causal attention: no real row sees the padding) instead of ~30 launches per layer
    # from Python. Captured with the decode graphs (a standby's start) or one per idle moment (lazy_graphs),
    # never on a request's path; not archived; buckets past the first that holds a whole chunk
    # (max_num_batched_tokens, or max_model_len if shorter) are left out. Each costs a capture and the pool
    # holds the largest bucket's activations (132 MiB for 128/256/512 with the 7B). Empty: none.
    prefill_graph_tokens: tuple[int, ...] = ()
    # CUDA: decode state in a fixed-address arena, and decode graphs restored from an archive written by the
    # first worker of the same key instead of captured (graph_cache.py; a standby's start, a lazy worker's
    # first decode step); archives under `graph_archive_dir` (default: cache_dir) /graphs/
    graph_archives: bool = False
    graph_archive_dir: str | Path | None = None
    cache_dir: str | Path | None = None
    # CUDA: the per-thread stack the context reserves local memory for (None: the driver's 1 KiB);
    # 256 saves ~200 MiB per worker process on an H100 (docs/benchmarks.md "Per-worker memory"), and a
    # kernel that needs more grows it at launch, so it is the default.
    cuda_stack_bytes: int | None = 256
    # CUDA: the fused kernels of models/fused_decode.py (LoRA expands inside the elementwise kernels; a
    # step of at most skinny_gemm_rows rows runs one skinny-GEMM launch per projection group, shrink in it);
    # False keeps the cuBLAS + addmm path everywhere (the benchmarks' baseline)
    fused_decode: bool = True
    # CUDA, fused path: steps of at most this many rows (decode batches, short prefill chunks) run each
    # projection group as one segmented skinny-GEMM launch with the group's LoRA shrink in it; larger steps
    # through cuBLAS + one shrink GEMM per group. 1..SKINNY_GEMM_MAX_ROWS; the per-row elementwise kernels
    # (expands inside them) stay at 16 rows whatever this is (lora_expand decides above that).
    skinny_gemm_rows: int = DEFAULT_SKINNY_GEMM_ROWS
    # CUDA, steps above 16 rows (prefill, decode batches > 16): how the LoRA expands y += t·Bᵀ are added
    # to the cuBLAS outputs. "grouped": on the tensor cores, per projection group: on the fused path inside
    # the kernel that reads the group's output anyway (RoPE + cache writes, SiLU·up, add + RMSNorm; no
    # launch of their own), else one triton_ops.lora_expand launch per group;
    # "per_projection": one addmm_ per projection (the path before it);
    # "in_kernels": inside the elementwise kernels that follow (RoPE, SiLU·up, add + RMSNorm; fused path
    # only, else per projection). The shrink is one GEMM per group in all three. CPU: per projection.
    # Chosen per step by its kind (`expand_modes`): "hybrid" is per_projection for a step with a prefill
    # chunk (a mixed step of chunked prefill + decodes too) and in_kernels for a step of decodes only (so
    # every decode CUDA graph: its mode is fixed when it is captured); "PREFILL/DECODE" names the two
    # modes; one mode alone is used for every step (the default, DEFAULT_LORA_EXPAND: grouped).
    lora_expand: str = DEFAULT_LORA_EXPAND
    # CUDA: the paged decode attention kernel, one of DECODE_ATTENTION_KERNELS (attention/triton_decode.py)
    decode_attention: str = DEFAULT_DECODE_ATTENTION
    # CUDA, fused path: a step of at most skinny_gemm_rows rows adds each projection's LoRA expand inside its
    # group's skinny-GEMM launch (every program its own columns of B, after the shrink's programs; see
    # fused_decode._seg_gemm_kernel) instead of in the per-row kernels after it (RoPE, SiLU·up, add + RMSNorm:
    # one program per row reads all of B there, ~0.3 ms a step at batch 1 on an H200). Roundings as there (up
    # to float32 summation order). The default (DEFAULT_EXPAND_IN_GEMM). False: the per-row kernels (and
    # lora_expand above 16 rows).
    expand_in_gemm: bool = DEFAULT_EXPAND_IN_GEMM
    # CUDA, fused path: a step of at most this many rows (and of at most skinny_gemm_rows) runs the residual
    # add + RMSNorm and SiLU·up inside the skinny GEMM that reads their output (DEFAULT_GEMM_PROLOGUE_ROWS;
    # with an adapter only where its expands are inside the GEMMs too, expand_in_gemm). Roundings as the
    # separate kernels' (up to the norm's float32 summation order). 0: never.
    gemm_prologue_rows: int = DEFAULT_GEMM_PROLOGUE_ROWS
    # CUDA, fused path: how a step above skinny_gemm_rows rows (prefill chunks) computes the LoRA shrinks, one
    # of LORA_SHRINKS (DEFAULT_LORA_SHRINK). Roundings alike (float32 sums, rounded once; in another order).
    lora_shrink: str = DEFAULT_LORA_SHRINK
    # CUDA, fused path: a step of decodes only whose q/k/v expands are done before RoPE (inside the skinny
    # GEMM, expand_in_gemm, or no adapter) rotates q and k and writes K/V inside the decode attention launch
    # (DEFAULT_ROPE_IN_ATTENTION). The same roundings and outputs as the two launches.
    rope_in_attention: bool = DEFAULT_ROPE_IN_ATTENTION
    # CUDA: let torch's SDPA pick cuDNN attention for prefill chunks. Off by default: cuDNN builds an
    # execution plan per exact shape, and on the H100 the first prefill of each new chunk length paid
    # ~65 ms of host time for it (a standby's first request prefilled in 110 ms, the next one in 28 ms;
    # docs/benchmarks.md, cold start, fifth session); flash / memory-efficient attention have no per-shape
    # set-up and cost ~1 ms more per 512-token prefill of the 7B.
    cudnn_attention: bool = False
    # Overlapped steps (Engine.step): a step is queued on the device before the previous step's tokens
    # are read back, its inputs taking those tokens from the device; the host then reads the previous
    # step's tokens, detokenizes them and checks their stops while the GPU runs, so a step's host work
    # (scheduling, inputs, text) hides behind the forward instead of adding to it: on an H200 with the 7B
    # TPOT fell 3-7% at batch 1 (to the graph replay's time) and 8-16% at 64 (bench/engine.py
    # --other-overlap, docs/benchmarks.md). Each `step()` then returns the previous step's deltas; a request
    # that ends on a stop token or a stop string has one more row computed and dropped. None (the
    # default): on for CUDA, off on a CPU (its forward runs on the host: nothing to overlap). The tokens
    # are those of steps one at a time.
    overlap_steps: bool | None = None
    # KV offload to host memory for preempted sequences (kv_offload.py: swap or recompute, host budget)
    kv_offload: OffloadConfig = field(default_factory=OffloadConfig)
    # serve pending prefills by TTFT deadline (`Engine.set_deadline`; SchedulerConfig.deadline_order,
    # docs/scheduler.md#deadline-order) instead of first come first served
    deadline_order: bool = False
    weight_source: WeightSource | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not str(self.model):
            raise ValueError("model: a model directory is required")
        if self.cuda_stack_bytes is not None and not 16 <= self.cuda_stack_bytes <= 1 << 20:
            raise ValueError(f"cuda_stack_bytes: must be in [16, 1 MiB], got {self.cuda_stack_bytes}")
        if self.lora_shape is not None and self.adapter is not None:
            raise ValueError("lora_shape: only for an engine without an adapter (a standby); got both")
        self.adapters = tuple(self.adapters)
        if not isinstance(self.adapter_slots, int) or self.adapter_slots < 1:
            raise ValueError(f"adapter_slots: must be a positive integer, got {self.adapter_slots!r}")
        if self.adapters and self.adapter is not None:
            raise ValueError("adapters: give `adapter` (one adapter) or `adapters` (adapter slots), not both")
        if len(self.adapters) > self.adapter_slots:
            raise ValueError(f"adapters: {len(self.adapters)} adapters, adapter_slots {self.adapter_slots}")
        if self.adapter_slots > 1:
            if self.adapter is not None:
                raise ValueError("adapter_slots: slots are filled from `adapters`, not `adapter`")
            if not self.adapters and self.lora_shape is None:
                raise ValueError("adapter_slots: needs `adapters` or a `lora_shape` to size the slots")
            if self.graph_archives:
                raise ValueError("adapter_slots: graph archives hold one adapter slot; no graph_archives")
        elif self.adapters and self.lora_shape is not None:
            raise ValueError("lora_shape: only for an engine without an adapter (a standby); got adapters")
        expand_modes(self.lora_expand)  # ValueError naming the field
        if self.overlap_steps is not None and not isinstance(self.overlap_steps, bool):
            raise ValueError(f"overlap_steps: must be true, false or null, got {self.overlap_steps!r}")
        if self.decode_attention not in DECODE_ATTENTION_KERNELS:
            raise ValueError(
                f"decode_attention: {self.decode_attention!r} is not one of {DECODE_ATTENTION_KERNELS}"
            )
        if not isinstance(self.rope_in_attention, bool):
            raise ValueError(f"rope_in_attention: must be true or false, got {self.rope_in_attention!r}")
        if self.lora_shrink not in LORA_SHRINKS:
            raise ValueError(f"lora_shrink: {self.lora_shrink!r} is not one of {LORA_SHRINKS}")
        if not 0 <= self.gemm_prologue_rows <= SKINNY_GEMM_MAX_ROWS:
            raise ValueError(
                f"gemm_prologue_rows: must be in [0, {SKINNY_GEMM_MAX_ROWS}], got {self.gemm_prologue_rows}"
            )
        if not 1 <= self.skinny_gemm_rows <= SKINNY_GEMM_MAX_ROWS:
            raise ValueError(
                f"skinny_gemm_rows: must be in [1, {SKINNY_GEMM_MAX_ROWS}], got {self.skinny_gemm_rows}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {DTYPES}")
        if not (self.device == "cpu" or str(self.device).startswith("cuda")):
            raise ValueError(f"device: {self.device!r}; use 'cpu', 'cuda' or 'cuda:N'")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len: must be positive, got {self.max_model_len}")
        if self.num_kv_blocks is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("num_kv_blocks, kv_cache_memory_bytes: give at most one of the two")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks: must be positive, got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes: must be positive, got {self.kv_cache_memory_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        sizes = tuple(sorted(set(self.cuda_graph_batch_sizes)))
        if not sizes or sizes[0] < 1:
            raise ValueError(
                f"cuda_graph_batch_sizes: positive sizes needed, got {self.cuda_graph_batch_sizes}"
            )
        self.cuda_graph_batch_sizes = sizes
        tokens = tuple(sorted(set(self.prefill_graph_tokens)))
        if tokens and tokens[0] < 2:  # larger ones than a chunk can fill are left out (ModelRunner)
            raise ValueError(
                f"prefill_graph_tokens: buckets of at least 2 tokens, got {self.prefill_graph_tokens}"
            )
        self.prefill_graph_tokens = tokens

    @property
    def resolved_cache_dir(self) -> Path:
        if self.cache_dir is not None:
            return Path(self.cache_dir)
        return default_cache_dir()


SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """The fields of an HF config.json that the Llama family needs (Llama 2/3, Mistral, Qwen2, SmolLM2)."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"model: no config.json in {model_dir}")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type: {model_type!r} is not supported; use one of {SUPPORTED_MODEL_TYPES}"
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act: {act!r} is not supported; the Llama family uses 'silu'")
        # transformers >= 5 writes `rope_parameters` (theta inside); older versions `rope_theta` +
        # `rope_scaling`.
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_scaling: rope_type {rope_type!r} is not supported; use {SUPPORTED_ROPE_TYPES}"
            )
        rope_scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        head_dim = raw.get("head_dim") or hidden // num_heads
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        window = raw.get("sliding_window")
        if model_type == "qwen2" and not raw.get("use_sliding_window", False):
            window = None
        return cls(
            model_type=model_type,
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            vocab_size=int(raw["vocab_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            sliding_window=int(window) if window else None,
        )

    @property
    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(out_features, in_features) of each LoRA-targetable projection of one decoder layer."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (q, h),
            "k_proj": (kv, h),
            "v_proj": (kv, h),
            "o_proj": (h, q),
            "gate_proj": (i, h),
            "up_proj": (i, h),
            "down_proj": (h, i),
        }
