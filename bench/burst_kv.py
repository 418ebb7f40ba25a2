"""KV for bursts (`PolicyConfig.burst_kv_bytes`, docs/architecture.md "KV for bursts"), end to end: `lorafn
up` with one function whose workers have a small KV cache (a worker holds only the requests its KV serves,
`runtime.read_cap`), hit by bursts of concurrent streamed requests; once with `burst_kv_mib: 0` (off, the
default) and once with it set, side by side in one run: TTFT p50 / p99, end to end p50 / p99, each burst's
makespan, the grants the controller sent (`kv_resized` events) and the on/off ratios.

Bursts are `--gap-s` apart (longer than the controller's `kv_grant_idle_s`, 5 s: each burst starts from the
function's own KV, as on a bursty trace). Every request must end in a complete answer; a failed one is counted
and printed. On CPU the tiny model's decode cost grows with the batch (compute-bound), so the ratios there
show the mechanism, not what a memory-bound GPU decode gains.

CPU:  python bench/burst_kv.py --preset tiny --kv-mib 1 --burst-kv-mib 8 --bursts 3 --burst 16 --max-tokens 64
H100: python bench/burst_kv.py --model /tmp/llama-2-7b --device cuda --kv-mib 512 --burst-kv-mib 2048 \\
          --bursts 5 --burst 24 --max-tokens 128
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lorafn.replay.configs import ReplayConfig  # noqa: E402
from lorafn.replay.driver import DriveOptions, Target, send_one  # noqa: E402
from lorafn.replay.platform import (  # noqa: E402
    FunctionSetup,
    ManagedPlatform,
    manifest,
    new_keys,
    prepare_adapters,
    prepare_model,
)
from lorafn.replay.stats import RequestResult, percentiles  # noqa: E402
from lorafn.replay.trace import PlannedRequest  # noqa: E402

FN = "burst/f"


async def bursts(target: Target, count: int, size: int, gap_s: float, max_tokens: int) -> dict[str, Any]:
    """``count`` bursts of ``size`` streamed completions sent at once (the replay's `send_one`), ``gap_s``
    apart: TTFT and end to end (s) of the answered ones, each burst's makespan, the failed count."""
    import httpx

    ttft: list[float] = []
    e2e: list[float] = []
    makespans: list[float] = []
    failed = 0
    options = DriveOptions()
    async with httpx.AsyncClient(timeout=options.request_timeout_s) as client:
        for b in range(count):
            if b:
                await asyncio.sleep(gap_s)
            reqs = [
                PlannedRequest(
                    b * size + i, 0.0, FN, f"Question {b}.{i}: {i} cows have how many legs?", 0, max_tokens
                )
                for i in range(size)
            ]
            results = [RequestResult(r.index, FN, 0.0) for r in reqs]
            start = time.perf_counter()
            await asyncio.gather(
                *(
                    send_one(client, target, r, res, start, options)
                    for r, res in zip(reqs, results, strict=True)
                )
            )
            makespans.append(time.perf_counter() - start)
            for res in results:
                if res.ok and res.ttft_ms is not None and res.e2e_ms is not None:
                    ttft.append(res.ttft_ms / 1000)
                    e2e.append(res.e2e_ms / 1000)
                else:
                    failed += 1
    return {"ttft_s": ttft, "e2e_s": e2e, "makespan_s": makespans, "failed": failed}


def kv_changes(platform: ManagedPlatform, own_bytes: int) -> tuple[int, int]:
    """(grows, returns) of the function's workers' KV budgets, from the `kv_resized` lifecycle events (each
    worker starts at the function's own budget)."""
    from lorafn.store import control

    assert platform.store is not None
    grown = returned = 0
    last: dict[str, int] = {}
    for _id, e in platform.store.run(control.read_events(platform.keys, "0-0")):
        if e.get("kind") != control.KV_RESIZED:
            continue
        budget = int(e["budget_bytes"])
        if budget > last.get(e["worker"], own_bytes):
            grown += 1
        else:
            returned += 1
        last[e["worker"]] = budget
    return grown, returned


def run_config(args: argparse.Namespace, model_dir: Path, adapter: Path, work: Path, burst_mib: int) -> dict:
    settings = {"device": args.device, "devices": 1, "warm_pool": False, "burst_kv_mib": burst_mib}
    env = {"LORAFN_RATE_LIMIT_RPS": "0", "LORAFN_MAX_QUEUE": "0"}  # the gateway must not throttle a burst
    platform = ManagedPlatform(work / f"platform-{burst_mib}", settings, env=env)
    keys = new_keys([FN])
    setup = FunctionSetup(slo_ttft_ms=60_000, keep_alive_s=3600, max_replicas=1, kv_cache_mib=args.kv_mib)
    config = ReplayConfig("burst", "bench/burst_kv.py", min_replicas=1, warm_pool_fallback=(0, 0))
    try:
        state = platform.start(timeout_s=args.start_timeout_s)
        platform.apply(
            manifest(model_dir, args.dtype, [FN], [adapter], keys, setup, config, True, namespace="burst")
        )
        platform.settle([FN], 1, want_standby=False, shared=True, timeout_s=args.start_timeout_s)
        target = Target(state.gateway_url, keys)
        asyncio.run(bursts(target, 1, 2, 0.0, 8))  # warm-up: the worker's first steps are slower
        print(f"burst_kv_mib {burst_mib}: {args.bursts} bursts of {args.burst} ...", flush=True)
        out = asyncio.run(bursts(target, args.bursts, args.burst, args.gap_s, args.max_tokens))
        out["grants"], out["returns"] = kv_changes(platform, args.kv_mib << 20)
        return out
    finally:
        platform.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--model", help="an existing model directory instead of --preset")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--kv-mib", type=int, default=1, help="the function's spec.resources.kvCacheMiB")
    ap.add_argument("--burst-kv-mib", type=int, default=8, help="the controller's burst_kv_mib when on")
    ap.add_argument("--bursts", type=int, default=3)
    ap.add_argument("--burst", type=int, default=16, help="requests sent at once in each burst")
    ap.add_argument("--gap-s", type=float, default=8.0, help="between bursts (> kv_grant_idle_s, 5 s)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--start-timeout-s", type=float, default=600.0)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.burst_kv_mib <= args.kv_mib:
        ap.error(f"--burst-kv-mib ({args.burst_kv_mib}) must be above --kv-mib ({args.kv_mib})")
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="lorafn-burst-bench-"))
    model_dir = (
        Path(args.model)
        if args.model
        else prepare_model(args.preset, work / f"model-{args.preset}", args.dtype)
    )
    (adapter,) = prepare_adapters(model_dir, work / "adapters", 1, 16, "all-linear")
    rows = {name: run_config(args, model_dir, adapter, work, mib) for name, mib in
            (("off", 0), ("on", args.burst_kv_mib))}  # fmt: skip

    def ms(xs: list[float], q: str) -> float:
        got = percentiles([x * 1000 for x in xs]).get(q)
        return float("nan") if got is None else got

    print(
        f"\n{args.bursts} bursts of {args.burst} requests ({args.max_tokens} tokens), KV {args.kv_mib} MiB, "
        f"{args.device}; burst KV budget {args.burst_kv_mib} MiB when on"
    )
    head = ("", "TTFT p50", "p99", "E2E p50", "p99", "makespan s", "failed", "grants")
    print(f"{head[0]:4}" + "".join(f"{h:>11}" for h in head[1:]))
    for name, r in rows.items():
        cells = (
            ms(r["ttft_s"], "p50"), ms(r["ttft_s"], "p99"), ms(r["e2e_s"], "p50"), ms(r["e2e_s"], "p99"),
        )  # fmt: skip
        makespan = sum(r["makespan_s"]) / len(r["makespan_s"])
        print(
            f"{name:4}"
            + "".join(f"{c:11.0f}" for c in cells)
            + f"{makespan:11.2f}{r['failed']:11d}{r['grants']:11d}"
        )
    on, off = rows["on"], rows["off"]
    print(
        f"on / off: TTFT p50 {ms(on['ttft_s'], 'p50') / ms(off['ttft_s'], 'p50'):.2f}, p99 "
        f"{ms(on['ttft_s'], 'p99') / ms(off['ttft_s'], 'p99'):.2f}; E2E p99 "
        f"{ms(on['e2e_s'], 'p99') / ms(off['e2e_s'], 'p99'):.2f}; makespan "
        f"{sum(on['makespan_s']) / sum(off['makespan_s']):.2f}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 1 if any(r["failed"] for r in rows.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
