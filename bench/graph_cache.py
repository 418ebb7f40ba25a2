"""Decode graphs from the archive in real engines: a standby's start with and without (issue 11 item 2).

    python3 bench/graph_cache.py --model /tmp/llama-2-7b --backbone --shape all-linear:16 --runs 3

Each engine is its own process (as a worker: the arena is one per process, at a fixed address), started
by this script as `graph_cache.py child CONFIG_JSON`. In order: a standby without archives (captures every
bucket: the baseline), the first standby with archives (captures, then writes the archive), then `--runs`
standbys with archives (each restores every bucket instead of capturing), and one lazily started bound
worker (restores at its first decode step). Every one binds the same adapter and decodes the same prompts;
their tokens must be equal. Printed side by side: engine start, the graphs stage (capture / restore), and
the ratio. `--backbone` maps the weights from a backbone server started here (W at its fixed address: a
worker's real set-up); without it each engine loads its own copy into its arena.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def child(cfg: dict) -> dict:
    """One engine: built (timed), bound, decoding; what the archive did and the tokens."""
    t0 = time.perf_counter()
    from lorafn.runtime import Engine, EngineConfig, SamplingParams

    source = None
    if cfg.get("backbone_socket"):
        from lorafn.backbone_server.client import SharedWeightSource

        source = SharedWeightSource(cfg["backbone_socket"], device="cuda:0")
    t_import = time.perf_counter()
    engine = Engine(
        EngineConfig(
            model=cfg["model"],
            adapter=cfg.get("adapter"),
            lora_shape=cfg.get("lora_shape"),
            device="cuda:0",
            dtype=cfg.get("dtype", "bfloat16"),
            graph_archives=cfg.get("archives", True),
            lazy_graphs=cfg.get("lazy", False),
            cache_dir=cfg["cache_dir"],
            kv_cache_memory_bytes=cfg.get("kv_mib", 8) << 20,
            max_num_seqs=cfg.get("max_num_seqs", 16),
            weight_source=source,
            prefill_graph_tokens=tuple(cfg.get("prefill_tokens", ())),
        )
    )
    t_engine = time.perf_counter()
    runner = engine.runner
    at_start = runner.archives.outcome if runner.archives is not None else "off"
    if cfg.get("bind"):
        engine.bind_adapter(cfg["bind"])
    params = SamplingParams(max_tokens=cfg.get("max_tokens", 12), temperature=0.0, ignore_eos=True)
    tokens = [list(o.token_ids) for o in engine.generate(cfg["prompts"], params)]  # batched: several buckets
    single = [list(engine.generate([p], params)[0].token_ids) for p in cfg["prompts"][:2]]  # bucket 1
    # one decode batch of n rows per n (ignore_eos: every sequence runs to max_tokens, so the batch stays n):
    # n = 1, 2, 3, 5, 9, ... replay the graphs of buckets 1, 2, 4, 8, 16, ...
    per_batch = {
        str(n): [list(o.token_ids) for o in engine.generate(cfg["prompts"][:n], params)]
        for n in cfg.get("batches", [])
    }
    while engine.capture_pending_graph():
        pass
    archives = runner.archives
    from lorafn.runtime.gpu_memory import process_bytes

    used = process_bytes(engine.device)  # the driver's figure for this process (context included)
    return {
        "process_mib": None if used is None else used / 2**20,
        "at_start": at_start,
        "outcome": archives.outcome if archives is not None else "off",
        "written": bool(archives and archives.written),
        "path": str(archives.path) if archives is not None and archives.path else None,
        "restore_s": archives.restore_s if archives is not None else 0.0,
        "import_s": t_import - t0,
        "engine_s": t_engine - t_import,
        "startup_s": dict(runner.startup_s),
        "shape": engine.lora_shape_key,
        "buckets": sorted(runner.graphs.graphs) if runner.graphs is not None else [],
        "tokens": tokens,
        "single": single,
        "per_batch": per_batch,
        "prefill_replays": runner.prefill_graphs.replays if runner.prefill_graphs is not None else 0,
    }


def run_child(cfg: dict, timeout: float = 900) -> dict:
    """`child` in a new process; its JSON line, with the tail of its log as "log"."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "child", json.dumps(cfg)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"engine process failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    out = json.loads(lines[-1])
    out["log"] = proc.stderr[-6000:]
    return out


