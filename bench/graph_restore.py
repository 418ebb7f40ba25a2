"""Decode CUDA graphs captured in one process, restored in ANOTHER without capturing (issue 11 item 2).

    python3 bench/graph_restore.py --preset tiny --device cuda --out /tmp/graph_restore.json
    python3 bench/graph_restore.py --model /tmp/llama-2-7b --device cuda --out /tmp/graph_restore_7b.json

The parent writes the model (tiny preset; or uses --model DIR) and a random adapter, then runs child
processes of this script: `capture` (--capture-runs times; the first may also fill Triton's disk cache,
the last one's archive and numbers are used), then `restore`. Each child builds the same state in its
fixed-address arena (lorafn/runtime/arena.py), logs every stage with its time (`[role] ok STAGE 12.3 ms`
or `[role] FAILED STAGE ...` with the traceback) and writes ROLE.json + ROLE.npz into --workdir.

capture: capture all buckets into the arena's pools (as DecodeGraphRunner does in a worker: warm-ups,
Triton kernels loaded from its disk cache), walk the graphs and write the archive.
restore: read the archive, check key and arena layout, rebuild the graphs (lorafn/runtime/
graph_restore.py), self-check. Also checks that a changed key and a corrupted file are refused.
Both then copy the same random adapter into the LoRA buffers, fill the KV cache with the same random
values and run greedy decode steps per bucket through their graphs and eagerly; the parent compares
restored with captured (bitwise logits, tokens) and each with eager, and prints the times side by side:
capture vs restore (target: restore >= 30x faster) and replay latency per bucket (target within 2%).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ALL_LINEAR = "q_proj:16,k_proj:16,v_proj:16,o_proj:16,gate_proj:16,up_proj:16,down_proj:16"
MAX_CONTEXT = 48  # longest cached context of a compared row (then `steps` more tokens)


# ------------------------------------------------------------------------------------------- stages


class Stages:
    """Timed, logged stages of one child: which one broke is the first thing a failed run tells."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.times: dict[str, float] = {}
        self.current: str | None = None

    def say(self, msg: str) -> None:
        print(f"[{self.role}] {msg}", flush=True)

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self.current = name
        self.say(f">> {name}")
        t0 = time.perf_counter()
        try:
            yield
        except BaseException as exc:
            self.say(
                f"FAILED {name} after {1e3 * (time.perf_counter() - t0):.1f} ms: {type(exc).__name__}: {exc}"
            )
            raise
        self.times[name] = time.perf_counter() - t0
        self.say(f"ok {name} {1e3 * self.times[name]:.1f} ms")
        self.current = None


# ------------------------------------------------------------------------------------------ children


def _inputs(bucket: int, vocab: int, block_size: int, steps: int, seed: int) -> dict[str, list]:
    """Deterministic decode rows for one bucket: row i has its own blocks and a cached context."""
    import numpy as np

    rng = np.random.default_rng(seed + bucket)
    per_seq = math.ceil((MAX_CONTEXT + steps) / block_size)
    rows = []
    for i in range(bucket):
        ctx = 1 + (17 * i + 5) % MAX_CONTEXT
        rows.append(
            {
                "token": int(rng.integers(0, vocab)),
                "position": ctx - 1,
                "table": list(range(i * per_seq, (i + 1) * per_seq)),
            }
        )
    return {"rows": rows}


def _greedy(state: Any, bucket: int, rows: list[dict], steps: int, graph: bool) -> tuple[Any, Any]:
    """`steps` greedy decode steps of the rows; (tokens [steps, n], logits of the first step [n, vocab])."""
    import numpy as np
    import torch

    from lorafn.runtime.cuda_graphs import pad_decode_inputs

    runner, kv = state.runner, state.kv_cache
    bs = kv.block_size
    tokens = [r["token"] for r in rows]
    positions = [r["position"] for r in rows]
    tables = [r["table"] for r in rows]
    out_tokens, first = [], None
    for _ in range(steps):
        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions, strict=True)]
        if graph:
            logits = runner.run(tokens, positions, slots, tables)
        else:
            inputs = pad_decode_inputs(
                tokens, positions, slots, tables, bucket, runner.max_blocks, kv.scratch_block, bs
            )
            for static, host in (
                (runner.input_ids, inputs.input_ids),
                (runner.positions, inputs.positions),
                (runner.slot_mapping, inputs.slot_mapping),
                (runner.block_tables, inputs.block_tables),
                (runner.context_lens, inputs.context_lens),
            ):
                static[:bucket].copy_(torch.from_numpy(host))
            logits = runner.model.forward(runner._batch(bucket), kv.layers)[: len(tokens)]
        logits = logits.float().cpu().numpy()
        if first is None:
            first = logits.copy()
        tokens = [int(t) for t in logits.argmax(axis=-1)]
        out_tokens.append(tokens)
        positions = [p + 1 for p in positions]
    return np.asarray(out_tokens, dtype=np.int64), first


