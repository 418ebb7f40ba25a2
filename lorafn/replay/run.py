"""One replay from start to end: plan the requests, run each configuration (a platform of its own, or
the given one), gather the figures, compare, write the JSON and the plots, print the tables."""

from __future__ import annotations

import asyncio
import os
import platform as host
import subprocess
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from lorafn.api.sizing import MiB
from lorafn.replay import report as rep
from lorafn.replay.configs import ReplayConfig, resolve
from lorafn.replay.driver import Drive, DriveOptions, Target, drive
from lorafn.replay.platform import (
    BACKBONE,
    FunctionSetup,
    ManagedPlatform,
    backbone_bytes,
    dump_json,
    local_config_fields,
    manifest,
    new_keys,
    own_adapter_dirs,
    prepare_adapters,
    prepare_model,
    registry_facts,
)
from lorafn.replay.stats import assign_paths
from lorafn.replay.trace import (
    PlannedRequest,
    PlanOptions,
    describe_plan,
    function_names,
    load_questions,
    parse_trace,
    plan_requests,
    window_facts,
)


@dataclass
class Managed:
    """The replay starts `lorafn up` itself, once per configuration."""

    device: str  # cpu | cuda
    model: Path | None = None
    preset: str = "tiny"
    dtype: str | None = None
    rank: int = 8
    target_modules: list[str] | str = field(default_factory=lambda: ["q_proj", "v_proj"])
    num_adapters: int = 8
    settings: dict[str, Any] = field(default_factory=dict)  # extra LocalConfig settings (--platform-config)
    setup: FunctionSetup = field(default_factory=lambda: FunctionSetup(2500, 60, 4))
    settle_timeout_s: float = 600.0


@dataclass
class External:
    """The replay drives a platform someone else runs."""

    gateway_url: str
    api_keys: dict[str, str]
    redis_url: str | None = None
    key_prefix: str = "lorafn"
    slo_ttft_ms: float = 2500.0  # for functions the registry does not name (or without --redis-url)
    device_memory_gib: float = 80.0
    shared: bool = True  # whether its workers map one shared backbone per GPU (lorafn's default)


@dataclass
class ReplayOptions:
    trace: Path
    prompts: Path
    plan: PlanOptions
    configs: list[ReplayConfig]
    out_dir: Path
    drive: DriveOptions
    usd_per_gpu_hour: float = 2.0
    worker_overhead_mib: int | None = None
    plots: bool = True
    managed: Managed | None = None
    external: External | None = None


def _git_commit() -> str:
    # a run from an exported tree (`git archive` on a lent GPU machine) names its commit in LORAFN_COMMIT:
    # there `git rev-parse` answers for whatever repository encloses the copy (a wrong commit, found so)
    if os.environ.get("LORAFN_COMMIT"):
        return os.environ["LORAFN_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip() or "unknown"  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _drive_with_progress(
    plan: list[PlannedRequest],
    target: Target,
    options: DriveOptions,
    label: str,
    console: Console,
    warmup_s: float,
) -> Drive:
    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=False,
    ) as progress:  # fmt: skip
        sent = progress.add_task(f"{label}: sent", total=len(plan))
        done = progress.add_task(f"{label}: ended", total=len(plan))
        return asyncio.run(
            drive(
                plan, target, options,
                on_sent=lambda: progress.advance(sent), on_done=lambda: progress.advance(done),
                warmup_s=warmup_s,
            )
        )  # fmt: skip


def _requests_json(result: Drive) -> dict[str, list[dict[str, Any]]]:
    """`requests`: the measured window's (what every figure is made of, as before warm-ups existed);
    `warmup_requests`: the warm-up's, kept apart so that no reader of `requests` counts them."""
    return {
        "requests": [r.to_json() for r in result.results if not r.warmup],
        "warmup_requests": [r.to_json() for r in result.results if r.warmup],
    }


