"""The Llama family as plain tensor code over a flattened batch of chunks (varlen), with unmerged LoRA.

One forward takes T tokens of several sequences at once: first the single-token chunks (decodes,
attended with paged attention over the KV cache), then the multi-token prefill chunks (SDPA over the
cached prefix + the chunk, causally). Only the rows in `logits_indices` go through the LM head.

Weights come from a WeightSource and are held as they are handed out (views): nothing here writes
to them. LoRA tensors are private (lora.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lorafn.runtime.attention import paged_decode_attention, prefill_attention, write_kv
from lorafn.runtime.config import (
    DEFAULT_DECODE_ATTENTION,
    DEFAULT_EXPAND_IN_GEMM,
    DEFAULT_GEMM_PROLOGUE_ROWS,
    DEFAULT_LORA_EXPAND,
    DEFAULT_LORA_SHRINK,
    DEFAULT_ROPE_IN_ATTENTION,
    DEFAULT_SKINNY_GEMM_ROWS,
    ModelConfig,
    expand_modes,
)
from lorafn.runtime.lora import SHRINK_GROUPS, LoRAGroup, LoRAWeights, slot_masks
from lorafn.runtime.weights import WeightSource


@dataclass
class PrefillSpan:
    """A multi-token chunk in the flattened batch: rows token_offset..token_offset+num_tokens-1.

    start: the position of its first token; kv_slots [start + num_tokens] (int64): the KV-cache slots of
    positions 0..start+num_tokens-1, needed only when start > 0 (a cached prefix to attend to).
    """

    token_offset: int
    num_tokens: int
    start: int
    kv_slots: torch.Tensor | None = None


@dataclass
class ForwardBatch:
    """Inputs of one forward. input_ids, positions, slot_mapping: [T] int64 (slot_mapping: where each
    token's K/V is stored). The first `num_decodes` rows are single-token chunks: block_tables
    [num_decodes, M] int32 and context_lens [num_decodes] int32 describe their cached context.
    logits_indices [S] int64: the rows whose logits are wanted (None: all rows)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    num_decodes: int
    block_tables: torch.Tensor | None
    context_lens: torch.Tensor | None
    prefills: list[PrefillSpan]
    logits_indices: torch.Tensor | None
    # [T] int64: each row's adapter slot, for a model whose LoRA buffers hold several (lora.py, adapter
    # slots); None with one adapter (or none)
    adapter_slots: torch.Tensor | None = None


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies, with Llama-3 or linear scaling as transformers does."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos, sin [T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def lora_project(
    x: torch.Tensor,
    outputs: dict[str, torch.Tensor],
    group: LoRAGroup | None,
    ops=None,
    mask: torch.Tensor | None = None,
) -> None:
    """Adds s·(x·Aᵀ)·Bᵀ into each output of the group, in place: one shrink GEMM for the group (its A
    matrices concatenated), then the expands (`add_expands`). `mask`: the group's adapter-slot mask
    (lora.slot_masks), applied to the shrink's output first."""
    if group is None:
        return
    t = F.linear(x, group.a_cat)  # [T, sum of ranks]
    if mask is not None:
        t.mul_(mask)
    add_expands(t, [(outputs[p], off, rank, b_t) for p, off, rank, b_t in group.targets], ops)


def add_expands(
    t: torch.Tensor, targets: list[tuple[torch.Tensor, int, int, torch.Tensor]], ops=None
) -> None:
    """y += t[:, off:off+rank]·b_t for each (y, off, rank, b_t) of one projection group, in place. With
    `ops` (triton_ops, CUDA) in one launch for the group (`triton_ops.lora_expand`), else one `addmm_` per
    projection (the add happens in the GEMM's epilogue). The launch accumulates in float32 and rounds once,
    as addmm_ does on a CPU; cuBLAS's bf16 addmm_ on the H100 appears to round t·b_t first (one bf16 step
    apart on ~28% of outputs, docs/runtime.md). The launch count differs too (eager prefill of a 7B with
    r16 all-linear: 7 expands per layer -> 4)."""
    if ops is not None:
        ops.lora_expand(t, targets)
        return
    for y, off, rank, b_t in targets:
        y.addmm_(t[:, off : off + rank], b_t)