def _compare_and_time(st: Stages, state: Any, cfg: dict, result: dict, arrays: dict) -> None:
    import numpy as np
    import torch

    from lorafn.runtime.lora import copy_lora, load_lora

    runner = state.runner
    if state.lora is not None:
        with st("adapter_copy"):  # a bind: the adapter into the prepared buffers (graphs unchanged)
            adapter = load_lora(cfg["adapter"], state.model_config, runner.model.device, runner.model.dtype)
            copy_lora(state.lora, adapter)
            del adapter
    gen = torch.Generator(device=runner.model.device)
    per_bucket: dict[str, Any] = {}
    with st("compare"):
        for bucket in runner.buckets:
            rows = _inputs(bucket, state.model_config.vocab_size, state.kv_cache.block_size, cfg["steps"], 7)[
                "rows"
            ]
            gen.manual_seed(1234)
            state.kv_cache.data.normal_(generator=gen)
            g_tokens, g_logits = _greedy(state, bucket, rows, cfg["steps"], graph=True)
            gen.manual_seed(1234)
            state.kv_cache.data.normal_(generator=gen)
            e_tokens, e_logits = _greedy(state, bucket, rows, cfg["steps"], graph=False)
            arrays[f"tokens_{bucket}"] = g_tokens
            arrays[f"logits_{bucket}"] = g_logits
            per_bucket[str(bucket)] = {
                "graph_vs_eager_tokens_equal": bool(np.array_equal(g_tokens, e_tokens)),
                "graph_vs_eager_logits_bitwise": bool(np.array_equal(g_logits, e_logits)),
                "graph_vs_eager_max_abs_diff": float(np.max(np.abs(g_logits - e_logits))),
                "finite": bool(np.isfinite(g_logits).all()),
            }
    with st("latency"):
        for bucket in runner.buckets:
            graph = runner.graphs[bucket]
            for _ in range(5):
                graph.replay()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(cfg["replays"]):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            per_bucket[str(bucket)]["replay_ms"] = start.elapsed_time(end) / cfg["replays"]
    result["buckets"] = per_bucket


