"""One configuration's figures from what the driver recorded, the comparison across configurations and
with the paper, and the terminal tables (rich)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from lorafn.replay import paper
from lorafn.replay.configs import BASELINES
from lorafn.replay.stats import (
    WINDOW_START_S,
    MiB,
    RequestResult,
    Sample,
    cost_effectiveness,
    cost_usd,
    decode_concurrency,
    gpu_seconds,
    held_bytes,
    summarize_all,
    unshared_gpu_seconds,
    worker_series,
)


def peak_in_flight(results: Sequence[RequestResult]) -> int:
    """Most requests open at once (sent, not yet ended)."""
    edges: list[tuple[float, int]] = []
    for r in results:
        if r.sent_s is not None and r.e2e_ms is not None:
            edges += [(r.sent_s, 1), (r.sent_s + r.e2e_ms / 1000, -1)]
    peak = open_now = 0
    for _, step in sorted(edges, key=lambda e: (e[0], e[1])):
        open_now += step
        peak = max(peak, open_now)
    return peak


def throughput(results: Sequence[RequestResult]) -> dict[str, float | int]:
    """Output tokens/s and answered requests/s over the span from the first send to the last end."""
    ended = [r for r in results if r.sent_s is not None and r.e2e_ms is not None]
    if not ended:
        return {"tokens_per_s": 0.0, "requests_per_s": 0.0, "peak_in_flight": 0}
    span = max(r.sent_s + r.e2e_ms / 1000 for r in ended) - min(r.sent_s for r in ended)  # type: ignore[operator]
    ok = [r for r in ended if r.ok]
    tokens = sum(r.completion_tokens or 0 for r in ok)
    return {
        "tokens_per_s": tokens / span if span > 0 else 0.0,
        "requests_per_s": len(ok) / span if span > 0 else 0.0,
        "peak_in_flight": peak_in_flight(results),
    }


def config_figures(
    results: Sequence[RequestResult],
    samples: Sequence[Sample],
    end_s: float,
    slo_ms: dict[str, float],
    device_bytes: dict[str, int],
    backbone_bytes: dict[str, int],
    shared: bool,
    worker_overhead_bytes: int,
    usd_per_gpu_hour: float,
) -> dict[str, Any]:
    """Summary, GPU-seconds, cost, series and throughput of one configuration's run: all of the measured
    window (from WINDOW_START_S to `end_s`) only. The warm-up's requests are summarized apart
    (`warmup`); its samples stay in the series (negative times, for the plots) but count in no
    GPU-second, peak or cost."""
    measured = [r for r in results if not r.warmup]
    summary = summarize_all(measured, slo_ms)
    gpu_s = gpu_seconds(
        samples, end_s, device_bytes, backbone_bytes, shared, worker_overhead_bytes, start_s=WINDOW_START_S
    )
    # with sharing: what the same workers would have held without it (a computed lower bound; None for a
    # run without sharing, whose own GPU-seconds are that measurement on the devices it had)
    unshared_s = (
        unshared_gpu_seconds(
            samples, end_s, device_bytes, backbone_bytes, worker_overhead_bytes, start_s=WINDOW_START_S
        )
        if shared
        else None
    )
    series: dict[str, list[float]] = worker_series(samples)
    series["held_mib"] = [
        sum(held_bytes(s, list(device_bytes), backbone_bytes, shared, worker_overhead_bytes).values()) / MiB
        for s in sorted(samples, key=lambda s: s.t_s)
    ]
    window = [i for i, t in enumerate(series["t_s"]) if t >= WINDOW_START_S]
    overall = summary["overall"]
    return {
        "summary": summary,
        "warmup": {"summary": summarize_all([r for r in results if r.warmup], slo_ms)},
        "gpu_seconds": gpu_s,
        "gpu_seconds_unshared_same_workers": unshared_s,
        "cost_usd": cost_usd(gpu_s, usd_per_gpu_hour),
        "peak_held_mib": max((series["held_mib"][i] for i in window), default=0.0),
        "peak_workers": max((series["bound"][i] + series["standby"][i] for i in window), default=0),
        "throughput": throughput(measured),
        "decode_concurrency": decode_concurrency(measured),
        "series": series,
        "row": {  # the flat figures the comparisons use
            "ttft_ms_p50": overall["ttft_ms"]["p50"],
            "ttft_ms_mean": overall["ttft_ms"]["mean"],
            "e2e_ms_mean": overall["e2e_ms"]["mean"],
            "cost_usd": cost_usd(gpu_s, usd_per_gpu_hour),
            "gpu_seconds": gpu_s,
            "gpu_seconds_unshared_same_workers": unshared_s,
            "slo_violation_rate": overall["slo_violation_rate"],
        },
    }


def decode_concurrency_of(run: dict[str, Any]) -> dict[str, Any]:
    """A configuration's decode concurrency as its report holds it, else computed from its request records
    (reports written before the figure existed)."""
    if "decode_concurrency" in run:
        return run["decode_concurrency"]
    return decode_concurrency([RequestResult.from_json(r) for r in run.get("requests", [])])


def compare(configs: list[dict[str, Any]]) -> dict[str, Any]:
    """Across configurations: against the paper's Table 3, each ablation's share of the gain,
    cost-effectiveness against the always-on baseline, and the issue's targets."""
    rows = {c["config"]: c["row"] for c in configs if not c.get("unavailable")}
    baseline = next((b for b in BASELINES if b in rows), None)
    ce = {}
    if baseline is not None:
        base = rows[baseline]
        for name, r in rows.items():
            ce[name] = cost_effectiveness(
                r["e2e_ms_mean"], r["cost_usd"], base["e2e_ms_mean"], base["cost_usd"]
            )
    return {
        "ablation_vs_paper": paper.ablation_comparison(rows),
        "gain_share": {
            "ttft_ms_mean": paper.gain_shares(rows, "ttft_ms_mean"),
            "gpu_seconds": paper.gain_shares(rows, "gpu_seconds"),
        },
        "cost_effectiveness_baseline": baseline,
        "cost_effectiveness": ce,
        "paper_cost_effectiveness_7b": list(paper.COST_EFFECTIVENESS_7B),
        "targets": paper.targets_check(rows),
        "paper_table2": paper.TABLE2,
        "paper_slo_violations": paper.SLO_VIOLATIONS,
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}×"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


