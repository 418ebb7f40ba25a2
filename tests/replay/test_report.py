"""The report across configurations: comparison, merging runs split over several commands, rendering."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from lorafn.replay.report import compare, config_figures, render
from lorafn.replay.run import merge_reports
from lorafn.replay.stats import MiB, RequestResult, Sample, WorkerSample


def _run(name: str, ttft: float, e2e: float, mem_mib: int) -> dict:
    results = [RequestResult(i, "a/x", i, i, 200, i == 0, "r", ttft, e2e, 10, 4) for i in range(4)]
    samples = [Sample(0.0, [WorkerSample("w", "serving", "a/x", "g0", "bb", mem_mib * MiB)])]
    figures = config_figures(
        results, samples, 10.0, {"a/x": 1000.0}, {"g0": 1000 * MiB}, {"bb": 100 * MiB}, True, 0, 3.6
    )
    return {"config": name, **figures, "requests": [r.to_json() for r in results]}


def test_figures_and_cost_effectiveness_against_always_on() -> None:
    full = _run("full", 100, 400, 100)  # (100 + 100 backbone) / 1000 of a GPU for 10 s = 2 GPU-s
    assert full["gpu_seconds"] == pytest.approx(2.0)
    assert full["cost_usd"] == pytest.approx(2.0 / 3600 * 3.6)
    assert full["peak_held_mib"] == pytest.approx(200)
    always = _run("always-on", 50, 800, 700)  # 8 GPU-s, twice the E2E: 8× less cost-effective
    cmp = compare([full, always, {"config": "no-slo-admission", "unavailable": "no gpu_admission"}])
    assert cmp["cost_effectiveness_baseline"] == "always-on"
    assert cmp["cost_effectiveness"]["full"] == pytest.approx(8.0)
    assert cmp["cost_effectiveness"]["always-on"] == pytest.approx(1.0)
    assert "no-slo-admission" not in cmp["cost_effectiveness"]
    report = {
        "workload": {"trace": "code", "workload_class": "bursty", "interarrival_cov": 13.0, "requests": 4,
                     "duration_s": 10.0, "functions": 1},
        "configs": [full, always, {"config": "no-slo-admission", "unavailable": "no gpu_admission"}],
        "comparison": cmp,
    }  # fmt: skip
    out = io.StringIO()
    render(report, Console(file=out, width=160))
    text = out.getvalue()
    assert "n/a: no gpu_admission" in text and "8.00×" in text and "ServerlessLoRA Table 3" in text


def test_merge_reports_keeps_one_workload_and_the_first_run_of_each_config() -> None:
    wl = {"trace": "code", "requests": 4, "trace_file": "/a/code.csv"}
    a = {"workload": wl, "usd_per_gpu_hour": 2.0, "configs": [{"config": "full", "n": 1}], "date": "d1"}
    b = {
        "workload": {**wl, "trace_file": "/b/code.csv"},  # another machine's path: still one replay
        "usd_per_gpu_hour": 2.0,
        "configs": [{"config": "full", "n": 2}, {"config": "no-sharing", "n": 3}],
        "comparison": {},
    }
    merged = merge_reports([a, b])
    assert [(c["config"], c["n"]) for c in merged["configs"]] == [("full", 1), ("no-sharing", 3)]
    assert [m["configs"] for m in merged["merged_from"]] == [["full"], ["full", "no-sharing"]]
    with pytest.raises(ValueError, match="workload differs"):
        merge_reports([a, {**b, "workload": {**wl, "requests": 5}}])
    with pytest.raises(ValueError, match="usd_per_gpu_hour differs"):
        merge_reports([a, {**b, "usd_per_gpu_hour": 3.0}])
    with pytest.raises(ValueError, match="none given"):
        merge_reports([])