def child(role: str, cfg: dict, mode: str | None = None) -> int:
    """`role` capture, restore (compared with the capture), restore_alt (a restore as `mode` says: its times
    only) or fallback. `mode`: a self-check mode, optionally /tN for N instantiating threads ("one/t4")."""
    mode = mode or cfg["selfcheck"]
    label = f"{role}[{mode}]" if role == "restore_alt" else role
    selfcheck_mode, _, threads = mode.partition("/t")
    instantiate_threads = int(threads) if threads else cfg["instantiate_threads"]
    st = Stages(label)
    result: dict[str, Any] = {"role": label, "ok": False, "pid": os.getpid()}
    arrays: dict[str, Any] = {}
    out = Path(cfg["workdir"])
    try:
        with st("import"):
            import numpy as np
            import torch
            import triton

            from lorafn.runtime.arena import Arena
            from lorafn.runtime.graph_archive import (
                ArchiveCorrupt,
                ArchiveMismatch,
                check_key,
                decode,
                encode,
                read_archive,
                trigger_buckets,
                write_archive,
            )
            from lorafn.runtime.graph_restore import (
                DecodeStateSpec,
                archive_graphs,
                build_decode_state,
                harvest_library_functions,
                restore_graphs,
                restore_or_capture,
                state_key,
            )
        result["versions"] = {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "triton": triton.__version__,
        }
        with st("cuda_init"):  # what a worker has done before its graphs: context, cuBLAS (prefill path)
            device = torch.device(cfg["device"])
            device = torch.device("cuda", device.index if device.index is not None else 0)
            torch.cuda.set_device(device)
            a = torch.randn(64, 64, device=device, dtype=torch.bfloat16)
            (a @ a).sum().item()
            del a
            result["gpu"] = torch.cuda.get_device_name(device)
        with st("arena"):
            arena = Arena(
                device,
                Path(cfg["cache_dir"]),
                base=int(cfg["arena_base"], 0),
                reserve_bytes=cfg["arena_bytes"],
            )
            st.say(f"arena at 0x{arena.base:x}, {arena.reserved >> 30} GiB, granularity {arena.granularity}")
        spec = DecodeStateSpec(
            model_dir=cfg["model"],
            dtype=cfg["dtype"],
            lora_shape=cfg["lora_shape"] or None,
            buckets=tuple(cfg["buckets"]),
            num_kv_blocks=cfg["num_kv_blocks"],
            block_size=cfg["block_size"],
            max_model_len=cfg["max_model_len"],
            rope_in_attention=cfg.get("rope_in_attention", False),
            backbone_socket=cfg.get("backbone_socket"),
        )
        with st("state"):
            state = build_decode_state(spec, arena)
            st.say(
                f"state: {len(state.state_log)} arena allocations, top at +{state.state_top} bytes, "
                f"weights in {state.weights_in}"
            )
            result["weights_in"] = state.weights_in
        with st("key"):
            key = state_key(state, arena)
        runner = state.runner
        archive_path = Path(cfg["archive"])
        if role == "capture":
            with st("capture"):
                result["capture_s"] = runner.capture(
                    pool=arena.graph_pool.id, warmup_pool=arena.scratch_pool, keep_graph=True
                )
            with st("archive_walk"):
                # references outside the arena are reported, not refused: the restore then shows what they do
                archive = archive_graphs(
                    runner, arena, key, state.state_top, state.state_log, selfcheck=True, allow_foreign=True
                )
            for ref in archive.info["foreign"]:
                st.say(f"warning: outside the arena: {ref}")
            with st("archive_write"):
                write_archive(archive_path, archive)
            result["archive"] = {
                "path": str(archive_path),
                "bytes": archive_path.stat().st_size,
                "nodes": {g.bucket: len(g.nodes) for g in archive.graphs},
                "modules": len(archive.modules),
                "library_kernels": sorted(archive.library_names()),
                "info": archive.info,
                "high_water": archive.layout["high_water"],
            }
            st.say(
                f"archive: {result['archive']['bytes']} bytes, nodes per bucket {result['archive']['nodes']}"
            )
        elif role == "fallback":  # an archive whose key differs: refused, naming the field; capture instead
            import logging

            with st("tamper"):
                tampered = read_archive(archive_path)
                tampered.key["torch"] = "0.0-tampered"
                tampered_path = write_archive(out / "tampered.lfgraph", tampered)
            warnings: list[str] = []

            class _Keep(logging.Handler):
                def emit(self, record: logging.LogRecord) -> None:
                    warnings.append(record.getMessage())

            logging.getLogger("lorafn.runtime.graph_restore").addHandler(_Keep(logging.WARNING))
            with st("restore_or_capture"):
                how, seconds, _report = restore_or_capture(state, arena, tampered_path, write=False)
            result["fallback"] = {"mode": how, "seconds": seconds, "warnings": warnings}
            st.say(f"fallback: {how} in {seconds:.3f} s; warnings {warnings}")
            result["ok"] = True
            return 0
        else:
            with st("archive_read"):
                archive = read_archive(archive_path)
            if role == "restore":
                with st("refusals"):  # a changed key and a damaged file must be refused, naming why
                    changed = dict(key, driver=int(key["driver"]) + 1)
                    try:
                        check_key(archive.key, changed)
                        result["refused_key"] = None
                    except ArchiveMismatch as exc:
                        result["refused_key"] = str(exc)
                    damaged = bytearray(encode(archive))
                    damaged[len(damaged) // 3] ^= 0xFF
                    try:
                        decode(bytes(damaged))
                        result["refused_corrupt"] = None
                    except ArchiveCorrupt as exc:
                        result["refused_corrupt"] = str(exc)
            with st("restore"):
                report = restore_graphs(
                    archive,
                    runner,
                    arena,
                    key,
                    state.state_top,
                    state.state_log,
                    selfcheck=selfcheck_mode,
                    trigger_layers=cfg["trigger_layers"],
                    instantiate_threads=instantiate_threads,
                    selfcheck_fatal=False,  # go on: the comparisons below say more than the digest
                )
            result["restore_stages_s"] = report.stages
            result["restore_detail_s"] = report.detail
            result["restore_label"] = (
                mode if instantiate_threads == 1 else f"{selfcheck_mode}/t{instantiate_threads}"
            )
            result["key_s"], result["archive_read_s"] = st.times["key"], st.times["archive_read"]
            # what a fresh worker pays to get graphs without capturing: its key, the file, the restore
            result["restore_s"] = st.times["key"] + st.times["archive_read"] + report.total_s
            result["restore_report"] = {
                "nodes": report.nodes,
                "modules": report.modules,
                "library_functions": report.library_functions,
                "triggers": report.triggers,
                "selfcheck_mode": report.selfcheck_mode,
                "selfcheck": {str(k): v for k, v in report.selfcheck.items()},
                "warnings": report.warnings,
            }
            for w in report.warnings[:20]:
                st.say(f"warning: {w}")
            st.say(
                f"restore ({mode}, {instantiate_threads} instantiating threads) "
                f"{1e3 * result['restore_s']:.1f} ms: key {1e3 * result['key_s']:.1f}, "
                f"archive_read {1e3 * result['archive_read_s']:.1f}, "
                + ", ".join(f"{k} {1e3 * v:.1f}" for k, v in report.stages.items())
                + " ms; harvest "
                + ", ".join(f"{k.removeprefix('harvest_')} {1e3 * v:.1f}" for k, v in report.detail.items())
                + f" ms; triggers {report.triggers}; selfcheck {report.selfcheck}"
            )
            # diagnostic, after the clock: the same trigger again, now warm. Its eager pass minus the first
            # one's is what the first calls of the library kernels cost (lazy module loads, cuBLAS set-up
            # and heuristics), which the capturing process pays in its warm-ups too
            with st("harvest_again"):
                warm: dict[str, float] = {}
                first = trigger_buckets({g.bucket: g.table.library_names() for g in archive.graphs})
                harvest_library_functions(runner, first, cfg["trigger_layers"], warm)
                result["harvest_warm_s"] = warm
                st.say(
                    "harvest again (warm): "
                    + ", ".join(f"{k} {1e3 * v:.1f}" for k, v in warm.items())
                    + f" ms; first calls cost ~{1e3 * first_calls_s(result):.1f} ms"
                )
            if role == "restore_alt":
                result["ok"] = True
                return 0
        _compare_and_time(st, state, cfg, result, arrays)
        result["arena"] = arena.stats().__dict__
        result["ok"] = True
    except BaseException as exc:
        result["failed_stage"] = st.current
        result["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    finally:
        result["stages_s"] = st.times
        if arrays:
            np.savez(out / f"{role}.npz", **arrays)
        name = f"restore_{mode.replace('/', '_')}" if role == "restore_alt" else role
        (out / f"{name}.json").write_text(json.dumps(result, indent=1, default=str))
    return 0 if result["ok"] else 1


# -------------------------------------------------------------------------------------------- parent


def _prepare(args: argparse.Namespace, workdir: Path) -> tuple[Path, Path | None]:
    from lorafn.runtime.config import ModelConfig

    if args.model:
        model = Path(args.model)
    else:
        from lorafn.models.random_model import write_random_model

        model = workdir / args.preset
        if not (model / "config.json").exists():
            write_random_model(args.preset, model, seed=0, dtype=args.dtype, progress=False)
    adapter = None
    if args.lora_shape:
        import torch

        from lorafn.api.sizing import parse_shape_key
        from lorafn.runtime.lora import write_random_adapter

        ranks = parse_shape_key(args.lora_shape)
        adapter = workdir / "adapter"
        if not (adapter / "adapter_config.json").exists():
            write_random_adapter(
                ModelConfig.from_dir(model),
                adapter,
                rank=min(ranks.values()),
                target_modules=list(ranks),
                seed=0,
                dtype=getattr(torch, args.dtype),
            )
    return model, adapter


def first_calls_s(res: dict) -> float:
    """What the restore's harvest paid for first calls of library kernels (its eager pass, cold minus warm):
    lazy module loads, cuBLAS set-up and heuristics. The capture's warm-ups pay at least as much."""
    cold = res.get("restore_detail_s", {}).get("harvest_eager", 0.0)
    warm = res.get("harvest_warm_s", {}).get("eager", cold)
    return max(0.0, cold - warm)


def _run_child(role: str, cfg_path: Path, timeout: float, mode: str | None = None) -> int:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", role, "--config", str(cfg_path)]
    if mode:
        cmd += ["--mode", mode]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    t0 = time.perf_counter()
    try:
        rc = subprocess.run(cmd, env=env, cwd=str(ROOT), timeout=timeout, check=False).returncode
    except subprocess.TimeoutExpired:
        print(f"[parent] {role} child timed out after {timeout:.0f} s", flush=True)
        rc = 124
    print(f"[parent] {role} child exited {rc} after {time.perf_counter() - t0:.1f} s", flush=True)
    return rc


def _summary(
    cap: dict, res: dict, workdir: Path, first_capture_s: float | None, alts: dict[str, dict] | None = None
) -> dict:
    import numpy as np

    out: dict[str, Any] = {"capture": cap, "restore": res, "restore_alt": alts or {}}
    if not (cap.get("ok") and res.get("ok")):
        out["ok"] = False
        return out
    cz, rz = np.load(workdir / "capture.npz"), np.load(workdir / "restore.npz")
    rows = {}
    for b, rb in res["buckets"].items():
        cb = cap["buckets"][b]
        lc, lr = cz[f"logits_{b}"], rz[f"logits_{b}"]
        rows[b] = {
            "restored_vs_captured_logits_bitwise": bool(np.array_equal(lc, lr)),
            "restored_vs_captured_tokens_equal": bool(np.array_equal(cz[f"tokens_{b}"], rz[f"tokens_{b}"])),
            "restored_vs_captured_max_abs_diff": float(np.max(np.abs(lc - lr))),
            "restored_vs_eager_tokens_equal": rb["graph_vs_eager_tokens_equal"],
            "restored_vs_eager_max_abs_diff": rb["graph_vs_eager_max_abs_diff"],
            "captured_vs_eager_tokens_equal": cb["graph_vs_eager_tokens_equal"],
            "captured_vs_eager_max_abs_diff": cb["graph_vs_eager_max_abs_diff"],
            "replay_ms_captured": cb["replay_ms"],
            "replay_ms_restored": rb["replay_ms"],
            "replay_diff_pct": 100.0 * (rb["replay_ms"] - cb["replay_ms"]) / cb["replay_ms"],
        }
    no_check = res["restore_s"] - res["restore_stages_s"].get("selfcheck", 0.0)
    # graphs ready per self-check mode (the compared restore's, and each extra child's), and net of the
    # first calls of library kernels that capture and restore both pay (measured in the restore: its
    # harvest's eager pass cold minus warm)
    ready = {res["restore_label"]: res["restore_s"]}
    for mode, alt in (alts or {}).items():
        if alt.get("ok"):
            ready[mode] = alt["restore_s"]
    ready.setdefault("none", no_check)  # the wait for the digests taken out (its launches stay in)
    first_calls = first_calls_s(res)
    cap_s = cap["capture_s"]
    out.update(
        {
            "capture_s": cap_s,
            "capture_first_run_s": first_capture_s,
            "restore_s": res["restore_s"],
            "restore_without_selfcheck_s": no_check,
            "ratio": cap_s / res["restore_s"],
            "ratio_without_selfcheck": cap_s / no_check,
            "ready_s": ready,
            "ratios": {m: cap_s / v for m, v in ready.items()},
            "first_calls_s": first_calls,
            "ratios_net_of_first_calls": {
                m: (cap_s - first_calls) / (v - first_calls) for m, v in ready.items()
            },
            "buckets": rows,
            "equal": all(
                r["restored_vs_captured_logits_bitwise"] and r["restored_vs_captured_tokens_equal"]
                for r in rows.values()
            ),
            "refusals_ok": bool(res.get("refused_key")) and bool(res.get("refused_corrupt")),
            # addresses outside A and W may even work when both processes' cudaMalloc give the same
            # addresses: luck, not a restore
            "foreign_refs": cap["archive"]["info"].get("foreign", []),
        }
    )
    # an extra restore must have worked and passed its own self-check
    out["alts_ok"] = all(
        a.get("ok") and all(a["restore_report"]["selfcheck"].values()) for a in (alts or {}).values()
    )
    out["ok"] = out["equal"] and out["refusals_ok"] and not out["foreign_refs"] and out["alts_ok"]
    return out


def _print(s: dict) -> None:
    cap, res = s["capture"], s["restore"]
    if "capture_s" not in s:
        for r in (cap, res):
            if r and not r.get("ok"):
                print(f"{r.get('role')}: FAILED at stage {r.get('failed_stage')}: {r.get('error')}")
        return
    print(f"\nGPU {cap.get('gpu')}  versions {cap.get('versions')}  weights in {cap.get('weights_in')}")
    print(f"{'':34}{'capture':>12}{'restore':>12}")
    for name in ("import", "cuda_init", "arena", "state"):
        print(f"{name + ' (s)':34}{cap['stages_s'].get(name, 0):12.3f}{res['stages_s'].get(name, 0):12.3f}")
    fc = s["first_calls_s"]
    print(f"{'graphs ready (s), self-check:':34}{'':24}   ratio (target >= 30x)   net of first calls")
    for mode, v in s["ready_s"].items():
        note = (
            " (the compared restore with the wait for its digests taken out)"
            if mode == "none" and mode not in s["restore_alt"]
            else ""
        )
        print(
            f"{'  ' + mode:34}{s['capture_s']:12.3f}{v:12.3f}   {s['ratios'][mode]:6.1f}x"
            f"{'':15}{s['ratios_net_of_first_calls'][mode]:6.1f}x{note}"
        )
    print(
        f"  first calls of library kernels (lazy loads, cuBLAS set-up), paid by both: {1e3 * fc:.1f} ms "
        "(the restore's trigger eager pass, cold minus warm)"
    )
    if s.get("capture_first_run_s") is not None:
        print(f"{'  capture, first run (s)':34}{s['capture_first_run_s']:12.3f}")
    for r in [res, *[a for a in s["restore_alt"].values() if a.get("ok")]]:
        stages = ", ".join(f"{k} {1e3 * v:.1f}" for k, v in r["restore_stages_s"].items())
        detail = ", ".join(f"{k} {1e3 * v:.1f}" for k, v in r.get("restore_detail_s", {}).items())
        warm = ", ".join(f"{k} {1e3 * v:.1f}" for k, v in r.get("harvest_warm_s", {}).items())
        print(
            f"  {r['role']} stages (ms): key {1e3 * r['key_s']:.1f}, "
            f"archive_read {1e3 * r['archive_read_s']:.1f}, {stages}\n"
            f"      harvest detail (ms): {detail}; the same trigger again, warm: {warm}"
        )
    arch = cap["archive"]
    print(
        f"  archive {arch['bytes']} bytes, {arch['modules']} Triton images, "
        f"{len(arch['library_kernels'])} library kernels, "
        f"triggers at buckets {res['restore_report']['triggers']}"
    )
    print(
        f"\n{'bucket':>6} {'replay ms cap':>14} {'restored':>10} {'diff%':>7}  restored==captured"
        "  restored~eager (tokens, max|d|)  captured~eager"
    )
    for b, r in s["buckets"].items():
        same = "bitwise" if r["restored_vs_captured_logits_bitwise"] else "DIFFERENT"
        toks = "tokens" if r["restored_vs_captured_tokens_equal"] else "TOKENS DIFFER"
        print(
            f"{b:>6} {r['replay_ms_captured']:14.4f} {r['replay_ms_restored']:10.4f} "
            f"{r['replay_diff_pct']:7.2f}  {same}/{toks}   "
            f"{r['restored_vs_eager_tokens_equal']}, {r['restored_vs_eager_max_abs_diff']:.3g}"
            f"   {r['captured_vs_eager_tokens_equal']}, {r['captured_vs_eager_max_abs_diff']:.3g}"
        )
    print(
        f"\nrefusals: key -> {res.get('refused_key')!r}\n          corrupt -> {res.get('refused_corrupt')!r}"
    )
    print(f"restored == captured in every bucket: {s['equal']}; refusals named: {s['refusals_ok']}")
    print(f"self-check of the compared restore: {res['restore_report']['selfcheck']}")
    for mode, a in s["restore_alt"].items():
        state = a["restore_report"]["selfcheck"] if a.get("ok") else f"FAILED: {a.get('error')}"
        print(f"extra restore, self-check {mode}: {state}")
    print(f"references outside the arena and W: {len(s['foreign_refs'])} {s['foreign_refs'][:3]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", help="random model preset to write when --model is not given")
    ap.add_argument("--model", help="a model directory (e.g. `lorafn model random --preset llama-2-7b`)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--lora-shape", default=ALL_LINEAR, help="adapter shape of the LoRA buffers ('' for none)"
    )
    ap.add_argument("--buckets", default="1,2,4,8,16,32,64")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-kv-blocks", type=int, default=0, help="0: enough for the largest bucket's rows")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8, help="greedy decode steps compared per bucket")
    ap.add_argument("--replays", type=int, default=50, help="replays timed per bucket")
    ap.add_argument("--capture-runs", type=int, default=2, help="capture children (the last one counts)")
    ap.add_argument("--trigger-layers", type=int, default=1, help="layers of the harvest trigger (0: all)")
    ap.add_argument("--arena-base", default="0x200000000000")
    ap.add_argument("--arena-gib", type=int, default=64)
    ap.add_argument("--workdir", help="default: a new temporary directory")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per child")
    ap.add_argument("--out", help="write the summary JSON here")
    ap.add_argument(
        "--no-fallback-check",
        action="store_true",
        help="skip the third child: an archive with another key is refused and capture takes over",
    )
    ap.add_argument(
        "--backbone",
        action="store_true",
        help="weights from a backbone server started here (W, read-only at its fixed address; needs "
        "lorafn._ipc built: python3 setup.py build_ext --inplace) instead of in the arena",
    )
    ap.add_argument(
        "--selfcheck",
        default="all",
        choices=("all", "cover", "one", "none"),
        help="self-check of the compared restore: every bucket, every function once, the smallest, none",
    )
    ap.add_argument(
        "--instantiate-threads",
        type=int,
        default=1,
        help="threads instantiating the compared restore's graphs",
    )
    ap.add_argument(
        "--also-restore",
        default="one,cover,one/t4",
        help="extra restore children (times only; '' for none), comma-separated: a self-check mode, "
        "optionally /tN for N instantiating threads",
    )
    ap.add_argument(
        "--child", choices=("capture", "restore", "restore_alt", "fallback"), help=argparse.SUPPRESS
    )
    ap.add_argument(
        "--rope-in-attention",
        action="store_true",
        help="the decode state with EngineConfig.rope_in_attention (RoPE + K/V writes inside attention)",
    )
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args.child, json.loads(Path(args.config).read_text()), args.mode)
    if args.device != "cuda" and not args.device.startswith("cuda:"):
        ap.error("--device: graph materialization needs CUDA")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="graph_restore-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"[parent] workdir {workdir}", flush=True)
    model, adapter = _prepare(args, workdir)
    buckets = sorted({int(b) for b in args.buckets.split(",")})
    per_seq = math.ceil((MAX_CONTEXT + args.steps) / args.block_size)
    cfg = {
        "workdir": str(workdir),
        "cache_dir": str(workdir / "cache"),
        "archive": str(workdir / "decode.lfgraph"),
        "model": str(model),
        "adapter": str(adapter) if adapter else None,
        "device": args.device,
        "dtype": args.dtype,
        "lora_shape": args.lora_shape,
        "buckets": buckets,
        "block_size": args.block_size,
        "num_kv_blocks": args.num_kv_blocks or buckets[-1] * per_seq + 8,
        "max_model_len": args.max_model_len,
        "steps": args.steps,
        "replays": args.replays,
        "trigger_layers": args.trigger_layers or None,
        "selfcheck": args.selfcheck,
        "instantiate_threads": args.instantiate_threads,
        "arena_base": args.arena_base,
        "arena_bytes": args.arena_gib << 30,
        "rope_in_attention": args.rope_in_attention,
    }
    server = None
    if args.backbone:
        server = _start_backbone(model, workdir, args.device)
        cfg["backbone_socket"] = str(workdir / "backbone.sock")
    try:
        return _run(args, cfg, workdir)
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()


def _start_backbone(model: Path, workdir: Path, device: str) -> subprocess.Popen:
    """`lorafn.backbone_server.cli serve` on the model; returns once its socket accepts."""
    import socket

    sock = workdir / "backbone.sock"
    sock.unlink(missing_ok=True)
    log = (workdir / "backbone.log").open("wb")
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    cmd = [sys.executable, "-m", "lorafn.backbone_server.cli", "serve", "--model", str(model)]
    cmd += ["--socket", str(sock), "--device", device]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT))
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"backbone server exited {proc.returncode}: see {workdir / 'backbone.log'}")
        if sock.exists():
            with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as s:
                s.connect(str(sock))
                print(f"[parent] backbone server ready at {sock}", flush=True)
                return proc
        time.sleep(0.1)
    proc.kill()
    raise TimeoutError("backbone server not ready after 600 s")