WARMUP_ROW = "  warm-up"  # the warm-up's row, under its configuration's
# the request paths the resources table counts (stats.assign_paths; `unparked`: a parked worker got its KV)
ROUTES = ("warm", "unparked", "join", "standby", "fresh", "queued")


def window_title(workload: dict[str, Any]) -> str:
    """A few words for a table's title that tell a warmed run from a cold one."""
    warmup_s = workload.get("warmup_s") or 0
    if warmup_s > 0:
        return f"measured window {workload['duration_s']:g} s after a {warmup_s:g} s warm-up"
    return f"measured {workload['duration_s']:g} s from a cold start, no warm-up"


def window_line(workload: dict[str, Any]) -> str:
    """The measured window and the warm-up in full (a report older than warm-ups had none)."""
    trace = (workload.get("window") or {}).get("trace_s")
    where = f" (trace {trace[0]:.0f}-{trace[1]:.0f} s)" if trace else ""
    line = f"Measured window: {workload['duration_s']:g} s, {workload['requests']} requests{where}. "
    warmup_s = workload.get("warmup_s") or 0
    if warmup_s <= 0:
        return line + (
            "No warm-up: the window starts cold, every function's first request a cold start of a "
            "function the platform has never seen."
        )
    wtrace = (workload.get("window") or {}).get("warmup_trace_s")
    wwhere = f" (trace {wtrace[0]:.0f}-{wtrace[1]:.0f} s)" if wtrace else ""
    return line + (
        f"Warm-up before it: {warmup_s:g} s, {workload.get('warmup_requests', 0)} requests{wwhere}, sent "
        "the same way and left out of every figure but its own 'warm-up' rows; GPU-seconds, peaks and "
        "cost are the window's."
    )


