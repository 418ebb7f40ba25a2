"""The adapter layout as `lorafn.runtime.lora` built it before the packed load (commit bb9892f): one small
device copy or op per tensor. Kept here, not in lorafn, as the reference the packed `load_lora`, `copy_lora`
and `clear_lora` must equal bit for bit (tests/unit/runtime/test_lora_packed.py,
tests/gpu/test_lora_load_gpu.py, bench/lora_load.py)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from lorafn.runtime.config import ModelConfig
from lorafn.runtime.lora import _KEY, SHRINK_GROUPS, TARGETS, LoRAGroup, LoRAWeights, read_adapter_config


def reference_load(
    adapter_dir: str | Path, model_cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype
) -> LoRAWeights:
    """The old algorithm for a valid adapter (no refusals: test_lora_refusals covers those on the new one)."""
    from safetensors.torch import load_file

    adapter_dir = Path(adapter_dir)
    cfg = read_adapter_config(adapter_dir, model_cfg.num_layers)
    raw = load_file(str(adapter_dir / "adapter_model.safetensors"))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in raw.items():
        m = _KEY.match(key)
        assert m is not None, key
        pairs.setdefault((int(m.group(1)), m.group(3)), {})[m.group(4)] = tensor
    out = LoRAWeights(layers=[{} for _ in range(model_cfg.num_layers)])
    per_layer: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(model_cfg.num_layers)]
    for (layer, proj), ab in sorted(pairs.items()):
        block = "self_attn" if proj in TARGETS[:4] else "mlp"
        module_name = f"model.layers.{layer}.{block}.{proj}"
        a, b = ab["A"], ab["B"]
        rank = a.shape[0]
        mod_alpha = cfg.alpha_of(module_name)
        scale = mod_alpha / math.sqrt(rank) if cfg.use_rslora else mod_alpha / rank
        b_scaled = (b.to(device=device).to(torch.float32) * scale).to(dtype)
        per_layer[layer][proj] = (a.to(device=device, dtype=dtype), b_scaled)
        out.ranks[proj] = max(out.ranks.get(proj, 0), rank)
    for layer, mods in enumerate(per_layer):
        for group in SHRINK_GROUPS:
            present = [p for p in group if p in mods]
            if not present:
                continue
            a_cat = torch.cat([mods[p][0] for p in present], dim=0).contiguous()
            targets, off = [], 0
            for p in present:
                r = mods[p][0].shape[0]
                targets.append((p, off, r, mods[p][1].t().contiguous()))
                off += r
            out.layers[layer][group[0]] = LoRAGroup(a_cat=a_cat, targets=targets)
    out.target_modules = tuple(t for t in TARGETS if t in out.ranks)
    return out


def reference_copy(buffers: LoRAWeights, adapter: LoRAWeights) -> None:
    """The old copy_lora: per group zero a_cat, per target zero B, copy its rows of A and its B."""
    for layer, groups in enumerate(buffers.layers):
        src_groups = adapter.layers[layer]
        for head, dst in groups.items():
            dst.a_cat.zero_()
            src = src_groups.get(head)
            src_targets = {p: (off, r, b) for p, off, r, b in src.targets} if src is not None else {}
            for p, off, _r, b_dst in dst.targets:
                b_dst.zero_()
                if p not in src_targets:
                    continue
                s_off, s_r, b_src = src_targets[p]
                dst.a_cat[off : off + s_r].copy_(src.a_cat[s_off : s_off + s_r])  # type: ignore[union-attr]
                b_dst[:s_r].copy_(b_src)


def assert_same(new: LoRAWeights, ref: LoRAWeights, *, check_layout: bool = True) -> None:
    """Bitwise equal: values, dtypes, shapes, contiguity, the targets' (projection, offset, rank), the ranks
    and target modules."""
    assert new.ranks == ref.ranks
    assert new.target_modules == ref.target_modules
    assert new.shape_key == ref.shape_key
    assert len(new.layers) == len(ref.layers)
    for layer, (n_groups, r_groups) in enumerate(zip(new.layers, ref.layers, strict=True)):
        assert list(n_groups) == list(r_groups), layer
        for head, n in n_groups.items():
            r = r_groups[head]
            pairs = [(n.a_cat, r.a_cat)] + [
                (nb, rb) for (*_, nb), (*_, rb) in zip(n.targets, r.targets, strict=True)
            ]
            assert [t[:3] for t in n.targets] == [t[:3] for t in r.targets], (layer, head)
            for nt, rt in pairs:
                assert nt.dtype == rt.dtype and nt.shape == rt.shape and nt.device == rt.device, (layer, head)
                if check_layout:
                    assert nt.is_contiguous() and nt.stride() == rt.stride(), (layer, head)
                assert_bitwise(nt, rt)


def assert_bitwise(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal bit for bit (a NaN equals the same NaN; -0.0 differs from 0.0)."""
    assert a.shape == b.shape and a.dtype == b.dtype
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    assert torch.equal(a.contiguous().view(ints).cpu(), b.contiguous().view(ints).cpu())
