"""The LoRA kernels of a large step (a prefill chunk) alone, on a 7B's shapes, each in one CUDA graph of 32
launches (one per layer, each layer its own tensors, as a prefill reads them), against the base kernel they
add to or replace (issue 12: the LoRA prefill's TTFT over the base's):

- the shrink t = x·A_catᵀ of each group (q/k/v 48 ranks, o 16, gate/up 32 over K = 4096; down 16 over 11008):
  cuBLAS (F.linear: a split-K GEMM + a reduce on Hopper) against triton_ops.lora_shrink (one launch);
- SiLU·up with the gate/up expands inside (triton_ops.silu_mul_expand, the prefill's `grouped` mode) at each
  tile shape / warps, against the plain SiLU·up kernel (fused_decode.silu_mul_lora without LoRA) and against
  the plain kernel after two addmm_ expands (`per_projection`);
- the o / down expand alone: triton_ops.lora_expand against addmm_.

(A fourth probe, the residual add + RMSNorm with its group's shrink in one launch, measured 2.3-4.6x the
separate kernels on an H200 and was removed with its kernel: docs/benchmarks.md, twenty-eighth session.)

Every variant is checked against torch in float32 first. µs a launch, median of `--rounds` rounds of
`--replays` replays:
    python3 bench/prefill_lora_probe.py --rows 512,2048
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from graph_timing import capture, replay_ms  # (bench/ is not a package)

from lorafn.runtime.models import fused_decode as fd
from lorafn.runtime.models import triton_ops as ops

LAYERS = 32
HIDDEN, INTER, RANK = 4096, 11008, 16
SILU_CONFIGS = [(64, 4), (64, 8), (32, 4), (32, 8), (16, 4)]  # (block_m, num_warps)


def _rand(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", generator=gen, dtype=torch.bfloat16) * scale


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _layers(fn, *per_layer: list):
    """A function that calls fn(*args) for each layer's args (one list per argument, an item per layer)."""
    return lambda: [fn(*args) for args in zip(*per_layer, strict=True)]


def _time(fn, replays: int, rounds: int) -> float:
    """µs a launch of `fn` (which launches once per layer)."""
    graph, _ = capture(fn)
    ms = replay_ms(graph, replays, rounds)
    del graph
    return ms * 1e3 / LAYERS


def probe_shrinks(
    rows: int, gen: torch.Generator, replays: int, rounds: int
) -> list[tuple[str, float, float]]:
    """(group, cuBLAS µs, lora_shrink µs) per shrink shape."""
    tickets = ops.shrink_tickets(torch.device("cuda"), ops.SHRINK_MAX_ROWS)
    out = []
    for name, k, r in (("q/k/v", HIDDEN, 3 * RANK), ("o", HIDDEN, RANK), ("gate/up", HIDDEN, 2 * RANK),
                       ("down", INTER, RANK)):  # fmt: skip
        xs = [_rand(gen, rows, k) for _ in range(LAYERS)]
        a_cats = [_rand(gen, r, k, scale=k**-0.5) for _ in range(LAYERS)]
        ref = xs[0].float() @ a_cats[0].float().T
        got = ops.lora_shrink(xs[0], a_cats[0], tickets)
        assert _rel(got, ref) < 1e-2, f"lora_shrink {name}: {_rel(got, ref)}"
        cublas = _time(_layers(F.linear, xs, a_cats), replays, rounds)
        triton = _time(_layers(lambda x, a: ops.lora_shrink(x, a, tickets), xs, a_cats), replays, rounds)
        out.append((name, cublas, triton))
        del xs, a_cats
    return out


