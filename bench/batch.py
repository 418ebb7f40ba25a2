"""Offline batch vs online requests (issue 17, docs/batch.md): GSM8K prompts on one function, once as an
OpenAI batch (KV-packed waves at batch priority) and once as concurrent online requests (at most
`--concurrency` in flight, default: what the batch runner keeps in flight), side by side in one run:
makespan, requests/s, tokens/s and the ratio. With `--other-rps R`, a second function on the same device
gets steady online traffic during both phases and its TTFT p50/p99 is reported per phase (batch work must
not hurt it). Each phase also reports the function's KV offload counters from its workers' heartbeats
(swaps out, MiB swapped out, recomputes: docs/batch.md#kv-offload); `--kv-mib` below what the concurrent
online requests want is where packing and offload matter.

CPU (tiny preset, a subset):  python bench/batch.py --preset tiny --limit 96 --max-tokens 32 \\
                                  --concurrency 16 --other-rps 2 --baseline-s 10 --repeats 2
H100 (7B, ~5 min; --limit 0 = all 1,319 prompts):
    python bench/batch.py --model /tmp/llama-2-7b --data-dir .data --device cuda --limit 192 --warmup 16 \\
        --max-tokens 256 --concurrency 48 --kv-mib 4096 --kv-overcommit 0.25 --other-rps 2 \\
        --baseline-s 20 --repeats 2 --json batch-h100.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lorafn.replay import trace  # noqa: E402
from lorafn.replay.configs import ReplayConfig  # noqa: E402
from lorafn.replay.platform import (  # noqa: E402
    FunctionSetup,
    ManagedPlatform,
    new_keys,
    prepare_adapters,
    prepare_model,
)
from lorafn.replay.platform import manifest as replay_manifest  # noqa: E402
from lorafn.replay.stats import percentiles  # noqa: E402

DATA = ROOT.parent / "shared" / "data"
NAMESPACE = "batch"


def manifest(model_dir: Path, dtype: str, functions: list[str], adapters: list[Path], keys: dict[str, str],
             kv_mib: int | None = None) -> str:  # fmt: skip
    """The replay's manifest (a Backbone without a warm pool, a Secret of keys, the LoRAFunctions), each
    function warm from the start (minReplicas = maxReplicas = 1, kept an hour), in the namespace `batch`."""
    setup = FunctionSetup(slo_ttft_ms=1000, keep_alive_s=3600, max_replicas=1, kv_cache_mib=kv_mib)
    config = ReplayConfig("batch", "bench/batch.py", min_replicas=1, warm_pool_fallback=(0, 0))
    return replay_manifest(
        model_dir,
        dtype,
        functions,
        adapters,
        keys,
        setup,
        config,
        True,
        namespace=NAMESPACE,
        secret="batch-keys",
    )


def run_batch(url: str, key: str, fn: str, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=2, timeout=600)
    lines = [
        json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions",
                    "body": {"model": fn, "prompt": p, "max_tokens": max_tokens, "temperature": 0}})
        for i, p in enumerate(prompts)
    ]  # fmt: skip
    start = time.perf_counter()
    f = client.files.create(file=("gsm8k.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    makespan = time.perf_counter() - start
    out = (
        [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
        if batch.output_file_id
        else []
    )
    tokens = sum(o["response"]["body"]["usage"]["completion_tokens"] for o in out)
    counts = batch.request_counts
    return {"makespan_s": makespan, "completed": counts.completed, "failed": counts.failed,
            "completion_tokens": tokens, "status": batch.status}  # fmt: skip


async def run_online(
    url: str, key: str, fn: str, prompts: list[str], max_tokens: int, concurrency: int
) -> dict[str, Any]:
    import httpx

    sem = asyncio.Semaphore(concurrency or len(prompts))  # 0: every prompt at once
    tokens, failed = 0, 0
    async with httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=600
    ) as client:

        async def one(p: str) -> None:
            nonlocal tokens, failed
            async with sem:
                r = await client.post(
                    "/v1/completions",
                    json={"model": fn, "prompt": p, "max_tokens": max_tokens, "temperature": 0},
                )
                if r.status_code == 200:
                    tokens += r.json()["usage"]["completion_tokens"]
                else:
                    failed += 1

        start = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
    return {"makespan_s": time.perf_counter() - start, "completed": len(prompts) - failed, "failed": failed,
            "completion_tokens": tokens, "status": "done"}  # fmt: skip


KV_COUNTERS = ("kv_swaps_out", "kv_swaps_in", "kv_swap_out_bytes", "kv_recomputes")


def kv_counters(redis_url: str, prefix: str, fn: str) -> dict[str, int]:
    """The function's live workers' KV offload counters (their heartbeats; cumulative since start)."""
    from lorafn.store import Keys, Store, workers

    store, keys = Store(redis_url), Keys(prefix)
    try:
        now_ms = store.run(workers.server_time_ms())
        live = store.run(workers.live_workers(keys, fn, 10_000, now_ms))
        info = store.run(workers.worker_info(keys, live)) if live else {}
    finally:
        store.close()
    return {k: sum(int(h.get(k) or 0) for h in info.values()) for k in KV_COUNTERS}


class Other:
    """Steady online traffic (Poisson arrivals at `rps`) on another function while a phase runs, in a
    thread with its own event loop; the TTFT (first streamed text) of each request it sent."""

    def __init__(self, url: str, key: str, fn: str, rps: float, prompts: list[str], max_tokens: int) -> None:
        self.url, self.key, self.fn, self.rps, self.prompts, self.max_tokens = (
            url,
            key,
            fn,
            rps,
            prompts,
            max_tokens,
        )
        self.stop = threading.Event()
        self.ttfts: list[float] = []
        self.errors = 0
        self.thread: threading.Thread | None = None

    async def _one(self, client: Any, prompt: str) -> None:
        start = time.perf_counter()
        body = {
            "model": self.fn,
            "prompt": prompt,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "stream": True,
        }
        try:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    self.errors += 1
                    return
                first = True
                async for line in r.aiter_lines():  # read to the end: the answer is not cancelled
                    if first and line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                        self.ttfts.append((time.perf_counter() - start) * 1000)
                        first = False
        except Exception:
            self.errors += 1

    async def _loop(self) -> None:
        import random

        import httpx

        rng = random.Random(0)
        tasks: list[asyncio.Task[None]] = []
        headers = {"Authorization": f"Bearer {self.key}"}
        async with httpx.AsyncClient(base_url=self.url, headers=headers, timeout=600) as client:
            i = 0
            while not self.stop.is_set():
                tasks.append(asyncio.create_task(self._one(client, self.prompts[i % len(self.prompts)])))
                i += 1
                await asyncio.sleep(rng.expovariate(self.rps))
            await asyncio.gather(*tasks)

    def __enter__(self) -> Other:
        self.thread = threading.Thread(target=lambda: asyncio.run(self._loop()), daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        assert self.thread is not None
        self.thread.join(timeout=600)

    def figures(self) -> dict[str, Any]:
        return {**percentiles(self.ttfts), "requests": len(self.ttfts) + self.errors, "errors": self.errors}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--model", help="an existing model directory instead of --preset")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--limit", type=int, default=None, help="the first N GSM8K prompts (0 or none: all)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--concurrency",
        type=int,
        default=48,
        help="online phase: requests in flight (0: all at once); also the runner's in-flight cap per worker "
        "unless --batch-inflight says otherwise",
    )
    ap.add_argument(
        "--batch-inflight",
        type=int,
        default=None,
        help="the batch runner's in-flight cap per worker (default: --concurrency): a batch knows all its "
        "prompts, so it may keep more in flight than an online client would (larger decode batches)",
    )
    ap.add_argument("--other-rps", type=float, default=0.0, help="online traffic on a second function")
    ap.add_argument(
        "--baseline-s", type=float, default=20.0, help="the other function alone first, this long"
    )
    ap.add_argument("--order", default="online,batch", choices=["online,batch", "batch,online"])
    ap.add_argument("--repeats", type=int, default=1, help="run the phases this many times, alternating")
    ap.add_argument("--warmup", type=int, default=32, help="prompts of each path before measuring")
    ap.add_argument("--kv-mib", type=int, default=None, help="spec.resources.kvCacheMiB of the functions")
    ap.add_argument(
        "--kv-overcommit",
        type=float,
        default=0.0,
        help="pack batch waves this fraction beyond the KV budget, the overflow swapped to host memory",
    )
    ap.add_argument(
        "--batch-kv-mib",
        type=int,
        default=0,
        help="the controller's batch_kv_mib: a worker of a function with a batch backlog grows its KV cache "
        "to this many MiB out of idle GPU memory (docs/batch.md#kv-from-idle-memory); 0: off",
    )
    ap.add_argument("--data-dir", default=str(DATA))
    ap.add_argument("--start-timeout-s", type=float, default=600.0)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="lorafn-batch-bench-"))
    model_dir = (
        Path(args.model)
        if args.model
        else prepare_model(args.preset, work / f"model-{args.preset}", args.dtype)
    )
    adapters = prepare_adapters(model_dir, work / "adapters", 2, 16, "all-linear")
    questions = trace.load_questions(Path(args.data_dir) / "gsm8k_test.jsonl")
    prompts = [f"Question: {q}\nAnswer:" for q in questions[: args.limit or None]]
    functions = [f"{NAMESPACE}/gsm8k"] + ([f"{NAMESPACE}/online"] if args.other_rps > 0 else [])
    keys = new_keys(functions)
    settings = {"device": args.device, "devices": 1, "warm_pool": False, "batch_kv_mib": args.batch_kv_mib}
    # no rate limit or queue cap: the online baseline must not be throttled by the gateway's defaults
    env = {
        "LORAFN_RATE_LIMIT_RPS": "0",
        "LORAFN_MAX_QUEUE": "0",
        "LORAFN_BATCH_MAX_INFLIGHT_PER_WORKER": str(args.batch_inflight or args.concurrency or 48),
        "LORAFN_BATCH_KV_OVERCOMMIT": str(args.kv_overcommit),
    }
    platform = ManagedPlatform(work / "platform", settings, env=env)
    rows: dict[str, Any] = {}
    try:
        state = platform.start(timeout_s=args.start_timeout_s)
        platform.apply(manifest(model_dir, args.dtype, functions, adapters, keys, args.kv_mib))
        platform.settle(functions, 1, want_standby=False, shared=True, timeout_s=args.start_timeout_s)
        fn, key = functions[0], keys[functions[0]]
        # warm-up: both paths once, at full concurrency (the first seconds of a worker are slower: its
        # latency profile, allocator and thread pools settle; the first phase must not pay for them)
        warm = prompts[: max(4, min(len(prompts), args.warmup))]
        asyncio.run(run_online(state.gateway_url, key, fn, warm, args.max_tokens, args.concurrency or 48))
        run_batch(state.gateway_url, key, fn, warm, args.max_tokens)
        other_fn = functions[1] if args.other_rps > 0 else None
        if other_fn is not None:
            asyncio.run(run_online(state.gateway_url, keys[other_fn], other_fn, prompts[:2], 8, 2))

        def other() -> Any:
            if other_fn is None:
                return contextlib.nullcontext(None)
            return Other(state.gateway_url, keys[other_fn], other_fn, args.other_rps, prompts, 16)

        if other_fn is not None:  # the other function alone: its TTFT without any load of ours
            with other() as o:
                time.sleep(args.baseline_s)
            rows["quiet"] = {"other_ttft_ms": o.figures()}
        for phase in args.order.split(",") * args.repeats:
            print(f"{phase}: {len(prompts)} prompts ...", flush=True)
            name, phase = f"{phase}#{sum(k.startswith(phase) for k in rows) + 1}", phase
            time.sleep(1.5)  # a heartbeat: the counters below include the previous phase
            before = kv_counters(state.redis_url, state.key_prefix, fn)
            with other() as o:
                if phase == "batch":
                    rows[name] = run_batch(state.gateway_url, key, fn, prompts, args.max_tokens)
                else:
                    rows[name] = asyncio.run(
                        run_online(state.gateway_url, key, fn, prompts, args.max_tokens, args.concurrency)
                    )
            if o is not None:
                rows[name]["other_ttft_ms"] = o.figures()
            time.sleep(1.5)
            after = kv_counters(state.redis_url, state.key_prefix, fn)
            rows[name]["kv"] = {k: after[k] - before[k] for k in KV_COUNTERS}
    finally:
        platform.stop()
    print(
        f"\n{'':10} {'makespan s':>11} {'req/s':>8} {'tok/s':>8} {'failed':>7} {'other TTFT p50/p99 ms':>22}"
        f" {'swaps/MiB/recomp':>18}"
    )
    for phase, r in rows.items():
        o = r.get("other_ttft_ms") or {}
        if phase == "quiet":
            print(
                f"{'quiet':10} {'-':>11} {'-':>8} {'-':>8} {'-':>7} "
                f"{o.get('p50') or 0:>12.0f}/{o.get('p99') or 0:.0f}"
            )
            continue
        other_s = f"{o.get('p50') or 0:.0f}/{o.get('p99') or 0:.0f}" if o else "-"
        kv = r.get("kv") or {}
        swapped_mib = kv.get("kv_swap_out_bytes", 0) >> 20
        kv_s = f"{kv.get('kv_swaps_out', 0)}/{swapped_mib}/{kv.get('kv_recomputes', 0)}"
        print(f"{phase:10} {r['makespan_s']:11.2f} {r['completed'] / r['makespan_s']:8.2f} "
              f"{r['completion_tokens'] / r['makespan_s']:8.1f} {r['failed']:7d} {other_s:>22} "
              f"{kv_s:>18}")  # fmt: skip
    made = {
        p: sorted(r["makespan_s"] for k, r in rows.items() if k.startswith(p + "#"))
        for p in ("online", "batch")
    }
    if made["online"] and made["batch"]:
        # best of the repeats: the run least disturbed by other load on the machine
        ratio = made["batch"][0] / made["online"][0]
        print(f"makespan batch / online (best of {len(made['batch'])}) = {ratio:.2f} (target <= 0.8)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
