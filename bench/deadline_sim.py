"""Deadline order vs first come first served inside one worker, simulated on the real `Scheduler` (CPU).

Each function of `bench/admission.py`'s plan (the Azure code trace, GSM8K prompt sizes, the same seed, rate
and window) is replayed against one simulated worker: the real scheduler (`lorafn.runtime.scheduler`) and
KV offload policy (whose prefill cost per token learns from the simulated steps, as the engine's does), a
paged KV cache of `--kv-tokens` slots, and a step-time model in place of the GPU:

    step_ms = (decode_ms if the step has decodes else overhead_ms) + prefill_tokens x alpha_us / 1000

A worker on a shared GPU runs slower than alone; `--decode-ms` and `--alpha-us` stand for the contended
device (defaults: the H100 8-function run's TPOT p50 of ~50-70 ms, and a 7B prefill of ~45 us a token alone,
slowed ~2x by seven other workers). Trace prompt tokens are counted at ~4 characters a token; the random
models' byte-level tokenizer makes 2.1 times that many (`--llama-per-trace-token`: 512 -> ~1100), so
2 GiB of llama-2-7b KV (4096 tokens) holds three such prompts. Printed per function and mode: TTFT
p50/p99, SLO violations, tokens/s over the function's makespan, steps. This is a model of the worker's
queue, not of the GPU: the H100 run (`bench/admission.py --modes off,edf,...`) decides.

    python bench/deadline_sim.py --slos 500,8000,8000 --rate 10 --duration-s 45 --trace-start-s 120 \\
        --max-prompt-tokens 512 --max-tokens 128

`--shared-gpu also|only` runs every function's worker on one simulated GPU instead (`simulate_shared`):
each step's fixed part (`--decode-ms`, `--overhead-ms`) is its own, its prefill tokens cost
`--gpu-alpha-us` each of the GPU alone and share the GPU's prefill throughput with the other workers'
prefill chunks in flight (processor sharing). With admission the workers ask the GPU's prefill budget
(`--prefill-tokens`) before each step as `Batching.allow_prefill` does, granted by `slo.admit` (the Lua
script's reference), bidding with the oldest request's deadline or the deadline plan's
(`batching.bid_deadline_ms`, issue 13). Printed side by side: no admission (first come first served, deadline
order), admission with first come first served, admission with deadline order bidding "oldest" and "plan";
pooled over `--seeds`, with each seed's violations (paired). `bid_differs`: asks where the two rules' bids
differ (the plan had a prompt on time whose deadline is later than the oldest request's).

    python bench/deadline_sim.py --shared-gpu only --seeds 0,1,2,3,4
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lorafn.replay import trace  # noqa: E402
from lorafn.replay.stats import percentiles  # noqa: E402
from lorafn.runtime import slo  # noqa: E402
from lorafn.runtime.batching import bid_deadline_ms  # noqa: E402
from lorafn.runtime.kv_offload import OffloadConfig, OffloadPolicy  # noqa: E402
from lorafn.runtime.sampling_params import SamplingParams  # noqa: E402
from lorafn.runtime.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from lorafn.runtime.sequence import Sequence  # noqa: E402

DATA = ROOT.parent / "shared" / "data"


@dataclass
class Model:
    decode_ms: float
    overhead_ms: float
    alpha_us: float

    def step_s(self, prefill_tokens: int, decodes: int) -> float:
        base = self.decode_ms if decodes else self.overhead_ms
        return (base + prefill_tokens * self.alpha_us / 1000) / 1000


@dataclass
class Outcome:
    ttft_ms: list[float]
    violations: int
    makespan_s: float
    tokens: int
    steps: int


def simulate(
    requests: list[tuple[float, int, int]], slo_ms: float, model: Model, config: SchedulerConfig
) -> Outcome:
    """One worker serving `requests` = [(arrival s, prompt tokens, output tokens)] in arrival order."""
    offload = OffloadPolicy(OffloadConfig(host_budget_bytes=0), block_bytes=1)  # recompute only; learns cost
    sched = Scheduler(config, offload)
    arrival = {f"r{k}": a for k, (a, _, _) in enumerate(requests)}
    first: dict[str, float] = {}
    clock, k, steps, tokens = 0.0, 0, 0, 0
    while k < len(requests) or sched.has_unfinished():
        if not sched.has_unfinished() and k < len(requests):
            clock = max(clock, requests[k][0])
        while k < len(requests) and requests[k][0] <= clock:  # read between steps, as the worker does
            at, prompt, out = requests[k]
            seq = Sequence(f"r{k}", [1] * prompt, SamplingParams(max_tokens=out, ignore_eos=True))
            sched.add(seq)
            sched.set_deadline(seq.seq_id, at + slo_ms / 1000)
            k += 1
        plan = sched.schedule(now=clock)
        if plan.is_empty:  # waits for memory only while something runs: cannot be empty here
            raise RuntimeError("empty step with requests pending")
        prefill = plan.num_batched_tokens - plan.num_decodes
        took = model.step_s(prefill, plan.num_decodes)
        if prefill >= offload.config.min_measured_tokens:
            offload.observe_prefill(plan.num_batched_tokens, took)
        clock += took
        steps += 1
        for seq in sched.update(plan, {c.seq_id: 7 for c in plan.chunks if c.samples}):
            tokens += 1
            first.setdefault(seq.seq_id, clock)
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq.seq_id, "length")
    ttft = [(first[i] - arrival[i]) * 1000 for i in arrival]
    return Outcome(ttft, sum(t > slo_ms for t in ttft), clock - requests[0][0], tokens, steps)


@dataclass
class SharedGpu:
    """One GPU's step time for several workers: a step's fixed part (`decode_ms` with decodes, else
    `overhead_ms`) is its own; its prefill tokens cost `alpha_us` each of the GPU's time alone and share the
    GPU's prefill throughput equally with the other workers' prefill chunks in flight (processor sharing).
    So a prefill runs at 1/k the speed beside k-1 others, and holding prefills back (admission) speeds up
    the ones that run."""

    decode_ms: float
    overhead_ms: float
    alpha_us: float


@dataclass
class SharedOutcome(Outcome):
    grants: int = 0
    refused: int = 0  # asks refused (the budget was held): how contended it was
    on_time_bids: int = 0  # asks whose plan had a prompt on time (the bid rules can differ only then)
    differing_bids: int = 0  # of those, asks whose oldest request's deadline was earlier than the plan's


class _Worker:
    """One function's worker in `simulate_shared`: the real scheduler, its latency profile (slo's, as the
    worker fits it), its share of the GPU's prefill budget, where its current step is."""

    def __init__(
        self, name: str, reqs: list[tuple[float, int, int]], slo_ms: float, config: SchedulerConfig
    ) -> None:
        self.name, self.reqs, self.slo_ms = name, reqs, slo_ms
        self.offload = OffloadPolicy(OffloadConfig(host_budget_bytes=0), block_bytes=1)
        self.sched = Scheduler(config, self.offload)
        self.profile = slo.LatencyProfile()
        self.k = 0  # next request to arrive
        self.enqueued: dict[str, float] = {}
        self.first: dict[str, float] = {}
        self.share: int | None = None  # tokens of the budget share it holds (granted or handed over)
        self.share_in_step = False  # its running step uses the share (released when it ends)
        self.blocked: frozenset[str] | None = None  # its running requests when a granted step prefilled none
        self.step: tuple | None = None  # (output, started, prefill tokens, base s) of the step running
        self.waiting_for_share = False
        self.steps = self.tokens = self.grants = self.refused = self.on_time_bids = self.differing_bids = 0
        self.last_end = 0.0