def probe_silu(rows: int, gen: torch.Generator, replays: int, rounds: int) -> list[tuple[str, float]]:
    """(variant, µs) of SiLU·up with the gate/up group's expands, and without."""
    gates = [_rand(gen, rows, INTER) for _ in range(LAYERS)]
    ups = [_rand(gen, rows, INTER) for _ in range(LAYERS)]
    ts = [_rand(gen, rows, 2 * RANK) for _ in range(LAYERS)]
    b_g = [_rand(gen, RANK, INTER, scale=0.1) for _ in range(LAYERS)]
    b_u = [_rand(gen, RANK, INTER, scale=0.1) for _ in range(LAYERS)]
    lora = [
        (fd.Expand(t, 0, RANK, g), fd.Expand(t, RANK, RANK, u)) for t, g, u in zip(ts, b_g, b_u, strict=True)
    ]
    g0 = (gates[0].float() + ts[0][:, :RANK].float() @ b_g[0].float()).to(torch.bfloat16).float()
    u0 = (ups[0].float() + ts[0][:, RANK:].float() @ b_u[0].float()).to(torch.bfloat16).float()
    ref = (F.silu(g0).to(torch.bfloat16).float() * u0).to(torch.bfloat16)
    plain = _time(_layers(lambda g, u: fd.silu_mul_lora(g, u, None), gates, ups), replays, rounds)
    out = [("plain SiLU·up (no LoRA)", plain)]
    for block_m, warps in SILU_CONFIGS:
        got = ops.silu_mul_expand(gates[0], ups[0], lora[0], block_m=block_m, num_warps=warps)
        assert _rel(got, ref) < 1e-2, f"silu_mul_expand {block_m}x{warps}: {_rel(got, ref)}"
        fn = _layers(
            lambda g, u, e, bm=block_m, w=warps: ops.silu_mul_expand(g, u, e, block_m=bm, num_warps=w),
            gates,
            ups,
            lora,
        )
        out.append((f"silu_mul_expand BLOCK_M {block_m}, {warps} warps", _time(fn, replays, rounds)))

    def per_projection(g, u, t, bg, bu):
        g.addmm_(t[:, :RANK], bg)  # (in place: the timing replays them, the values do not matter)
        u.addmm_(t[:, RANK:], bu)
        return fd.silu_mul_lora(g, u, None)

    fn = _layers(per_projection, gates, ups, ts, b_g, b_u)
    out.append(("addmm_ x2 + plain SiLU·up (per_projection)", _time(fn, replays, rounds)))
    return out


def probe_expand(rows: int, gen: torch.Generator, replays: int, rounds: int) -> list[tuple[str, float]]:
    """(variant, µs) of the o projection's expand alone (down's has the same output shape)."""
    ys = [_rand(gen, rows, HIDDEN) for _ in range(LAYERS)]
    ts = [_rand(gen, rows, RANK) for _ in range(LAYERS)]
    bs = [_rand(gen, RANK, HIDDEN, scale=0.1) for _ in range(LAYERS)]
    addmm = _time(_layers(lambda y, t, b: y.addmm_(t, b), ys, ts, bs), replays, rounds)
    expand = _time(
        _layers(lambda y, t, b: ops.lora_expand(t, [(y, 0, RANK, b)]), ys, ts, bs), replays, rounds
    )
    return [("addmm_", addmm), ("lora_expand", expand)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="512,2048", help="comma-separated step rows (prefill chunk tokens)")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("prefill_lora_probe: needs CUDA")
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(
        f"LoRA kernels of a large step, {torch.cuda.get_device_name()}, bf16, 7B shapes, r{RANK}, µs a launch"
    )
    for rows in (int(r) for r in args.rows.split(",")):
        print(f"\n{rows} rows")
        print("  shrink t = x·A_catᵀ: cuBLAS -> lora_shrink")
        for name, cublas, triton in probe_shrinks(rows, gen, args.replays, args.rounds):
            print(f"    {name:<8} {cublas:7.2f} -> {triton:7.2f} ({triton / cublas:.2f}x)")
        print("  SiLU·up with gate/up expands")
        for name, us in probe_silu(rows, gen, args.replays, args.rounds):
            print(f"    {name:<44} {us:7.2f}")
        print("  o/down expand alone")
        for name, us in probe_expand(rows, gen, args.replays, args.rounds):
            print(f"    {name:<44} {us:7.2f}")
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