def _device_bytes(device: str, settings: dict[str, Any]) -> dict[str, int]:
    from lorafn.local.executor import CPU_DEVICE_MIB, gpu_id, query_gpus

    mem = settings.get("device_memory_mib")
    n = settings.get("devices")
    if device == "cuda":
        found = query_gpus()[: n or None]
        return {gpu_id(i): (mem * MiB if mem else total) for i, total in found}
    return {gpu_id(i): (mem or CPU_DEVICE_MIB) * MiB for i in range(n or 1)}


def _overhead_bytes(options: ReplayOptions, device: str) -> int:
    if options.worker_overhead_mib is not None:
        return options.worker_overhead_mib * MiB
    from lorafn.controller.snapshot import default_sizing

    return default_sizing(device).worker_overhead_bytes


def _run_managed(
    options: ReplayOptions,
    m: Managed,
    config: ReplayConfig,
    plan: list[PlannedRequest],
    functions: list[str],
    model_dir: Path,
    adapters: list[Path],
    console: Console,
) -> dict[str, Any]:
    local, spec_fallback, unavailable = resolve(config, local_config_fields())
    if unavailable:
        console.print(f"[yellow]{config.name}: skipped, {unavailable}[/]")
        return {"config": config.name, "description": config.description, "unavailable": unavailable}
    settings = {**m.settings, **local, "device": m.device}
    dtype = m.dtype or ("bfloat16" if m.device == "cuda" else "float32")
    workdir = options.out_dir / "runs" / config.name
    platform = ManagedPlatform(workdir, settings)
    keys = new_keys(functions)
    console.print(f"[bold]{config.name}[/]: {config.description}")
    started = time.monotonic()
    try:
        state = platform.start()
        platform.apply(
            manifest(
                model_dir, dtype, functions, adapters, keys, m.setup, config, spec_fallback,
                adapter_slots=config.adapter_slots,
            )
        )  # fmt: skip
        warm_pool = settings.get("warm_pool", True) and not spec_fallback
        settled = platform.settle(
            functions, config.min_replicas, warm_pool, config.shares_backbone, m.settle_timeout_s
        )
        if not settled["settled"]:
            console.print(f"[yellow]{config.name}: not settled after {m.settle_timeout_s:g} s: {settled}[/]")
        setup_s = time.monotonic() - started
        target = Target(state.gateway_url, keys, state.redis_url, state.key_prefix)
        result = _drive_with_progress(
            plan, target, options.drive, config.name, console, options.plan.warmup_s
        )
    finally:
        platform.stop()
    assign_paths(result.results, result.events)
    slo = dict.fromkeys(functions, float(m.setup.slo_ttft_ms))
    figures = rep.config_figures(
        result.results, result.samples, result.duration_s, slo,
        _device_bytes(m.device, settings), {BACKBONE: backbone_bytes(model_dir)}, config.shares_backbone,
        _overhead_bytes(options, m.device), options.usd_per_gpu_hour,
    )  # fmt: skip
    return {
        "config": config.name,
        "description": config.description,
        "local_settings": settings,
        "backbone_warm_pool_off_by_spec": spec_fallback,
        "settle": settled,
        "setup_s": setup_s,
        "duration_s": result.duration_s,
        "log": str(platform.log_path),
        **figures,
        "bound_events": [e.__dict__ for e in result.events],
        **_requests_json(result),
    }