def simulate_shared(
    workloads: dict[str, tuple[list[tuple[float, int, int]], float]],
    gpu: SharedGpu,
    config: SchedulerConfig,
    admission: bool,
    bid: str,
    budget_tokens: int,
) -> dict[str, SharedOutcome]:
    """Every function's worker on one GPU (`SharedGpu`), in one discrete-event run. With `admission` a worker
    with prefills pending asks the GPU's prefill token budget before each step as `Batching.allow_prefill`
    does (its bid: `batching.bid_deadline_ms` by rule `bid`, T(b) from its `slo.LatencyProfile`, the prompt
    tokens its step prefills), and `slo.admit` (the Lua script's reference) grants by deadline margin with
    M = workers with requests; a share is released after the step and handed to the best waiters; a refused
    worker runs its decodes only, or waits for a share. Not modelled: Redis round trips, the active mark's
    TTL, decode gating, fill-or-expire, the blocked worker's 2 s recheck."""
    workers = [_Worker(fn, reqs, slo_ms, config) for fn, (reqs, slo_ms) in workloads.items()]
    waiters: dict[str, slo.Waiter] = {}
    holders: dict[str, tuple[int, float, float]] = {}  # worker -> (tokens, granted at s, t ms)
    by_name = {w.name: w for w in workers}
    ps: dict[str, float] = {}  # worker -> prefill work left (s of the GPU alone)
    timers: dict[str, float] = {}  # worker -> when it next decides (or its step's fixed part ends)
    now = min(w.reqs[0][0] for w in workers if w.reqs)
    for w in workers:
        if w.reqs:
            timers[w.name] = w.reqs[0][0]

    def active() -> int:
        return sum(1 for w in workers if w.sched.has_unfinished())

    def grant(t: float) -> None:
        """`slo.admit` over the waiters; granted ones hold a share (a blocked one wakes at once)."""
        if not waiters:
            return
        now_ms = t * 1000
        used = sum(tok for tok, _, _ in holders.values())
        wait_ms = min((max(0.0, (at + tm / 1000 - t) * 1000) for _, at, tm in holders.values()), default=0.0)
        for wt in slo.admit(list(waiters.values()), now_ms, max(1, active()), used, budget_tokens, wait_ms):
            del waiters[wt.worker]
            holders[wt.worker] = (wt.tokens, t, wt.t_ms)
            x = by_name[wt.worker]
            x.share, x.grants = wt.tokens, x.grants + 1
            if x.waiting_for_share:
                x.waiting_for_share = False
                timers[x.name] = t

    def release(w: _Worker, t: float) -> None:
        w.share = None
        if holders.pop(w.name, None) is not None:
            grant(t)

    def decide(w: _Worker, t: float) -> None:
        while w.k < len(w.reqs) and w.reqs[w.k][0] <= t:  # read between steps, as the worker does
            at, prompt, out = w.reqs[w.k]
            seq = Sequence(f"r{w.k}", [1] * prompt, SamplingParams(max_tokens=out, ignore_eos=True))
            w.sched.add(seq)
            w.sched.set_deadline(seq.seq_id, at + w.slo_ms / 1000)
            w.enqueued[seq.seq_id] = at
            w.k += 1
        sched = w.sched
        if not sched.has_unfinished():
            waiters.pop(w.name, None)
            release(w, t)
            if w.k < len(w.reqs):
                timers[w.name] = w.reqs[w.k][0]
            return
        allow, cap = True, None
        if w.share is not None and not sched.num_pending_prefills:
            release(w, t)  # handed over while its last prefill finished: nothing to use it for
        if admission and sched.num_pending_prefills:
            running = frozenset(s.seq_id for s in sched.running)
            decoding = any(s.num_uncomputed_tokens == 1 for s in sched.running)
            if w.share is None and w.blocked is not None and decoding and w.blocked <= running:
                allow = False  # nothing freed its cache since its granted step prefilled nothing
            elif w.share is None:
                w.blocked = None
                unserved = [
                    w.enqueued[s.seq_id] for s in sched.waiting + sched.running if not s.num_output_tokens
                ]
                oldest = min(unserved) if unserved else t
                planned = sched.next_prefill_deadline(t)  # None: nothing on time, or first come first served
                w.on_time_bids += planned is not None
                w.differing_bids += planned is not None and planned * 1000 > oldest * 1000 + w.slo_ms + 1e-6
                planned = planned if bid == "plan" else None
                fit = w.profile.fit()
                waiters[w.name] = slo.Waiter(
                    w.name,
                    bid_deadline_ms(bid, oldest * 1000, w.slo_ms, planned),
                    fit.latency_ms(max(1, sched.num_pending_prefills)) if fit else 0.0,
                    max(1, min(sched.pending_prefill_tokens(), config.max_num_batched_tokens)),
                )
                grant(t)
                w.refused += w.share is None
            if w.share is not None:
                cap, w.share_in_step = w.share, True
            else:
                allow = False
                if not decoding:  # nothing to run: wait for a share to be handed over
                    w.waiting_for_share = True
                    timers.pop(w.name, None)
                    return
        out = sched.schedule(allow_prefill=allow, max_prefill_tokens=cap, now=t)
        if out.is_empty:
            raise RuntimeError(f"{w.name}: empty step with requests pending")
        prefill = out.num_batched_tokens - out.num_decodes
        if cap is not None and prefill == 0:
            w.blocked = frozenset(s.seq_id for s in sched.running)
        base_s = (gpu.decode_ms if out.num_decodes else gpu.overhead_ms) / 1000
        w.step = (out, t, prefill, base_s)
        if prefill:
            ps[w.name] = prefill * gpu.alpha_us / 1e6
        else:
            timers[w.name] = t + base_s

    def step_end(w: _Worker, t: float) -> None:
        out, started, prefill, _ = w.step
        w.step = None
        took = t - started
        if prefill >= w.offload.config.min_measured_tokens:
            w.offload.observe_prefill(out.num_batched_tokens, took)
        num_prefill = len(out.chunks) - out.num_decodes
        if num_prefill:  # the prefill profile T(b), b = sequences prefilled (Batching.observe)
            w.profile.observe(num_prefill, took * 1000)
        w.steps += 1
        w.last_end = t
        for seq in w.sched.update(out, {c.seq_id: 7 for c in out.chunks if c.samples}):
            w.tokens += 1
            w.first.setdefault(seq.seq_id, t)
            if seq.num_output_tokens >= seq.params.max_tokens:
                w.sched.finish(seq.seq_id, "length")
        if w.share_in_step:  # a share handed over during a step without prefill is kept for the next
            w.share_in_step = False
            release(w, t)
        decide(w, t)

    while timers or ps:
        k = len(ps)
        t_ps = now + min(ps.values()) * k if ps else math.inf
        t_timer = min(timers.values()) if timers else math.inf
        t_next = min(t_ps, t_timer)
        if ps:
            for name in ps:
                ps[name] -= (t_next - now) / k
        now = t_next
        for name in [n for n, left in ps.items() if left <= 1e-12]:
            del ps[name]
            timers[name] = now + by_name[name].step[3]  # the step's fixed part
        for name in [n for n, at in timers.items() if at <= now]:
            del timers[name]
            w = by_name[name]
            if w.step is not None:
                step_end(w, now)
            else:
                decide(w, now)
    result = {}
    for w in workers:
        if w.sched.has_unfinished() or w.k < len(w.reqs):
            raise RuntimeError(f"{w.name}: requests left unserved")
        ttft = [(w.first[f"r{i}"] - at) * 1000 for i, (at, _, _) in enumerate(w.reqs)]
        span = w.last_end - (w.reqs[0][0] if w.reqs else 0.0)
        result[w.name] = SharedOutcome(
            ttft, sum(x > w.slo_ms for x in ttft), max(span, 1e-9), w.tokens, w.steps,
            w.grants, w.refused, w.on_time_bids, w.differing_bids,
        )  # fmt: skip
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--functions", type=int, default=8)
    ap.add_argument("--slos", default="500,8000,8000")
    ap.add_argument("--rate", type=float, default=10.0)
    ap.add_argument("--duration-s", type=float, default=45.0)
    ap.add_argument("--trace-start-s", type=float, default=120.0)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-dir", default=str(DATA))
    ap.add_argument("--llama-per-trace-token", type=float, default=2.1)
    ap.add_argument("--kv-tokens", type=int, default=4096, help="KV slots (2 GiB of llama-2-7b: 4096)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--decode-ms", default="60", help="comma-separated: one table each")
    ap.add_argument("--alpha-us", default="90", help="comma-separated, paired with --decode-ms")
    ap.add_argument("--overhead-ms", type=float, default=10.0)
    ap.add_argument(
        "--overdue-s", default="5", help="comma-separated overdue_after_s values for the edf rows"
    )
    ap.add_argument(
        "--shared-gpu",
        choices=("no", "also", "only"),
        default="no",
        help="also (or only) run every function's worker on one GPU (SharedGpu) with and without the GPU's "
        "prefill budget, bidding with the oldest request's deadline or the plan's (issue 13)",
    )
    ap.add_argument(
        "--gpu-alpha-us", default="45", help="shared GPU: prefill us/token alone, paired with --decode-ms"
    )
    ap.add_argument("--prefill-tokens", type=int, default=2048, help="shared GPU: the prefill token budget")
    ap.add_argument(
        "--seeds",
        default="",
        help="shared GPU: comma-separated plan seeds, pooled and paired (default --seed)",
    )
    args = ap.parse_args()

    rows = trace.parse_trace(Path(args.data_dir) / "azure_llm_2023_code.csv")
    questions = trace.load_questions(Path(args.data_dir) / "gsm8k_test.jsonl")
    functions = [f"adm/f{i:02d}" for i in range(args.functions)]
    slo_list = [int(s) for s in args.slos.split(",")]
    slos = {fn: slo_list[i % len(slo_list)] for i, fn in enumerate(functions)}

    def workloads_for(seed: int) -> dict[str, tuple[list[tuple[float, int, int]], float]]:
        """Each function's requests [(arrival s, prompt tokens, output tokens)] and SLO, from the plan."""
        plan = trace.plan_requests(
            rows, questions, functions,
            trace.PlanOptions(
                num_functions=args.functions, rate_rps=args.rate, duration_s=args.duration_s,
                trace_start_s=args.trace_start_s, zipf_exponent=0.0, seed=seed,
                max_prompt_tokens=args.max_prompt_tokens, max_output_tokens=args.max_tokens,
                prompt_from_trace=True,
            ),
        )  # fmt: skip
        print(f"plan (seed {seed}): {trace.describe_plan(plan, args.duration_s)}")
        cap = args.kv_tokens - 2 * args.block_size  # a prompt must fit the cache with its output
        out = {}
        for fn in functions:
            reqs = []
            for p in sorted((p for p in plan if p.function == fn), key=lambda p: p.at_s):
                prompt = max(1, round(p.prompt_tokens * args.llama_per_trace_token))
                reqs.append((p.at_s, min(prompt, cap - p.max_tokens), p.max_tokens))
            out[fn] = (reqs, float(slos[fn]))
        return out

    num_blocks = args.kv_tokens // args.block_size
    base = dict(max_num_seqs=64, max_num_batched_tokens=args.budget, block_size=args.block_size)
    modes: list[tuple[str, SchedulerConfig]] = [("fcfs", SchedulerConfig(num_blocks=num_blocks, **base))]
    for overdue in (float(x) for x in args.overdue_s.split(",")):
        name = "edf" if math.isinf(overdue) else f"edf/{overdue:g}s"
        cfg = SchedulerConfig(num_blocks=num_blocks, deadline_order=True, overdue_after_s=overdue, **base)
        modes.append((name, cfg))
    if args.shared_gpu != "no":
        seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [args.seed]
        shared_tables(
            args, {seed: workloads_for(seed) for seed in seeds}, modes, functions, slos, min(slo_list)
        )
    if args.shared_gpu == "only":
        return 0
    workloads = workloads_for(args.seed)
    for decode_ms, alpha_us in zip(args.decode_ms.split(","), args.alpha_us.split(","), strict=True):
        model = Model(float(decode_ms), args.overhead_ms, float(alpha_us))
        print(f"\n== step model: decode {model.decode_ms:g} ms, prefill {model.alpha_us:g} us/token, "
              f"KV {args.kv_tokens} tokens, budget {args.budget}")  # fmt: skip
        head = ["ttft_p50", "ttft_p99", "violations", "tokens/s", "steps"]
        print(f"{'function (SLO ms, n)':<26}{'mode':<10}" + "".join(f"{h:>12}" for h in head))
        totals: dict[str, list[int]] = {m: [0, 0, 0] for m, _ in modes}
        for fn in functions:
            reqs = workloads[fn][0]
            for name, cfg in modes:
                o = simulate(reqs, slos[fn], model, cfg)
                pc = percentiles(o.ttft_ms)
                totals[name][0] += o.violations
                totals[name][1] += len(reqs)
                totals[name][2] += o.tokens
                cells = [f"{pc['p50']:.0f}", f"{pc['p99']:.0f}", f"{100 * o.violations / len(reqs):.1f}%",
                         f"{o.tokens / o.makespan_s:.1f}", str(o.steps)]  # fmt: skip
                print(
                    f"{f'{fn} ({slos[fn]}, {len(reqs)})':<26}{name:<10}" + "".join(f"{c:>12}" for c in cells)
                )
        tight = [fn for fn in functions if slos[fn] == min(slo_list)]
        print("all: " + ", ".join(f"{m} {100 * v / max(1, n):.1f}%" for m, (v, n, _) in totals.items()),
              f"(tight functions: {', '.join(tight)})")  # fmt: skip
    return 0


