"""Run by test_lora_grouped.py in a child with TRITON_INTERPRET=1: the CUDA model code (Triton kernels
interpreted on CPU tensors) with each `lora_expand` mode (and the per-step pairs: "hybrid",
"per_projection/grouped") against the plain torch CPU forward (one addmm_ per projection), float32; the
launches counted show which mode each step ran in.

    python -m tests.integration.runtime.lora_grouped_check [--slots] MODEL_DIR NAME=ADAPTER_DIR ...

`--slots`: only the adapter-slot check (`_check_slots`), the first three adapters in four slots.

Prints one line per check and `ok` last; exits non-zero (an AssertionError) on the first difference.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from lorafn.runtime.config import (
    DEFAULT_EXPAND_IN_GEMM,
    DEFAULT_LORA_SHRINK,
    LORA_EXPANDS,
    ModelConfig,
    expand_modes,
)
from lorafn.runtime.kv_cache import KVCache
from lorafn.runtime.local_weights import SafetensorsWeightSource
from lorafn.runtime.lora import LoRAWeights, clear_lora, copy_lora, copy_lora_slot, load_lora, zero_lora
from lorafn.runtime.models import fused_decode, triton_ops
from lorafn.runtime.models.llama import ForwardBatch, LlamaModel, PrefillSpan

TOL = 2e-6  # relative (norm) difference allowed between modes: float32 accumulation order only
DEV = torch.device("cpu")


# the modes run for the first adapter: every single one and two per-step pairs (prefill/decode)
MODES = (*LORA_EXPANDS, "hybrid", "per_projection/grouped")
DECODE_ROWS = 18  # the decode-only large step's rows


def _steps(cfg: ModelConfig, num_slots: int = 1) -> list[ForwardBatch]:
    """A 24-token prompt of sequence 0 (above the 16-row limit: a large step), a 21-token prompt of
    sequence 1 beside a decode of sequence 0 (22 rows: a mixed large step), a decode (a small step), then
    a step of 18 decodes only (a large decode step, as a decode graph's bucket 32 runs it): row i at
    position i of blocks 4-5 (slot 64 + i), attending to rows 0..i of the same step (written first)."""
    gen = torch.Generator().manual_seed(0)

    def ids(n: int) -> torch.Tensor:
        return torch.randint(5, cfg.vocab_size - 5, (n,), generator=gen)

    steps = [
        ForwardBatch(
            ids(24), torch.arange(24), torch.arange(24), 0, None, None, [PrefillSpan(0, 24, 0)], None
        )
    ]
    steps.append(
        ForwardBatch(
            ids(22),
            torch.cat([torch.tensor([24]), torch.arange(21)]),
            torch.cat([torch.tensor([24]), 32 + torch.arange(21)]),
            1,
            torch.tensor([[0, 1]], dtype=torch.int32),
            torch.tensor([25], dtype=torch.int32),
            [PrefillSpan(1, 21, 0)],
            None,
        )
    )
    steps.append(
        ForwardBatch(
            ids(1),
            torch.tensor([25]),
            torch.tensor([25]),
            1,
            torch.tensor([[0, 1]], dtype=torch.int32),
            torch.tensor([26], dtype=torch.int32),
            [],
            None,
        )
    )
    n = DECODE_ROWS
    steps.append(
        ForwardBatch(
            ids(n),
            torch.arange(n),
            64 + torch.arange(n),
            n,
            torch.tensor([[4, 5]] * n, dtype=torch.int32),
            torch.arange(1, n + 1, dtype=torch.int32),
            [],
            None,
        )
    )
    if num_slots > 1:  # adapter slots: rows of every slot in each step (the one-row step's in slot 1)
        for step in steps:
            step.adapter_slots = (torch.arange(step.input_ids.shape[0]) * 3 + 1) % num_slots
    return steps


def _forward(
    model_dir: Path,
    cfg: ModelConfig,
    lora: LoRAWeights | None,
    *,
    triton: bool,
    fused: bool,
    mode: str,
    skinny: int = 16,
    in_gemm: bool = DEFAULT_EXPAND_IN_GEMM,
    prologue_rows: int = 0,
    shrink: str = DEFAULT_LORA_SHRINK,
    rope_in_attention: bool = False,
    steps: list[ForwardBatch] | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor, int, int]:
    """(logits of every step, the KV cache after them, grouped expand launches: lora_expand, and on the
    fused path the kernels with a group's expand inside; q/k/v expands of steps above 16 rows inside the
    per-row RoPE kernel: in_kernels) of one model variant. `skinny` is EngineConfig.skinny_gemm_rows: 16
    here (not the default 64) so that the steps above 16 rows take cuBLAS + a shrink GEMM per group, the path
    of every step above skinny_gemm_rows; `_check_skinny` runs them through the segmented GEMM. `in_gemm`:
    EngineConfig.expand_in_gemm (the steps of the segmented GEMM add their expands inside it);
    `prologue_rows`: EngineConfig.gemm_prologue_rows (gemm_prologue_check.py); `shrink`:
    EngineConfig.lora_shrink; `rope_in_attention`: EngineConfig.rope_in_attention (rope_attention_check.py);
    `steps`: other steps than `_steps`'."""
    model = LlamaModel(
        cfg, SafetensorsWeightSource(model_dir), DEV, torch.float32, lora, max_position=128,
        use_triton_attention=triton, fused_decode=fused, lora_expand=mode, skinny_gemm_rows=skinny,
        expand_in_gemm=in_gemm, gemm_prologue_rows=prologue_rows, lora_shrink=shrink,
        rope_in_attention=rope_in_attention,
    )  # fmt: skip
    assert (model.fused is not None) == fused, "the fused path did not turn on"
    kv = KVCache(cfg, 8, 16, DEV, torch.float32)
    launches = in_kernels = 0
    names = ("lora_expand", "silu_mul_expand", "rope_expand_kv", "add_rms_norm_expand")
    real = {name: getattr(triton_ops, name) for name in names}
    real_rope = fused_decode.rope_lora_kv

    def counting(fn):
        def counted(*args):
            nonlocal launches
            launches += 1
            return fn(*args)

        return counted

    def rope_counted(q, k, v, lora, *rest):
        nonlocal in_kernels
        in_kernels += q.shape[0] > fused_decode.MAX_TOKENS and lora is not None
        return real_rope(q, k, v, lora, *rest)

    for name, fn in real.items():
        setattr(triton_ops, name, counting(fn))
    fused_decode.rope_lora_kv = rope_counted
    try:
        steps = steps if steps is not None else _steps(cfg, lora.num_slots if lora else 1)
        logits = [model.forward(step, kv.layers) for step in steps]
    finally:
        for name, fn in real.items():
            setattr(triton_ops, name, fn)
        fused_decode.rope_lora_kv = real_rope
    return logits, kv.data.clone(), launches, in_kernels


def check_base_and_adapters(argv: list[str], check) -> None:
    """`MODEL_DIR NAME=ADAPTER_DIR ...`: check(model_dir, cfg, name, lora) for the base model, then each
    adapter (float32), then "ok" (the model checks' common main)."""
    model_dir = Path(argv[0])
    cfg = ModelConfig.from_dir(model_dir)
    check(model_dir, cfg, "base", None)
    for name, path in (a.split("=", 1) for a in argv[1:]):
        check(model_dir, cfg, name, load_lora(Path(path), cfg, DEV, torch.float32))
    print("ok")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _same(name: str, got, want) -> None:
    logits, kv, *_ = got
    ref_logits, ref_kv, *_ = want
    for i, (a, b) in enumerate(zip(logits, ref_logits, strict=True)):
        assert _rel(a, b) < TOL, f"{name}: step {i} logits differ by {_rel(a, b):.2e}"
    assert _rel(kv, ref_kv) < TOL, f"{name}: KV cache differs by {_rel(kv, ref_kv):.2e}"


def _check_skinny(
    model_dir: Path, cfg: ModelConfig, lora: LoRAWeights, ref, name: str, most_rows: int
) -> None:
    """skinny_gemm_rows = 64: every step's GEMMs (up to `most_rows` rows) in the segmented skinny GEMM, the
    same output as the per-projection torch forward `ref`, with hybrid and with grouped expands, and with
    the expands inside the segmented GEMMs (expand_in_gemm; then every group's launch carries them, and its
    counter holds just its own shrink programs after it: zeroed at each step's start)."""
    real_seg, seg_rows = fused_decode.seg_linear, []

    def seg_counted(x, weights, expands=None, row_slots=None, flags=None, *rest, **kw):
        seg_rows.append((x.shape[0], expands is not None))
        outs = real_seg(x, weights, expands, row_slots, flags, *rest, **kw)
        if expands is not None:  # its counter was zero when it started (the model zeroes them every step)
            counted = fused_decode.shrink_programs(weights[0].shape[0])
            assert flags.tolist() == [counted], (flags.tolist(), counted)
        return outs

    groups = sum(len(layer) for layer in lora.layers)
    fused_decode.seg_linear = seg_counted
    try:
        for mode, in_gemm in (("hybrid", False), ("grouped", False), ("hybrid", True)):
            seg_rows.clear()
            got = _forward(
                model_dir, cfg, lora, triton=True, fused=True, mode=mode, skinny=64, in_gemm=in_gemm
            )
            _same(f"{name} skinny_gemm_rows=64 {mode} in_gemm={in_gemm}", got, ref)
            with_expands = sum(e for _rows, e in seg_rows)
            assert with_expands == in_gemm * groups * len(got[0]), (mode, in_gemm, with_expands, groups)
            assert (got[2], got[3]) == (0, 0) or not in_gemm, got[2:]  # in the GEMMs: none outside them
    finally:
        fused_decode.seg_linear = real_seg
    assert max(rows for rows, _e in seg_rows) == most_rows > fused_decode.MAX_TOKENS, seg_rows
    print(
        f"{name} skinny_gemm_rows=64: as per-projection torch (segmented GEMMs up to {most_rows} rows; the "
        "expands in the per-row kernels, or in the GEMMs)"
    )


def _check_slots(model_dir: Path, cfg: ModelConfig, adapters: list[LoRAWeights], shape: str) -> None:
    """Adapter slots: the first three adapters in slots of `shape` (the first one's; the other two must fit
    it) and an empty fourth, rows of every slot
    in each step; the CUDA code (per-row kernels reading each row's own slot, `Expand.row_slots`; settled
    large steps with the other slots' columns masked) against the torch forward of the same buffers, which
    the CPU engine tests hold to transformers + peft row by row."""
    slots = zero_lora(shape, cfg, DEV, torch.float32, num_slots=4)
    for s, lora in enumerate(adapters[:3]):
        copy_lora_slot(slots, lora, s)
    ref = _forward(model_dir, cfg, slots, triton=False, fused=False, mode="per_projection")
    one = _forward(model_dir, cfg, adapters[0], triton=False, fused=False, mode="per_projection")
    assert _rel(ref[0][0], one[0][0]) > 1e-3, "slots: the rows of other slots change nothing"
    for mode in ("hybrid", "grouped", "in_kernels"):
        _same(f"slots {mode}", _forward(model_dir, cfg, slots, triton=True, fused=True, mode=mode), ref)
        print(f"adapter slots, {mode}: as the torch forward of the same slots")
    for in_gemm in (False, True):
        _same(
            f"slots skinny in_gemm={in_gemm}",
            _forward(
                model_dir, cfg, slots, triton=True, fused=True, mode="hybrid", skinny=64, in_gemm=in_gemm
            ),
            ref,
        )
        print(f"adapter slots, skinny_gemm_rows=64, expands in the GEMMs {in_gemm}: as the torch forward")


def _check_triton_shrink(model_dir, cfg, lora, ref, name: str, rows: list[int], narrow: int) -> None:
    """The fused forward with lora_shrink "triton" (hybrid, skinny 16) equals per-projection torch, with one
    lora_shrink launch per group of at most SHRINK_MAX_RANKS ranks (`narrow` of them) per step above 16."""
    real_shrink, shrinks = triton_ops.lora_shrink, []

    def shrink_counted(x, a_cat, tickets):
        shrinks.append(x.shape[0])
        return real_shrink(x, a_cat, tickets)

    triton_ops.lora_shrink = shrink_counted
    try:
        got = _forward(model_dir, cfg, lora, triton=True, fused=True, mode="hybrid", shrink="triton")
    finally:
        triton_ops.lora_shrink = real_shrink
    _same(f"{name} lora_shrink triton", got, ref)
    assert sorted(shrinks) == sorted(r for r in rows for _ in range(narrow) if r > 16), (shrinks, rows)
    print(f"{name} lora_shrink triton: same as per-projection torch ({len(shrinks)} shrink launches)")


def main(argv: list[str]) -> None:
    slots = argv[0] == "--slots"  # the adapter-slot check alone (its own child: each takes minutes)
    argv = argv[1:] if slots else argv
    model_dir = Path(argv[0])
    adapters = {name: Path(path) for name, path in (a.split("=", 1) for a in argv[1:])}
    cfg = ModelConfig.from_dir(model_dir)
    if slots:
        loras = [load_lora(p, cfg, DEV, torch.float32) for p in adapters.values()]
        _check_slots(model_dir, cfg, loras, loras[0].shape_key)
        print("ok")
        return
    base_ref = _forward(model_dir, cfg, None, triton=False, fused=False, mode="per_projection")
    steps = _steps(cfg)
    # per step: large (more than 16 rows), and whether it has a prefill chunk (else: decodes only)
    large = [s.input_ids.shape[0] > fused_decode.MAX_TOKENS for s in steps]
    prefill = [bool(s.prefills) for s in steps]
    for n, (name, path) in enumerate(adapters.items()):
        lora = load_lora(path, cfg, DEV, torch.float32)
        groups = sum(len(layer) for layer in lora.layers)
        ref = _forward(model_dir, cfg, lora, triton=False, fused=False, mode="per_projection")
        assert _rel(ref[0][0], base_ref[0][0]) > 1e-3, f"{name}: the adapter changes nothing"
        # every mode for the first adapter; grouped (the kernels this check is for) for every adapter
        # (interpreting Triton is slow: ~5-15 s a variant)
        q_groups = sum("q_proj" in layer for layer in lora.layers)
        for fused in (False, True):
            for mode in MODES if n == 0 else ("grouped",):
                got = _forward(model_dir, cfg, lora, triton=True, fused=fused, mode=mode)
                _same(f"{name} fused={fused} {mode}", got, ref)
                # each step in its kind's mode (the prefill one where it has a prefill chunk): grouped is
                # one launch per projection group per step (fused: per large step only, each group's
                # expand inside the kernel that follows its GEMM); in_kernels (fused, large steps) has the
                # q/k/v expands in the per-row RoPE kernel
                kinds = list(zip([expand_modes(mode)[0 if p else 1] for p in prefill], large, strict=True))
                want = groups * sum(m == "grouped" and (lg or not fused) for m, lg in kinds)
                want_in = fused * q_groups * sum(m == "in_kernels" and lg for m, lg in kinds)
                assert got[2:] == (want, want_in), (
                    f"{name} fused={fused} {mode}: {got[2]} grouped launches, want {want}; "
                    f"{got[3]} in-kernel large q/k/v expands, want {want_in}"
                )
                print(
                    f"{name} fused={fused} {mode}: same as per-projection torch ({got[2]} grouped launches,"
                    f" {got[3]} in-kernel large-step q/k/v expands)"
                )
        # EngineConfig.lora_shrink "triton": each group's shrink of a step above 16 rows (skinny_gemm_rows
        # here) in one triton_ops.lora_shrink launch (K splits summed by the last to arrive), and a group
        # of more than SHRINK_MAX_RANKS ranks summed (r80 on q/k/v) through cuBLAS: the first adapter and any
        # with such a group (interpreting costs ~10 s a variant)
        narrow = sum(
            g.a_cat.shape[0] <= triton_ops.SHRINK_MAX_RANKS for layer in lora.layers for g in layer.values()
        )
        if n == 0 or narrow < groups:
            _check_triton_shrink(
                model_dir, cfg, lora, ref, name, [s.input_ids.shape[0] for s in steps], narrow
            )
        if n == 0:  # every step's GEMMs in the segmented skinny GEMM (EngineConfig.skinny_gemm_rows = 64)
            _check_skinny(model_dir, cfg, lora, ref, name, max(s.input_ids.shape[0] for s in steps))
        if n == 0:  # o/down expands inside add + RMSNorm: only from TILED_NORM_MIN_ROWS rows (2048) otherwise
            floor, triton_ops.TILED_NORM_MIN_ROWS = triton_ops.TILED_NORM_MIN_ROWS, 1
            try:
                got = _forward(model_dir, cfg, lora, triton=True, fused=True, mode="grouped")
            finally:
                triton_ops.TILED_NORM_MIN_ROWS = floor
            _same(f"{name} tiled norm", got, ref)
            assert got[2] == sum(large) * groups, got[2]
            print(f"{name} with the o/down expands inside add + RMSNorm: same as per-projection torch")
    # a standby's prepared buffers: copy_lora of each adapter into all-linear buffers of the widest rank
    # gives that adapter's output through the grouped launches, clear_lora the base model's
    widest = max(max(load_lora(p, cfg, DEV, torch.float32).ranks.values()) for p in adapters.values())
    shape = ",".join(f"{m}:{widest}" for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"))  # fmt: skip
    buffers = zero_lora(shape, cfg, DEV, torch.float32)
    for name, path in list(adapters.items())[1:3]:  # a group with a member missing, then mixed ranks
        lora = load_lora(path, cfg, DEV, torch.float32)
        copy_lora(buffers, lora)
        want = _forward(model_dir, cfg, lora, triton=False, fused=False, mode="per_projection")
        _same(
            f"buffers <- {name}",
            _forward(model_dir, cfg, buffers, triton=True, fused=True, mode="grouped"),
            want,
        )
        print(f"copy_lora({name}) into {shape}: the adapter's output")
    clear_lora(buffers)
    _same("cleared", _forward(model_dir, cfg, buffers, triton=True, fused=True, mode="grouped"), base_ref)
    print("clear_lora: the base model's output")
    print("ok")


if __name__ == "__main__":
    main(sys.argv[1:])
