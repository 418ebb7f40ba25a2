"""Probe (issue 12): what the LoRA expands inside the skinny GEMM cost, launch by launch.

The skinny GEMMs of one llama-2-7b decode step (32 layers x the four LoRA groups q/k/v, o, gate/up, down;
`fused_decode.seg_linear`, what EngineConfig.expand_in_gemm runs), r16 all-linear, in one CUDA graph:
without an adapter (base: the same weights, no shrink rows, no expands) and with the expands inside, over
the shrink programs' widths (`--shrink-n`). `--baseline-kernels FILE` also times another fused_decode.py
(an earlier commit's, e.g. `git show fb62133:lorafn/runtime/models/fused_decode.py > /tmp/fd_old.py`) on
the same tensors: an A/B of two kernel versions in one run. Every variant's outputs are checked against a
float32 torch reference of the first layer before it is timed.

    python bench/seg_expand_probe.py --rows 1,8,16,32,64
    python bench/seg_expand_probe.py --rows 1,8 --shrink-n 32,16,8 --baseline-kernels /tmp/fd_old.py

Prints, per row count, the graph's replay in µs (median of `--rounds` rounds of `--replays` replays) and
each LoRA variant's cost over base, in total and per launch (128 launches a step).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from graph_timing import capture, replay_ms  # a bench helper beside this file

HIDDEN, INTER, LAYERS, RANK = 4096, 11008, 32, 16
GROUPS = (  # (input width, output widths) of each LoRA group of a layer
    (HIDDEN, (HIDDEN, HIDDEN, HIDDEN)),
    (HIDDEN, (HIDDEN,)),
    (HIDDEN, (INTER, INTER)),
    (INTER, (HIDDEN,)),
)


def load_kernels(path: Path) -> ModuleType:
    """A fused_decode.py file as a module of its own (its imports resolve against this checkout)."""
    spec = importlib.util.spec_from_file_location(f"fused_decode_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--baseline-kernels: cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


class Step:
    """The step's weights (random, the 7B's shapes), one adapter's A_cat and Bᵀs per group, and inputs."""

    def __init__(self, rows: int, gen: torch.Generator) -> None:
        def rand(*shape: int, scale: float) -> torch.Tensor:
            return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)

        self.layers = []
        for _ in range(LAYERS):
            layer = []
            for k, widths in GROUPS:
                weights = [rand(n, k, scale=k**-0.5) for n in widths]
                a_cat = rand(RANK * len(widths), k, scale=k**-0.5)
                expands = [(i * RANK, RANK, rand(RANK, n, scale=0.05)) for i, n in enumerate(widths)]
                layer.append((weights, a_cat, expands))
            self.layers.append(layer)
        self.x = {k: rand(rows, k, scale=1.0) for k in (HIDDEN, INTER)}

    def reference(self, group: int) -> list[torch.Tensor]:
        """float32 torch of layer 0's group: x·Wᵀ rounded, + (x·A_catᵀ rounded)·Bᵀ."""
        weights, a_cat, expands = self.layers[0][group]
        x = self.x[GROUPS[group][0]].float()
        t = (x @ a_cat.float().t()).to(torch.bfloat16).float()
        outs = []
        for w, (off, rank, b_t) in zip(weights, expands, strict=True):
            y = (x @ w.float().t()).to(torch.bfloat16).float()
            outs.append(y + t[:, off : off + rank] @ b_t.float())
        return outs


def variants(fd: ModuleType, baseline: ModuleType | None, shrink_ns: list[int]) -> dict:
    """name -> fn(step) running the step's 128 launches once (their outputs of layer 0 returned)."""

    def base(step: Step) -> list[list[torch.Tensor]]:
        return [
            fd.seg_linear(step.x[GROUPS[g][0]], w)
            for layer in step.layers
            for g, (w, _a, _e) in enumerate(layer)
        ]

    out = {"base": base}
    sites = LAYERS * len(GROUPS)
    flags = fd.seg_flags("cuda", sites)

    def lora_new(shrink_n: int):
        def run(step: Step) -> list[list[torch.Tensor]]:
            flags.zero_()  # as the model does at a step's start
            res = []
            for i, layer in enumerate(step.layers):
                for g, (w, a_cat, expands) in enumerate(layer):
                    j = i * len(GROUPS) + g
                    x = step.x[GROUPS[g][0]]
                    res.append(
                        fd.seg_linear(x, [a_cat, *w], expands, None, flags[j : j + 1], shrink_n=shrink_n)[1:]
                    )
            return res

        return run

    for n in shrink_ns:
        out[f"lora shrink_n {n}"] = lora_new(n)
    if baseline is not None:
        old_flags = baseline.seg_flags("cuda")

        def lora_old(step: Step) -> list[list[torch.Tensor]]:
            res = []
            for layer in step.layers:
                for g, (w, a_cat, expands) in enumerate(layer):
                    x = step.x[GROUPS[g][0]]
                    res.append(baseline.seg_linear(x, [a_cat, *w], expands, None, old_flags)[1:])
            return res

        out["lora baseline kernels"] = lora_old
    return out


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm().clamp_min(1e-30)).item()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,16,32,64")
    ap.add_argument("--shrink-n", default="16,32", help="comma-separated SHRINK_N values of the new kernels")
    ap.add_argument(
        "--baseline-kernels", type=Path, help="another fused_decode.py to time on the same tensors"
    )
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    from lorafn.runtime.models import fused_decode as fd

    baseline = load_kernels(args.baseline_kernels) if args.baseline_kernels else None
    shrink_ns = [int(v) for v in args.shrink_n.split(",") if v]
    rows_list = [int(v) for v in args.rows.split(",") if v]
    gen = torch.Generator(device="cuda").manual_seed(0)
    launches = LAYERS * len(GROUPS)
    name = torch.cuda.get_device_name()
    print(f"{name}: {LAYERS} layers x {len(GROUPS)} LoRA groups, {launches} launches a step, r{RANK}")
    results = []
    for rows in rows_list:
        step = Step(rows, gen)
        fns = variants(fd, baseline, shrink_ns)
        timed = {}
        for name, fn in fns.items():
            graph, outs = capture(lambda fn=fn, step=step: fn(step))
            us = replay_ms(graph, args.replays, args.rounds) * 1000
            del graph
            if name != "base":  # layer 0's four groups against torch (the graph's last replay wrote them)
                pairs = [p for g in range(len(GROUPS)) for p in zip(outs[g], step.reference(g), strict=True)]
                worst = max(rel(o, r) for o, r in pairs)
                if worst > 1e-2:
                    raise SystemExit(f"{name} at {rows} rows: relative error {worst:.3g} against torch")
            timed[name] = us
        base = timed["base"]
        print(f"rows {rows}: base {base:.1f} µs")
        for name, us in timed.items():
            if name != "base":
                extra = us - base
                per = extra / launches
                print(
                    f"  {name:24s} {us:8.1f} µs  x{us / base:.3f}  +{extra:6.1f} µs  +{per:.2f} µs a launch"
                )
        results.append({"rows": rows, **{k: round(v, 2) for k, v in timed.items()}})
        del step, fns
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
