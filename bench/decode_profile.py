"""Where a decode step's time goes (issue 12): per batch size, for the base model and unmerged LoRA, each
on the cuBLAS + addmm path and on the fused decode kernels (models/fused_decode.py), side by side in one
run:

- step: one `Engine.step()` of decodes only (what a user sees as TPOT: host work + GPU work);
- replay: the decode CUDA graph's replay alone, back to back, timed with CUDA events (GPU time);
- host: step − replay, the host work not hidden behind the GPU (with overlapped steps,
  EngineConfig.overlap_steps, the default on CUDA, only what the queued step does not hide;
  `--steps-one-at-a-time` for all of it);
- the HBM floor (weight bytes ÷ measured copy bandwidth) and each figure over it;
- a kernel table of one graph replay (torch.profiler / CUPTI): time per kernel family, base vs LoRA;
- the projections' GEMMs alone (cuBLAS through F.linear) and their achieved bandwidth.

`--compare-expand-in-gemm` adds lora+g (the LoRA expands inside the skinny GEMMs); `--gemm-prologue-rows N`
adds base+p and lora+p (fused, expands in the GEMMs, EngineConfig.gemm_prologue_rows = N: the norms and
SiLU·up inside the skinny GEMMs too), with their kernel tables beside base+f and lora+g.

    python bench/decode_profile.py --model /tmp/llama-2-7b [--batches 1,8] [--json out.json]

GPU only (the figures are about the H100's memory bandwidth); nothing here is timed on a CPU.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import itertools
import json
import pstats
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine import ResidentSource, copy_bandwidth, random_prompts

from lorafn.runtime import Engine, EngineConfig, SamplingParams
from lorafn.runtime.config import ModelConfig
from lorafn.runtime.lora import write_random_adapter
from lorafn.runtime.models import fused_decode


def _family(name: str) -> str:
    """A kernel's family for the table: GEMMs by library, Triton kernels by their Python name."""
    if "nvjet" in name or "gemm" in name.lower() or "cublas" in name.lower() or "sm90_xmma" in name:
        return "gemm: " + re.sub(r"_\d+x\d+.*$", "", name)[:48]
    if "splitK" in name or "reduce" in name.lower():
        return "reduce: " + name[:40]
    return name[:60]