class LlamaModel:
    """Holds the backbone tensors (views from the WeightSource) and an optional private adapter."""

    def __init__(
        self,
        cfg: ModelConfig,
        source: WeightSource,
        device: torch.device,
        dtype: torch.dtype,
        lora: LoRAWeights | None = None,
        max_position: int | None = None,
        use_triton_attention: bool = False,
        fused_decode: bool = False,
        lora_expand: str = DEFAULT_LORA_EXPAND,
        skinny_gemm_rows: int = DEFAULT_SKINNY_GEMM_ROWS,
        decode_attention: str = DEFAULT_DECODE_ATTENTION,
        expand_in_gemm: bool = DEFAULT_EXPAND_IN_GEMM,
        gemm_prologue_rows: int = DEFAULT_GEMM_PROLOGUE_ROWS,
        lora_shrink: str = DEFAULT_LORA_SHRINK,
        rope_in_attention: bool = DEFAULT_ROPE_IN_ATTENTION,
    ) -> None:
        self.cfg, self.device, self.dtype, self.lora = cfg, device, dtype, lora
        self.decode_attention = decode_attention  # EngineConfig.decode_attention
        self.expand_in_gemm = expand_in_gemm  # EngineConfig.expand_in_gemm
        self.gemm_prologue_rows = gemm_prologue_rows  # EngineConfig.gemm_prologue_rows
        self.lora_expand = lora_expand  # EngineConfig.lora_expand
        self.rope_in_attention = rope_in_attention  # EngineConfig.rope_in_attention
        self.skinny_gemm_rows = skinny_gemm_rows  # EngineConfig.skinny_gemm_rows
        # the mode of a step with a prefill chunk, of a step of decodes only (config.expand_modes)
        self.prefill_expand, self.decode_expand = expand_modes(lora_expand)
        self.use_triton_attention = use_triton_attention
        # On CUDA with Triton: fused RMSNorm(+residual), RoPE and SiLU·up (models/triton_ops.py).
        self.ops = None
        if use_triton_attention:
            from lorafn.runtime.models import triton_ops

            self.ops = triton_ops
        names = set(source.names())

        def get(name: str) -> torch.Tensor:
            return source.get(name, device, dtype)

        def maybe(name: str) -> torch.Tensor | None:
            return get(name) if name in names else None

        self.embed = get("model.embed_tokens.weight")
        self.norm = get("model.norm.weight")
        if cfg.tie_word_embeddings or "lm_head.weight" not in names:
            self.lm_head = self.embed
        else:
            self.lm_head = get("lm_head.weight")
        self.layers: list[dict[str, torch.Tensor | None]] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            layer: dict[str, torch.Tensor | None] = {
                "input_layernorm": get(p + "input_layernorm.weight"),
                "post_attention_layernorm": get(p + "post_attention_layernorm.weight"),
            }
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                layer[proj] = get(f"{p}self_attn.{proj}.weight")
                layer[proj + ".bias"] = maybe(f"{p}self_attn.{proj}.bias")
            for proj in ("gate_proj", "up_proj", "down_proj"):
                layer[proj] = get(f"{p}mlp.{proj}.weight")
                layer[proj + ".bias"] = maybe(f"{p}mlp.{proj}.bias")
            self.layers.append(layer)
        max_position = max_position or cfg.max_position_embeddings
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), rope_inv_freq(cfg))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)  # [max_position, D]
        self.sin = emb.sin().to(device=device, dtype=dtype)
        self.scale = cfg.head_dim**-0.5
        # small steps through models/fused_decode.py: CUDA + Triton, no biases, widths it can tile
        self.fused = None
        self.shrink_tickets: torch.Tensor | None = None
        if fused_decode and self.ops is not None:
            from lorafn.runtime.models import fused_decode as fd

            widths = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim)
            no_bias = all(v is None for layer in self.layers for k, v in layer.items() if k.endswith(".bias"))
            if no_bias and all(fd.block_k(w) is not None for w in widths) and dtype in fd.DOT_PRECISION:
                self.fused = fd
                # the counters of the skinny GEMMs that add their expands inside, one per (layer, GEMM
                # group) and zeroed at each step's start (made now: before any capture, in the arena's
                # state pool when there is one; graphs hold their address)
                self.seg_flags = (
                    fd.seg_flags(device, len(self.layers) * len(SHRINK_GROUPS)) if expand_in_gemm else None
                )
                # lora_shrink "triton": the tickets of its launches (zero between them), made now as above
                self.shrink_tickets = (
                    self.ops.shrink_tickets(device, self.ops.SHRINK_MAX_ROWS)
                    if lora_shrink == "triton" and lora is not None
                    else None
                )

    def weight_bytes(self) -> int:
        """Bytes of backbone weights one decode step reads: every layer, the final norm and the LM head
        (the embedding table only through a few rows, so it is not counted unless tied to the head)."""
        tensors = {t.data_ptr(): t for layer in self.layers for t in layer.values() if t is not None}
        tensors.update({self.norm.data_ptr(): self.norm, self.lm_head.data_ptr(): self.lm_head})
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def _norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(h + delta), h + delta): the residual add and the next norm, fused on CUDA."""
        eps = self.cfg.rms_norm_eps
        if self.ops is None:
            if delta is not None:
                h = h + delta
            return rms_norm(h, weight, eps), h
        if delta is None:
            return self.ops.rms_norm(h, weight, eps), h
        h, x = self.ops.add_rms_norm(h, delta, weight, eps)
        return x, h

    def _linear(self, x: torch.Tensor, layer: dict, proj: str) -> torch.Tensor:
        return F.linear(x, layer[proj], layer[proj + ".bias"])

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, k_cache, v_cache
    ) -> torch.Tensor:
        """Attention of the step's rows: q [T, H, D], k, v [T, Hkv, D] (already in the cache) -> [T, H·D]."""
        nd, nkv, hd = batch.num_decodes, self.cfg.num_kv_heads, self.cfg.head_dim
        pieces = []
        if nd:
            pieces.append(
                paged_decode_attention(
                    q[:nd],
                    k_cache,
                    v_cache,
                    batch.block_tables,
                    batch.context_lens,
                    self.scale,
                    self.use_triton_attention,
                    self.decode_attention,
                )
            )
        for span in batch.prefills:
            rows = slice(span.token_offset, span.token_offset + span.num_tokens)
            if span.start == 0:
                kk, vv = k[rows], v[rows]
            else:
                kk = k_cache.view(-1, nkv, hd)[span.kv_slots]
                vv = v_cache.view(-1, nkv, hd)[span.kv_slots]
            pieces.append(prefill_attention(q[rows], kk, vv, span.start, self.scale))
        attn = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
        return attn.reshape(q.shape[0], -1)

    def _attend_rope(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, k_cache, v_cache
    ) -> torch.Tensor:
        """A step of decodes only (rope_in_attention): q [B, H·D], k, v [B, Hkv·D] as the q/k/v projections
        wrote them -> attention [B, H·D], with RoPE and the K/V cache writes inside the same launch."""
        from lorafn.runtime.attention.triton_decode import paged_decode_attention_rope

        attn = paged_decode_attention_rope(
            q, k, v, self.cos, self.sin, batch.positions, batch.slot_mapping, k_cache, v_cache,
            batch.block_tables, batch.context_lens, self.scale, kernel=self.decode_attention,
        )  # fmt: skip
        return attn.reshape(q.shape[0], -1)

    def _row_slots(self, batch: ForwardBatch) -> torch.Tensor | None:
        """The step's [T] row slots on a model with adapter slots (a step that names none is refused); None
        with one adapter slot."""
        lora = self.lora
        if lora is None or lora.num_slots == 1:
            return None
        if batch.adapter_slots is None:
            raise ValueError(f"adapter_slots: the model has {lora.num_slots} adapter slots; name each row's")
        return batch.adapter_slots

    def slot_masks(self, batch: ForwardBatch) -> dict[str, torch.Tensor]:
        """The step's adapter-slot masks per shrink group (lora.slot_masks); {} with one adapter slot."""
        rows = self._row_slots(batch)
        return {} if rows is None else slot_masks(self.lora, rows, self.dtype)  # type: ignore[arg-type]

    def expand_mode(self, batch: ForwardBatch) -> str:
        """The LORA_EXPANDS mode of this step: the prefill one when it has a prefill chunk (a mixed step
        of decodes + chunked prefill too), else (decodes only: every decode CUDA graph) the decode one."""
        return self.prefill_expand if batch.prefills else self.decode_expand

    def forward(
        self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """Returns logits [S, vocab] (float32) for the rows in batch.logits_indices."""
        cfg = self.cfg
        num_tokens = batch.input_ids.shape[0]
        mode = self.expand_mode(batch)
        if self.fused is not None:
            return self._forward_fused(batch, kv_caches, mode)
        # the ops that add a group's expands in one launch (add_expands), or None: one addmm_ each
        expand_ops = self.ops if mode == "grouped" else None
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        lora_layers = self.lora.layers if self.lora is not None else None
        masks = self.slot_masks(batch)
        ops, eps = self.ops, cfg.rms_norm_eps
        h = F.embedding(batch.input_ids, self.embed)
        if ops is None:
            cos = self.cos[batch.positions].unsqueeze(1)
            sin = self.sin[batch.positions].unsqueeze(1)
        delta = None  # the last sub-layer's output, added to h together with the next norm
        for i, layer in enumerate(self.layers):
            groups = lora_layers[i] if lora_layers is not None else {}
            x, h = self._norm(h, delta, layer["input_layernorm"])
            qkv = {p: self._linear(x, layer, p) for p in ("q_proj", "k_proj", "v_proj")}
            lora_project(x, qkv, groups.get("q_proj"), expand_ops, masks.get("q_proj"))
            if ops is not None:
                q = ops.rope(qkv["q_proj"], nh, self.cos, self.sin, batch.positions)
                k = ops.rope(qkv["k_proj"], nkv, self.cos, self.sin, batch.positions)
            else:
                q = apply_rope(qkv["q_proj"].view(num_tokens, nh, hd), cos, sin)
                k = apply_rope(qkv["k_proj"].view(num_tokens, nkv, hd), cos, sin)
            v = qkv["v_proj"].view(num_tokens, nkv, hd)
            k_cache, v_cache = kv_caches[i]
            write_kv(k_cache, v_cache, k, v, batch.slot_mapping)
            attn = self._attend(q, k, v, batch, k_cache, v_cache)
            o = {"o_proj": self._linear(attn, layer, "o_proj")}
            lora_project(attn, o, groups.get("o_proj"), expand_ops, masks.get("o_proj"))
            x, h = self._norm(h, o["o_proj"], layer["post_attention_layernorm"])
            gu = {p: self._linear(x, layer, p) for p in ("gate_proj", "up_proj")}
            lora_project(x, gu, groups.get("gate_proj"), expand_ops, masks.get("gate_proj"))
            if ops is not None:
                act = ops.silu_mul(gu["gate_proj"], gu["up_proj"])
            else:
                act = F.silu(gu["gate_proj"]) * gu["up_proj"]
            d = {"down_proj": self._linear(act, layer, "down_proj")}
            lora_project(act, d, groups.get("down_proj"), expand_ops, masks.get("down_proj"))
            delta = d["down_proj"]
        h = h + delta
        if batch.logits_indices is not None:
            h = h[batch.logits_indices]
        h = rms_norm(h, self.norm, eps) if ops is None else ops.rms_norm(h, self.norm, eps)
        return F.linear(h, self.lm_head).float()

    def _forward_fused(
        self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], mode: str
    ) -> torch.Tensor:
        """`forward` in the fused kernels of models/fused_decode.py (same math, same roundings). Per layer:
        norm, q/k/v GEMMs + the group's LoRA shrink, RoPE + q/k/v expands + cache writes, attention, o GEMM +
        shrink, add + o expand + norm, gate/up GEMMs + shrink, SiLU·up + expands, down GEMM + shrink (its
        expand joins the next layer's add + norm). A step of at most `skinny_gemm_rows` rows runs each GEMM
        group as one skinny-GEMM launch (its shrink inside), a larger one through cuBLAS; a step above
        fused_decode.MAX_TOKENS rows (prefill, decode batches > 16) adds its expands as its `mode`
        (`expand_mode`, a LORA_EXPANDS name) says: grouped, on the tensor cores over tiles of rows inside
        the kernel that reads the projection's output anyway (q/k/v: RoPE + cache writes; gate/up: SiLU·up;
        o, down: add + RMSNorm from TILED_NORM_MIN_ROWS rows, else one lora_expand launch each; triton_ops),
        so LoRA costs the 4 shrink GEMMs per layer and at most 2 launches more; per_projection, one addmm_
        per projection; or in_kernels, in the fused kernels as a small step does (no launch either, but each
        of the kernel's programs is one row and reads its rank rows of B again, rows x B bytes)."""
        cfg, fd, ops, eps = self.cfg, self.fused, self.ops, self.cfg.rms_norm_eps
        lora_layers = self.lora.layers if self.lora is not None else None
        h = F.embedding(batch.input_ids, self.embed)
        num_rows = batch.input_ids.shape[0]
        # a step whose GEMMs are skinny ones adds its expands inside them (expand_in_gemm): the kernels
        # that follow get none, so `settle` and `mode` below change nothing for it
        in_gemm = self.expand_in_gemm and num_rows <= self.skinny_gemm_rows
        if in_gemm and lora_layers is not None:
            self.seg_flags.zero_()  # type: ignore[union-attr]  (each GEMM's counter: zero when it starts)
        # a large step keeps its expands out of the per-row decode kernels (each of their programs reads its
        # rank rows of B again: B's bytes x rows) unless the mode is in_kernels
        settle = num_rows > fd.MAX_TOKENS and mode != "in_kernels"
        # a small step whose GEMMs are skinny ones computes their inputs inside them (gemm_prologue_rows): the
        # residual add + RMSNorm before q/k/v and gate/up, SiLU·up before down; with an adapter only where its
        # expands are inside the GEMMs too (the separate kernels would add o's, down's and gate/up's)
        pro = num_rows <= min(self.gemm_prologue_rows, self.skinny_gemm_rows) and (
            self.lora is None or in_gemm
        )
        # adapter slots: the per-row kernels read each row's own slot (Expand.row_slots); a settled step's
        # expands (GEMMs over all rows) read every slot's columns, the others' masked to zeros first; the
        # skinny GEMMs read each row's slot too
        rows = self._row_slots(batch)
        masks = self.slot_masks(batch) if rows is not None and settle and not in_gemm else {}
        row_slots = rows if in_gemm or not settle else None
        expand_ops = ops if mode == "grouped" else None
        # rope_in_attention: a step of decodes only rotates q, k and writes K/V inside its attention launch
        rope_in_attn = self.rope_in_attention and batch.num_decodes == num_rows and not batch.prefills
        # grouped, large step: every expand inside the kernel that reads its projection's output anyway, on
        # the tensor cores over tiles of rows (q/k/v: RoPE + cache writes; o, down: add + RMSNorm; gate/up:
        # SiLU·up)
        tiled = settle and expand_ops is not None

        def add_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, lora) -> tuple:
            """(h + delta + its expand, the norm of it): o and down's expands (see TILED_NORM_MIN_ROWS)."""
            if tiled and lora is not None:
                if h.shape[0] >= ops.TILED_NORM_MIN_ROWS:
                    return ops.add_rms_norm_expand(h, delta, weight, eps, lora)
                ops.lora_expand(lora.t, [(delta, lora.offset, lora.rank, lora.b_t)])
                lora = None
            return ops.add_rms_norm(h, delta, weight, eps, lora=lora)

        def pre_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, lora) -> tuple:
            """(the residual h + delta, the next GEMM's input, its prologue or None): with `pro`, the GEMM
            computes the norm (and writes the residual) itself from h; else add_norm (or the first norm)."""
            if pro:
                if delta is None:
                    return h, h, fd.NormPrologue(weight, eps)
                res = torch.empty_like(h)
                return res, h, fd.NormPrologue(weight, eps, delta, res)
            if delta is None:
                return h, ops.rms_norm(h, weight, eps), None
            return (*add_norm(h, delta, weight, lora), None)

        delta: torch.Tensor | None = None
        delta_lora = None
        for i, layer in enumerate(self.layers):
            groups = lora_layers[i] if lora_layers is not None else {}
            h, x, norm = pre_norm(h, delta, layer["input_layernorm"], delta_lora)
            (q, k, v), qkv_lora = self._group_gemm(
                x, layer, SHRINK_GROUPS[0], groups, masks, row_slots, in_gemm, norm, site=(i, 0)
            )
            k_cache, v_cache = kv_caches[i]
            if rope_in_attn and qkv_lora is None:  # decodes only, nothing left to add to q/k/v
                attn = self._attend_rope(q, k, v, batch, k_cache, v_cache)
            else:
                rope = ops.rope_expand_kv if tiled and qkv_lora else fd.rope_lora_kv
                if settle and not tiled:
                    qkv_lora = _settle_expands((q, k, v), qkv_lora, expand_ops)
                q, k, v = rope(
                    q,
                    k,
                    v,
                    qkv_lora,
                    cfg.num_heads,
                    cfg.num_kv_heads,
                    self.cos,
                    self.sin,
                    batch.positions,
                    k_cache,
                    v_cache,
                    batch.slot_mapping,
                )
                attn = self._attend(q, k, v, batch, k_cache, v_cache)
            (o,), o_lora = self._group_gemm(
                attn, layer, SHRINK_GROUPS[1], groups, masks, row_slots, in_gemm, site=(i, 1)
            )
            if settle and not tiled:
                o_lora = _settle_expands((o,), o_lora, expand_ops)
            h, x, norm = pre_norm(h, o, layer["post_attention_layernorm"], o_lora and o_lora[0])
            (gate, up), gu_lora = self._group_gemm(
                x, layer, SHRINK_GROUPS[2], groups, masks, row_slots, in_gemm, norm, site=(i, 2)
            )
            silu = None
            if pro:  # the down GEMM computes SiLU(gate)·up itself
                act, silu = gate, fd.SiluMulPrologue(up)
            elif tiled and gu_lora is not None:
                act = ops.silu_mul_expand(gate, up, gu_lora)
            else:
                if settle:
                    gu_lora = _settle_expands((gate, up), gu_lora, expand_ops)
                act = fd.silu_mul_lora(gate, up, gu_lora)
            (delta,), d_lora = self._group_gemm(
                act, layer, SHRINK_GROUPS[3], groups, masks, row_slots, in_gemm, silu, site=(i, 3)
            )
            if settle and not tiled:
                d_lora = _settle_expands((delta,), d_lora, expand_ops)
            delta_lora = d_lora and d_lora[0]
        assert delta is not None  # a model has layers
        _h, x = add_norm(h, delta, self.norm, delta_lora)
        if batch.logits_indices is not None:
            x = x[batch.logits_indices]
        return self._linear_many(x, [self.lm_head])[0].float()

    def _group_gemm(
        self,
        x: torch.Tensor,
        layer: dict,
        projs: tuple[str, ...],
        groups: dict[str, LoRAGroup],
        masks: dict[str, torch.Tensor],
        row_slots: torch.Tensor | None = None,
        in_gemm: bool = False,
        prologue=None,
        site: tuple[int, int] | None = None,
    ):
        """The projections `projs` of x and, when the adapter targets them, the group's shrink t = x·A_catᵀ
        (one launch for a small step), masked to each row's adapter slot (`masks`, `slot_masks`). Returns
        (outputs in `projs` order, one Expand or None per projection / None). `row_slots` (adapter slots, a
        step of the per-row kernels or `in_gemm`): Expands of one slot's rank that pick each row's slot.
        `in_gemm` (a skinny step, expand_in_gemm): the expands are added inside the same launch, and the
        outputs come with them (no Expands returned). `prologue` (gemm_prologue_rows: a skinny step): what x
        becomes inside the launch first (fused_decode.NormPrologue, SiluMulPrologue). `site` (layer, index in
        SHRINK_GROUPS): which of `seg_flags` an in_gemm launch counts into."""
        group = groups.get(projs[0])
        weights = [layer[p] for p in projs]
        if group is None:
            return self._linear_many(x, weights, prologue), None
        k = self.lora.num_slots if row_slots is not None else 1  # type: ignore[union-attr]
        if in_gemm:
            spec = {p: (off, rank // k, b_t) for p, off, rank, b_t in group.targets}
            expands = [spec.get(p) for p in projs]
            if site is None:  # a shared counter would let a later launch's waits pass early
                raise ValueError(f"{projs}: a skinny GEMM with its expands inside needs its site's counter")
            j = site[0] * len(SHRINK_GROUPS) + site[1]
            flags = self.seg_flags[j : j + 1]  # type: ignore[index]
            _t, *outs = self.fused.seg_linear(x, [group.a_cat, *weights], expands, row_slots, flags, prologue)
            return outs, None
        if self._triton_shrink(x, group):
            t = self.ops.lora_shrink(x, group.a_cat, self.shrink_tickets)  # (a cuBLAS step: no prologue)
            outs = self._linear_many(x, weights)
        else:
            t, *outs = self._linear_many(x, [group.a_cat, *weights], prologue)
        mask = masks.get(projs[0])
        if mask is not None:
            t.mul_(mask)
        by_proj = {
            p: self.fused.Expand(t, off, rank // k, b_t, row_slots) for p, off, rank, b_t in group.targets
        }
        return outs, tuple(by_proj.get(p) for p in projs)

    def _triton_shrink(self, x: torch.Tensor, group: LoRAGroup) -> bool:
        """Whether this group's shrink runs as triton_ops.lora_shrink (EngineConfig.lora_shrink "triton"): a
        step above skinny_gemm_rows rows (below: inside the skinny GEMM) that its tickets cover, of at most
        SHRINK_MAX_RANKS ranks summed."""
        ops = self.ops
        return (
            self.shrink_tickets is not None
            and self.skinny_gemm_rows < x.shape[0] <= ops.SHRINK_MAX_ROWS
            and group.a_cat.shape[0] <= ops.SHRINK_MAX_RANKS
        )

    def _linear_many(self, x: torch.Tensor, weights: list[torch.Tensor], prologue=None) -> list[torch.Tensor]:
        """[x·Wᵀ for each W]: one segmented skinny-GEMM launch for at most `skinny_gemm_rows` rows (with its
        `prologue`, if any), else cuBLAS."""
        if x.shape[0] <= self.skinny_gemm_rows:
            return self.fused.seg_linear(x, weights, prologue=prologue)
        if prologue is not None:
            raise ValueError(f"a GEMM prologue needs a skinny step, got {x.shape[0]} rows")
        return [F.linear(x, w) for w in weights]


def _settle_expands(outs, expands, ops) -> None:
    """Adds a group's expands (one Expand or None per output, from `_group_gemm`) into its outputs now
    (`add_expands`); returns None: the kernels that follow have nothing left to add."""
    if expands is not None:
        targets = [(y, e.offset, e.rank, e.b_t) for y, e in zip(outs, expands, strict=True) if e is not None]
        add_expands(next(e for e in expands if e is not None).t, targets, ops)
    return None
