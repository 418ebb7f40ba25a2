"""The controller's policy on a real trace, simulated (`lorafn.controller.policy.simulate`): fresh starts,
queued requests, offloads and TTFT for the policy before and after each of issue 16's controller changes
(burst anticipation in the warm pool, a cap on concurrent fresh starts per GPU, the anti-thrash guard on
offloading), side by side in one run, in seconds of CPU.

Arrivals are the trace replay's (`lorafn.replay.trace`: the same rows, scaling and Zipf assignment of
requests to functions, same seed), so a row here is the simulated twin of a `lorafn bench replay` run
with the same --functions/--rate/--duration/--trace-start. The platform is a model (see the simulate
module): its figures compare policies with each other, not with the GPU; the defaults are the H100
replay's (llama-2-7b bf16 backbone 12.6 GiB, ~2 s fresh starts, ~10 at full speed at once).

"before" is this build with the three switches off (and idle bound workers ranked by the 60 s rate); two
fixes made with them are not switches (a claimed starting standby keeps its place under maxStandby;
pre-loading only into a standby the function fits). The
policy of commit b722e86 (before all of it) on the same simulator, host running 4 starts at full speed:
KV 512 MiB: SLO violations 5.8%, 12 fresh starts, 12 queued; KV 1024 MiB, 120 s: 18.3%, 73 fresh starts,
73 offloads (59 of idle bound workers), TTFT p99 13.6 s (the H100 run at f304ad6: 55%, 81, 74).

Issue 16's second round (the 64-function H100 replay: an account that stopped at 36 workers with 10-16 GiB
of the GPU unused, 155 idle bound workers offloaded, 105 of 116 fresh starts functions offloaded earlier):
`--sized` gives every worker its own size, drawn from `--overhead-quantiles` (defaults from that run: 1409
MiB per process at the median, the account's 1.70 GiB charge = the largest + 64 MiB), so that the variants
"account: own" (settled bound workers charged by their own report, `controller.policy.charge`), "+ driver
guard" (the account capped by the device's free memory) and "+ victims: long rate" / "max rate" (idle bound
workers ranked for offloading by their rate over `--long-window-s`) can be told apart; the "peak held" and
"over GPU" columns say whether what the processes really hold ever passed the GPU's memory.

Fresh starts by the GPU's state (issue 16, third round): `--startup-model h100-conn1|h100-default` makes a
fresh start's time depend on the requests running on its GPU and the other starts under way there
(`simulate.StartupModel`, fitted to the H100 replays with one CUDA connection per worker / the driver's
default 8); `--calibration` prints the simulated fresh starts' pre_runner p50 by those bins beside the H100's.
The variants 'startup' vary the fresh-start cap (4 / 6 = the default / 12 / none) and the Backbone's
warm-pool floor (warmPool.minStandby 0 / 1 = the default here / 2 / 4; met only where memory allows:
the policy has no knob that keeps standbys under memory pressure).

Parking (issue 16, fourth round; `PolicyConfig.park_idle`): under memory pressure an idle bound worker
releases its KV cache and graph pools (--kv-mib + --graph-mib) and keeps its process, instead of being
stopped; its function's next request unparks it (the variants' 0.1 / 0.3 / 1.0 s: allocate the KV,
re-capture graphs) instead of a fresh start. The variants 'parking' (= "after (defaults)", then parking at
each unpark time, then parking also every worker idle 10 s) print parks, unparks, requests served by an
unpark, the mean number of parked workers and the window's GPU memory in GPU-seconds beside the other
columns. No worker could park then: this was the simulated case for building it. 'parking2' adds parked
workers' own keep-alive (`PolicyConfig.parked_keep_alive_s` 120 s / 300 s / never; the driver sends it in
the park command since 914416c) and parking at 50 s idle with parked workers never retired;
`--startup-model h100-conn1-ctx` (or `-ctx-hi`) adds a fresh start's cost per other live CUDA context beyond
the ~40 the fit saw.

    python bench/policy_replay.py [--functions 32] [--rate 4] [--duration 90] [--kv-mib 512]
                                  [--max-standby 4] [--start-parallelism 10] [--variants ...]
                                  [--warmup-s 90] [--sized] [--overhead-quantiles ...]
                                  [--startup-model fixed|h100-conn1|h100-default|h100-conn1-ctx[-hi]]
                                  [--calibration]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lorafn.controller.policy import PolicyConfig  # noqa: E402
from lorafn.controller.policy.simulate import STARTUP_MODELS, GiB, SimResult, SimSetup, Simulation  # noqa: E402
from lorafn.replay.trace import (  # noqa: E402
    WARMUP_STREAM,
    assign_functions,
    parse_trace,
    select_and_scale,
    select_warmup,
)

MiB = 2**20
# each of issue 16's switches off, then on one at a time, then all on (the defaults)
AFTER = PolicyConfig()
BEFORE = PolicyConfig(
    cold_prior_rps=0.0, max_fresh_starts_per_gpu=None, thrash_horizon_starts=0.0, victim_rate="window"
)
ROUND1 = dataclasses.replace(AFTER, victim_rate="window")  # the burst policy, victims by the 60 s rate
# each variant: the policy's config and the simulated platform's changes (the account's charging rule and
# driver guard live in the snapshot reader, so they are setup fields of the simulation)
VARIANTS: dict[str, tuple[PolicyConfig, dict[str, object]]] = {
    "before": (BEFORE, {}),
    "+anticipation": (dataclasses.replace(BEFORE, cold_prior_rps=AFTER.cold_prior_rps), {}),
    "+start-cap": (
        dataclasses.replace(BEFORE, max_fresh_starts_per_gpu=AFTER.max_fresh_starts_per_gpu),
        {},
    ),
    "+anti-thrash": (dataclasses.replace(BEFORE, thrash_horizon_starts=AFTER.thrash_horizon_starts), {}),
    "after (defaults)": (AFTER, {"charge": "own", "driver_guard": True}),  # the platform's defaults
    # issue 16's second round, on the burst policy: the account, its guard, the victims' rate
    "burst policy (60 s rate)": (ROUND1, {}),
    "account: own": (ROUND1, {"charge": "own"}),
    "+ driver guard": (ROUND1, {"charge": "own", "driver_guard": True}),
    "+ victims: long rate": (AFTER, {"charge": "own", "driver_guard": True}),
    "+ victims: max rate": (
        dataclasses.replace(AFTER, victim_rate="max"),
        {"charge": "own", "driver_guard": True},
    ),
    "victims: long rate only": (AFTER, {}),
}
PLATFORM = {"charge": "own", "driver_guard": True}
# issue 16's third round: the fresh-start cap and the warm pool's floor (a Backbone setting), on the defaults
for _cap in (4, 6, 12, None):
    VARIANTS[f"cap {_cap or 'none'}"] = (
        dataclasses.replace(AFTER, max_fresh_starts_per_gpu=_cap),
        PLATFORM,
    )
for _floor in (0, 1, 2, 4):
    VARIANTS[f"floor {_floor}"] = (AFTER, {**PLATFORM, "min_standby": _floor})
VARIANTS["cap 12 + floor 2"] = (
    dataclasses.replace(AFTER, max_fresh_starts_per_gpu=12),
    {**PLATFORM, "min_standby": 2},
)
STARTUP_VARIANTS = "cap 4,cap 6,cap 12,cap none,floor 0,floor 1,floor 2,floor 4,cap 12 + floor 2"
# issue 16's fourth round: parking idle bound workers (the policy's estimate of an unpark = the simulated one)
for _unpark in (0.1, 0.3, 1.0):
    VARIANTS[f"park: unpark {_unpark:g} s"] = (
        dataclasses.replace(AFTER, park_idle=True, unpark_s=_unpark),
        {**PLATFORM, "unpark_s": _unpark},
    )
VARIANTS["park 0.3 s + idle 10 s"] = (
    dataclasses.replace(AFTER, park_idle=True, unpark_s=0.3, park_after_s=10.0),
    {**PLATFORM, "unpark_s": 0.3},
)
PARKING_VARIANTS = (
    "after (defaults),park: unpark 0.1 s,park: unpark 0.3 s,park: unpark 1 s,park 0.3 s + idle 10 s"
)
# parked workers' own keep-alive (PolicyConfig.parked_keep_alive_s; today: the function's 60 s), and parking
# at 50 s idle instead of exiting at 60 s with parked workers kept until offloaded
PARKED_KEEP_ALIVE = {"parked keep-alive 120 s": 120.0, "parked keep-alive 300 s": 300.0}
PARKED_KEEP_ALIVE["parked keep-alive never"] = math.inf
for _name, _keep in PARKED_KEEP_ALIVE.items():
    VARIANTS[_name] = (
        dataclasses.replace(AFTER, park_idle=True, unpark_s=0.3, parked_keep_alive_s=_keep),
        {**PLATFORM, "unpark_s": 0.3},
    )
VARIANTS["park idle 50 s + never"] = (
    dataclasses.replace(AFTER, park_idle=True, unpark_s=0.3, park_after_s=50.0, parked_keep_alive_s=math.inf),
    {**PLATFORM, "unpark_s": 0.3},
)
PARKING2_VARIANTS = PARKING_VARIANTS + "," + ",".join(PARKED_KEEP_ALIVE) + ",park idle 50 s + never"
# what shipped from the 10-minute H100 replay (parking, parked workers kept 300 s) to the seventeenth
# session, and the knobs around it: the fresh-start cap, the warm pool's floor, a longer parked keep-alive,
# parking before the keep-alive ends. What ships since is "shipped + park idle 50 s" (park_after_s 50, the
# H100 replays of docs/benchmarks.md); "shipped" keeps its meaning so that the tables there still read.
SHIPPED = dataclasses.replace(AFTER, park_idle=True, unpark_s=0.3, parked_keep_alive_s=300.0)
SHIPPED_PLATFORM = {**PLATFORM, "unpark_s": 0.3}
VARIANTS["shipped (park 300 s)"] = (SHIPPED, SHIPPED_PLATFORM)
for _cap in (4, 12, None):
    VARIANTS[f"shipped + cap {_cap or 'none'}"] = (
        dataclasses.replace(SHIPPED, max_fresh_starts_per_gpu=_cap),
        SHIPPED_PLATFORM,
    )
VARIANTS["shipped + floor 2"] = (SHIPPED, {**SHIPPED_PLATFORM, "min_standby": 2})
VARIANTS["shipped + parked 600 s"] = (
    dataclasses.replace(SHIPPED, parked_keep_alive_s=600.0),
    SHIPPED_PLATFORM,
)
VARIANTS["shipped + park idle 50 s"] = (dataclasses.replace(SHIPPED, park_after_s=50.0), SHIPPED_PLATFORM)
SHIPPED_VARIANTS = ",".join(name for name in VARIANTS if name.startswith("shipped"))
# KV for bursts (PolicyConfig.burst_kv_bytes): the busy workers of a function with requests queued behind them
# grow their KV (their batch with it) instead of the queue waiting for running requests to end; with parking
# at 50 s idle (the other lever the shipped group found); and scaling up on a queue's wait
# (PolicyConfig.scale_up_wait_fraction) instead of its length alone
for _gib in (1, 2, 4):
    VARIANTS[f"shipped + burst KV {_gib} GiB"] = (
        dataclasses.replace(SHIPPED, burst_kv_bytes=_gib << 30),
        SHIPPED_PLATFORM,
    )
VARIANTS["shipped + burst 2 GiB + idle 50"] = (
    dataclasses.replace(SHIPPED, burst_kv_bytes=2 << 30, park_after_s=50.0),
    SHIPPED_PLATFORM,
)
for _frac in (0.2, 0.4):
    VARIANTS[f"shipped + scale-up wait {_frac:g}"] = (
        dataclasses.replace(SHIPPED, scale_up_wait_fraction=_frac),
        SHIPPED_PLATFORM,
    )
# what ships since the seventeenth session (park_after_s 50), and the two burst switches on top of it
NOW = dataclasses.replace(SHIPPED, park_after_s=50.0)
VARIANTS["now (park idle 50 s)"] = (NOW, SHIPPED_PLATFORM)
VARIANTS["now + burst KV 1 GiB"] = (dataclasses.replace(NOW, burst_kv_bytes=1 << 30), SHIPPED_PLATFORM)
for _frac in (0.2, 0.4):
    VARIANTS[f"now + scale-up wait {_frac:g}"] = (
        dataclasses.replace(NOW, scale_up_wait_fraction=_frac),
        SHIPPED_PLATFORM,
    )
NOW_VARIANTS = ",".join(n for n in VARIANTS if n.startswith("now"))
BURST_VARIANTS = ",".join(
    [
        "shipped (park 300 s)",
        *(n for n in VARIANTS if n.startswith(("shipped + burst", "shipped + scale-up"))),
    ]
)
# the H100's pre_runner p50 (ms) of fresh starts (bench/replay_breakdown.py, 2026-11-24): by requests running
# on the GPU during the start, and by starts under way at the decision (itself included)
RUNNING_BINS = ((0, 2), (2, 5), (5, 10), (10, 20), (20, 10**9))
STARTS_BINS = ((1, 2), (3, 4), (5, 6), (7, 10**9))
H100_PRE_RUNNER_MS = {
    "h100-conn1": ((271, 446, 834, 813, 1775), (886, 1361, 1711, 2814)),
    "h100-default": ((2283, 3227, 3376, 4392, 7642), (3439, 3282, 3596, 10027)),
}
# the -ctx models are h100-conn1 with a context term (the same replay to compare with)
H100_PRE_RUNNER_MS["h100-conn1-ctx"] = H100_PRE_RUNNER_MS["h100-conn1-ctx-hi"] = H100_PRE_RUNNER_MS[
    "h100-conn1"
]
DEFAULT_VARIANTS = "before,+anticipation,+start-cap,+anti-thrash,burst policy (60 s rate),after (defaults)"
ISSUE16_VARIANTS = (
    "burst policy (60 s rate),account: own,+ driver guard,+ victims: long rate,+ victims: max rate,"
    "victims: long rate only"
)
# a worker's overhead beyond KV + LoRA, MiB, as a quantile function (the 64-function H100 replay at KV 512:
# 1409 MiB per process at the median = 817 + 512 KV + 80 LoRA; a warmed standby 1500 MiB = 908; the account
# charged 1.70 GiB = the largest + 64 MiB, so the largest ~1086)
H100_OVERHEAD_QUANTILES = "0:720,0.5:817,0.9:908,1:1086"
COLUMNS = (
    ("ttft_p50_ms", "TTFT p50"),
    ("ttft_p90_ms", "p90"),
    ("ttft_p99_ms", "p99"),
    ("slo_violations_pct", "SLO viol %"),
    ("warm", "warm"),
    ("standby", "standby"),
    ("fresh", "fresh"),
    ("queued", "queued"),
    ("fresh_starts", "fresh starts"),
    ("pool_starts", "pool starts"),
    ("offloads", "offloads"),
    ("offloads_idle_bound", "of idle bound"),
    ("offloads_regretted", "offl. back"),
    ("fresh_after_offload", "fresh of offl"),
    ("peak_workers", "peak workers"),
    ("peak_held_gib", "peak held GiB"),
    ("over_gpu_ticks", "over GPU"),
    ("pool_empty_pct", "pool empty %"),
    ("unparked", "unparked"),
    ("parks", "parks"),
    ("unparks", "unparks"),
    ("mean_parked", "mean parked"),
    ("held_gpu_s", "GPU-s held"),
    ("kv_grants", "KV grants"),
)


def binned_p50_ms(records: list[tuple[float, int, float]]) -> tuple[list[float | None], list[float | None]]:
    """The pre_runner p50 (ms) of fresh starts by requests running (`RUNNING_BINS`, [lo, hi)) and by starts
    under way at the decision (`STARTS_BINS`, [lo, hi]); None for an empty bin."""

    def p50(xs: list[float]) -> float | None:
        return round(sorted(xs)[len(xs) // 2] * 1000) if xs else None

    by_running = [p50([p for r, _, p in records if lo <= r < hi]) for lo, hi in RUNNING_BINS]
    by_starts = [p50([p for _, n, p in records if lo <= n <= hi]) for lo, hi in STARTS_BINS]
    return by_running, by_starts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", type=Path, default=REPO.parent / "shared" / "data")
    ap.add_argument("--trace", default="code", help="code | conv")
    ap.add_argument("--functions", type=int, default=32)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--duration", type=float, default=90.0)
    ap.add_argument("--trace-start", type=float, default=600.0)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="seeds --seed .. --seed+N-1 (function assignment, worker sizes); print each column's mean",
    )
    ap.add_argument("--kv-mib", type=int, default=512, help="KV budget of every function")
    ap.add_argument("--overhead-mib", type=int, default=1230, help="a worker's memory besides its KV")
    ap.add_argument("--tokens-per-request", type=int, default=256, help="KV tokens one request holds")
    ap.add_argument("--max-standby", type=int, default=4, help="the Backbone's warmPool.maxStandby")
    ap.add_argument("--min-standby", type=int, default=1)
    ap.add_argument(
        "--start-parallelism", type=float, default=10.0, help="starts one GPU/host runs at full speed at once"
    )
    ap.add_argument("--stop-s", type=float, default=0.5, help="a stopped worker's memory is freed this late")
    ap.add_argument("--fresh-start-s", type=float, default=2.0)
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--service-s", type=float, default=3.0, help="a request's time on its worker")
    ap.add_argument("--warmup-s", type=float, default=0.0, help="trace before the window, not measured")
    ap.add_argument(
        "--sized",
        action="store_true",
        help="every worker its own size (--overhead-quantiles); else all are --kv-mib + --overhead-mib",
    )
    ap.add_argument(
        "--overhead-quantiles",
        default=H100_OVERHEAD_QUANTILES,
        help="q:MiB,... a worker's settled overhead beyond KV + LoRA (with --sized)",
    )
    ap.add_argument("--lora-mib", type=int, default=80, help="a function's LoRA tensors (with --sized)")
    ap.add_argument(
        "--graph-mib",
        type=int,
        default=150,
        help="lazy decode graphs' pool (with --sized); a park releases it with the KV",
    )
    ap.add_argument("--graph-settle-s", type=float, default=2.0, help="lazy graphs in by then")
    ap.add_argument("--unattributed-mib", type=int, default=0, help="per process, held but in no report")
    ap.add_argument("--late-growth-mib", type=int, default=0, help="a fresh worker's growth once it served")
    ap.add_argument("--long-window-s", type=float, default=600.0, help="the long arrival-rate horizon")
    ap.add_argument(
        "--startup-model",
        default="fixed",
        choices=["fixed", *STARTUP_MODELS],
        help="fixed: --fresh-start-s shared by --start-parallelism; else a start's time by the GPU's state",
    )
    ap.add_argument(
        "--calibration",
        action="store_true",
        help="each variant's violations by seed; with a --startup-model, its pre_runner p50 by bins "
        "beside the H100's",
    )
    ap.add_argument(
        "--variants",
        default=DEFAULT_VARIANTS,
        help=f"comma-separated, of: {', '.join(VARIANTS)}; 'issue16' = {ISSUE16_VARIANTS}; "
        f"'startup' = {STARTUP_VARIANTS}; 'parking' = {PARKING_VARIANTS}; 'parking2' = {PARKING2_VARIANTS}; "
        f"'shipped' = {SHIPPED_VARIANTS}; 'burst' = {BURST_VARIANTS}",
    )
    args = ap.parse_args()

    rows = parse_trace(args.data_dir / f"azure_llm_2023_{args.trace}.csv")
    picked = select_and_scale(rows, args.trace_start, args.rate, args.duration)
    early = select_warmup(rows, args.trace_start, args.rate, args.duration, args.warmup_s)

    def arrivals_of(seed: int) -> list[tuple[float, int]]:
        which = assign_functions(len(picked), args.functions, args.zipf, seed)
        early_which = assign_functions(len(early), args.functions, args.zipf, seed, WARMUP_STREAM)
        return [(at, i) for (at, _), i in zip(early, early_which, strict=True)] + [
            (at, i) for (at, _), i in zip(picked, which, strict=True)
        ]

    seeds = list(range(args.seed, args.seed + max(1, args.seeds)))
    arrivals = {seed: arrivals_of(seed) for seed in seeds}
    # llama-2-7b: 32 layers x 2 (K, V) x 4096 x 2 bytes = 512 KiB of KV per token
    batch = max(1, args.kv_mib * MiB // (512 * 1024) // args.tokens_per_request)
    setup = SimSetup(
        args.functions,
        num_gpus=args.gpus,
        worker_bytes=(args.kv_mib + args.overhead_mib) * MiB,
        max_batch=batch,
        fresh_start_s=args.fresh_start_s,
        start_parallelism=args.start_parallelism,
        stop_s=args.stop_s,
        min_standby=args.min_standby,
        max_standby=args.max_standby,
        long_window_s=args.long_window_s,
        service_s=args.service_s,
        startup=STARTUP_MODELS.get(args.startup_model),
        # a park releases the KV cache and the decode graphs' pool (their memory points into the KV)
        park_release_bytes=(args.kv_mib + args.graph_mib) * MiB,
        kv_bytes=args.kv_mib * MiB,  # a KV grant grows the batch in proportion (burst variants)
        seed=args.seed,
    )
    if args.sized:
        knots = tuple(
            (float(q), int(float(mib) * MiB))
            for q, mib in (part.split(":") for part in args.overhead_quantiles.split(","))
        )
        setup = dataclasses.replace(
            setup,
            overhead_quantiles=knots,
            kv_lora_bytes=(args.kv_mib + args.lora_mib) * MiB,
            # before anything reports, the configured size (the flat model's worker)
            worker_bytes=(args.kv_mib + args.overhead_mib) * MiB,
            graph_bytes=args.graph_mib * MiB,
            graph_settle_s=args.graph_settle_s,
            unattributed_bytes=args.unattributed_mib * MiB,
            late_growth_bytes=args.late_growth_mib * MiB,
        )
    print(
        f"{len(picked)} requests (+{len(early)} in a {args.warmup_s:g} s warm-up) over "
        f"{args.functions} functions ({args.trace} trace from "
        f"{args.trace_start:g} s, {args.rate:g} rps, {args.duration:g} s); {args.gpus} x 80 GiB, worker "
        f"{setup.worker_bytes / GiB:.2f} GiB, batch {batch}, service {args.service_s:g} s, "
        f"warmPool {args.min_standby}..{args.max_standby}; "
        + (
            f"fresh start {args.fresh_start_s:g} s alone, {args.start_parallelism:g} at full speed at once, "
            if setup.startup is None
            else f"fresh start by the GPU's state ({setup.startup}), "
        )
        + f"stop {args.stop_s:g} s"
        + (f"; sized: overhead quantiles {args.overhead_quantiles} MiB + KV + LoRA" if args.sized else "")
        + (f"; mean of seeds {seeds[0]}..{seeds[-1]}" if len(seeds) > 1 else "")
    )
    chosen = {
        "issue16": ISSUE16_VARIANTS,
        "startup": STARTUP_VARIANTS,
        "parking": PARKING_VARIANTS,
        "parking2": PARKING2_VARIANTS,
        "shipped": SHIPPED_VARIANTS,
        "burst": BURST_VARIANTS,
        "now": NOW_VARIANTS,
    }.get(args.variants, args.variants)
    names = [v.strip() for v in chosen.split(",") if v.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    width = max(24, *(len(n) + 1 for n in names))
    header = f"{'policy':<{width}s}" + "".join(f"{title:>14s}" for _, title in COLUMNS) + f"{'CPU s':>8s}"
    print(header)
    for name in names:
        t = time.process_time()
        config, changes = VARIANTS[name]
        results: list[SimResult] = [
            Simulation(dataclasses.replace(setup, seed=seed, **changes), config, arrivals[seed]).run()  # type: ignore[arg-type]
            for seed in seeds
        ]
        rows_of = [r.row() for r in results]
        if len(rows_of) == 1:
            row: dict[str, object] = dict(rows_of[0])
        else:
            row = {k: round(sum(float(r[k]) for r in rows_of) / len(rows_of), 1) for k, _ in COLUMNS}
        cells = "".join(f"{row[k]:>14}" for k, _ in COLUMNS)
        print(f"{name:<{width}s}{cells}{time.process_time() - t:>8.1f}")
        if args.calibration and len(rows_of) > 1:
            print(f"    SLO violations % by seed: {[r['slo_violations_pct'] for r in rows_of]}")
        if args.calibration and setup.startup is not None:
            by_running, by_starts = binned_p50_ms([rec for r in results for rec in r.start_records])
            h100_running, h100_starts = H100_PRE_RUNNER_MS[args.startup_model]
            print(
                "    pre_runner p50 ms by running 0-2/2-5/5-10/10-20/20+: sim "
                f"{by_running} H100 {list(h100_running)}; by starts 1-2/3-4/5-6/7+: sim {by_starts} "
                f"H100 {list(h100_starts)}"
            )


if __name__ == "__main__":
    main()
