"""CUDA-graph timing shared by the kernel probes (decode_attention.py, pdl_probe.py, seg_expand_probe.py):
capture a function once warmed up, then time replays of it with CUDA events."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch


def capture(fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """(a CUDA graph of `fn`, what `fn` returned while it was captured): `fn` runs once eagerly first (Triton
    compiles, cuBLAS picks its kernels), and the graph is replayed once before it is returned."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph, outs


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int, rounds: int = 1) -> float:
    """Median over `rounds` of the ms one replay took in a round of `replays` back-to-back replays."""
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / replays)
    return statistics.median(times)
