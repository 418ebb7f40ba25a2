"""Decode attention (issue 12): the split kernel's SIMT form (float32 products and sums) against the same
kernel on tensor cores (`kernel="dot"`, the engine's) and other launch settings, as the engine runs them:
one call per layer, a CUDA graph of all layers, each layer its own paged KV cache (so nothing stays in L2
from one layer to the next), block tables shuffled like a long-lived cache's; and against the floor, the K
and V bytes read over the device's measured copy bandwidth.

    python bench/decode_attention.py                     # llama-2-7b (32/32 heads) and llama-3-8b (32/8)
    python bench/decode_attention.py --batches 1,8 --contexts 512 --json out.json
    python bench/decode_attention.py --rope --batches 1,8,64   # RoPE + K/V writes inside the launch or not

Prints µs per layer of each variant and its ratio to the first (`--variants`; "simt"), the floor, the best
variant's share of the copy bandwidth. Every variant's output is checked against the torch reference before
it is timed (bf16 tolerance); one that does not build or does not match is shown FAILED, not timed, listed
at the end, and the exit status is 1. Needs CUDA and Triton.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from graph_timing import capture, replay_ms  # a bench helper beside this file

from lorafn.runtime.attention.reference import paged_decode_attention_ref
from lorafn.runtime.attention.triton_decode import (
    TARGET_PROGRAMS,
    num_splits,
    paged_decode_attention_rope,
    paged_decode_attention_triton,
)

SHAPES = {"llama-2-7b": (32, 32, 128), "llama-3-8b": (32, 8, 128)}  # heads, KV heads, head dim
# name -> keyword arguments of paged_decode_attention_triton; the first is the baseline
VARIANTS = {
    "simt": {"kernel": "simt"},
    "simt 4x programs": {"kernel": "simt", "target_programs": 4 * TARGET_PROGRAMS, "max_splits": 64},
    "simt 8 warps": {"kernel": "simt", "num_warps": 8},
    "dot": {"kernel": "dot"},  # the engine's: 8 warps on a small grid (triton_decode.SMALL_GRID_DOT_WARPS)
    "dot 4 warps": {"kernel": "dot", "num_warps": 4},  # the engine's before SMALL_GRID_DOT_WARPS
    "dot 4x programs": {"kernel": "dot", "target_programs": 4 * TARGET_PROGRAMS, "max_splits": 64},
    "dot n128 8 warps": {"kernel": "dot", "block_n": 128, "num_warps": 8},
    "dot 8 warps": {"kernel": "dot", "num_warps": 8},
    "dot 4 stages": {"kernel": "dot", "num_stages": 4},
    "dot n32": {"kernel": "dot", "block_n": 32},
    # fewer, longer programs (one per (sequence, KV head) at most two): at batch 1 the default's 256 programs
    # of one 64-token block each read 8 MB in ~8.8 µs a layer against a ~2 µs floor (latency, not bandwidth)
    "dot 1 split": {"kernel": "dot", "max_splits": 1},
    "dot 2 splits n128 8 warps": {"kernel": "dot", "max_splits": 2, "block_n": 128, "num_warps": 8},
    # 8 warps with the other split counts (at batch 1: 128 programs, one wave; 1024 programs of 16 tokens)
    "dot 4 splits 8 warps": {"kernel": "dot", "max_splits": 4, "num_warps": 8},
    "dot 4x programs 8 warps": {
        "kernel": "dot",
        "target_programs": 4 * TARGET_PROGRAMS,
        "max_splits": 64,
        "num_warps": 8,
    },
}


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def all_layers(qs, caches, tables, lens, scale, kw: dict) -> None:
    """One decode step's attention: every layer's queries against its own cache."""
    for q, (k, v) in zip(qs, caches, strict=True):
        paged_decode_attention_triton(q, k, v, tables, lens, scale, **kw)


def rope_layers(fused: bool, qkv, caches, heads: int, kv_heads: int, cos, sin, step: tuple) -> list:
    """One decode step's RoPE + K/V writes + attention over every layer: the engine's two launches
    (fused_decode.rope_lora_kv, then the split attention) or one (paged_decode_attention_rope).
    step = (positions, slots, tables, lens, scale)."""
    from lorafn.runtime.models import fused_decode as fd

    positions, slots, tables, lens, scale = step
    outs = []
    for (q, k, v), (kc, vc) in zip(qkv, caches, strict=True):
        if fused:
            outs.append(
                paged_decode_attention_rope(q, k, v, cos, sin, positions, slots, kc, vc, tables, lens, scale)
            )
        else:
            qr, _k, _v = fd.rope_lora_kv(q, k, v, None, heads, kv_heads, cos, sin, positions, kc, vc, slots)
            outs.append(paged_decode_attention_triton(qr, kc, vc, tables, lens, scale))
    return outs


def run_rope(name: str, args: argparse.Namespace, rows: list[dict], problems: list[str]) -> None:
    """`--rope`: a decode step's RoPE + K/V writes and attention as the engine runs them by default (two
    launches + the reduce a layer) against one launch + the reduce (EngineConfig.rope_in_attention), on each
    layer's own q/k/v projection rows and cache; the first layer's outputs and new K/V compared first (they
    must be equal bit for bit)."""
    heads, kv_heads, dim = SHAPES[name]
    page, layers, dtype = args.page, args.layers, torch.bfloat16
    blocks = args.max_tokens // page + 1
    gen = torch.Generator(device="cuda").manual_seed(1)

    def cache() -> torch.Tensor:
        return torch.empty(blocks, page, kv_heads, dim, device="cuda", dtype=dtype).normal_(generator=gen)

    caches = [(cache(), cache()) for _ in range(layers)]
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, device="cuda").float() / dim))
    emb = torch.cat([torch.outer(torch.arange(max(args.contexts) + 1, device="cuda").float(), inv)] * 2, -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    cut = (heads * dim, (heads + kv_heads) * dim)
    for ctx in args.contexts:
        for batch in args.batches:
            if batch * ctx > args.max_tokens:
                continue
            per_seq = -(-ctx // page)
            perm = torch.randperm(blocks - 1, device="cuda", generator=gen)[: batch * per_seq] + 1
            tables = perm.view(batch, per_seq).int().contiguous()
            lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
            positions = (lens - 1).long()
            blk = tables[torch.arange(batch, device="cuda"), positions // page].long()
            slots = blk * page + positions % page
            outs = [torch.randn(batch, cut[1] + kv_heads * dim, device="cuda", dtype=dtype, generator=gen)]
            outs += [torch.randn_like(outs[0]) for _ in caches[1:]]
            qkv = [(o[:, : cut[0]], o[:, cut[0] : cut[1]], o[:, cut[1] :]) for o in outs]
            step = (positions, slots, tables, lens, dim**-0.5)
            want = rope_layers(False, qkv[:1], caches[:1], heads, kv_heads, cos, sin, step)[0]
            new_kv = [c[blk, positions % page].clone() for c in caches[0]]
            for c in caches[0]:  # written again by the fused form only
                c[blk, positions % page] = 0
            got = rope_layers(True, qkv[:1], caches[:1], heads, kv_heads, cos, sin, step)[0]
            same_kv = all(
                torch.equal(c[blk, positions % page], w) for c, w in zip(caches[0], new_kv, strict=True)
            )
            if not (torch.equal(got, want) and same_kv):
                problems.append(
                    f"{name} batch {batch} context {ctx} rope: output or K/V differ from two launches"
                )
                continue
            timed = {}
            for fused in (False, True):
                fn = partial(rope_layers, fused, qkv, caches, heads, kv_heads, cos, sin, step)
                timed[fused] = time_graph(fn, args.replays, args.rounds) * 1000 / layers  # µs a layer
            two, one = timed[False], timed[True]
            rows.append(
                {"shape": name, "batch": batch, "context": ctx, "two_launches": two, "rope_inside": one}
            )
            print(
                f"{name} b{batch:<3d} ctx {ctx:5d}  RoPE kernel + attention {two:6.1f}, RoPE inside "
                f"{one:6.1f} µs a layer ({one / two:.2f}x; a {layers}-layer step"
                f" {(one - two) * layers:+5.0f} µs)",
                flush=True,
            )
    caches.clear()
    torch.cuda.empty_cache()


def copy_bandwidth(num_bytes: int = 4 << 30) -> float:
    """Bytes per second of a device-to-device copy (read + write counted), the best of 5."""
    src = torch.empty(num_bytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    return num_bytes / best


def time_graph(fn, replays: int, rounds: int) -> float:
    """Median ms of one replay of a graph of `fn` (warmed up eagerly, then captured)."""
    graph, _ = capture(fn)
    for _ in range(2):  # with capture's own: three replays before the timed ones
        graph.replay()
    ms = replay_ms(graph, replays, rounds)
    del graph
    return ms


def run_shape(
    name: str, args: argparse.Namespace, rows: list[dict], bandwidth: float, problems: list[str]
) -> None:
    heads, kv_heads, dim = SHAPES[name]
    variants = {label: VARIANTS[label] for label in args.variants}
    first = args.variants[0]  # the ratios' baseline
    page, layers = args.page, args.layers
    dtype = torch.bfloat16
    max_tokens = args.max_tokens
    blocks = max_tokens // page + 1
    gen = torch.Generator(device="cuda").manual_seed(0)
    caches = []
    for _ in range(layers):  # [blocks, page, Hkv, D] each, filled once for every configuration
        k = torch.empty(blocks, page, kv_heads, dim, device="cuda", dtype=dtype).normal_(generator=gen)
        caches.append((k, torch.empty_like(k).normal_(generator=gen)))
    for ctx in args.contexts:
        for batch in args.batches:
            if batch * ctx > max_tokens:
                continue
            per_seq = -(-ctx // page)
            perm = torch.randperm(blocks - 1, device="cuda", generator=gen)[: batch * per_seq] + 1
            tables = perm.view(batch, per_seq).int().contiguous()
            lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
            qs = [torch.randn(batch, heads, dim, device="cuda", dtype=dtype, generator=gen) for _ in caches]
            ref = paged_decode_attention_ref(qs[0], *caches[0], tables, lens, dim**-0.5).float()
            row = {"shape": name, "batch": batch, "context": ctx, "splits": num_splits(batch, kv_heads)}
            for label, kw in variants.items():
                row[label] = None  # a variant that fails to build or to match the reference is not timed
                try:
                    out = paged_decode_attention_triton(qs[0], *caches[0], tables, lens, dim**-0.5, **kw)
                except Exception as e:  # Triton's compile and resource errors share no narrower base
                    problems.append(f"{name} batch {batch} context {ctx} {label}: {type(e).__name__}: {e}")
                    continue
                err = (out.float() - ref).abs().max().item()
                if err > 2e-2 * max(1.0, ref.abs().max().item()):
                    problems.append(f"{name} batch {batch} context {ctx} {label}: max error {err:.3g}")
                    continue
                step = partial(all_layers, qs, caches, tables, lens, dim**-0.5, kw)
                row[label] = time_graph(step, args.replays, args.rounds) * 1000 / layers  # µs per layer
            kv_bytes = batch * ctx * kv_heads * dim * 2 * dtype.itemsize
            row["floor"] = kv_bytes / bandwidth * 1e6  # µs per layer
            timed = [label for label in variants if row[label] is not None]
            best = min(timed, key=lambda label: row[label]) if timed else None
            row["best"] = best
            row["best_share_of_copy_bw"] = row["floor"] / row[best] if best else None
            rows.append(row)
            base = row[first]

            def cell(label: str, base: float | None = base, row: dict = row) -> str:
                if row[label] is None:
                    return f"{label} FAILED"
                ratio = f" ({row[label] / base:4.2f}x)" if base else ""
                return f"{label} {row[label]:6.1f}{ratio}"

            summary = "nothing timed"
            if best:
                share, step_ms = row["best_share_of_copy_bw"], row[best] * layers / 1000
                summary = f"best {best}: {share:.0%} of copy bw, {step_ms:.2f} ms a {layers}-layer step"
                summary += f" ({first} {base * layers / 1000:.2f})" if base else ""
            print(
                f"{name} b{batch:<3d} ctx {ctx:5d} splits {row['splits']:2d}  "
                + "  ".join(cell(label) for label in variants)
                + f"  floor {row['floor']:6.1f}  {summary}",
                flush=True,
            )
    caches.clear()
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama-2-7b,llama-3-8b", help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--batches", type=ints, default=ints("1,2,4,8,16,32,64"))
    ap.add_argument("--contexts", type=ints, default=ints("512,2048"))
    ap.add_argument("--max-tokens", type=int, default=32768, help="cached tokens per layer at most")
    ap.add_argument("--page", type=int, default=16, help="KV block size (EngineConfig.block_size)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="comma-separated names of VARIANTS; the first is the baseline",
    )
    ap.add_argument(
        "--rope",
        action="store_true",
        help="instead of the variants: the engine's RoPE kernel + attention against RoPE inside the attention"
        " launch (EngineConfig.rope_in_attention), each layer's q/k/v rows raw",
    )
    args = ap.parse_args()
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or not args.variants:
        raise SystemExit(f"--variants: unknown {unknown or 'none given'}; known: {', '.join(VARIANTS)}")
    if not torch.cuda.is_available():
        raise SystemExit("bench/decode_attention.py needs CUDA (its kernels are Triton's)")
    bandwidth = copy_bandwidth()
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}; copy bandwidth "
        f"{bandwidth / 1e12:.2f} TB/s;"
        f" µs per layer (ratio to {args.variants[0]}; the engine runs dot)"
    )
    rows: list[dict] = []
    problems: list[str] = []  # variants that failed: printed at the end, and the exit status is 1
    for name in args.shapes.split(","):
        if name not in SHAPES:
            raise SystemExit(f"--shapes: unknown {name!r}; known: {', '.join(SHAPES)}")
        if args.rope:
            run_rope(name, args, rows, problems)
        else:
            run_shape(name, args, rows, bandwidth, problems)
    if args.json:
        report = {"device": torch.cuda.get_device_name(), "copy_bytes_s": bandwidth, "rows": rows}
        args.json.write_text(json.dumps({**report, "problems": problems}, indent=1))
    for line in problems:
        print(f"FAILED {line}", file=sys.stderr)
    if problems:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