def _run_external(
    options: ReplayOptions, e: External, plan: list[PlannedRequest], functions: list[str], console: Console
) -> dict[str, Any]:
    target = Target(e.gateway_url, e.api_keys, e.redis_url, e.key_prefix)
    result = _drive_with_progress(plan, target, options.drive, "external", console, options.plan.warmup_s)
    assign_paths(result.results, result.events)
    gpus = sorted({w.gpu for s in result.samples for w in s.workers if w.gpu}) or ["local/0"]
    device_bytes = dict.fromkeys(gpus, int(e.device_memory_gib * 1024 * MiB))
    slo = dict.fromkeys(functions, e.slo_ttft_ms)
    weights: dict[str, int] = {}
    if e.redis_url:  # each function's own SLO and its backbone's size, from the platform's registry
        registered, weights = registry_facts(e.redis_url, e.key_prefix, functions)
        slo.update(registered)
    figures = rep.config_figures(
        result.results, result.samples, result.duration_s, slo,
        device_bytes, weights, e.shared, _overhead_bytes(options, "cuda"), options.usd_per_gpu_hour,
    )  # fmt: skip
    return {
        "config": "external",
        "description": f"the platform at {e.gateway_url}",
        "duration_s": result.duration_s,
        **figures,
        "bound_events": [ev.__dict__ for ev in result.events],
        **_requests_json(result),
    }


def run_replay(options: ReplayOptions, console: Console | None = None) -> dict[str, Any]:
    """Run every configuration; returns the report (also written to out_dir/replay.json, plots beside)."""
    console = console or Console()
    if (options.managed is None) == (options.external is None):
        raise ValueError("give either a platform to start (managed) or one to drive (external), not both")
    rows = parse_trace(options.trace)
    questions = load_questions(options.prompts)
    if options.external is not None:
        functions = sorted(options.external.api_keys)[: options.plan.num_functions]
        if len(functions) < options.plan.num_functions:
            raise ValueError(
                f"functions: {options.plan.num_functions} wanted, the keys file names {len(functions)}"
            )
    else:
        functions = function_names(options.plan.num_functions)
    plan = plan_requests(rows, questions, functions, options.plan)
    warmup = [p for p in plan if p.warmup]
    window = window_facts(rows, options.plan)
    options.out_dir.mkdir(parents=True, exist_ok=True)
    workload = {
        "trace": options.trace.stem.replace("azure_llm_2023_", ""),
        "trace_file": str(options.trace),
        "prompts_file": str(options.prompts),
        "functions": len(functions),
        "duration_s": options.plan.duration_s,
        **describe_plan(plan, options.plan.duration_s),
        "plan_options": options.plan.__dict__,
        "function_share": {fn: sum(p.function == fn and not p.warmup for p in plan) for fn in functions},
        "warmup_s": options.plan.warmup_s,
        "warmup_requests": len(warmup),
        "warmup_functions_used": len({p.function for p in warmup}),
        "window": window,
    }
    a, b = window["trace_s"]
    console.print(
        f"{workload['requests']} requests ({workload['workload_class']}, CoV {workload['interarrival_cov']}) "
        f"over {options.plan.duration_s:g} s (trace {a:.0f}-{b:.0f} s) onto {len(functions)} functions"
    )
    if warmup:
        wa, wb = window["warmup_trace_s"]
        console.print(
            f"warm-up first: {len(warmup)} requests over {options.plan.warmup_s:g} s (trace "
            f"{wa:.0f}-{wb:.0f} s, {workload['warmup_functions_used']} functions), sent like the rest and "
            "left out of every figure of the measured window"
        )
    runs: list[dict[str, Any]] = []
    if options.managed is not None:
        m = options.managed
        dtype = m.dtype or ("bfloat16" if m.device == "cuda" else "float32")
        assets = options.out_dir / "assets"
        model_dir = m.model or prepare_model(m.preset, assets / f"model-{m.preset}-{dtype}", dtype)
        adapters = prepare_adapters(
            model_dir,
            assets / "adapters",
            max(1, min(m.num_adapters, len(functions))),
            m.rank,
            m.target_modules,
        )
        adapters = own_adapter_dirs(adapters, functions, assets / "functions")
        for config in options.configs:
            try:
                runs.append(_run_managed(options, m, config, plan, functions, model_dir, adapters, console))
            except (
                Exception
            ) as exc:  # one broken row (a platform that died, Redis gone) must not lose the others
                console.print(f"[red]{config.name}: failed: {exc}[/]")
                runs.append(
                    {
                        "config": config.name,
                        "description": config.description,
                        "unavailable": f"failed: {exc}",
                    }
                )
    else:
        assert options.external is not None
        runs.append(_run_external(options, options.external, plan, functions, console))
    report: dict[str, Any] = {
        "tool": "lorafn bench replay",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": _git_commit(),
        "host": {"machine": host.machine(), "node": host.node(), "python": host.python_version()},
        "usd_per_gpu_hour": options.usd_per_gpu_hour,
        "workload": workload,
        "configs": runs,
    }
    return finish(report, options.out_dir, options.plots, console)


