"""Probe (issue 12): can a Triton skinny GEMM read the backbone's weights faster than cuBLAS at decode
batch sizes? y[M, N] = x[M, K] · W[N, K]ᵀ for the 7B projection shapes, M = 1..8, a few block configs;
prints µs and TB/s of each next to F.linear, and the relative error against an fp32 reference.

    python bench/gemv_probe.py
    python bench/gemv_probe.py --rows 16,32,64   # fused_decode's segmented GEMM at larger decode batches

`--rows`: the engine's own `fused_decode._seg_gemm_kernel` (one launch per projection group, the LoRA shrink
as extra output rows) at M rows, over block configs, against what the cuBLAS path launches for the same group
(F.linear per projection + the group's shrink GEMM). Tells whether decode steps above 16 rows should take the
segmented GEMM too (issue 12: LoRA overhead at batch 32-64).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _skinny_kernel(X, W, Y, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(X + rm[:, None] * K + (k0 + rk)[None, :], mask=rm[:, None] < M, other=0.0)
        w = tl.load(W + rn[None, :] * K + (k0 + rk)[:, None])
        acc += tl.dot(x, w)
    tl.store(Y + rm[:, None] * N + rn[None, :], acc.to(Y.dtype.element_ty), mask=rm[:, None] < M)


@triton.jit
def _gemv_kernel(X, W, Y, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(X + k0 + rk).to(tl.float32)
        w = tl.load(W + rn[:, None] * K + (k0 + rk)[None, :]).to(tl.float32)
        acc += w * x[None, :]
    tl.store(Y + rn, tl.sum(acc, axis=1).to(Y.dtype.element_ty))


def skinny(x, w, bn, bk, warps, stages):
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    grid = (n // bn,)
    _skinny_kernel[grid](
        x, w, y, m, n, k, BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages
    )
    return y


def gemv(x, w, bn, bk, warps, stages):
    n, k = w.shape
    y = torch.empty(1, n, device=x.device, dtype=x.dtype)
    _gemv_kernel[(n // bn,)](x, w, y, n, k, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return y


class Rotation:
    """Hands out (x, W) pairs in turn, so that repeated calls read different weights (not the L2)."""

    def __init__(self, xs: list[torch.Tensor], ws: list[torch.Tensor]) -> None:
        self.xs, self.ws, self.i = xs, ws, -1

    def reset(self) -> None:
        self.i = -1

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.i = (self.i + 1) % len(self.ws)
        return self.xs[self.i], self.ws[self.i]


def call(kernel, nxt: Rotation, *config):
    return kernel(*nxt(), *config)


def graph_us(fn, reps: int = 20) -> float:
    """µs per call, from replays of a graph holding `reps` calls (launch gaps shrunk), median of 30."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(30):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(times)