@contextlib.contextmanager
def backbone_server(model: Path, workdir: Path) -> Iterator[Path]:
    """A backbone server on `model` (bench/graph_restore.py's start); yields its socket, stops it after."""
    from graph_restore import _start_backbone  # this directory is on sys.path (a script's, or the test's)

    proc = _start_backbone(model, workdir, "cuda:0")
    try:
        yield workdir / "backbone.sock"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "child":
        print(json.dumps(child(json.loads(sys.argv[2]))), flush=True)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="model directory (default: the tiny preset, written here)")
    ap.add_argument("--backbone", action="store_true", help="weights from a backbone server started here")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--target-modules", default="all-linear")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-mib", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=64, help="decides the buckets (up to 64)")
    ap.add_argument("--runs", type=int, default=3, help="standbys that restore")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    import torch

    from lorafn.runtime.config import ModelConfig
    from lorafn.runtime.lora import write_random_adapter

    work = args.workdir or Path(tempfile.mkdtemp(prefix="graph-cache-"))
    work.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        from lorafn.models.random_model import write_random_model

        model = write_random_model("tiny", work / "tiny", seed=0, progress=False)
    adapter = write_random_adapter(
        ModelConfig.from_dir(model), work / "adapter", rank=args.rank, target_modules=args.target_modules,
        dtype=getattr(torch, args.dtype),
    )  # fmt: skip
    prompts = [[(7 * i + 3 * j) % 1000 + 5 for j in range(n)] for i, n in enumerate((9, 40, 130, 3, 61))]
    common = {
        "model": str(model), "cache_dir": str(work / "cache"), "prompts": prompts, "dtype": args.dtype,
        "kv_mib": args.kv_mib, "max_num_seqs": args.max_num_seqs, "max_tokens": 16,
    }  # fmt: skip
    with contextlib.ExitStack() as stack:
        if args.backbone:
            common["backbone_socket"] = str(stack.enter_context(backbone_server(model, work)))
        ref = run_child({**common, "adapter": str(adapter), "archives": False, "lazy": False})
        shape = ref["shape"]
        standby = {**common, "lora_shape": shape, "bind": str(adapter)}
        rows = [("standby, no archive (captures)", run_child({**standby, "archives": False}))]
        rows.append(("standby, first with archive (captures, writes)", run_child(standby)))
        restored = [run_child(standby) for _ in range(args.runs)]
        rows += [(f"standby, archive (restores) #{i + 1}", r) for i, r in enumerate(restored)]
        rows.append(
            (
                "bound, lazy, archive (restores at 1st decode)",
                run_child({**common, "adapter": str(adapter), "lazy": True}),
            )
        )

    print(
        f"\nmodel {model}, {args.dtype}, shape {shape}, KV {args.kv_mib} MiB, "
        f"backbone server: {args.backbone}"
    )
    print(f"{'engine':<48} {'archive':<10} {'buckets':>7} {'engine s':>9} {'graphs s':>9} {'MiB':>7}  tokens")
    for name, r in rows:
        graphs = r["startup_s"].get("graphs", 0.0) if r["at_start"] != "lazy" else r["restore_s"]
        same = r["tokens"] == ref["tokens"] and r["single"] == ref["single"]
        verdict = "equal" if same else "DIFFER"
        mib = f"{r['process_mib']:.0f}" if r.get("process_mib") is not None else "-"
        cells = (
            f"{r['outcome'][:10]:<10} {len(r['buckets']):>7} {r['engine_s']:>9.3f} {graphs:>9.3f} {mib:>7}"
        )
        print(f"{name:<48} {cells}  {verdict}")
    cap = rows[0][1]["startup_s"].get("graphs", 0.0)
    res = statistics.median(r["startup_s"].get("graphs", 0.0) for r in restored)
    eng_cap = rows[0][1]["engine_s"]
    eng_res = statistics.median(r["engine_s"] for r in restored)
    print(
        f"\ngraphs: capture {cap:.3f} s vs restore {res:.3f} s (median of {len(restored)}): "
        f"{cap / max(res, 1e-9):.1f}x"
    )
    print(f"engine start: {eng_cap:.3f} s vs {eng_res:.3f} s: {eng_cap - eng_res:.3f} s saved per standby")
    ok = all(r["tokens"] == ref["tokens"] and r["single"] == ref["single"] for _n, r in rows)
    ok = ok and all(r["outcome"] == "restored" for r in restored) and rows[-1][1]["outcome"] == "restored"
    print(
        "all tokens equal, every archive run restored"
        if ok
        else "FAILED: tokens differ or a restore was refused"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"rows": [{"name": n, **{k: v for k, v in r.items() if k != "log"}} for n, r in rows]},
                indent=1,
            )
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