def shared_tables(
    args: argparse.Namespace,
    by_seed: dict[int, dict[str, tuple[list[tuple[float, int, int]], float]]],
    modes: list[tuple[str, SchedulerConfig]],
    functions: list[str],
    slos: dict[str, int],
    tight_slo: int,
) -> None:
    """Every function's worker on one GPU (`simulate_shared`): no admission, admission with first come first
    served workers, and admission with deadline-ordered workers bidding the oldest request's deadline (the
    rule before issue 13) or the plan's, side by side on the same arrivals; pooled over the seeds' plans,
    then each seed's violations (the variants share the seeds: paired)."""
    fcfs = modes[0][1]
    edf = modes[1][1]  # the first --overdue-s value
    variants = [
        ("off/fcfs", fcfs, False, "oldest"),
        ("off/edf", edf, False, "plan"),
        ("on/fcfs", fcfs, True, "oldest"),
        ("on/edf/oldest", edf, True, "oldest"),
        ("on/edf/plan", edf, True, "plan"),
    ]
    tight = [fn for fn in functions if slos[fn] == tight_slo]
    loose = [fn for fn in functions if fn not in tight]
    for decode_ms, alpha_us in zip(args.decode_ms.split(","), args.gpu_alpha_us.split(","), strict=True):
        gpu = SharedGpu(float(decode_ms), args.overhead_ms, float(alpha_us))
        print(
            f"\n== one GPU for all {len(functions)} workers: decode {gpu.decode_ms:g} ms, prefill "
            f"{gpu.alpha_us:g} us/token alone (shared by the prefills in flight), prefill budget "
            f"{args.prefill_tokens}, KV {args.kv_tokens} tokens, step budget {args.budget}, "
            f"seeds {','.join(map(str, by_seed))}"
        )
        head = ["tight_p50", "tight_p99", "tight_viol", "loose_viol", "all_viol", "tokens/s", "grants"]
        head += ["refused", "bid_differs"]
        print(f"{'mode':<15}" + "".join(f"{h:>12}" for h in head) + "  violations by seed")
        for name, cfg, admission, bid in variants:
            runs = {
                seed: simulate_shared(w, gpu, cfg, admission, bid, args.prefill_tokens)
                for seed, w in by_seed.items()
            }
            outs = [res for res in runs.values()]
            pc = percentiles([x for res in outs for fn in tight for x in res[fn].ttft_ms])

            def viol(fns: list[str], outs: list[dict[str, SharedOutcome]] = outs) -> str:
                n = sum(len(res[f].ttft_ms) for res in outs for f in fns)
                return f"{100 * sum(res[f].violations for res in outs for f in fns) / max(1, n):.1f}%"

            def total(field: str, outs: list[dict[str, SharedOutcome]] = outs, on: bool = admission) -> str:
                return str(sum(getattr(o, field) for res in outs for o in res.values())) if on else "-"

            rates = []
            for seed, res in runs.items():
                start = min(r[0][0] for r, _ in by_seed[seed].values() if r)
                end = max(start + o.makespan_s for o in res.values())
                rates.append(sum(o.tokens for o in res.values()) / (end - start))
            cells = [
                f"{pc['p50']:.0f}", f"{pc['p99']:.0f}", viol(tight), viol(loose), viol(functions),
                f"{sum(rates) / len(rates):.1f}", total("grants"), total("refused"), total("differing_bids"),
            ]  # fmt: skip
            per_seed = " ".join(str(sum(o.violations for o in res.values())) for res in outs)
            print(f"{name:<15}" + "".join(f"{c:>12}" for c in cells) + f"  {per_seed}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