class GroupCalls:
    """One projection group at m rows: the cuBLAS launches and the segmented GEMM, each call reading the
    next of 4 copies of the inputs (so that the 50 MB L2 does not serve repeated reads)."""

    def __init__(self, m: int, k: int, widths: list[int]) -> None:
        dev, dt = "cuda", torch.bfloat16
        self.m, self.k, self.i = m, k, -1
        self.sets = [[torch.randn(n, k, device=dev, dtype=dt) / k**0.5 for n in widths] for _ in range(4)]
        self.xs = [torch.randn(m, k, device=dev, dtype=dt) for _ in range(4)]

    def next(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        self.i = (self.i + 1) % 4
        return self.xs[self.i], self.sets[self.i]

    def cublas(self) -> list[torch.Tensor]:
        x, ws = self.next()
        return [F.linear(x, w) for w in ws]

    def seg(self, bm: int, bn: int, bk: int, warps: int, stages: int) -> list[torch.Tensor]:
        from lorafn.runtime.models import fused_decode as fd

        x, ws = self.next()
        outs = [torch.empty(self.m, w.shape[0], device=x.device, dtype=x.dtype) for w in ws]
        pad = fd.MAX_SEGMENTS - len(ws)
        ns = [w.shape[0] for w in ws] + [0] * pad
        grid = (sum(triton.cdiv(n, bn) for n in ns),)
        fd._seg_gemm_kernel[grid](
            x, *ws, *[ws[0]] * pad, *outs, *[outs[0]] * pad, *ns, self.m, self.k, x.stride(0),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PRECISION="tf32", num_warps=warps, num_stages=stages,
        )  # fmt: skip
        return outs


def seg_rows_probe(rows: list[int], rank: int = 16) -> None:
    """The segmented GEMM of models/fused_decode.py at `rows` rows vs cuBLAS, per llama-2-7b group."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    # group -> (K, output widths: the group's A_cat rows first, then its projections)
    groups = {
        "qkv": (4096, [3 * rank, 4096, 4096, 4096]),
        "o": (4096, [rank, 4096]),
        "gate/up": (4096, [2 * rank, 11008, 11008]),
        "down": (11008, [rank, 4096]),
        "head": (4096, [32000]),
    }
    configs = list(itertools.product((32, 64), (64, 128, 256), (4, 8), (3, 4)))
    for label, (k, widths) in groups.items():
        nbytes = sum(n * k * 2 for n in widths)
        for m in rows:
            calls = GroupCalls(m, k, widths)
            ref = [o.float() for o in calls.cublas()]
            base_us = graph_us(calls.cublas)
            bm = max(16, triton.next_power_of_2(m))
            results = []
            for bn, bk, warps, stages in configs:
                if k % bk:
                    continue
                fn = partial(calls.seg, bm, bn, bk, warps, stages)
                calls.i = -1
                try:
                    out = fn()
                    pairs = zip(out, ref, strict=True)
                    err = max((o.float() - r).norm().item() / r.norm().item() for o, r in pairs)
                    us = graph_us(fn)
                except Exception as exc:  # a config that does not compile or fit: say so, go on
                    print(f"{label:8} m={m:3} bn{bn} bk{bk} w{warps} s{stages} failed: {str(exc)[:80]}")
                    continue
                results.append((us, bn, bk, warps, stages, err))
            results.sort()
            what = "per projection + shrink" if len(widths) > 1 else "one GEMM"
            print(f"{label:8} m={m:3} cublas ({what}) {base_us:8.1f} µs {nbytes / base_us / 1e6:5.2f} TB/s")
            for us, bn, bk, warps, stages, err in results[:4]:
                print(
                    f"{label:8} m={m:3} seg bm{bm} bn{bn} bk{bk} w{warps} s{stages} {us:8.1f} µs "
                    f"{nbytes / us / 1e6:5.2f} TB/s  x{us / base_us:.2f} of cublas  err {err:.1e}"
                )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="", help="comma-separated M: probe the segmented GEMM instead")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.rows:
        seg_rows_probe([int(r) for r in args.rows.split(",")])
        return
    shapes = {
        "qkv-like 4096x4096": (4096, 4096),
        "gate 11008x4096": (11008, 4096),
        "down 4096x11008": (4096, 11008),
        "head 32000x4096": (32000, 4096),
    }
    configs = ((16, 256, 4, 4), (32, 256, 4, 4), (32, 128, 4, 5), (64, 128, 4, 4), (16, 512, 4, 3))
    # rotate over several weight copies so that the 50 MB L2 does not serve repeated reads
    for label, (n, k) in shapes.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(4)]
        nbytes = n * k * 2
        for m in (1, 4, 8):
            xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
            ref = xs[0].float() @ ws[0].float().t()
            nxt = Rotation(xs, ws)
            rows = [("cublas", partial(call, F.linear, nxt))]
            for bn, bk, warps, stages in configs:
                if n % bn or k % bk:
                    continue
                rows.append(
                    (
                        f"skinny bn{bn} bk{bk} w{warps} s{stages}",
                        partial(call, skinny, nxt, bn, bk, warps, stages),
                    )
                )
                if m == 1:
                    rows.append(
                        (
                            f"gemv   bn{bn} bk{bk} w{warps} s{stages}",
                            partial(call, gemv, nxt, bn, bk, warps, stages),
                        )
                    )
            for name, fn in rows:
                nxt.reset()
                try:
                    out = fn()
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    us = graph_us(fn)
                except Exception as exc:  # a config that does not compile: say so, go on
                    print(f"{label:22} m={m} {name:30} failed: {str(exc)[:80]}")
                    continue
                print(f"{label:22} m={m} {name:30} {us:8.1f} µs {nbytes / us / 1e6:6.2f} TB/s  err {err:.1e}")


if __name__ == "__main__":
    main()