def finish(report: dict[str, Any], out_dir: Path, plots: bool, console: Console) -> dict[str, Any]:
    """Compare the configurations, write the plots and replay.json, print the tables."""
    report["comparison"] = rep.compare(report["configs"])
    if plots:
        from lorafn.replay.plots import write_plots

        report["plots"] = [str(p) for p in write_plots(report, out_dir)]
    dump_json(out_dir / "replay.json", report)
    rep.render(report, console)
    console.print(f"report: {out_dir / 'replay.json'}; plots: {', '.join(report.get('plots', [])) or 'none'}")
    return report


# A report written before warm-ups existed has none of these: it ran without one.
_NO_WARMUP = {"warmup_s": 0.0, "warmup_requests": 0, "warmup_functions_used": 0}


def _comparable_workload(workload: dict[str, Any]) -> dict[str, Any]:
    """What must be equal for two reports to be one replay: the workload less the file paths (which may
    differ between machines; the plan may not) and the derived trace window, with a report older than
    warm-ups read as one without."""
    w = {k: v for k, v in workload.items() if not k.endswith("_file") and k != "window"}
    w = {**_NO_WARMUP, **w}
    w["plan_options"] = {"warmup_s": 0.0, **(w.get("plan_options") or {})}
    return w


def merge_reports(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One report from several runs of the same workload (e.g. the configurations split over several
    commands to fit a time limit): configurations in the order given, a name seen twice keeps the first
    (`merged_from[i]["left_out"]` names the others; `rename_configs` keeps both).
    Refuses reports of different workloads or prices (their rows would not compare)."""
    if not reports:
        raise ValueError("reports: none given")
    first = reports[0]
    for other in reports[1:]:
        for key in ("workload", "usd_per_gpu_hour"):
            a, b = first.get(key), other.get(key)
            if key == "workload":
                a, b = _comparable_workload(a or {}), _comparable_workload(b or {})
            if a != b:
                raise ValueError(f"reports: {key} differs between the files; they are not one replay")
    configs: list[dict[str, Any]] = []
    merged_from = []
    for r in reports:
        seen = {x["config"] for x in configs}
        configs += [c for c in r["configs"] if c["config"] not in seen]
        merged_from.append(
            {
                "date": r.get("date"),
                "commit": r.get("commit"),
                "configs": [c["config"] for c in r["configs"]],
                "left_out": [c["config"] for c in r["configs"] if c["config"] in seen],
            }
        )
    for c in configs:  # reports written before the figure existed get it from their request records
        if "requests" in c:
            c["decode_concurrency"] = rep.decode_concurrency_of(c)
    merged = {k: v for k, v in first.items() if k not in ("comparison", "plots")}
    merged["configs"] = configs
    merged["merged_from"] = merged_from
    return merged


def rename_configs(report: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """The report with its configurations renamed (old name -> new), e.g. one configuration run at two
    settings or commits, merged as two rows. ValueError naming a configuration the report does not have, or
    a new name it has already."""
    have = [c["config"] for c in report["configs"]]
    missing = sorted(set(names) - set(have))
    if missing:
        raise ValueError(f"rename: no configuration {missing} in this report (it has {have})")
    renamed = [names.get(name, name) for name in have]
    if len(set(renamed)) != len(renamed):
        raise ValueError(f"rename: {names} gives two configurations one name ({renamed})")
    return {
        **report,
        "configs": [{**c, "config": names.get(c["config"], c["config"])} for c in report["configs"]],
    }
