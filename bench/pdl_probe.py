"""Probe (issue 12): does programmatic dependent launch (PDL) hide the small kernels and launch gaps of a
batch-1 decode step? A decode layer's chain of launches at one row (add + RMSNorm -> q/k/v GEMM -> o GEMM ->
add + RMSNorm -> gate/up GEMM -> SiLU·up -> down GEMM; the 7B's shapes, 32 layers of their own weights, 13
GB streamed a step) captured in one CUDA graph, three ways, replayed and timed with CUDA events:

- plain: ordinary launches (each kernel starts once the one before it has ended);
- pdl: every kernel launched with PDL (Triton's `launch_pdl`): it may start while the one before it runs,
  waits (griddepcontrol.wait) before it reads what that one wrote, and lets the next one start at once;
- pdl+prefetch: as pdl, and each GEMM loads its first weight tile before the wait, so the weight stream
  starts while the kernel before it (a norm, SiLU) still runs.

All writes come after the wait (a buffer the graph reuses may still be read by the kernel before). The
outputs of the three must be equal bit for bit (the same math in the same order); prints replay ms and the
ratios, beside the HBM floor of the weights (bytes / copy bandwidth).

    python bench/pdl_probe.py [--layers 32] [--rows 1]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, str(Path(__file__).resolve().parent))

from graph_timing import capture, replay_ms  # a bench helper beside this file

BLOCK_N, BLOCK_K, STAGES = 32, 256, 4  # fused_decode's skinny-GEMM tile at 16 rows


@triton.jit
def _add_norm(H, D, NW, H_OUT, Y, K: tl.constexpr, EPS, ADD: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, K)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    h = tl.load(H + row * K + cols).to(tl.float32)
    if ADD:
        h = (h + tl.load(D + row * K + cols).to(tl.float32)).to(H.dtype.element_ty).to(tl.float32)
        tl.store(H_OUT + row * K + cols, h.to(H.dtype.element_ty))
    inv = tl.rsqrt(tl.sum(h * h, axis=0) / K + EPS)
    y = (h * inv).to(H.dtype.element_ty).to(tl.float32) * tl.load(NW + cols).to(tl.float32)
    tl.store(Y + row * K + cols, y.to(H.dtype.element_ty))


@triton.jit
def _silu_mul(GU, Y, N: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    blk = tl.program_id(1)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    g = tl.load(GU + row * 2 * N + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + row * 2 * N + N + cols, mask=ok, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32)
    tl.store(Y + row * N + cols, (act * u).to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _gemm(
    X,
    W,
    Y,
    M,
    N,
    K,
    stride_xm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_rows = W + rn[None, :].to(tl.int64) * K
    if PREFETCH:  # the first weight tile, read while the kernel before this one runs (weights are constant)
        w0 = tl.load(w_rows + rk[:, None])
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    if PREFETCH:
        x0 = tl.load(X + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None], other=0.0)
        acc += tl.dot(x0, w0)
        start = BLOCK_K
    else:
        start = 0
    for k0 in range(start, K, BLOCK_K):
        x = tl.load(X + rm[:, None] * stride_xm + (k0 + rk)[None, :], mask=m_ok[:, None], other=0.0)
        wt = tl.load(w_rows + (k0 + rk)[:, None])
        acc += tl.dot(x, wt)
    tl.store(Y + rm[:, None] * N + rn[None, :], acc.to(Y.dtype.element_ty), mask=m_ok[:, None])


class Chain:
    """The decode layers' launches over their own weights and activations (made once, before capture)."""

    def __init__(self, layers: int, rows: int, hidden: int = 4096, inter: int = 11008) -> None:
        dev, dt = torch.device("cuda"), torch.bfloat16
        gen = torch.Generator(device=dev).manual_seed(0)

        def rand(*shape: int, scale: float) -> torch.Tensor:
            return (torch.randn(*shape, device=dev, generator=gen) * scale).to(dt)

        self.rows, self.hidden, self.inter = rows, hidden, inter
        self.weights = [
            {
                "qkv": rand(3 * hidden, hidden, scale=hidden**-0.5),
                "o": rand(hidden, hidden, scale=hidden**-0.5),
                "gu": rand(2 * inter, hidden, scale=hidden**-0.5),
                "down": rand(hidden, inter, scale=inter**-0.5),
                "n1": 1 + rand(hidden, scale=0.1),
                "n2": 1 + rand(hidden, scale=0.1),
            }
            for _ in range(layers)
        ]
        self.h0 = rand(rows, hidden, scale=1.0)
        tensors = [w for layer in self.weights for w in layer.values()]
        self.weight_bytes = sum(w.numel() * w.element_size() for w in tensors)

    def run(self, pdl: bool, prefetch: bool) -> torch.Tensor:
        r, hid, inter = self.rows, self.hidden, self.inter
        h, delta = self.h0, None
        for lw in self.weights:
            x = torch.empty_like(h)
            h_next = torch.empty_like(h)
            add = delta is not None
            _add_norm[(r,)](h, delta if add else h, lw["n1"], h_next, x, hid, 1e-5, add, pdl, launch_pdl=pdl)
            h = h_next if add else h
            qkv = self._gemm(x, lw["qkv"], pdl, prefetch)
            # the attention's stand-in: o reads the q columns (a strided view, as the engine's o reads attn)
            o = self._gemm(qkv[:, :hid], lw["o"], pdl, prefetch)
            x, h_next = torch.empty_like(h), torch.empty_like(h)
            _add_norm[(r,)](h, o, lw["n2"], h_next, x, hid, 1e-5, True, pdl, launch_pdl=pdl)
            h = h_next
            gu = self._gemm(x, lw["gu"], pdl, prefetch)
            act = torch.empty(r, inter, device=h.device, dtype=h.dtype)
            _silu_mul[(r, triton.cdiv(inter, 1024))](gu, act, inter, 1024, pdl, launch_pdl=pdl)
            delta = self._gemm(act, lw["down"], pdl, prefetch)
        return torch.cat([h, delta])

    def _gemm(self, x: torch.Tensor, w: torch.Tensor, pdl: bool, prefetch: bool) -> torch.Tensor:
        m, k = x.shape
        n = w.shape[0]
        y = torch.empty(m, n, device=x.device, dtype=x.dtype)
        bk = BLOCK_K if k % BLOCK_K == 0 else 128 if k % 128 == 0 else 64
        _gemm[(triton.cdiv(n, BLOCK_N),)](
            x, w, y, m, n, k, x.stride(0), 16, BLOCK_N, bk, pdl, prefetch,
            num_warps=4, num_stages=STAGES, launch_pdl=pdl,
        )  # fmt: skip
        return y


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize()
    return 2 * nbytes * 10 / (start.elapsed_time(end) / 1e3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("a CUDA device (Hopper or later) is needed: PDL is a GPU launch feature")
    chain = Chain(args.layers, args.rows)
    variants = {"plain": (False, False), "pdl": (True, False), "pdl+prefetch": (True, True)}
    graphs, outs = {}, {}
    for name, (pdl, prefetch) in variants.items():
        eager = chain.run(pdl, prefetch)  # compiles, and the eager result
        torch.cuda.synchronize()
        graph, out = capture(lambda pdl=pdl, prefetch=prefetch: chain.run(pdl, prefetch))
        graphs[name], outs[name] = graph, out
        assert torch.equal(out, eager), f"{name}: the graph's output is not the eager one"
    for name, out in outs.items():
        same = torch.equal(out, outs["plain"])
        print(f"{name}: output {'equal to' if same else 'DIFFERS from'} plain's")
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _round in range(args.rounds):  # interleaved rounds: drift reaches every variant alike
        for name, graph in graphs.items():
            times[name].append(replay_ms(graph, args.reps))
    floor = chain.weight_bytes / copy_bandwidth() * 1e3
    gb = chain.weight_bytes / 1e9
    print(f"{args.layers} layers, {args.rows} row(s): weights {gb:.2f} GB, floor {floor:.2f} ms")
    base = min(times["plain"])
    for name, ts in times.items():
        best = min(ts)
        print(f"  {name:13} replay {best:7.3f} ms (rounds {', '.join(f'{t:.3f}' for t in ts)}) "
              f"x{best / floor:.3f} floor, x{best / base:.3f} plain")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
