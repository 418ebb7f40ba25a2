"""The host's part of a decode step (issue 12): what `Engine.step()` spends besides the model's forward, part
by part, at each batch size, beside the forward itself in the same run.

On the H200 the host part of a 7B decode step was 0.4 ms at batch 1 and 4.0-4.4 ms at batch 64 against a
6.3 ms graph replay (bench/decode_profile.py, docs/benchmarks.md): nothing of it overlaps the GPU. This bench
times the same Python on a CPU (the tiny preset; the forward is the CPU model's, so compare the host parts
with each other and between commits, as ratios, not with the GPU's forward):

    python bench/host_step.py                       # batches 1, 8, 32, 64
    python bench/host_step.py --batches 64 --json out.json

Parts: schedule (Scheduler.schedule), inputs (the step's input tensors: ModelRunner._build_batch on a CPU;
a GPU decode step pads into the graph's static inputs instead), sample, update (Scheduler.update), text
(IncrementalOutput.push: detokenizing and stop strings), and the rest of Engine.step.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lorafn.runtime.engine as engine_module
from lorafn.models.random_model import write_random_model
from lorafn.runtime import Engine, EngineConfig, SamplingParams, detokenizer

PARTS = ("forward", "schedule", "inputs", "sample", "update", "text")


def timed(fn: Callable, spent: Counter, part: str) -> Callable:
    def run(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[part] += time.perf_counter() - t0

    return run


def measure(model_dir: Path, batch: int, prompt_len: int, decode_tokens: int) -> dict:
    """ms per decode step of each part, over `decode_tokens` steps of `batch` sequences."""
    engine = Engine(
        EngineConfig(
            model=model_dir,
            device="cpu",
            dtype="float32",
            max_num_seqs=batch,
            max_model_len=prompt_len + decode_tokens + 8,
            num_kv_blocks=batch * (-(-(prompt_len + decode_tokens + 8) // 16)) + 16,
        )
    )
    rng = random.Random(batch)
    params = SamplingParams(max_tokens=decode_tokens + 1, temperature=0.0, ignore_eos=True)
    prompts = [[rng.randrange(5, 500) for _ in range(prompt_len)] for _ in range(batch)]
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    while any(not engine.get_output(i).token_ids for i in ids):  # every prefill done: decodes only from here
        engine.step()
    spent: Counter = Counter()
    scheduler, runner = engine.scheduler, engine.runner
    scheduler.schedule = timed(scheduler.schedule, spent, "schedule")
    scheduler.update = timed(scheduler.update, spent, "update")
    runner.model.forward = timed(runner.model.forward, spent, "forward")
    runner._build_batch = timed(runner._build_batch, spent, "inputs")
    real_sample, real_push = engine_module.sample, detokenizer.IncrementalOutput.push
    engine_module.sample = timed(real_sample, spent, "sample")
    detokenizer.IncrementalOutput.push = timed(real_push, spent, "text")
    try:
        t0, steps = time.perf_counter(), 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
        total = time.perf_counter() - t0
    finally:
        engine_module.sample, detokenizer.IncrementalOutput.push = real_sample, real_push
    row = {part: spent[part] / steps * 1e3 for part in PARTS}
    row["step"] = total / steps * 1e3
    row["rest"] = row["step"] - sum(row[p] for p in PARTS)
    row["host"] = row["step"] - row["forward"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lorafn-host-"))
    model_dir = write_random_model("tiny", work / "tiny", seed=0, progress=False)
    rows = {}
    print("ms per decode step (tiny preset on this CPU); host = step - forward, each part's share of it")
    head = f"{'batch':>5} {'step':>7} {'forward':>8} {'host':>7} | "
    print(head + " ".join(f"{p:>12}" for p in PARTS[1:]) + "  rest")
    for batch in (int(b) for b in args.batches.split(",") if b):
        r = measure(model_dir, batch, args.prompt_len, args.decode_tokens)
        rows[batch] = r
        shares = " ".join(f"{r[p]:6.3f} ({r[p] / r['host']:3.0%})" for p in PARTS[1:])
        print(f"{batch:>5} {r['step']:7.2f} {r['forward']:8.2f} {r['host']:7.3f} | {shares}  {r['rest']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
