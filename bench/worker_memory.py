"""What one worker process costs in GPU memory beyond the shared backbone, and what each knob saves.

    python bench/worker_memory.py --json out/worker_memory.json      # on a GPU machine

A fresh process per variant; the device-wide memory in use (NVML: it sees every process) is read
before the process starts and at each stage inside it, so each figure is that process's whole cost:
  ctx      CUDA context only (torch.cuda.init + one tiny tensor)
  cublas   + a bf16 matmul (cuBLAS handle and workspace)
  triton   + one Triton kernel launch (module load)
  graph    + a captured and replayed CUDA graph of a few matmuls (graph pool)
Variants (environment or driver limits set before CUDA starts; each is a candidate for the worker):
  default           what a worker gets today
  eager-modules     CUDA_MODULE_LOADING=EAGER (for contrast: every kernel image loaded at start)
  small-stack       cuCtxSetLimit(STACK_SIZE=256) right after the context exists (local memory
                    reserved per resident thread shrinks; kernels needing more grow it on launch)
  small-cublas-ws   CUBLAS_WORKSPACE_CONFIG=:0:0 and CUBLASLT_WORKSPACE_SIZE=0 (no split-K workspace)
  cublas-ws-1mib    the worker's default workspace (WorkerSettings.cublas_workspace_kib = 1024 KiB)
  worker-default    what a GPU worker starts with now: stack 256 B + the 1 MiB cuBLAS workspace
  expandable        PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (no rounding to 2 MiB blocks)
  small-limits      small-stack + a 1 MiB device malloc heap, 64 KiB printf FIFO, 32 pending launches
  no-stack          cuCtxSetLimit(STACK_SIZE=0): the driver grows local memory at launch as kernels need
  one-connection    small-stack + CUDA_DEVICE_MAX_CONNECTIONS=1 (one hardware work queue)
  all-savings       small-stack + small-cublas-ws + expandable
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lorafn.runtime.worker import WorkerSettings, cublas_workspace_env

MiB = 1 << 20
# the environment a GPU worker sets before its first cuBLAS call (lorafn.runtime.worker.default_engine)
WORKER_CUBLAS = cublas_workspace_env(WorkerSettings.model_fields["cublas_workspace_kib"].default)

VARIANTS: dict[str, dict[str, str]] = {
    "default": {},
    "eager-modules": {"CUDA_MODULE_LOADING": "EAGER"},
    "small-stack": {"LORAFN_BENCH_STACK": "256"},
    "small-cublas-ws": {"CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0"},
    "expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    "cublas-ws-1mib": WORKER_CUBLAS,
    "worker-default": {"LORAFN_BENCH_STACK": "256", **WORKER_CUBLAS},
    # the context's other reservations: device malloc heap, printf FIFO, device-runtime launch pool
    "small-limits": {
        "LORAFN_BENCH_LIMITS": "STACK_SIZE=256,MALLOC_HEAP_SIZE=1048576,PRINTF_FIFO_SIZE=65536,"
        "DEV_RUNTIME_PENDING_LAUNCH_COUNT=32"
    },
    "no-stack": {"LORAFN_BENCH_STACK": "0"},  # the driver grows it at launch for kernels that need more
    "one-connection": {"LORAFN_BENCH_STACK": "256", "CUDA_DEVICE_MAX_CONNECTIONS": "1"},
    "all-savings": {
        "LORAFN_BENCH_STACK": "256",
        "CUBLAS_WORKSPACE_CONFIG": ":0:0",
        "CUBLASLT_WORKSPACE_SIZE": "0",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    },
}


def _used(index: int) -> int:
    import pynvml

    pynvml.nvmlInit()
    return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).used)


def child(index: int) -> None:
    """Runs in the measured process: prints one JSON line per stage (device-wide bytes in use)."""
    import torch

    def mark(stage: str) -> None:
        torch.cuda.synchronize()
        print(json.dumps({"stage": stage, "used": _used(index)}), flush=True)

    torch.cuda.set_device(index)
    torch.zeros(1, device="cuda")
    limits = dict(item.split("=") for item in os.environ.get("LORAFN_BENCH_LIMITS", "").split(",") if item)
    if os.environ.get("LORAFN_BENCH_STACK"):
        limits["STACK_SIZE"] = os.environ["LORAFN_BENCH_STACK"]
    if limits:
        from cuda.bindings import driver

        for name, value in limits.items():
            (err,) = driver.cuCtxSetLimit(getattr(driver.CUlimit, f"CU_LIMIT_{name}"), int(value))
            if err != driver.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuCtxSetLimit({name}={value}): {err}")
    mark("ctx")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    (x @ a.T).sum().item()
    del a
    mark("cublas")
    import triton
    import triton.language as tl

    @triton.jit
    def _add(p, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(p + i, tl.load(p + i, mask=i < n) + 1, mask=i < n)

    buf = torch.zeros(1024, device="cuda")
    _add[(1,)](buf, 1024, BLOCK=1024)
    mark("triton")
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = x @ w.T
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for _ in range(4):
            y = torch.relu(y @ w.T)
    g.replay()
    del w
    mark("graph")


def measure(index: int, variant: str) -> dict[str, float]:
    env = {**os.environ, **VARIANTS[variant]}
    before = _used(index)
    proc = subprocess.run(
        [sys.executable, __file__, "--child", "--index", str(index)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{variant}: child failed:\n{proc.stderr[-2000:]}")
    stages = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    time.sleep(0.5)  # the context is gone before the next variant's baseline
    return {s["stage"]: (s["used"] - before) / MiB for s in stages}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.child:
        child(args.index)
        return
    results = {v: measure(args.index, v) for v in VARIANTS}
    stages = ("ctx", "cublas", "triton", "graph")
    print(f"{'variant':<18}" + "".join(f"{s:>10}" for s in stages) + "   (MiB of GPU memory, whole process)")
    base = results["default"]["graph"]
    for name, r in results.items():
        row = "".join(f"{r.get(s, float('nan')):>10.0f}" for s in stages)
        print(f"{name:<18}{row}   saves {base - r.get('graph', base):+.0f} MiB vs default")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
