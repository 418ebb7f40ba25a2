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
    args = ap.parse_args()

    rows = trace.parse_trace(Path(args.data_dir) / "azure_llm_2023_code.csv")
    questions = trace.load_questions(Path(args.data_dir) / "gsm8k_test.jsonl")
    functions = [f"adm/f{i:02d}" for i in range(args.functions)]
    slo_list = [int(s) for s in args.slos.split(",")]
    slos = {fn: slo_list[i % len(slo_list)] for i, fn in enumerate(functions)}
    plan = trace.plan_requests(
        rows, questions, functions,
        trace.PlanOptions(
            num_functions=args.functions, rate_rps=args.rate, duration_s=args.duration_s,
            trace_start_s=args.trace_start_s, zipf_exponent=0.0, seed=args.seed,
            max_prompt_tokens=args.max_prompt_tokens, max_output_tokens=args.max_tokens,
            prompt_from_trace=True,
        ),
    )  # fmt: skip
    print(f"plan: {trace.describe_plan(plan, args.duration_s)}")
    num_blocks = args.kv_tokens // args.block_size
    base = dict(max_num_seqs=64, max_num_batched_tokens=args.budget, block_size=args.block_size)
    modes: list[tuple[str, SchedulerConfig]] = [("fcfs", SchedulerConfig(num_blocks=num_blocks, **base))]
    for overdue in (float(x) for x in args.overdue_s.split(",")):
        name = "edf" if math.isinf(overdue) else f"edf/{overdue:g}s"
        cfg = SchedulerConfig(num_blocks=num_blocks, deadline_order=True, overdue_after_s=overdue, **base)
        modes.append((name, cfg))
    for decode_ms, alpha_us in zip(args.decode_ms.split(","), args.alpha_us.split(","), strict=True):
        model = Model(float(decode_ms), args.overhead_ms, float(alpha_us))
        print(f"\n== step model: decode {model.decode_ms:g} ms, prefill {model.alpha_us:g} us/token, "
              f"KV {args.kv_tokens} tokens, budget {args.budget}")  # fmt: skip
        head = ["ttft_p50", "ttft_p99", "violations", "tokens/s", "steps"]
        print(f"{'function (SLO ms, n)':<26}{'mode':<10}" + "".join(f"{h:>12}" for h in head))
        totals: dict[str, list[int]] = {m: [0, 0, 0] for m, _ in modes}
        cap = args.kv_tokens - 2 * args.block_size  # a prompt must fit the cache with its output
        for fn in functions:
            reqs = []
            for p in sorted((p for p in plan if p.function == fn), key=lambda p: p.at_s):
                prompt = max(1, round(p.prompt_tokens * args.llama_per_trace_token))
                prompt = min(prompt, cap - p.max_tokens)
                reqs.append((p.at_s, prompt, p.max_tokens))
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


if __name__ == "__main__":
    raise SystemExit(main())
