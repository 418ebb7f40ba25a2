"""Unmerged LoRA: load and validate a PEFT adapter, keep A and B privately, apply y = x·Wᵀ + s·(x·Aᵀ)·Bᵀ.

The backbone W is never touched. At load time the scale s (lora_alpha / r, or lora_alpha / sqrt(r)
with rslora) is folded into this worker's private copy of B, so the forward pays two small GEMMs per
target and nothing else: a shrink x·Aᵀ (shared by the projections that read the same input: q/k/v
and gate/up, whose A matrices are concatenated — a private copy, so that is free) and an expand
`addmm(y, t, Bᵀ)` that adds into the base output in the GEMM's epilogue. B is kept transposed, [r, out]
contiguous: the fused decode kernels (models/fused_decode.py) read rows of it, addmm takes it as is.

Anything this math cannot express exactly is refused at load time with a ValueError naming the field:
the config-level checks are `lorafn.api.adapters.check_adapter_config`, the ones the operator and
`lorafn apply` run too (an AdapterProblem, a ValueError); the tensor-level ones are here.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lorafn.api.adapters import CheckedConfig, check_adapter_config, foreign_tensor
from lorafn.api.sizing import parse_shape_key
from lorafn.runtime.config import ModelConfig

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Projections that read the same input and so share one shrink GEMM.
SHRINK_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
_GROUP_HEAD = {p: group[0] for group in SHRINK_GROUPS for p in group}  # projection -> its group's key
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[^.]+)?\.weight$"
)


@dataclass
class LoRAGroup:
    """One shrink GEMM and its expands, for one layer: t = x·A_catᵀ; y_p += t[:, off_p:off_p+r_p]·B_pᵀ."""

    a_cat: torch.Tensor  # [sum of ranks, in_features]
    targets: list[tuple[str, int, int, torch.Tensor]]  # (projection, offset, rank, Bᵀ scaled [r, out])


@dataclass
class LoRAWeights:
    """A loaded adapter: per layer, per shrink group (keyed by the group's first projection)."""

    layers: list[dict[str, LoRAGroup]] = field(default_factory=list)
    ranks: dict[str, int] = field(default_factory=dict)  # projection -> rank (max over layers)
    target_modules: tuple[str, ...] = ()
    # Adapter slots (`zero_lora(num_slots=K)`): buffers for K adapters of this shape, so that one batch
    # serves rows of K functions (docs/runtime.md#adapter-slots). Each group's a_cat and Bᵀs hold the K
    # slots projection-major: projection p's A rows are [K·off_p + s·r_p, +r_p) for slot s, its Bᵀ rows
    # [s·r_p, +r_p); so a target reads as one expand of rank K·r_p at offset K·off_p, and every kernel
    # that adds expands runs unchanged. What keeps a row to its own slot: in the per-row CUDA kernels, the
    # row's slot picks its columns and B rows (fused_decode.Expand.row_slots); everywhere else `slot_masks`
    # zeroes the shrink's columns of the other slots before the expands (exact: they add x·0).
    num_slots: int = 1
    # per group (keyed as `layers`' dicts): the slot of each shrink column, [K·sum of ranks] int64
    col_slots: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def shape_key(self) -> str:
        """The adapter shape (DESIGN §2): what CUDA graph archives of this adapter depend on."""
        return ",".join(f"{m}:{self.ranks[m]}" for m in self.target_modules)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the adapter, in layer and group order: each group's a_cat, then its Bᵀs."""
        return [
            t
            for groups in self.layers
            for g in groups.values()
            for t in (g.a_cat, *(b for *_, b in g.targets))
        ]


def _refuse(field_name: str, detail: str) -> ValueError:
    return ValueError(f"adapter: {field_name}: {detail}")


def read_adapter_config(adapter_dir: str | Path, num_layers: int | None = None) -> CheckedConfig:
    """adapter_config.json, checked by `check_adapter_config`: a ValueError naming the first bad field.

    `num_layers` (the base model's) lets a regex `target_modules` be matched against its layers.
    """
    adapter_dir = Path(adapter_dir)
    if not adapter_dir.is_dir():
        raise _refuse("path", f"{adapter_dir} is not a directory")
    cfg_path = adapter_dir / "adapter_config.json"
    if not cfg_path.is_file():
        raise _refuse("adapter_config.json", f"missing in {adapter_dir}")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _refuse("adapter_config.json", f"{cfg_path} is not readable JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise _refuse("adapter_config.json", f"{cfg_path} is not a JSON object")
    return check_adapter_config(cfg, num_layers)


def load_lora(
    adapter_dir: str | Path,
    model_cfg: ModelConfig,
    device: torch.device | str,
    dtype: torch.dtype,
    pinned: bool = False,
) -> LoRAWeights:
    """Load, validate and lay out an adapter for the forward (private tensors on `device`).

    `pinned`: stage the packed buffer in page-locked host memory (one DMA). Off by default: a worker loads
    one adapter in its life, and pinning a fresh 128 MiB block costs about what it saves (on the H100, with
    the block already pinned, 67-93 ms against 104-147 ms pageable beside 4-12 busy processes)."""
    from safetensors.torch import load_file

    adapter_dir = Path(adapter_dir)
    cfg = read_adapter_config(adapter_dir, model_cfg.num_layers)
    weights_path = adapter_dir / "adapter_model.safetensors"
    if not weights_path.is_file():
        raise _refuse("adapter_model.safetensors", f"missing in {adapter_dir}")
    raw = load_file(str(weights_path))
    shapes = model_cfg.linear_shapes

    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in raw.items():
        m = _KEY.match(key)
        if m is None:
            raise _refuse(*foreign_tensor(key))
        layer, _, proj, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if proj not in TARGETS:
            raise _refuse("target_modules", f"tensor {key}: {proj!r} is not a Llama projection")
        if layer >= model_cfg.num_layers:
            raise _refuse(
                "adapter_model.safetensors",
                f"tensor {key}: layer {layer} >= the base's {model_cfg.num_layers}",
            )
        pairs.setdefault((layer, proj), {})[ab] = tensor
    if not pairs:
        raise _refuse("adapter_model.safetensors", "holds no LoRA tensors")

    out = LoRAWeights(layers=[{} for _ in range(model_cfg.num_layers)])
    per_layer: list[dict[str, tuple[torch.Tensor, torch.Tensor, float]]] = [
        {} for _ in range(model_cfg.num_layers)
    ]
    for (layer, proj), ab in sorted(pairs.items()):
        prefix = (
            f"base_model.model.model.layers.{layer}.{'self_attn' if proj in TARGETS[:4] else 'mlp'}.{proj}"
        )
        if set(ab) != {"A", "B"}:
            missing = ({"A", "B"} - set(ab)).pop()
            raise _refuse("adapter_model.safetensors", f"{prefix}.lora_{missing}.weight is missing")
        a, b = ab["A"], ab["B"]
        out_f, in_f = shapes[proj]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise _refuse(
                "r", f"{prefix}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not share one rank"
            )
        if a.shape[1] != in_f or b.shape[0] != out_f:
            raise _refuse(
                "shape",
                f"{prefix}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the base "
                f"weight [{out_f}, {in_f}] (lora_A must be [r, {in_f}], lora_B [{out_f}, r])",
            )
        rank = a.shape[0]
        module_name = prefix.removeprefix("base_model.model.")
        expected_r = cfg.rank_of(module_name)
        if expected_r != rank:
            field_name = "r" if expected_r == cfg.rank else "rank_pattern"
            raise _refuse(field_name, f"{prefix}: tensors have rank {rank}, adapter_config says {expected_r}")
        mod_alpha = cfg.alpha_of(module_name)
        scale = mod_alpha / math.sqrt(rank) if cfg.use_rslora else mod_alpha / rank
        per_layer[layer][proj] = (a, b, scale)
        out.ranks[proj] = max(out.ranks.get(proj, 0), rank)

    pieces = _layout(per_layer, dtype)
    total = pieces[-1].end if pieces else 0
    dev = torch.device(device)
    # Every tensor is built on the host, in one buffer, and crosses to the device in ONE copy: on a GPU
    # time-sliced between many worker processes each small copy or kernel waits for this process's turn (H100
    # replay: ~450 copies + ~700 small ops took 3.2-4.4 s with 10-20 requests running elsewhere, 0.45 s when
    # quiet). The host math runs on the worker's one CPU thread (GPU workers set torch.set_num_threads: many
    # workers oversubscribed the host).
    host = torch.empty(total, dtype=dtype, pin_memory=pinned and dev.type == "cuda")
    for piece in pieces:
        view = host[piece.start : piece.end].view(piece.shape)
        if piece.target is None:  # the group's A matrices, concatenated: [sum of ranks, in]
            row = 0
            for proj in piece.present:
                a = per_layer[piece.layer][proj][0]
                view[row : row + a.shape[0]].copy_(a)  # cast to dtype as `a.to(dtype)` would
                row += a.shape[0]
        else:  # Bᵀ, scale folded in float32 and rounded once to dtype: [r, out] contiguous
            _a, b, scale = per_layer[piece.layer][piece.target]
            view.copy_((b.to(torch.float32) * scale).t())
    if dev.type == "cpu":
        flat = host
    else:
        flat = torch.empty(total, dtype=dtype, device=dev)
        flat.copy_(host, non_blocking=host.is_pinned())
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()  # `host` may be reused once this returns

    targets: list[tuple[str, int, int, torch.Tensor]] = []
    off = 0
    for piece in pieces:  # views into the one device buffer, contiguous, each aligned as an allocation
        view = flat[piece.start : piece.end].view(piece.shape)
        if piece.target is None:  # a group starts: its a_cat, then its targets' Bᵀ
            targets, off = [], 0
            # keyed by the group's first projection, whether the adapter targets it or not (the forward and
            # zero_lora's buffers look groups up by it: a v_proj-only adapter is the q/k/v group's)
            out.layers[piece.layer][_GROUP_HEAD[piece.present[0]]] = LoRAGroup(a_cat=view, targets=targets)
        else:
            targets.append((piece.target, off, piece.shape[0], view))
            off += piece.shape[0]
    out.target_modules = tuple(t for t in TARGETS if t in out.ranks)
    return out


# Each packed tensor starts at a multiple of this many bytes, as one of its own would (the CUDA caching
# allocator's 512-byte blocks): vectorized loads in the Triton kernels and cuBLAS keep their alignment.
_ALIGN_BYTES = 512


@dataclass(frozen=True)
class _Piece:
    """Where one tensor of a loaded adapter lives in the packed buffer (elements of the adapter dtype)."""

    layer: int
    present: tuple[str, ...]  # the group's projections the adapter targets in this layer
    target: str | None  # None: the group's a_cat; else the projection whose Bᵀ this is
    shape: tuple[int, int]
    start: int
    end: int


def _layout(
    per_layer: list[dict[str, tuple[torch.Tensor, torch.Tensor, float]]], dtype: torch.dtype
) -> list[_Piece]:
    """The packed order: per layer, per shrink group, its a_cat then each target's Bᵀ. Pure."""
    align = max(1, _ALIGN_BYTES // dtype.itemsize)
    pieces: list[_Piece] = []
    at = 0

    def place(layer: int, present: tuple[str, ...], target: str | None, shape: tuple[int, int]) -> None:
        nonlocal at
        pieces.append(_Piece(layer, present, target, shape, at, at + shape[0] * shape[1]))
        at += -(-shape[0] * shape[1] // align) * align

    for layer, mods in enumerate(per_layer):
        for group in SHRINK_GROUPS:
            present = tuple(p for p in group if p in mods)
            if not present:
                continue
            in_f = mods[present[0]][0].shape[1]
            place(layer, present, None, (sum(mods[p][0].shape[0] for p in present), in_f))
            for p in present:
                a, b, _scale = mods[p]
                place(layer, present, p, (a.shape[0], b.shape[0]))
    return pieces


def zero_lora(
    shape: str,
    model_cfg: ModelConfig,
    device: torch.device | str,
    dtype: torch.dtype,
    num_slots: int = 1,
) -> LoRAWeights:
    """LoRA buffers of an adapter shape, all zeros: a standby worker computes the LoRA path with them (so
    its CUDA graphs include it) and a bind copies an adapter in place (`copy_lora`), graphs unchanged.

    `num_slots` K > 1: buffers for K adapters of the shape, laid out slot by slot inside each projection
    (see `LoRAWeights.num_slots`); `copy_lora_slot` fills one slot, `slot_masks` keeps each row to its
    slot. K = 1 is the one-adapter layout exactly."""
    if num_slots < 1:
        raise ValueError(f"num_slots: {num_slots} (at least 1)")
    ranks = parse_shape_key(shape)
    shapes = model_cfg.linear_shapes
    k = num_slots
    out = LoRAWeights(layers=[{} for _ in range(model_cfg.num_layers)], ranks=dict(ranks), num_slots=k)
    out.target_modules = tuple(t for t in TARGETS if t in ranks)
    for group in SHRINK_GROUPS:
        present = [p for p in group if p in ranks]
        if present:  # shrink column -> slot: projection-major, slot-minor
            cols = [s for p in present for s in range(k) for _ in range(ranks[p])]
            out.col_slots[group[0]] = torch.tensor(cols, dtype=torch.int64, device=device)
    for layer in range(model_cfg.num_layers):
        for group in SHRINK_GROUPS:
            present = [p for p in group if p in ranks]
            if not present:
                continue
            in_f = shapes[present[0]][1]
            a_cat = torch.zeros(k * sum(ranks[p] for p in present), in_f, device=device, dtype=dtype)
            targets, off = [], 0
            for p in present:
                b_t = torch.zeros(k * ranks[p], shapes[p][0], device=device, dtype=dtype)
                targets.append((p, off, k * ranks[p], b_t))
                off += k * ranks[p]
            out.layers[layer][group[0]] = LoRAGroup(a_cat=a_cat, targets=targets)
    return out


def copy_lora_slot(buffers: LoRAWeights, adapter: LoRAWeights, slot: int) -> None:
    """Copy an adapter into slot `slot` of slot buffers (`zero_lora(num_slots=K)`) of a shape it fits, in
    place; the slot's rows it leaves out (a lower rank, a projection it does not target) are zeroed, the
    other slots are not touched. The buffers' addresses (captured in CUDA graphs) do not change."""
    k = _check_slot(buffers, slot)
    if not fits_shape(adapter, buffers):
        raise ValueError(
            f"adapter shape {adapter.shape_key!r} does not fit the buffers' {buffers.shape_key!r}"
        )
    zero: list[torch.Tensor] = []
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    for layer, groups in enumerate(buffers.layers):
        src_groups = adapter.layers[layer]
        for head, d in groups.items():
            s = src_groups.get(head)
            if k == 1 and s is not None and [t[:3] for t in s.targets] == [t[:3] for t in d.targets]:
                # the adapter's own layout (its shape is the buffers'): whole tensors, nothing to pad
                dst += [d.a_cat, *(b for *_, b in d.targets)]
                src += [s.a_cat, *(b for *_, b in s.targets)]
                continue
            s_targets = {p: (off, r, b) for p, off, r, b in s.targets} if s is not None else {}
            for target in d.targets:
                p = target[0]
                a_rows, b_rows = _slot_rows(d.a_cat, target, slot, k)
                r = a_rows.shape[0]  # this projection's rank in one slot
                if p not in s_targets:
                    zero += [a_rows, b_rows]
                    continue
                s_off, s_r, b_src = s_targets[p]
                if s_r < r:
                    zero += [a_rows, b_rows]
                dst += [a_rows[:s_r], b_rows[:s_r]]
                src += [s.a_cat[s_off : s_off + s_r], b_src]  # type: ignore[union-attr]
    # grouped: a few multi-tensor launches instead of one per tensor (each a wait on a time-sliced GPU);
    # every zero comes before every copy, so a padded buffer gets its rows after its zeros
    if zero:
        torch._foreach_zero_(zero)
    if dst:
        torch._foreach_copy_(dst, src)


def _check_slot(buffers: LoRAWeights, slot: int) -> int:
    """The buffers' slot count K, once `slot` is one of them (ValueError naming it otherwise)."""
    k = buffers.num_slots
    if not 0 <= slot < k:
        raise ValueError(f"adapter slot: {slot} is not one of the buffers' {k} slots (0..{k - 1})")
    return k


def _slot_rows(
    a_cat: torch.Tensor, target: tuple[str, int, int, torch.Tensor], slot: int, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A rows, Bᵀ rows) of one slot of one target (projection, offset, K·rank, Bᵀ) in slot buffers: views."""
    _p, k_off, k_rank, b_t = target
    r = k_rank // k
    return a_cat[k_off + slot * r : k_off + (slot + 1) * r], b_t[slot * r : (slot + 1) * r]


def clear_lora_slot(buffers: LoRAWeights, slot: int) -> None:
    """Zero one slot of slot buffers in place (a function leaves its slot: nothing of it stays)."""
    k = _check_slot(buffers, slot)
    rows: list[torch.Tensor] = []
    for groups in buffers.layers:
        for d in groups.values():
            for target in d.targets:
                rows += _slot_rows(d.a_cat, target, slot, k)
    if rows:
        torch._foreach_zero_(rows)


def slot_masks(buffers: LoRAWeights, row_slots: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Per group (keyed as `buffers.layers`' dicts), the [T, K·sum of ranks] 0/1 mask of one step's rows:
    1 where the shrink column belongs to the row's adapter slot (row_slots [T] int64). A step multiplies
    each shrink output t by its group's mask before the expands, so row i adds only its slot's
    t·Bᵀ (the other columns are exact zeros: their products add nothing)."""
    rows = row_slots.unsqueeze(1)
    return {head: (cols.unsqueeze(0) == rows).to(dtype) for head, cols in buffers.col_slots.items()}


def fits_shape(adapter: LoRAWeights, buffers: LoRAWeights) -> bool:
    """True when every projection the adapter targets is in the buffers with at least its rank."""
    return all(buffers.ranks.get(m, 0) >= r for m, r in adapter.ranks.items())


def copy_lora(buffers: LoRAWeights, adapter: LoRAWeights) -> None:
    """Copy an adapter into buffers of a shape it fits, in place: lower ranks and projections the adapter
    leaves out are zero-padded (they add exact zeros: y + x·0ᵀ·0ᵀ), so the result equals the adapter's own
    forward and the buffers' addresses (captured in CUDA graphs) do not change. One-adapter buffers (a
    standby's); `copy_lora_slot` for slot buffers."""
    if buffers.num_slots != 1:
        raise ValueError(f"copy_lora: the buffers hold {buffers.num_slots} adapter slots (copy_lora_slot)")
    copy_lora_slot(buffers, adapter, 0)


def clear_lora(buffers: LoRAWeights) -> None:
    """Zero every buffer in place: a standby that pre-loaded one function's adapter and is bound to another
    whose adapter does not fit them drops them with nothing of the first left in its memory."""
    tensors = buffers.tensors()
    if tensors:
        torch._foreach_zero_(tensors)


def write_random_adapter(
    model_cfg: ModelConfig,
    out: str | Path,
    *,
    rank: int = 16,
    lora_alpha: float = 32.0,
    target_modules: list[str] | str = "all-linear",
    seed: int = 0,
    b_std: float = 0.01,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """A PEFT-format LoRA adapter with random A and random non-zero B for `model_cfg` (benchmarks, GPU tests).

    PeftModel.from_pretrained loads it as it loads one written by save_pretrained.
    """
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    targets = list(TARGETS) if target_modules == "all-linear" else list(target_modules)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(model_cfg.num_layers):
        for proj in targets:
            out_f, in_f = model_cfg.linear_shapes[proj]
            block = "self_attn" if proj in TARGETS[:4] else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{proj}"
            tensors[prefix + ".lora_A.weight"] = (
                torch.randn(rank, in_f, generator=gen) / math.sqrt(in_f)
            ).to(dtype)
            tensors[prefix + ".lora_B.weight"] = (torch.randn(out_f, rank, generator=gen) * b_std).to(dtype)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": lora_alpha,
        "target_modules": targets,
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "inference_mode": True,
        "init_lora_weights": True,
        "rank_pattern": {},
        "alpha_pattern": {},
        "base_model_name_or_path": None,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out
