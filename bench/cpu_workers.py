"""CPU workers computing at once: N engine processes started together, each timing a 37-token prefill and
32 decode steps (after a 16-token warm-up), under an OpenMP environment given per run.

What it showed on the 2-core VM (docs/benchmarks.md, "The README demo"): with libgomp's default wait, a
thread that finishes its part of a parallel region spins while it believes it has its core, and every
worker process believes it has every core; two workers at once then slow each other down ~40x. `lorafn
up` on CPU starts the zygote and the workers with OMP_WAIT_POLICY=PASSIVE (`local.executor.cpu_compute_env`).

    python bench/cpu_workers.py --model /tmp/lfn/models/smollm2-135m --procs 1 2 --env "" \
        --env OMP_WAIT_POLICY=PASSIVE --env GOMP_SPINCOUNT=10000
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


def child(model: str) -> None:
    from lorafn.runtime.config import EngineConfig
    from lorafn.runtime.engine import Engine
    from lorafn.runtime.sampling_params import SamplingParams

    engine = Engine(
        EngineConfig(
            model=model,
            device="cpu",
            dtype="float32",
            lora_shape="q_proj:8,v_proj:8",
            kv_cache_memory_bytes=32 << 20,
        )
    )
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.generate([[3] * 16], one)  # the first forward's one-time costs
    t0 = time.perf_counter()
    engine.generate([[5] * 37], one)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.generate([[7] * 37], SamplingParams(max_tokens=33, temperature=0.0, ignore_eos=True))
    decode = (time.perf_counter() - t0 - prefill) / 32
    print(json.dumps({"prefill_ms": prefill * 1000, "decode_ms": decode * 1000}))


def run(model: str, procs: int, env_text: str) -> list[dict[str, float]]:
    env = dict(os.environ)
    for pair in filter(None, env_text.split(",")):
        key, _, value = pair.partition("=")
        env[key] = value
    started = [
        subprocess.Popen(
            [sys.executable, __file__, "--child", "--model", model],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(procs)
    ]
    return [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in started]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="a model directory (SmolLM2-135M for the figures)")
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2], help="processes at once, per run")
    parser.add_argument(
        "--env", action="append", default=None, help="KEY=VALUE[,KEY=VALUE] for a run ('' = as inherited)"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.model)
        return
    print(f"{'environment':32} {'procs':>5} {'prefill 37 ms':>14} {'decode ms/token':>16}")
    for env_text in args.env if args.env is not None else [""]:
        for procs in args.procs:
            results = run(args.model, procs, env_text)
            prefill = max(r["prefill_ms"] for r in results)
            decode = max(r["decode_ms"] for r in results)
            print(f"{env_text or '(inherited)':32} {procs:>5} {prefill:>14.0f} {decode:>16.1f}")


if __name__ == "__main__":
    main()
