"""SLO-aware GPU admission, on and off (and with decode gating), side by side in one run, through the
real platform (`lorafn up`).

N functions on one backbone and one device, each with its own TTFT SLO (cycled from --slos), all warm
(minReplicas 1) before the traffic starts, so cold starts stay out of the comparison. The same bursty
arrivals (the Azure LLM code trace, scaled to --rate over --duration-s, GSM8K prompts) are replayed
open-loop over HTTP once per mode (`--modes`, default `on,off`): `on` with cross-function admission
(`gpu_admission: true`: the workers of the device share a prefill token budget, waiters served by
deadline margin), `off` without, `gate` with admission and decode gating (`LORAFN_DECODE_GATING`: while a
tight function's urgent prefill runs, the other workers pause their decode steps, each at most its TPOT
slack; docs/scheduler.md#decode-gating), `edf` with each worker's pending prefills served by TTFT deadline
(`LORAFN_DEADLINE_ORDER`: earliest deadline first among those that can still make it, the ones predicted
late behind them; docs/scheduler.md#deadline-order) and no admission, `on-edf` with both (the workers bid
for the budget with the deadline of the first prompt their plan serves on time), `on-edf-oldest` as
`on-edf` but bidding with the oldest waiting request's deadline (`LORAFN_BID_DEADLINE=oldest`, the rule
before issue 13), `slots` with deadline order and every function in one worker of adapter slots (the
Backbone's `adapterSlots` = the number of functions, docs/runtime.md#adapter-slots: one batch and one read
of the backbone per step for all of them; the worker holds every function's KV budget). Printed per
function and overall: TTFT p50/p99, TPOT p50/p99, SLO
violations (an error or a first token later than the function's SLO), throughput (completion tokens/s),
the budget's grants, and per mode the gating counters (urgent grants, gated decode steps, their total and
mean wait, pauses that ran to their bound).

    # CPU (tiny preset; minutes; ratios only on a shared 2-core machine)
    python bench/admission.py --preset tiny --device cpu --slos 300,2000,8000 --rate 3 --duration-s 20 \
        --max-prompt-tokens 128 --max-tokens 16 --repeat 2 --workdir /tmp/adm
    # H100 (~6 min): 8 functions on one llama-2-7b (random weights of the real shape; --preset llama-2-7b
    # writes one), r16 adapters, KV 2 GiB each; a bursty window of the code trace (from 120 s: CoV ~4,
    # up to ~25 arrivals in a second), prompts of ~1000 Llama tokens; every third function tight (500 ms),
    # the others loose (8 s); a budget of one full engine step; a sweep of three rates, 45 s each, on one
    # platform per mode (.data = a copy of ../shared/data)
    python bench/admission.py --model /tmp/llama-2-7b --device cuda --dtype bfloat16 --functions 8 \
        --slos 500,8000,8000 --rates 4,5,6 --duration-s 45 --trace-start-s 120 --max-prompt-tokens 512 \
        --max-tokens 128 --kv-mib 2048 --prefill-tokens 2048 --data-dir .data --workdir /tmp/adm \
        --json $OUT/admission.json
    # the three modes side by side at one rate (each its own platform; ~5 min on an H100 after set-up)
    python bench/admission.py --model /tmp/llama-2-7b --device cuda --dtype bfloat16 --functions 8 \
        --slos 500,8000,8000 --rates 10 --duration-s 45 --trace-start-s 120 --max-prompt-tokens 512 \
        --max-tokens 128 --kv-mib 2048 --prefill-tokens 2048 --data-dir .data --workdir /tmp/adm \
        --modes off,on,gate --json $OUT/admission.json
    # deadline order in the workers, alone and with admission, beside off and admission (~6 min)
    python bench/admission.py --model /tmp/llama-2-7b --device cuda --dtype bfloat16 --functions 8 \
        --slos 500,8000,8000 --rates 10 --duration-s 45 --trace-start-s 120 --max-prompt-tokens 512 \
        --max-tokens 128 --kv-mib 2048 --prefill-tokens 2048 --data-dir .data --workdir /tmp/adm \
        --modes off,edf,on,on-edf --request-timeout-s 90 --json $OUT/admission.json
    # the bid's deadline with deadline order and admission: the plan's first on-time prompt vs the oldest
    # request (issue 13), twice each in alternating order (~8 min)
    python bench/admission.py --model /tmp/llama-2-7b --device cuda --dtype bfloat16 --functions 8 \\
        --slos 500,8000,8000 --rates 10 --duration-s 45 --trace-start-s 120 --max-prompt-tokens 512 \\
        --max-tokens 128 --kv-mib 2048 --prefill-tokens 2048 --data-dir .data --workdir /tmp/adm \\
        --modes on-edf-oldest,on-edf --repeat 2 --request-timeout-s 90 --json $OUT/admission.json

`--rates` replays each rate in turn on the same platform of each mode (one start-up per mode; its records
and figures per rate); `--prompt-size question` sends one GSM8K question per request instead of text of
the trace's context size. Also printed: what the budget cost (grant waits, hold times, granted steps that
prefilled nothing, how late releases came after their steps) from the records the Lua script keeps, and
what was lost.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lorafn.replay import trace  # noqa: E402
from lorafn.replay.configs import ReplayConfig  # noqa: E402
from lorafn.replay.driver import DriveOptions, Target, drive  # noqa: E402
from lorafn.replay.platform import (  # noqa: E402
    FunctionSetup,
    ManagedPlatform,
    new_keys,
    own_adapter_dirs,
    prepare_adapters,
    prepare_model,
)
from lorafn.replay.platform import manifest as replay_manifest  # noqa: E402
from lorafn.replay.stats import RequestResult, percentiles, slo_violated  # noqa: E402
from lorafn.store import Keys, Store, streams  # noqa: E402
from lorafn.store import admission as store_admission  # noqa: E402

DATA = ROOT.parent / "shared" / "data"
NAMESPACE = "adm"


def manifest(
    model_dir: Path, dtype: str, functions: list[str], adapters: list[Path], slos: dict[str, int],
    keys: dict[str, str], kv_mib: int | None = None, adapter_slots: int = 1,
) -> str:  # fmt: skip
    """The replay's manifest (a Backbone without a warm pool, a Secret of keys, the LoRAFunctions), each
    function warm from the start (minReplicas = maxReplicas = 1, kept an hour) with its own TTFT SLO, in
    the namespace `adm`. `adapter_slots` > 1: the functions share workers of that many adapter slots."""
    setup = FunctionSetup(
        slo_ttft_ms=max(slos.values()), keep_alive_s=3600, max_replicas=1, kv_cache_mib=kv_mib
    )
    config = ReplayConfig("admission", "bench/admission.py", min_replicas=1, warm_pool_fallback=(0, 0))
    return replay_manifest(
        model_dir, dtype, functions, adapters, keys, setup, config, True,
        namespace=NAMESPACE, secret="adm-keys", slos=slos, adapter_slots=adapter_slots,
    )  # fmt: skip


def figures(
    results: list[RequestResult], slo_ms: float | dict[str, float], duration_s: float
) -> dict[str, Any]:
    def slo_of(r: RequestResult) -> float:
        return slo_ms if isinstance(slo_ms, int | float) else slo_ms[r.function]

    ok = [r for r in results if r.ok]
    ttft = percentiles(r.ttft_ms for r in ok)
    tpot = percentiles(r.tpot_ms for r in ok)
    tokens = sum(r.completion_tokens or 0 for r in ok)
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "ttft_p50": ttft["p50"], "ttft_p99": ttft["p99"], "tpot_p50": tpot["p50"], "tpot_p99": tpot["p99"],
        "slo_violations": sum(slo_violated(r, slo_of(r)) for r in results) / max(1, len(results)),
        "tokens_per_s": tokens / duration_s if duration_s > 0 else 0.0,
    }  # fmt: skip


# admission; none; admission + decode gating; deadline order in each worker (no admission); both; both with
# the bid of the oldest waiting request (before issue 13); deadline order with every function in one worker
# of adapter slots (issue 13: one batch, one read of the backbone per step, for all of them)
MODES = ("on", "off", "gate", "edf", "on-edf", "on-edf-oldest", "slots")
EDF_MODES = ("edf", "on-edf", "on-edf-oldest", "slots")


def run_one(
    args: argparse.Namespace,
    mode: str,
    model_dir: Path,
    adapters: list[Path],
    plans: list[list[trace.PlannedRequest]],
    functions: list[str],
    slos: dict[str, int],
) -> list[dict[str, Any]]:
    """One platform of one mode (`MODES`): warm up, then replay each plan (one per rate, in order, each
    after the last one's answers came back); per plan its results, the budget's records during it and
    the change of the gating counters."""
    admission = mode in ("on", "gate", "on-edf", "on-edf-oldest")
    workdir = Path(args.workdir) / mode
    if workdir.exists():  # a repeat: a fresh platform each time
        shutil.rmtree(workdir)
    settings = {"device": args.device, "devices": 1, "gpu_admission": admission, "warm_pool": False}
    if args.device_memory_mib:
        settings["device_memory_mib"] = args.device_memory_mib
    env = {"LORAFN_GPU_PREFILL_TOKENS": str(args.prefill_tokens)} if args.prefill_tokens else {}
    env["LORAFN_DECODE_GATING"] = "true" if mode == "gate" else "false"
    env["LORAFN_DEADLINE_ORDER"] = "true" if mode in EDF_MODES else "false"
    env["LORAFN_BID_DEADLINE"] = "oldest" if mode == "on-edf-oldest" else "plan"
    if args.gate_tpot_ms:
        env["LORAFN_GATE_TPOT_MS"] = str(args.gate_tpot_ms)
    platform = ManagedPlatform(workdir, settings, env=env)  # the workers read these from the env
    keys = new_keys(functions)
    out: list[dict[str, Any]] = []
    try:
        state = platform.start(timeout_s=args.start_timeout_s)
        slots = len(functions) if mode == "slots" else 1
        platform.apply(manifest(model_dir, args.dtype, functions, adapters, slos, keys, args.kv_mib, slots))
        settled = platform.settle(
            functions, 1, want_standby=False, shared=True, timeout_s=args.start_timeout_s
        )
        if not settled.get("settled"):
            print(f"  warning: not settled before traffic: {settled}", flush=True)
        target = Target(state.gateway_url, keys, state.redis_url, state.key_prefix)
        options = DriveOptions(
            request_timeout_s=args.request_timeout_s, drain_timeout_s=args.request_timeout_s
        )
        # one request per function first: kernels load, the latency profiles get their first samples
        warm = [trace.PlannedRequest(i, 0.05 * i, fn, "Hello there, warm up.", 8, 8)
                for i, fn in enumerate(functions * args.warmup_rounds)]  # fmt: skip
        asyncio.run(drive(warm, target, options))
        assert platform.store is not None
        store = platform.store
        # the budget's records are read after each plan (the stream keeps the last ~5000): only its own
        seen: set[str] = set()
        budget_records(store, platform.keys, seen)  # the warm-up's
        for plan in plans:
            print(f"  mode {mode}: replaying {len(plan)} requests ...", flush=True)
            before = store.run(store_admission.gating_counters(platform.keys, "local/0"))
            done = asyncio.run(drive(plan, target, options))
            grants, releases = budget_records(store, platform.keys, seen)
            pending = sum(len(store.run(streams.pending(platform.keys, fn, 0))) for fn in functions)
            after = store.run(store_admission.gating_counters(platform.keys, "local/0"))
            gating = {k: v - before.get(k, 0.0) for k, v in after.items()}
            out.append({"results": done.results, "duration_s": done.duration_s, "grants": grants,
                        "releases": releases, "pending": pending, "gating": gating})  # fmt: skip
    finally:
        platform.stop()
    return out


def budget_records(
    store: Store, keys: Keys, seen: set[str]
) -> tuple[list[store_admission.Grant], list[store_admission.Release]]:
    """The device budget's grants and releases recorded since the last call (`seen`: their ids, updated)."""
    grants = [
        g for g in store.run(store_admission.grants(keys, "local/0", count=100_000)) if g.entry_id not in seen
    ]
    releases = [
        r
        for r in store.run(store_admission.releases(keys, "local/0", count=100_000))
        if r.entry_id not in seen
    ]
    seen.update(g.entry_id for g in grants)
    seen.update(r.entry_id for r in releases)
    return grants, releases


def summarize(
    mode: str, parts: list[dict[str, Any]], functions: list[str], slos: dict[str, int]
) -> dict[str, Any]:
    """The figures of one mode over its repeats (requests pooled, durations added, counters summed)."""
    results = [r for p in parts for r in p["results"]]
    duration = sum(p["duration_s"] for p in parts)
    grants = [g for p in parts for g in p["grants"]]
    releases = [r for p in parts for r in p["releases"]]
    per_fn = {fn: figures([r for r in results if r.function == fn], slos[fn], duration) for fn in functions}
    overall = figures(results, {fn: float(s) for fn, s in slos.items()}, duration)
    contested = [g for g in grants if g.waiters > 1]
    gating: dict[str, float] = {}
    for p in parts:
        for k, v in p.get("gating", {}).items():
            gating[k] = gating.get(k, 0.0) + v
    return {
        "mode": mode, "admission": mode in ("on", "gate", "on-edf", "on-edf-oldest"),
        "decode_gating": mode == "gate", "deadline_order": mode in EDF_MODES,
        "adapter_slots": mode == "slots", "bid_deadline": "oldest" if mode == "on-edf-oldest" else "plan",
        "gating": gating,
        "overall": overall, "functions": per_fn, "duration_s": duration,
        "repeats": len(parts), "grants": len(grants), "contested_grants": len(contested),
        "slot": slot_figures(grants, releases), "unanswered": sum(not r.ok for r in results),
        "pending_entries": sum(p["pending"] for p in parts), "results": [r.to_json() for r in results],
        "grant_log": [dataclasses.asdict(g) for g in grants],
        "release_log": [dataclasses.asdict(r) for r in releases],
    }  # fmt: skip


def slot_figures(
    grants: list[store_admission.Grant], releases: list[store_admission.Release]
) -> dict[str, Any]:
    """What the budget cost: how long grants waited, how long shares were held, how many granted steps
    prefilled nothing (a worker whose KV cache is full holding the budget across decode steps), and how
    late after its step a release reached Redis."""
    waited = percentiles(g.waited_ms for g in grants)
    held = percentiles(r.held_ms for r in releases)
    late = percentiles(r.late_ms for r in releases if r.late_ms is not None)
    return {
        "wait_p50_ms": waited["p50"], "wait_p99_ms": waited["p99"],
        "hold_p50_ms": held["p50"], "hold_p99_ms": held["p99"],
        "hold_total_ms": sum(r.held_ms for r in releases),
        "unused_grants": sum(r.prefilled == 0 for r in releases),
        "unused_hold_ms": sum(r.held_ms for r in releases if r.prefilled == 0),
        "release_late_p50_ms": late["p50"], "release_late_p99_ms": late["p99"],
        "used_max_tokens": max((g.used for g in grants), default=0),
    }  # fmt: skip


def _f(value: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if value is None else fmt.format(value)


def gating_line(gating: dict[str, float]) -> str:
    """The gating counters of one mode: urgent grants, gated decode steps, their total and mean wait, how
    many ran to their bound."""
    steps, ms = gating.get("gated_steps", 0.0), gating.get("gated_ms", 0.0)
    mean = ms / steps if steps else 0.0
    return (
        f"urgent grants {gating.get('urgent_grants', 0.0):.0f}, gated decode steps {steps:.0f}, waited "
        f"{ms / 1000:.1f} s in all ({mean:.1f} ms each), {gating.get('timeouts', 0.0):.0f} ran to their bound"
    )


def render(
    runs: dict[str, dict[str, Any]], functions: list[str], slos: dict[str, int], title: str = ""
) -> None:
    cols = ["ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "slo_violations", "tokens_per_s", "errors"]
    modes = list(runs)
    print()
    if title:
        print(title)
    print(f"{'function (SLO ms)':<26}{'mode':<10}" + "".join(f"{c:>15}" for c in cols))
    rows = [(f"{fn} ({slos[fn]})", fn) for fn in functions] + [("all", None)]
    for label, fn in rows:
        for name in modes:
            fig = runs[name]["overall"] if fn is None else runs[name]["functions"][fn]
            cells = []
            for c in cols:
                v = fig[c]
                cells.append(
                    _f(v * 100, "{:.1f}%")
                    if c == "slo_violations"
                    else _f(v, "{:.1f}")
                    if c == "tokens_per_s"
                    else _f(v)
                )
            print(f"{label:<26}{name:<10}" + "".join(f"{x:>15}" for x in cells))
    print()
    grants = "; ".join(f"{m}: {runs[m]['grants']} ({runs[m]['contested_grants']} with several waiters)"
                       for m in modes)  # fmt: skip
    print(f"grants: {grants}")
    for name in modes:
        if runs[name]["admission"]:
            slot = runs[name]["slot"]
            print(f"budget ({name}): " + ", ".join(f"{k} {_f(v, '{:.1f}')}" for k, v in slot.items()))
    for name in modes:
        if runs[name].get("decode_gating"):
            print(f"gating ({name}): {gating_line(runs[name]['gating'])}")
            paid = {fn: runs[name]["gating"].get(f"gated_ms|{fn}", 0.0) for fn in functions}
            print("  waited per function (ms): " + ", ".join(f"{fn} {ms:.0f}" for fn, ms in paid.items()))
    for name in modes:
        print(f"lost ({name}): {runs[name]['unanswered']} unanswered, {runs[name]['pending_entries']} "
              "entries left pending")  # fmt: skip
    base = runs["off"]["overall"] if "off" in runs else None
    parts = []
    for name in modes:
        fig = runs[name]["overall"]
        part = f"{name} {fig['slo_violations'] * 100:.1f}%"
        if base is not None and name != "off" and base["tokens_per_s"]:
            part += f" (throughput cost {(1 - fig['tokens_per_s'] / base['tokens_per_s']) * 100:.1f}%)"
        parts.append(part)
    print("SLO violations: " + " vs ".join(parts))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", help="random model preset (tiny | llama-2-7b | llama-3-8b)")
    ap.add_argument("--model", help="an existing model directory instead of --preset")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default=None, help="default: float32 on cpu, bfloat16 on cuda")
    ap.add_argument("--functions", type=int, default=3)
    ap.add_argument("--slos", default="150,1000,5000", help="TTFT SLOs (ms), cycled over the functions")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rate", type=float, default=6.0, help="mean requests/s over all functions")
    ap.add_argument(
        "--rates", default=None,
        help="a sweep instead of --rate: comma-separated rates, each replayed for --duration-s on the same "
        "platform of each mode, in this order (one start-up per mode)",
    )  # fmt: skip
    ap.add_argument("--duration-s", type=float, default=30.0)
    ap.add_argument(
        "--data-dir", default=str(DATA), help="the shared data (a copy such as .data on a device)"
    )
    ap.add_argument("--trace", default=None, help="default: <data-dir>/azure_llm_2023_code.csv")
    ap.add_argument("--trace-start-s", type=float, default=0.0)
    ap.add_argument("--questions", default=None, help="default: <data-dir>/gsm8k_test.jsonl")
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument(
        "--prompt-size", choices=["trace", "question"], default="trace",
        help="trace: GSM8K text of the trace's context size (capped by --max-prompt-tokens, counted at ~4 "
        "characters a token: a Llama tokenizer makes about twice that many); question: one GSM8K question",
    )  # fmt: skip
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--prefill-tokens", type=int, default=None,
        help="the device's prefill budget in prompt tokens (admission on; default: the workers' 4096)",
    )  # fmt: skip
    ap.add_argument("--warmup-rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=1, help="replays per mode, in --modes order, then reversed")
    ap.add_argument(
        "--modes", default="on,off",
        help="comma-separated, in this order, each on its own platform: on (admission), off (none), gate "
        "(admission + decode gating), edf (each worker serves its prefills by TTFT deadline, no admission), "
        "on-edf (admission + deadline order), on-edf-oldest (as on-edf, bidding the oldest request's "
        "deadline)",
    )  # fmt: skip
    ap.add_argument(
        "--gate-tpot-ms", type=float, default=None,
        help="gate: the TPOT SLO that bounds a paused decode step (the workers' gate_tpot_ms; default 200)",
    )  # fmt: skip
    ap.add_argument("--device-memory-mib", type=int, default=None)
    ap.add_argument("--kv-mib", type=int, default=None, help="spec.resources.kvCacheMiB of every function")
    ap.add_argument("--start-timeout-s", type=float, default=600.0)
    ap.add_argument("--request-timeout-s", type=float, default=300.0)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None, help="write every figure and request here")
    args = ap.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes) or len(set(modes)) != len(modes):
        raise SystemExit(f"--modes: give distinct modes among {', '.join(MODES)}, got {args.modes!r}")
    args.trace = args.trace or str(Path(args.data_dir) / "azure_llm_2023_code.csv")
    args.questions = args.questions or str(Path(args.data_dir) / "gsm8k_test.jsonl")
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="lorafn-adm-")
    work = Path(args.workdir)

    model_dir = (
        Path(args.model)
        if args.model
        else prepare_model(args.preset, work / f"model-{args.preset}", args.dtype)
    )
    adapters = prepare_adapters(model_dir, work / "adapters", min(args.functions, 4), args.rank, "all-linear")
    functions = [f"{NAMESPACE}/f{i:02d}" for i in range(args.functions)]
    adapters = own_adapter_dirs(adapters, functions, work / "functions")
    slo_list = [int(s) for s in args.slos.split(",") if s.strip()]
    if not slo_list:
        raise SystemExit("--slos: give at least one TTFT SLO in ms")
    slos = {fn: slo_list[i % len(slo_list)] for i, fn in enumerate(functions)}
    rows = trace.parse_trace(Path(args.trace))
    questions = trace.load_questions(Path(args.questions))
    rates = [float(r) for r in args.rates.split(",") if r.strip()] if args.rates else [args.rate]
    if not rates or any(r <= 0 for r in rates):
        raise SystemExit(f"--rates: give rates > 0 (requests/s), got {args.rates!r}")
    plans = []
    for rate in rates:
        plan_opts = trace.PlanOptions(
            num_functions=args.functions, rate_rps=rate, duration_s=args.duration_s,
            trace_start_s=args.trace_start_s, zipf_exponent=0.0, seed=args.seed,
            max_prompt_tokens=args.max_prompt_tokens, max_output_tokens=args.max_tokens,
            prompt_from_trace=args.prompt_size == "trace",
        )  # fmt: skip
        plans.append(trace.plan_requests(rows, questions, functions, plan_opts))
        print(f"plan at {rate:g} rps: {trace.describe_plan(plans[-1], args.duration_s)}", flush=True)
    print(f"SLOs {slos}", flush=True)

    t0 = time.perf_counter()
    parts: dict[str, list[list[dict[str, Any]]]] = {m: [] for m in modes}  # mode -> repeats -> rates
    for i in range(args.repeat):  # on, off, off, on, ...: a drift in the machine's load hits all alike
        for name in modes if i % 2 == 0 else modes[::-1]:
            parts[name].append(run_one(args, name, model_dir, adapters, plans, functions, slos))
            for rate, part in zip(rates, parts[name][-1], strict=True):  # at once: a run cut short keeps it
                fig = summarize(name, [part], functions, slos)
                viol, tps = fig["overall"]["slo_violations"] * 100, fig["overall"]["tokens_per_s"]
                lost = fig["unanswered"]
                print(f"  mode {name} at {rate:g} rps: violations {viol:.1f}%, {tps:.1f} tokens/s, {lost} "
                      f"unanswered; {gating_line(fig['gating'])}", flush=True)  # fmt: skip
    sweep: dict[str, dict[str, dict[str, Any]]] = {}
    for k, rate in enumerate(rates):
        runs = {name: summarize(name, [rep[k] for rep in parts[name]], functions, slos) for name in modes}
        sweep[f"{rate:g}"] = runs
        render(runs, functions, slos, title=f"== {rate:g} requests/s" if len(rates) > 1 else "")
    elapsed = time.perf_counter() - t0
    print(f"\n({len(modes) * args.repeat} platforms, {len(rates)} rate(s) each, in {elapsed:.0f} s; "
          f"model {model_dir}, device {args.device})")  # fmt: skip
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        # one rate: "runs" as before; a sweep: "sweep", rate -> runs
        body = {"runs": sweep[f"{rates[0]:g}"]} if len(rates) == 1 else {"sweep": sweep}
        Path(args.json).write_text(json.dumps({"args": vars(args), "slos": slos, **body}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
