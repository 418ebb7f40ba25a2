"""Fresh workers spawned vs forked from the zygote, side by side in one run, through `lorafn up`.

For each mode (`zygote: false`, then `zygote: true`) the platform is started, a backbone without a warm
pool is applied with --functions functions (so every first request needs a new worker process), and
each function is invoked once, one after the other. Two figures per start:

  spawn->serving   the controller's record of the cold start (`last_cold_start_ms`): from the moment
                   the executor asked for the process to the worker's first heartbeat as serving
  TTFT             the client's time to first text of that first request (the `openai` package,
                   streaming): demand -> controller round -> process -> engine -> first token

    # CPU (2 cores here, ratios only), the tiny preset:
    python bench/zygote.py --preset tiny --device cpu
    # H100, the llama-2-7b preset written by `lorafn model random` (backbone resident in the server):
    python bench/zygote.py --model /tmp/llama-2-7b --device cuda --json $OUT/zygote.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from coldstart import Platform, backbone_doc, function_doc, prompt_of, ttft_ms


def run_mode(
    zygote: bool, workdir: Path, model: Path, adapters: list[Path], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Start `lorafn up` with the zygote on or off; one fresh start per function; its rows."""
    workdir.mkdir(parents=True, exist_ok=True)
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    config = f"gateway_port: 0\nzygote: {str(zygote).lower()}\n"
    if args.device == "cuda":
        config += f"worker_overhead_mib: {args.overhead_mib}\ndefault_kv_mib: {args.kv_mib}\n"
    platform = Platform(workdir, args.device, config)
    rows = []
    try:
        platform.apply(backbone_doc("fresh", model, dtype, 0, 0), None, workdir, "bb")
        # the backbone resident first (its server's socket), so a start measures the worker alone
        deadline = time.monotonic() + 600
        while not list((platform.state_dir / "sockets").glob("fresh.*.sock")):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the backbone server did not start; see {workdir / 'up.log'}")
            time.sleep(0.2)
        prompt = prompt_of(args.prompt_tokens)
        url = platform.state["gateway_url"]
        for i, adapter in enumerate(adapters):
            name = f"f{i}"
            platform.apply(function_doc(name, "fresh", adapter), f"k-{name}", workdir, name)
            time.sleep(0.5)  # the registration lands before the first request
            t, _rid = ttft_ms(url, f"k-{name}", f"bench/{name}", prompt, args.max_tokens, 600)
            # the controller records the start in its next round: with a fast start, after the answer
            deadline = time.monotonic() + 10
            status = platform.status(f"bench/{name}")
            while not status.get("last_cold_start_ms") and time.monotonic() < deadline:
                time.sleep(0.1)
                status = platform.status(f"bench/{name}")
            row = {
                "mode": "zygote" if zygote else "spawn",
                "function": name,
                "ttft_ms": t,
                "spawn_to_serving_ms": float(status.get("last_cold_start_ms") or "nan"),
                "path": status.get("last_cold_path", ""),
            }
            print(row, flush=True)
            rows.append(row)
    finally:
        platform.stop()
    log = (workdir / "up.log").read_text()
    forked = log.count("forked from the zygote")
    spawned = log.count(" spawned, pid")
    print(f"{'zygote' if zygote else 'spawn'}: workers forked {forked}, spawned {spawned}", flush=True)
    if zygote and spawned:
        print("warning: some workers were spawned with the zygote on (see up.log)", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--preset", default="tiny", help="without --model: write this random preset")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--functions", type=int, default=3, help="fresh starts per mode")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--kv-mib", type=int, default=2048, help="cuda: each worker's KV budget")
    ap.add_argument(
        "--overhead-mib", type=int, default=1024, help="cuda: the controller's per-worker overhead"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="lorafn-zygote-"))
    workdir.mkdir(parents=True, exist_ok=True)
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    model = args.model
    if model is None:
        from lorafn.models.random_model import write_random_model

        model = write_random_model(args.preset, workdir / "model", seed=0, dtype=dtype, progress=False)
    from lorafn.runtime.config import ModelConfig
    from lorafn.runtime.lora import write_random_adapter

    mc = ModelConfig.from_dir(model)
    adapters = [
        write_random_adapter(mc, workdir / f"adapter{i}", rank=args.rank, seed=i, target_modules="all-linear")
        for i in range(args.functions)
    ]
    rows = run_mode(False, workdir / "spawn", model, adapters, args)
    rows += run_mode(True, workdir / "zygote", model, adapters, args)

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["mode"] == mode)

    summary = {
        mode: {key: med(mode, key) for key in ("spawn_to_serving_ms", "ttft_ms")}
        for mode in ("spawn", "zygote")
    }
    print(
        f"\nfresh worker, {args.device}, {model.name}, r{args.rank} all-linear, "
        f"{args.functions} starts per mode (median)"
    )
    print(f"{'':<22}{'spawn':>10}{'zygote':>10}{'zygote/spawn':>14}")
    for key, label in (("spawn_to_serving_ms", "spawn->serving ms"), ("ttft_ms", "first-request TTFT ms")):
        s, z = summary["spawn"][key], summary["zygote"][key]
        print(f"{label:<22}{s:>10.0f}{z:>10.0f}{z / s:>14.2f}")
    target = 1500 if args.device == "cpu" else 1000
    print(f"target (issue 11): fresh worker to first token <= {target} ms")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