def kernel_table(replay, steps: int = 5) -> dict[str, tuple[int, float]]:
    """{family: (kernels per step, µs per step)} over `steps` replays."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            replay()
        torch.cuda.synchronize()
    table: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        fam = _family(ev.name)
        table[fam][0] += 1
        table[fam][1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    return {k: (int(v[0] / steps), v[1] / steps) for k, v in table.items()}


def time_events(fn, iters: int = 50) -> float:
    """Median ms of `fn` over `iters` runs, each between CUDA events (after a warm-up)."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def measure(
    engine: Engine, prompt_len: int, batch: int, vocab: int, decode_tokens: int, host_profile: bool = False
) -> dict:
    params = SamplingParams(max_tokens=decode_tokens + 1, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in random_prompts(batch, prompt_len, vocab, batch)]
    while any(not engine.get_output(i).token_ids for i in ids):
        engine.step()
    torch.cuda.synchronize()
    step_times = []
    profiler = cProfile.Profile() if host_profile else None
    graphs = engine.runner.graphs
    bucket = next(b for b in graphs.buckets if b >= batch)
    replay = graphs.graphs[bucket].replay
    half = max(4, decode_tokens // 2)
    while engine.has_unfinished() and len(step_times) < half:  # the steps timed: the first half
        t0 = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        engine.step()
        if profiler is not None:
            profiler.disable()
        step_times.append(time.perf_counter() - t0)
    # the replay timed halfway, its static inputs a real step's: the contexts the steps attend over (after
    # the run they would be the last step's; a replay recomputes its step the same way). Then CUPTI's table,
    # which slows what runs after it: the rest of the run is not timed.
    torch.cuda.synchronize()
    replay_ms, kernels = time_events(replay), kernel_table(replay)
    while engine.has_unfinished():
        engine.step()
    if profiler is not None:  # where the host's part of a step goes (the GPU wait shows as the sync)
        print(f"\nhost profile of {len(step_times)} decode steps, batch {batch} (top 18 by own time):")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(18)
    out = {
        "bucket": bucket,
        "step_ms": statistics.median(step_times[2:]) * 1e3,
        "replay_ms": replay_ms,
        "kernels": kernels,
    }
    out["host_ms"] = out["step_ms"] - out["replay_ms"]
    return out


def gemm_table(model, batches: list[int], bandwidth: float) -> list[dict]:
    """cuBLAS (F.linear) alone for each distinct projection shape of layer 0 and the LM head."""
    layer = model.layers[0]
    weights = {p: layer[p] for p in ("q_proj", "k_proj", "o_proj", "gate_proj", "down_proj")}
    weights["lm_head"] = model.lm_head
    rows = []
    for name, w in weights.items():
        for m in batches:
            x = torch.randn(m, w.shape[1], device=w.device, dtype=w.dtype)
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                for _ in range(20):
                    F.linear(x, w)
            ms = time_events(graph.replay, 20) / 20
            nbytes = w.numel() * w.element_size()
            bps = nbytes / (ms * 1e-3)
            rows.append(
                {
                    "proj": name,
                    "shape": list(w.shape),
                    "m": m,
                    "us": ms * 1e3,
                    "TBps": bps / 1e12,
                    "of_copy_bw": bps / bandwidth,
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default="all-linear", help="all-linear or comma-separated projections")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--host-profile", action="store_true", help="cProfile the decode steps of lora+f")
    ap.add_argument("--lora-expand", default=None, help="EngineConfig.lora_expand (default: the engine's)")
    ap.add_argument(
        "--steps-one-at-a-time",
        action="store_true",
        help="EngineConfig.overlap_steps off: each step read back before the next is planned",
    )
    ap.add_argument(
        "--decode-attention", default=None, help="EngineConfig.decode_attention (default: the engine's)"
    )
    ap.add_argument(
        "--compare-expand-in-gemm",
        action="store_true",
        help="also lora+g: the fused LoRA engine with EngineConfig.expand_in_gemm on (expands in the GEMMs)",
    )
    ap.add_argument(
        "--gemm-prologue-rows",
        type=int,
        default=None,
        help="also base+p and lora+p: fused, expands in the GEMMs, EngineConfig.gemm_prologue_rows = N",
    )
    ap.add_argument(
        "--fused-only", action="store_true", help="only the fused decode kernels (base+f, lora+f), no cuBLAS"
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("a CUDA device is needed: this profiles GPU decode steps")
    device, dtype = torch.device("cuda"), torch.bfloat16
    batches = [int(b) for b in args.batches.split(",")]
    mc = ModelConfig.from_dir(args.model)
    work = Path(tempfile.mkdtemp(prefix="lorafn-prof-"))
    adapter = write_random_adapter(
        mc,
        work / "adapter",
        rank=args.rank,
        lora_alpha=2 * args.rank,
        dtype=dtype,
        target_modules=args.targets if args.targets == "all-linear" else args.targets.split(","),
    )
    source = ResidentSource(args.model, device, dtype)
    bandwidth = copy_bandwidth(device)
    max_len = args.prompt_len + args.decode_tokens + 8
    figures: dict = {
        "copy_bandwidth_Bps": bandwidth,
        "batches": batches,
        "rank": args.rank,
        "targets": args.targets,
    }
    # (name, adapter, fused_decode, EngineConfig overrides of this variant)
    variants: list[tuple[str, Path | None, bool, dict]] = [
        ("base", None, False, {}),
        ("lora", adapter, False, {}),
        ("base+f", None, True, {}),
        ("lora+f", adapter, True, {"expand_in_gemm": False}),
    ]
    if args.compare_expand_in_gemm or args.gemm_prologue_rows is not None:
        variants.append(("lora+g", adapter, True, {"expand_in_gemm": True}))
    if args.fused_only:
        variants = variants[2:]
    if args.gemm_prologue_rows is not None:
        pro = {"gemm_prologue_rows": args.gemm_prologue_rows}
        variants.append(("base+p", None, True, pro))
        variants.append(("lora+p", adapter, True, {"expand_in_gemm": True, **pro}))
    overrides = {"lora_expand": args.lora_expand} if args.lora_expand else {}
    if args.decode_attention:
        overrides["decode_attention"] = args.decode_attention
    if args.steps_one_at_a_time:
        overrides["overlap_steps"] = False
    for name, adapter_dir, fused, own in variants:
        engine = Engine(
            EngineConfig(
                model=args.model,
                adapter=adapter_dir,
                device="cuda",
                dtype="bfloat16",
                weight_source=source,
                max_num_seqs=max(batches),
                max_num_batched_tokens=max(2048, args.prompt_len),
                max_model_len=max_len,
                num_kv_blocks=max(batches) * -(-max_len // 16) + 16,
                block_size=16,
                cuda_graph_batch_sizes=batches,
                fused_decode=fused,
                **overrides,
                **own,
            )
        )
        figures["weight_bytes"] = engine.runner.model.weight_bytes()
        figures[name] = {
            b: measure(
                engine,
                args.prompt_len,
                b,
                mc.vocab_size,
                args.decode_tokens,
                host_profile=args.host_profile and name == "lora+f" and b == max(batches),
            )
            for b in batches
        }
        if name == variants[0][0]:
            figures["gemms"] = gemm_table(engine.runner.model, batches, bandwidth)
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    floor_ms = figures["weight_bytes"] / bandwidth * 1e3
    figures["floor_ms"] = floor_ms
    print(f"adapter: rank {args.rank}, {args.targets}")
    print(
        f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; weights {figures['weight_bytes'] / 1e9:.2f} GB; "
        f"HBM floor {floor_ms:.2f} ms"
    )
    head = f"{'batch':>5} {'':5} {'step ms':>8} {'replay ms':>9} {'host ms':>8}"
    print(head + f" {'step/floor':>10} {'replay/floor':>12}")
    for b in batches:
        for name, *_rest in variants:
            r = figures[name][b]
            print(
                f"{b:>5} {name:5} {r['step_ms']:8.2f} {r['replay_ms']:9.2f} {r['host_ms']:8.2f} "
                f"{r['step_ms'] / floor_ms:10.2f} {r['replay_ms'] / floor_ms:12.2f}"
            )
        pairs = (("lora", "base"), ("lora+f", "base+f"), ("lora+f", "lora"), ("base+f", "base"))
        pairs += (("lora+g", "base+f"), ("lora+g", "lora+f"))
        pairs += (("base+p", "base+f"), ("lora+p", "lora+g"), ("lora+p", "base+p"))
        for lo, ba in [(lo, ba) for lo, ba in pairs if lo in figures and ba in figures]:
            step_ratio = figures[lo][b]["step_ms"] / figures[ba][b]["step_ms"]
            replay_ratio = figures[lo][b]["replay_ms"] / figures[ba][b]["replay_ms"]
            print(f"      {lo}/{ba}: step {step_ratio:.3f}, replay {replay_ratio:.3f}")
    tables = (("base", "lora"), ("base+f", "lora+f"), ("lora+f", "lora+g"), ("base+f", "base+p"))
    tables += (("lora+g", "lora+p"),)
    kinds = [(ba, lo) for ba, lo in tables if ba in figures and lo in figures]
    for b, (ba_name, lo_name) in itertools.product(batches, kinds):
        print(f"\nkernels per replay, batch {b} (count, µs): {ba_name} | {lo_name}")
        base, lora = figures[ba_name][b]["kernels"], figures[lo_name][b]["kernels"]
        for fam in sorted(set(base) | set(lora), key=lambda f: -lora.get(f, base.get(f, (0, 0)))[1]):
            bc, bu = base.get(fam, (0, 0.0))
            lc, lu = lora.get(fam, (0, 0.0))
            print(f"  {fam[:64]:64} {bc:5d} {bu:9.1f} | {lc:5d} {lu:9.1f}")
    # the skinny GEMM's tiles that did not fit the GPU's shared memory, and the ones taken instead
    figures["fitted_tiles"] = fused_decode.fitted_tiles()
    for f in figures["fitted_tiles"]:
        what = f"prologue {f['prologue']}, expands {f['expands']}"
        print(f"seg_linear tile {f['tile']} ({what}) did not fit: {f['fitted']}")
    print("\ncuBLAS GEMMs alone (F.linear in a graph):")
    for r in figures["gemms"]:
        print(
            f"  {r['proj']:10} {r['shape']!s:16} m={r['m']:<3} {r['us']:8.1f} µs {r['TBps']:5.2f} TB/s "
            f"({r['of_copy_bw']:.0%} of copy)"
        )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
