"""Adapter load and standby copy: the packed `load_lora` (host-built, one buffer, one copy to the device;
its pinned-staging variant beside it) and the grouped `copy_lora` against the old per-tensor ones
(tests/unit/runtime/lora_reference.py),
side by side in one run, on llama-2-7b shapes (32 layers, 4096 / 11008), rank 16 all-linear by default.

    python3 bench/lora_load.py --device cpu
    python3 bench/lora_load.py --device cuda --busy 0,4,12

`--busy N`: N other processes keep the same GPU busy with small kernels while it is measured (a GPU
time-sliced between many worker processes, as in the 64-function replay: there each small copy or kernel of
a load waits for this process's turn). Every result is also checked bit for bit against the old one.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _busy(stop: Any, ready: Any) -> None:
    """Small kernels back to back, as a serving worker's decode steps keep the GPU's time slices taken."""
    import torch

    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    ready.release()
    while not stop.is_set():
        for _ in range(50):
            x = torch.nn.functional.linear(x, w).tanh_()
        torch.cuda.synchronize()


def _timed(fn: Any, sync: Any) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--busy", default="0", help="comma-separated counts of busy processes on the GPU")
    args = ap.parse_args()

    import torch

    from lorafn.runtime.config import ModelConfig
    from lorafn.runtime.lora import copy_lora, load_lora, write_random_adapter, zero_lora
    from tests.unit.runtime.lora_reference import assert_same, reference_copy, reference_load

    # One intra-op thread, as every worker runs (worker.py; OMP_NUM_THREADS else 1): with torch's default
    # (one per core) the host-side packing spun against the busy processes' threads (7.2 s on the H100
    # with 4 busy processes; a worker never runs so).
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    cfg = ModelConfig.from_dict(
        dict(
            model_type="llama",
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=args.layers,
            num_attention_heads=32,
            num_key_value_heads=32,
            vocab_size=32000,
        )
    )
    adapter = write_random_adapter(cfg, Path(tempfile.mkdtemp()) / "a", rank=args.rank)
    cuda = args.device.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    new = load_lora(adapter, cfg, args.device, dtype)  # warm-up (page cache, CUDA context, pinned pool)
    assert_same(new, reference_load(adapter, cfg, args.device, dtype))
    buffers = zero_lora(new.shape_key, cfg, args.device, dtype)
    check = zero_lora(new.shape_key, cfg, args.device, dtype)
    copy_lora(buffers, new)
    reference_copy(check, new)
    assert_same(buffers, check)
    print(
        f"{args.device} {args.dtype} {args.layers} layers r{args.rank} all-linear: results equal bit for bit"
    )
    print(
        f"{'busy':>4}  {'load old':>9}  {'load new':>9}  {'ratio':>6}  {'new pinned':>10}"
        f"  {'copy old':>9}  {'copy new':>9}  {'ratio':>6}"
    )

    for n_busy in [int(x) for x in args.busy.split(",")]:
        if n_busy and not cuda:
            raise SystemExit("--busy needs --device cuda")
        ctx = mp.get_context("spawn")
        stop, ready = ctx.Event(), ctx.Semaphore(0)
        procs = [ctx.Process(target=_busy, args=(stop, ready), daemon=True) for _ in range(n_busy)]
        for p in procs:
            p.start()
        for _ in procs:
            ready.acquire()
        times: dict[str, list[float]] = {"lo": [], "ln": [], "lp": [], "co": [], "cn": []}
        try:
            for _ in range(args.repeats):  # alternating, so drift hits both alike
                times["lo"].append(_timed(lambda: reference_load(adapter, cfg, args.device, dtype), sync))
                times["ln"].append(_timed(lambda: load_lora(adapter, cfg, args.device, dtype), sync))
                times["lp"].append(
                    _timed(lambda: load_lora(adapter, cfg, args.device, dtype, pinned=cuda), sync)
                )
                times["co"].append(_timed(lambda: reference_copy(buffers, new), sync))
                times["cn"].append(_timed(lambda: copy_lora(buffers, new), sync))
        finally:
            stop.set()
            for p in procs:
                p.join(timeout=30)
        med = {k: statistics.median(v) * 1000 for k, v in times.items()}
        print(
            f"{n_busy:>4}  {med['lo']:>7.0f}ms  {med['ln']:>7.0f}ms  {med['lo'] / med['ln']:>5.1f}x"
            f"  {med['lp']:>8.0f}ms  {med['co']:>7.1f}ms  {med['cn']:>7.1f}ms"
            f"  {med['co'] / med['cn']:>5.1f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
