"""How long a fresh process's CUDA context takes while other processes keep the GPU busy, stage by stage.

The 64-function H100 replay showed a fresh worker's CUDA context at p50 3.5-4.2 s (0.18 s quiet), 41% of the
late requests' time. This probe spawns `--busy` processes that keep the GPU time-sliced (small kernels
from CUDA graphs, as serving workers' decode steps do, or large GEMMs), then times fresh processes through
the driver API: cuInit, primary context retain + set current, the first small allocation, the first kernel
(torch.zeros, which also loads its module), a stack-limit change, and a synchronize; per environment
variant, side by side.

    python3 bench/context_probe.py --busy 0,4,12 --repeats 3 --variants default,conn1
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

VARIANTS: dict[str, dict[str, str]] = {
    "default": {},
    "conn1": {"CUDA_DEVICE_MAX_CONNECTIONS": "1"},
    "conn2": {"CUDA_DEVICE_MAX_CONNECTIONS": "2"},
    "eager": {"CUDA_MODULE_LOADING": "EAGER"},
}


def _busy(kind: str, stop: Any, ready: Any) -> None:
    import torch

    if kind == "graph":  # a decode-like step: many small kernels replayed from one graph
        x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            for _ in range(3):
                y = x
                for _ in range(64):
                    y = torch.nn.functional.linear(y, w).tanh_()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = x
            for _ in range(64):
                y = torch.nn.functional.linear(y, w).tanh_()
        ready.release()
        while not stop.is_set():
            g.replay()
            torch.cuda.synchronize()
    else:  # GEMMs back to back: bench/lora_load.py's busy processes (this directory is on sys.path)
        from lora_load import _busy as gemm_busy

        gemm_busy(stop, ready)


def _idle_context(stop: Any, ready: Any) -> None:
    """A process that holds a CUDA context and does nothing (an idle bound worker)."""
    import torch

    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    ready.release()
    stop.wait()


def _nvml_poller(hz: float, stop: Any, ready: Any) -> None:
    """What a worker's heartbeat asks the driver every 1/hz s: the GPU's compute processes with their
    memory (nvmlDeviceGetComputeRunningProcesses) and the device's free memory."""
    import ctypes

    lib = ctypes.CDLL("libnvidia-ml.so.1")
    assert lib.nvmlInit_v2() == 0
    handle = ctypes.c_void_p()
    assert lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle)) == 0
    infos = (ctypes.c_uint64 * (6 * 256))()
    mem = (ctypes.c_uint64 * 3)()
    call = (
        getattr(lib, "nvmlDeviceGetComputeRunningProcesses_v3", None)
        or lib.nvmlDeviceGetComputeRunningProcesses_v2
    )
    ready.release()
    while not stop.wait(1.0 / hz):
        count = ctypes.c_uint(256)
        call(handle, ctypes.byref(count), infos)
        lib.nvmlDeviceGetMemoryInfo(handle, mem)


def _fresh(env: dict[str, str], q: Any) -> None:
    os.environ.update(env)
    import ctypes

    import torch  # imported before the clock, as a zygote child has it

    libcuda = ctypes.CDLL("libcuda.so.1")
    t: dict[str, float] = {}
    t0 = time.perf_counter()
    assert libcuda.cuInit(0) == 0
    t["cuInit"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    torch.cuda.init()
    t["torch_init"] = time.perf_counter() - t1
    t1 = time.perf_counter()
    torch.cuda.set_device(0)
    ctx = ctypes.c_void_p()
    assert libcuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
    assert libcuda.cuCtxSetCurrent(ctx) == 0
    t["ctx_retain"] = time.perf_counter() - t1
    t1 = time.perf_counter()
    ptr = ctypes.c_uint64()
    assert libcuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(1 << 20)) == 0
    t["first_alloc"] = time.perf_counter() - t1
    t1 = time.perf_counter()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    t["first_kernel"] = time.perf_counter() - t1
    t1 = time.perf_counter()
    assert libcuda.cuCtxSetLimit(ctypes.c_int(0), ctypes.c_size_t(256)) == 0
    torch.cuda.synchronize()
    t["stack_limit"] = time.perf_counter() - t1
    t1 = time.perf_counter()
    torch.empty(512 << 20, dtype=torch.uint8, device="cuda").zero_()
    torch.cuda.synchronize()
    t["kv_512mib"] = time.perf_counter() - t1
    t["total"] = time.perf_counter() - t0
    q.put(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--busy", default="0,4,12")
    ap.add_argument("--busy-kind", default="graph", choices=["graph", "gemm"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", default="default,conn1")
    ap.add_argument("--idle-contexts", type=int, default=0, help="processes holding an idle CUDA context")
    ap.add_argument("--nvml-pollers", type=int, default=0, help="processes asking NVML as heartbeats do")
    ap.add_argument("--nvml-hz", type=float, default=1.0)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    rows: list[dict[str, Any]] = []
    names = [v for v in args.variants.split(",") if v]
    for n_busy in [int(x) for x in args.busy.split(",")]:
        stop, ready = ctx.Event(), ctx.Semaphore(0)
        procs = [
            ctx.Process(target=_busy, args=(args.busy_kind, stop, ready), daemon=True) for _ in range(n_busy)
        ]
        procs += [
            ctx.Process(target=_idle_context, args=(stop, ready), daemon=True)
            for _ in range(args.idle_contexts)
        ]
        procs += [
            ctx.Process(target=_nvml_poller, args=(args.nvml_hz, stop, ready), daemon=True)
            for _ in range(args.nvml_pollers)
        ]
        for p in procs:
            p.start()
        for _ in procs:
            ready.acquire()
        try:
            per: dict[str, list[dict[str, float]]] = {v: [] for v in names}
            for _ in range(args.repeats):
                for v in names:  # alternating, so drift hits every variant alike
                    q = ctx.Queue()
                    p = ctx.Process(target=_fresh, args=(VARIANTS[v], q))
                    p.start()
                    per[v].append(q.get(timeout=300))
                    p.join(timeout=60)
        finally:
            stop.set()
            for p in procs:
                p.join(timeout=30)
        for v in names:
            med = {k: statistics.median(r[k] for r in per[v]) * 1000 for k in per[v][0]}
            rows.append(
                {"busy": n_busy, "idle": args.idle_contexts, "nvml": args.nvml_pollers, "variant": v, **med}
            )
            print(
                f"busy {n_busy:>2} {args.busy_kind} idle {args.idle_contexts} nvml {args.nvml_pollers}"
                f" {v:>8}: " + "  ".join(f"{k} {val:.0f}" for k, val in med.items()) + " ms",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
