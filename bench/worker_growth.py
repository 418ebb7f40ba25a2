"""How much a fresh worker's process grows after its first heartbeat (issue 16: the controller charges a
settled worker its own reported size + a margin, never below its peers' 90th percentile; this measures
what that must cover).

One engine as a fresh bound worker builds it (lazy decode graphs, a KV budget, an r16 all-linear adapter;
its own copy of the weights here, so the absolute figures include them: read the deltas), then the
driver's count of this process (NVML by pid, what the heartbeat reports as `mem_bytes`) and torch's
reserved bytes after each stage:

1. build; 2. a first short request (~150 tokens, one token out: what the first heartbeat sees, it waits for
the first token); 3. its decode steps (the first decode graph, captured on need); 4. every pending decode
graph captured (idle time: `graphs_pending` turns 0, the worker is *settled*); 5. four short requests at
once; 6-7. a prompt of half and all of the longest step the worker can run (the step budget, 2048 tokens,
or what its KV budget holds, if less: ~1000 tokens at 512 MiB of a 7B); 8. a batch of short requests
decoding (as many as the KV budget holds).

Rows print the growth since stage 2 (first heartbeat) and since stage 4 (settled): the second is what the
margin and floor must cover.

    python3 bench/worker_growth.py --model /tmp/llama-2-7b --device cuda [--kv-mib 512] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MiB = 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a model directory (e.g. `lorafn model random` output)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--kv-mib", type=int, default=512, help="the KV budget the controller grants")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-running", type=int, default=64, help="the worker's max_running (max_num_seqs)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    import torch

    from lorafn.runtime import Engine, EngineConfig, SamplingParams
    from lorafn.runtime.config import ModelConfig
    from lorafn.runtime.gpu_memory import process_bytes
    from lorafn.runtime.lora import write_random_adapter

    device = torch.device(args.device)
    adapter = Path(tempfile.mkdtemp(prefix="lorafn-growth-")) / "adapter"
    write_random_adapter(
        ModelConfig.from_dir(args.model), adapter, rank=args.rank, lora_alpha=2.0 * args.rank
    )
    rows: list[dict[str, object]] = []

    def stage(name: str) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        whole = process_bytes(device)
        reserved = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
        rows.append(
            {
                "stage": name,
                "driver_mib": None if whole is None else whole / MiB,
                "reserved_mib": reserved / MiB,
            }
        )

    engine = Engine(
        EngineConfig(
            model=args.model,
            adapter=adapter,
            device=args.device,
            max_num_seqs=args.max_running,
            kv_cache_memory_bytes=args.kv_mib * MiB,
            lazy_graphs=True,
        )
    )
    stage("1 build")
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    decode = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    vocab = engine.model_config.vocab_size

    def prompt(n: int, seed: int) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    engine.generate([prompt(150, 0)], greedy)
    stage("2 first request (first heartbeat)")
    engine.generate([prompt(150, 1)], decode)
    stage("3 its decode steps")
    while engine.capture_pending_graph():
        pass
    stage("4 graphs captured (settled)")
    engine.generate([prompt(120 + 10 * i, 10 + i) for i in range(4)], decode)
    stage("5 four short requests at once")
    capacity = engine.runner.num_blocks * engine.config.block_size
    # a prefill step holds at most min(max_num_batched_tokens, what the KV budget holds): at KV 512 MiB of
    # a 7B (512 KiB a token) ~1000 tokens, not the 2048 of the step budget
    longest = min(engine.config.max_num_batched_tokens + 17, capacity, engine.max_model_len) - 16
    for n in sorted({longest // 2, longest}):
        engine.generate([prompt(n, n)], decode)
        stage(f"{len(rows) + 1} a {n}-token prompt")
    batch = max(1, min(args.max_running, capacity // (150 + 16)))
    engine.generate([prompt(150, 100 + i) for i in range(batch)], decode)
    stage(f"{len(rows) + 1} {batch} short requests decoding")

    base = {k: rows[i]["driver_mib"] or rows[i]["reserved_mib"] for k, i in (("first", 1), ("settled", 3))}
    print(
        f"{args.model} on {args.device}: KV {args.kv_mib} MiB ({capacity} tokens), r{args.rank} all-linear, "
        f"lazy decode graphs; MiB ({'driver, this pid' if rows[0]['driver_mib'] is not None else 'no NVML'})"
    )
    print(f"{'stage':<42s}{'driver':>10s}{'reserved':>10s}{'+ since 2':>11s}{'+ since 4':>11s}")
    for r in rows:
        now = r["driver_mib"] if r["driver_mib"] is not None else r["reserved_mib"]
        driver = "-" if r["driver_mib"] is None else f"{r['driver_mib']:.0f}"
        r["since_first_mib"] = now - base["first"]  # type: ignore[operator]
        r["since_settled_mib"] = now - base["settled"]  # type: ignore[operator]
        print(
            f"{r['stage']:<42s}{driver:>10s}{r['reserved_mib']:>10.0f}"
            f"{r['since_first_mib']:>11.0f}{r['since_settled_mib']:>11.0f}"
        )
    if args.json:
        args.json.write_text(
            json.dumps({"kv_mib": args.kv_mib, "capacity_tokens": capacity, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
