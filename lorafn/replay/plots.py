"""PNG plots of a replay (matplotlib, the `bench` extra): TTFT CDF per configuration, workers and memory
held over time, SLO violations per function. Each function takes the report's JSON-ready dict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

WINDOW_START_LABEL = "measured window starts"


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("the plots need matplotlib: pip install 'lorafn[bench]' (or --no-plots)") from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def _legend(ax: Any, ncol: int = 1) -> None:
    if ax.get_legend_handles_labels()[0]:  # a run with nothing to draw has no legend entries
        ax.legend(fontsize=7, ncol=ncol)


def _runs(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in report["configs"] if not r.get("unavailable")]


def ttft_cdf(report: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in _runs(report):
        ttft = np.sort(
            [r["ttft_ms"] for r in run["requests"] if r["error"] is None and r["ttft_ms"] is not None]
        )
        if ttft.size:
            ax.step(ttft, np.arange(1, ttft.size + 1) / ttft.size, where="post", label=run["config"])
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms, log scale)")
    ax.set_ylabel("fraction of answered requests")
    ax.set_title(
        f"TTFT CDF: {report['workload']['trace']} trace, {report['workload']['functions']} functions"
    )
    ax.grid(True, which="both", alpha=0.3)
    _legend(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def workers_figure(report: dict[str, Any]) -> Any:
    """The figure of `workers_over_time` (returned open, for tests to read its lines)."""
    plt = _pyplot()
    fig, (ax_w, ax_m) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    for run in _runs(report):
        series = run.get("series") or {}
        t = series.get("t_s") or []
        if not t:
            continue
        (line,) = ax_w.plot(t, series["bound"], label=f"{run['config']} bound")
        ax_w.plot(
            t, series["standby"], linestyle="--", color=line.get_color(), label=f"{run['config']} standby"
        )
        ax_m.plot(t, np.asarray(series["held_mib"]) / 1024, color=line.get_color(), label=run["config"])
    warmup_s = report["workload"].get("warmup_s") or 0
    if warmup_s > 0:  # times run from the window's start: the warm-up is the negative part
        for ax in (ax_w, ax_m):
            ax.axvline(0.0, color="black", linewidth=1, linestyle=":", label=WINDOW_START_LABEL)
        ax_m.set_xlabel(f"seconds since the measured window's start (before it: the {warmup_s:g} s warm-up)")
    else:
        ax_m.set_xlabel("seconds since the first arrival")
    ax_w.set_ylabel("workers")
    ax_w.set_title("workers (bound solid, standby dashed) and memory held on the devices")
    _legend(ax_w, ncol=2)
    ax_m.set_ylabel("memory held (GiB)")
    _legend(ax_m)
    for ax in (ax_w, ax_m):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    return fig


def workers_over_time(report: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    fig = workers_figure(report)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def slo_violations(report: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    runs = _runs(report)
    functions = sorted({fn for run in runs for fn in run["summary"]["functions"]})
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(functions) * max(1, len(runs)) ** 0.5 + 3), 4.5))
    width = 0.8 / max(1, len(runs))
    x = np.arange(len(functions))
    for i, run in enumerate(runs):
        rates = [
            100 * run["summary"]["functions"].get(fn, {}).get("slo_violation_rate", 0.0) for fn in functions
        ]
        ax.bar(x + i * width - 0.4 + width / 2, rates, width, label=run["config"])
    ax.set_xticks(x, [fn.split("/", 1)[-1] for fn in functions], rotation=60, fontsize=7)
    ax.set_ylabel("SLO violations (% of the function's requests)")
    ax.set_title("TTFT SLO violations per function (functions by popularity, most popular first)")
    ax.grid(True, axis="y", alpha=0.3)
    _legend(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_plots(report: dict[str, Any], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        ttft_cdf(report, out_dir / "ttft_cdf.png"),
        workers_over_time(report, out_dir / "workers_memory.png"),
        slo_violations(report, out_dir / "slo_violations.png"),
    ]
