"""The controller's policy on a real trace, simulated (`lorafn.controller.policy.simulate`): fresh starts,
queued requests, offloads and TTFT for the policy before and after each of issue 16's controller changes
(burst anticipation in the warm pool, a cap on concurrent fresh starts per GPU, the anti-thrash guard on
offloading), side by side in one run, in seconds of CPU.

Arrivals are the trace replay's (`lorafn.replay.trace`: the same rows, scaling and Zipf assignment of
requests to functions, same seed), so a row here is the simulated twin of a `lorafn bench replay` run
with the same --functions/--rate/--duration/--trace-start. The platform is a model (see the simulate
module): its figures compare policies with each other, not with the GPU; the defaults are the H100
replay's (llama-2-7b bf16 backbone 12.6 GiB, ~2 s fresh starts, ~10 at full speed at once).

"before" is this build with the three switches off; two fixes made with them are not switches (a claimed
starting standby keeps its place under maxStandby; pre-loading only into a standby the function fits). The
policy of commit b722e86 (before all of it) on the same simulator, host running 4 starts at full speed:
KV 512 MiB: SLO violations 5.8%, 12 fresh starts, 12 queued; KV 1024 MiB, 120 s: 18.3%, 73 fresh starts,
73 offloads (59 of idle bound workers), TTFT p99 13.6 s (the H100 run at f304ad6: 55%, 81, 74).

    python bench/policy_replay.py [--functions 32] [--rate 4] [--duration 90] [--kv-mib 512]
                                  [--max-standby 4] [--start-parallelism 10] [--variants ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lorafn.controller.policy import PolicyConfig  # noqa: E402
from lorafn.controller.policy.simulate import GiB, SimSetup, Simulation  # noqa: E402
from lorafn.replay.trace import assign_functions, parse_trace, select_and_scale  # noqa: E402

MiB = 2**20
# each of issue 16's switches off, then on one at a time, then all on (the defaults)
AFTER = PolicyConfig()
BEFORE = PolicyConfig(cold_prior_rps=0.0, max_fresh_starts_per_gpu=None, thrash_horizon_starts=0.0)
VARIANTS: dict[str, PolicyConfig] = {
    "before": BEFORE,
    "+anticipation": dataclasses.replace(BEFORE, cold_prior_rps=AFTER.cold_prior_rps),
    "+start-cap": dataclasses.replace(BEFORE, max_fresh_starts_per_gpu=AFTER.max_fresh_starts_per_gpu),
    "+anti-thrash": dataclasses.replace(BEFORE, thrash_horizon_starts=AFTER.thrash_horizon_starts),
    "after (defaults)": AFTER,
}
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
    ("peak_workers", "peak workers"),
)


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
    ap.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS)
    )
    args = ap.parse_args()

    rows = parse_trace(args.data_dir / f"azure_llm_2023_{args.trace}.csv")
    picked = select_and_scale(rows, args.trace_start, args.rate, args.duration)
    which = assign_functions(len(picked), args.functions, args.zipf, args.seed)
    arrivals = [(at, i) for (at, _), i in zip(picked, which, strict=True)]
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
    )
    print(
        f"{len(arrivals)} requests over {args.functions} functions ({args.trace} trace from "
        f"{args.trace_start:g} s, {args.rate:g} rps, {args.duration:g} s); {args.gpus} x 80 GiB, worker "
        f"{setup.worker_bytes / GiB:.2f} GiB, batch {batch}, "
        f"warmPool {args.min_standby}..{args.max_standby}; "
        f"fresh start {args.fresh_start_s:g} s alone, {args.start_parallelism:g} at full speed at once, "
        f"stop {args.stop_s:g} s"
    )
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    header = f"{'policy':<18s}" + "".join(f"{title:>14s}" for _, title in COLUMNS) + f"{'CPU s':>8s}"
    print(header)
    for name in names:
        t = time.process_time()
        result = Simulation(setup, VARIANTS[name], arrivals).run()
        row = result.row()
        cells = "".join(f"{row[k]:>14}" for k, _ in COLUMNS)
        print(f"{name:<18s}{cells}{time.process_time() - t:>8.1f}")


if __name__ == "__main__":
    main()