def render(report: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    w = report["workload"]
    warmed = (w.get("warmup_s") or 0) > 0
    console.rule(
        f"replay: {w['trace']} trace ({w['workload_class']}, CoV {w['interarrival_cov']}), {w['requests']} "
        f"requests over {w['duration_s']:g} s onto {w['functions']} functions; {window_title(w)}"
    )
    lat = Table(
        title=f"Latency per configuration, {window_title(w)} (ms; SLO = each function's spec.slo.ttftMs)",
        caption=window_line(w),
        caption_justify="left",
    )
    columns = ("config", "req", "ok", "err", "TTFT p50", "p90", "p99", "TPOT p50", "E2E p50", "p99", "SLO")
    for col in columns:
        lat.add_column(col, justify="left" if col == "config" else "right")
    res = Table(title=f"Paths and resources per configuration, {window_title(w)}")
    for col in ("config", *ROUTES, "GPU-s", "peak GiB", "cost $", "CE×"):
        res.add_column(col, justify="left" if col == "config" else "right")
    ce = report["comparison"]["cost_effectiveness"]
    for run in report["configs"]:
        if run.get("unavailable"):
            lat.add_row(run["config"], f"[yellow]n/a: {run['unavailable']}[/]", *[""] * 9)
            continue
        o = run["summary"]["overall"]
        lat.add_row(
            run["config"], str(o["requests"]), str(o["answered"]), str(o["errors"]),
            _ms(o["ttft_ms"]["p50"]), _ms(o["ttft_ms"]["p90"]), _ms(o["ttft_ms"]["p99"]),
            _ms(o["tpot_ms"]["p50"]), _ms(o["e2e_ms"]["p50"]), _ms(o["e2e_ms"]["p99"]),
            _pct(o["slo_violation_rate"]),
        )  # fmt: skip
        p = o["paths"]
        res.add_row(
            run["config"], *(str(p.get(k, 0)) for k in ROUTES),
            f"{run['gpu_seconds']:.1f}", f"{run['peak_held_mib'] / 1024:.1f}", f"{run['cost_usd']:.4f}",
            _x(ce.get(run["config"])),
        )  # fmt: skip
        if warmed and run.get("warmup"):  # the warm-up's own figures, under its configuration's row
            wo = run["warmup"]["summary"]["overall"]
            lat.add_row(
                WARMUP_ROW, str(wo["requests"]), str(wo["answered"]), str(wo["errors"]),
                _ms(wo["ttft_ms"]["p50"]), _ms(wo["ttft_ms"]["p90"]), _ms(wo["ttft_ms"]["p99"]),
                _ms(wo["tpot_ms"]["p50"]), _ms(wo["e2e_ms"]["p50"]), _ms(wo["e2e_ms"]["p99"]),
                _pct(wo["slo_violation_rate"]), style="dim",
            )  # fmt: skip
            wp = wo["paths"]
            res.add_row(
                WARMUP_ROW, *(str(wp.get(k, 0)) for k in ROUTES),
                "-", "-", "-", "-", style="dim",
            )  # fmt: skip
    console.print(lat)
    console.print(res)

    cmp = report["comparison"]
    pt = Table(title="Against ServerlessLoRA Table 3 (ratios to each side's own 'full'; TTFT/E2E means)")
    for col in (
        "config",
        "paper row",
        "TTFT ours",
        "TTFT paper",
        "E2E ours",
        "E2E paper",
        "cost ours",
        "cost paper",
    ):
        pt.add_column(col, justify="left" if col in ("config", "paper row") else "right")
    for row in cmp["ablation_vs_paper"]:
        pt.add_row(
            row["config"], row["paper_row"] or "-",
            _x(row["ttft_vs_full"]), _x(row["paper_ttft_vs_full"]),
            _x(row["e2e_vs_full"]), _x(row["paper_e2e_vs_full"]),
            _x(row["cost_vs_full"]), _x(row["paper_cost_vs_full"]),
        )  # fmt: skip
    console.print(pt)
    shares = cmp["gain_share"]
    if shares["ttft_ms_mean"]:
        console.print(
            "each ablation's share of the TTFT loss: "
            + ", ".join(f"{k} {_pct(v)}" for k, v in shares["ttft_ms_mean"].items())
        )
    lo, hi = cmp["paper_cost_effectiveness_7b"]
    baseline = cmp["cost_effectiveness_baseline"] or "no always-on run"
    console.print(
        f"cost-effectiveness 1/(E2E × cost) against {baseline} = 1: "
        + ", ".join(f"{k} {_x(v)}" for k, v in cmp["cost_effectiveness"].items())
        + f"  (paper, 7B vs vLLM: {lo}-{hi}×)"
    )
    tg = cmp["targets"]
    console.print(
        f"targets (full vs no-sharing): TTFT p50 {_pct(tg['ttft_p50_reduction'])} lower (want ≥ 87%), "
        f"GPU-seconds {_pct(tg['gpu_seconds_reduction'])} lower (want ≥ 90%), "
        f"SLO violations {_pct(tg['slo_violation_rate'])} (want ≤ 5%; paper ≤ 10%, ServerlessLLM up to 45%)"
    )
    if tg.get("gpu_seconds_unshared_same_workers") is not None:  # (absent from reports written before it)
        console.print(
            f"full's own workers without sharing (computed: each bound worker with its own backbone copy, "
            f"not capped at this run's GPUs): {tg['gpu_seconds_unshared_same_workers']:.1f} GPU-s; full "
            f"holds {_pct(tg['gpu_seconds_reduction_same_workers'])} less (want ≥ 90%)"
        )
    tp = Table(title="Throughput at the replayed rate (paper Table 2 is a saturation test: shape only)")
    for col in ("config", "tokens/s", "requests/s", "peak in flight", "fns decoding p50", "TPOT per fn"):
        tp.add_column(col, justify="left" if col == "config" else "right")
    for run in report["configs"]:
        if not run.get("unavailable"):
            th = run["throughput"]
            dc = run.get("decode_concurrency") or {}  # (absent from reports written before it)
            tp.add_row(
                run["config"],
                f"{th['tokens_per_s']:.1f}",
                f"{th['requests_per_s']:.2f}",
                str(th["peak_in_flight"]),
                "-" if dc.get("functions_p50") is None else f"{dc['functions_p50']:g}",
                _ms(dc.get("ms_per_function")),
            )
    for name, row in cmp["paper_table2"].items():
        tp.add_row(
            f"paper: {name}",
            str(row["tokens_per_s"]),
            str(row["requests_per_s"]),
            f"batch {row['peak_batch']}",
            "",
            "",
        )
    tp.caption = (
        "fns decoding: functions generating tokens at once, at the middle of each request's decode; TPOT per"
        " fn: the median of TPOT ÷ that count (each function's worker reads the whole backbone per step)"
    )
    tp.caption_justify = "left"
    console.print(tp)