def _run(args: argparse.Namespace, cfg: dict, workdir: Path) -> int:
    cfg_path = workdir / "config.json"
    cfg_path.write_text(json.dumps(cfg, indent=1))
    for stale in (
        "capture.json",
        "capture.npz",
        "restore.json",
        "restore.npz",
        "fallback.json",
        "decode.lfgraph",
        *(p.name for p in workdir.glob("restore_*.json")),
    ):
        (workdir / stale).unlink(missing_ok=True)  # a crashed child must not leave an old run's answer
    first_capture_s = None
    for run in range(max(1, args.capture_runs)):
        print(f"[parent] capture run {run + 1} of {args.capture_runs}", flush=True)
        if _run_child("capture", cfg_path, args.timeout) != 0:
            break
        if run == 0 and args.capture_runs > 1:
            first_capture_s = json.loads((workdir / "capture.json").read_text()).get("capture_s")
    cap = json.loads((workdir / "capture.json").read_text()) if (workdir / "capture.json").exists() else {}
    res: dict = {}
    if cap.get("ok"):
        _run_child("restore", cfg_path, args.timeout)
        res = (
            json.loads((workdir / "restore.json").read_text()) if (workdir / "restore.json").exists() else {}
        )
    alts: dict[str, dict] = {}
    for mode in [m for m in args.also_restore.split(",") if m] if res.get("ok") else []:
        _run_child("restore_alt", cfg_path, args.timeout, mode)
        path = workdir / f"restore_{mode.replace('/', '_')}.json"
        alts[mode] = json.loads(path.read_text()) if path.exists() else {"ok": False}
    fb: dict = {}
    if res.get("ok") and not args.no_fallback_check:
        _run_child("fallback", cfg_path, args.timeout)
        fb = (
            json.loads((workdir / "fallback.json").read_text())
            if (workdir / "fallback.json").exists()
            else {}
        )
    summary = _summary(cap, res, workdir, first_capture_s, alts)
    summary["config"] = cfg
    _print(summary)
    if not args.no_fallback_check:
        f = fb.get("fallback", {})
        summary["fallback"] = fb
        summary["fallback_ok"] = bool(
            fb.get("ok") and f.get("mode") == "captured" and any("torch:" in w for w in f.get("warnings", []))
        )
        summary["ok"] = bool(summary.get("ok")) and summary["fallback_ok"]
        print(
            f"fallback (an archive with another torch in its key): {f.get('mode')}, "
            f"warnings {f.get('warnings')}"
        )
    print(f"RESULT: {'OK' if summary.get('ok') else 'NOT OK'}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=1, default=str))
        print(f"[parent] wrote {args.out}")
    return 0 if summary.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
