"""`lorafn bench ...`: benchmarks through the real platform. `lorafn bench replay` replays real arrivals.

Heavy imports (numpy, httpx, matplotlib, torch for the random assets) happen inside the command.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import typer

from lorafn.replay.configs import configs_help

app = typer.Typer(help="Benchmarks through the real platform (docs/replay.md).", no_args_is_help=True)

TRACES = ("code", "conv")
PIPED_WIDTH = 160


def default_data_dir() -> Path:
    """$LORAFN_REPLAY_DATA, else ../shared/data beside the clone this package runs from."""
    env = os.environ.get("LORAFN_REPLAY_DATA")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2].parent / "shared" / "data"


def _console() -> Any:
    """The terminal's width, or 160 columns where the output goes to a file or a pipe (a device run's
    log): at Rich's default of 80 the tables crop their right columns and cut the configurations'
    names, and the tables are what gets pasted. $COLUMNS still decides where it is set."""
    from rich.console import Console

    piped = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    return Console(width=PIPED_WIDTH if piped else None)


def _fail(message: str) -> typer.Exit:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(2)


@app.command("replay")
def replay(
    # -- the workload --------------------------------------------------------------------------------
    trace: str = typer.Option(
        "code",
        "--trace",
        help="Arrivals: 'code' (Azure LLM 2023 code trace: bursty, inter-arrival CoV ≈ 13), 'conv' "
        "(conversation trace: smoother, CoV ≈ 1.1), or a CSV path with "
        "TIMESTAMP,ContextTokens,GeneratedTokens.",
    ),
    data_dir: Path = typer.Option(
        None,
        "--data-dir",
        help="Where the traces and gsm8k_test.jsonl lie (default: $LORAFN_REPLAY_DATA, else ../shared/data "
        "beside this clone).",
    ),
    prompts: Path = typer.Option(
        None, "--prompts", help="GSM8K JSONL file (default: <data dir>/gsm8k_test.jsonl)."
    ),
    functions: int = typer.Option(
        8,
        "--functions",
        "-n",
        min=1,
        max=1024,
        help="Functions the arrivals are spread over (a started platform registers replay/f000...; with "
        "--keys, the first N of the file in sorted order).",
    ),
    rate: float = typer.Option(
        2.0,
        "--rate",
        min=0.001,
        help="Mean arrival rate (requests/s) the trace is scaled to: rate × duration consecutive trace rows, "
        "their timestamps stretched linearly to span the duration (the trace's bursts keep their shape).",
    ),
    duration: float = typer.Option(
        60.0,
        "--duration",
        min=0.1,
        help="Seconds of arrivals to replay: the measured window (a --warmup-s comes before it).",
    ),
    trace_start: float = typer.Option(
        0.0, "--trace-start", min=0.0, help="Seconds into the trace where the replayed window begins."
    ),
    warmup_s: float = typer.Option(
        0.0,
        "--warmup-s",
        min=0.0,
        help="Seconds of warm-up sent before the measured window: the trace rows just before it, scaled "
        "the same way (a busier stretch sends more), over the same functions and seed, open-loop like the "
        "rest. Its requests are reported apart (a 'warm-up' row per configuration) and count in no "
        "figure of the window, nor do its GPU-seconds, peaks or cost; the window's requests are the same "
        "as without a warm-up. Without one (0) every function's first request is a cold start of a "
        "function the platform has never seen, which a platform in service does not have all at once.",
    ),
    zipf: float = typer.Option(
        1.0,
        "--zipf",
        min=0.0,
        help="Popularity exponent: function k gets a share ∝ 1/(k+1)^zipf of the requests (0: uniform).",
    ),
    seed: int = typer.Option(0, "--seed", help="Seeds the function of each request and the prompt order."),
    max_prompt_tokens: int = typer.Option(
        512,
        "--max-prompt-tokens",
        min=1,
        help="Cap on the trace's context tokens (prompts are GSM8K text sized to min(trace, cap), ~4 chars "
        "per token). Keep it small for a CPU run with the tiny preset.",
    ),
    max_output_tokens: int = typer.Option(
        64, "--max-output-tokens", min=1, help="Cap on the trace's generated tokens (sent as max_tokens)."
    ),
    prompt_size: str = typer.Option(
        "trace",
        "--prompt-size",
        help="'trace': prompt length from the trace's context tokens (capped); 'question': one GSM8K "
        "question each, as the paper sent.",
    ),
    # -- what to run -----------------------------------------------------------------------------------
    configs: str = typer.Option(
        "default",
        "--configs",
        help=configs_help(),
    ),
    device: str = typer.Option("auto", "--device", help="Started platform: auto | cpu | cuda."),
    model: Path = typer.Option(
        None, "--model", help="Started platform: the backbone's model directory (default: a random --preset)."
    ),
    preset: str = typer.Option(
        "tiny",
        "--preset",
        help="Started platform without --model: random weights of this shape (tiny | llama-2-7b | "
        "llama-3-8b), written once under <out>/assets.",
    ),
    dtype: str = typer.Option(
        None, "--dtype", help="Backbone dtype (default: bfloat16 on cuda, float32 on cpu)."
    ),
    rank: int = typer.Option(8, "--rank", min=1, help="LoRA rank of the random adapters."),
    target_modules: str = typer.Option(
        "q_proj,v_proj", "--target-modules", help="Adapter target modules, comma-separated, or all-linear."
    ),
    adapters: int = typer.Option(
        8, "--adapters", min=1, help="Distinct random adapters written; function i uses adapter i mod this."
    ),
    slo_ms: int = typer.Option(
        2500,
        "--slo-ms",
        min=1,
        help="Every function's spec.slo.ttftMs (paper: 5× the first warm TTFT, 2500 ms for 7B); violations "
        "are judged against it (an error is a violation). With --gateway-url and --redis-url each "
        "function's own SLO from the registry is used instead.",
    ),
    keep_alive: int = typer.Option(
        60, "--keep-alive", min=0, help="spec.scaling.keepAliveSeconds of every function (not always-on)."
    ),
    max_replicas: int = typer.Option(
        4, "--max-replicas", min=1, help="spec.scaling.maxReplicas of every function."
    ),
    kv_mib: int = typer.Option(
        None,
        "--kv-mib",
        min=1,
        help="spec.resources.kvCacheMiB of every function (default: the controller's).",
    ),
    platform_config: Path = typer.Option(
        None,
        "--platform-config",
        help="YAML of LocalConfig settings for every started platform (devices, device_memory_mib, "
        "worker_overhead_mib, ...); each configuration adds its own switch.",
    ),
    settle_timeout: float = typer.Option(
        600.0,
        "--settle-timeout",
        min=0.0,
        help="Seconds to wait before arrivals for the backbone, the warm pool or the always-on workers.",
    ),
    # -- or drive a running platform -----------------------------------------------------------------------
    gateway_url: str = typer.Option(
        None, "--gateway-url", help="Drive this running gateway instead of starting platforms (one row)."
    ),
    keys: Path = typer.Option(
        None, "--keys", help="With --gateway-url: YAML/JSON mapping namespace/name -> API key ('' if public)."
    ),
    redis_url: str = typer.Option(
        None,
        "--redis-url",
        help="With --gateway-url: the platform's Redis, for worker records (GPU-seconds, worker counts, "
        "cold-start paths); without it those stay empty.",
    ),
    key_prefix: str = typer.Option(
        "lorafn", "--key-prefix", help="With --redis-url: the deployment's key prefix."
    ),
    device_memory_gib: float = typer.Option(
        80.0, "--device-memory-gib", min=0.1, help="With --gateway-url: each GPU's memory, for GPU-seconds."
    ),
    # -- measurement and output ------------------------------------------------------------------------------
    usd_per_gpu_hour: float = typer.Option(
        2.0, "--usd-per-gpu-hour", min=0.0, help="Price of one GPU-hour for the cost column."
    ),
    worker_overhead_mib: int = typer.Option(
        None,
        "--worker-overhead-mib",
        min=0,
        help="Memory each worker holds beyond its heartbeat's mem_bytes (its CUDA context), counted in "
        "GPU-seconds (default: the controller's per-device estimate).",
    ),
    request_timeout: float = typer.Option(
        600.0, "--request-timeout", min=1.0, help="Client timeout of one request (s)."
    ),
    drain_timeout: float = typer.Option(
        300.0,
        "--drain-timeout",
        min=0.0,
        help="After the last arrival, seconds to wait for answers still running; later ones are errors.",
    ),
    sample_interval: float = typer.Option(
        0.5, "--sample-interval", min=0.05, help="Seconds between samples of the workers' records."
    ),
    out: Path = typer.Option(
        Path("replay-out"), "--out", help="Directory for replay.json, the PNG plots and each run's logs."
    ),
    plots: bool = typer.Option(True, "--plots/--no-plots", help="Write the PNG plots (needs matplotlib)."),
) -> None:
    """Replay real arrivals (Azure LLM traces) over N functions through the real HTTP API, open-loop.

    For each configuration it starts `lorafn up` (its own state under <out>/runs/<config>), registers the
    backbone and the functions, waits until the platform is settled, then sends every request at its
    time (streamed completions; arrivals never wait for answers) while it samples the workers' records
    in Redis; with --warmup-s, the trace before the measured window first, measured apart. It reports
    per function and overall TTFT, TPOT and end-to-end p50/p90/p99, SLO violations, the path each
    request took (warm / standby / fresh / queued), GPU-seconds held and their cost, beside
    ServerlessLoRA's own tables (docs/replay.md).
    """

    from lorafn.replay.configs import select_configs
    from lorafn.replay.driver import DriveOptions
    from lorafn.replay.platform import FunctionSetup, read_keys_file
    from lorafn.replay.run import External, Managed, ReplayOptions, run_replay
    from lorafn.replay.trace import PlanOptions

    if prompt_size not in ("trace", "question"):
        raise _fail(f"--prompt-size {prompt_size!r}: choose trace or question")
    ddir = data_dir or default_data_dir()
    trace_path = ddir / f"azure_llm_2023_{trace}.csv" if trace in TRACES else Path(trace)
    prompts_path = prompts or ddir / "gsm8k_test.jsonl"
    for what, path in (("--trace", trace_path), ("--prompts", prompts_path)):
        if not path.is_file():
            raise _fail(f"{what}: {path} does not exist (see --data-dir)")
    out = out.resolve()  # the functions' adapter URIs under it must be absolute file:// URIs
    try:
        chosen = select_configs(configs)
        managed = external = None
        if gateway_url:
            if keys is None:
                raise ValueError("--gateway-url needs --keys (namespace/name -> API key)")
            external = External(
                gateway_url.rstrip("/"), read_keys_file(keys), redis_url, key_prefix, float(slo_ms),
                device_memory_gib,
            )  # fmt: skip
        else:
            import yaml

            from lorafn.local.config import LocalConfig

            settings = yaml.safe_load(platform_config.read_text()) or {} if platform_config else {}
            if not isinstance(settings, dict):
                raise ValueError(
                    f"--platform-config {platform_config}: expected a mapping of LocalConfig settings"
                )
            resolved = LocalConfig(device=device).resolved_device() if device == "auto" else device
            if resolved not in ("cpu", "cuda"):
                raise ValueError(f"--device {device!r}: choose auto, cpu or cuda")
            targets = (
                "all-linear"
                if target_modules == "all-linear"
                else [t for t in target_modules.split(",") if t]
            )
            managed = Managed(
                resolved, model, preset, dtype, rank, targets, adapters, settings,
                FunctionSetup(slo_ms, keep_alive, max_replicas, kv_mib), settle_timeout,
            )  # fmt: skip
        options = ReplayOptions(
            trace=trace_path,
            prompts=prompts_path,
            plan=PlanOptions(
                functions,
                rate,
                duration,
                trace_start,
                zipf,
                seed,
                max_prompt_tokens,
                max_output_tokens,
                prompt_size == "trace",
                warmup_s,
            ),
            configs=chosen,
            out_dir=out,
            drive=DriveOptions(request_timeout, drain_timeout, sample_interval),
            usd_per_gpu_hour=usd_per_gpu_hour,
            worker_overhead_mib=worker_overhead_mib,
            plots=plots,
            managed=managed,
            external=external,
        )
        report = run_replay(options, _console())
    except (ValueError, RuntimeError, OSError) as exc:
        raise _fail(str(exc)) from None
    runs = [r for r in report["configs"] if not r.get("unavailable")]
    if not runs:
        raise _fail("no configuration ran")


@app.command("report")
def report(
    files: list[Path] = typer.Argument(
        ..., help="replay.json files of one workload (same trace, rate, seed)."
    ),
    out: Path = typer.Option(
        Path("replay-merged"), "--out", help="Directory for the merged replay.json and plots."
    ),
    plots: bool = typer.Option(True, "--plots/--no-plots", help="Write the PNG plots (needs matplotlib)."),
    rename: list[str] = typer.Option(
        [],
        "--rename",
        help="N:OLD=NEW: report configuration OLD of the N-th file (1 = the first) as NEW, e.g. one "
        "configuration run at two settings or commits (1:full=parked-function); repeatable.",
    ),
) -> None:
    """Merge replays of the same workload into one report (tables, comparison, plots), e.g. when the
    configurations were run by several commands to fit a time limit; a configuration in several files
    keeps its first run (the others are named; --rename keeps them as rows of their own)."""
    import json

    from lorafn.replay.run import finish, merge_reports, rename_configs

    console = _console()
    try:
        names = _renames(rename, len(files))
        loaded = [json.loads(f.read_text()) for f in files]
        loaded = [rename_configs(r, names.get(i, {})) for i, r in enumerate(loaded, 1)]
        merged = merge_reports(loaded)
        for path, source in zip(files, merged["merged_from"], strict=True):
            for name in source["left_out"]:
                console.print(
                    f"{path}: configuration {name!r} left out (an earlier file has it; --rename keeps it)"
                )
        finish(merged, out, plots, console)
    except (OSError, ValueError, KeyError) as exc:
        raise _fail(str(exc)) from None


def _renames(specs: list[str], num_files: int) -> dict[int, dict[str, str]]:
    """["2:full=parked-function"] -> {2: {"full": "parked-function"}}; ValueError naming a malformed one."""
    out: dict[int, dict[str, str]] = {}
    for spec in specs:
        index, sep, pair = spec.partition(":")
        old, eq, new = pair.partition("=")
        if not (sep and eq and index.isdigit() and old and new) or not 1 <= int(index) <= num_files:
            raise ValueError(
                f"--rename {spec!r}: expected N:OLD=NEW with N a file's position, 1..{num_files}"
            )
        out.setdefault(int(index), {})[old] = new
    return out
