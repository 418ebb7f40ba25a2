"""The report across configurations: comparison, merging runs split over several commands, rendering."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from lorafn.replay.cli import app
from lorafn.replay.report import compare, config_figures, render, window_line
from lorafn.replay.run import merge_reports, rename_configs
from lorafn.replay.stats import MiB, RequestResult, Sample, WorkerSample

# a report written before warm-ups existed (commit 5918dfd, H100, full and no-sharing): no warm-up fields
OLD_REPORT = Path(__file__).resolve().parents[2] / "docs" / "img" / "replay-h100-5918dfd" / "replay.json"


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
    # full's workers without sharing (computed): 100 MiB + their own 100 MiB copy, as the shared run's 200
    assert "without sharing (computed" in text and "2.0 GPU-s; full holds 0% less" in text


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
    assert [m["left_out"] for m in merged["merged_from"]] == [[], ["full"]]
    # one configuration at two settings: renamed, both stay
    both = merge_reports([rename_configs(a, {"full": "parked-function"}), b])
    assert [(c["config"], c["n"]) for c in both["configs"]] == [
        ("parked-function", 1),
        ("full", 2),
        ("no-sharing", 3),
    ]
    assert a["configs"][0]["config"] == "full"  # the input is left as it was
    with pytest.raises(ValueError, match="no configuration \\['always-on'\\]"):
        rename_configs(a, {"always-on": "x"})
    with pytest.raises(ValueError, match="two configurations one name"):
        rename_configs(b, {"full": "no-sharing"})
    with pytest.raises(ValueError, match="workload differs"):
        merge_reports([a, {**b, "workload": {**wl, "requests": 5}}])
    with pytest.raises(ValueError, match="usd_per_gpu_hour differs"):
        merge_reports([a, {**b, "usd_per_gpu_hour": 3.0}])
    with pytest.raises(ValueError, match="none given"):
        merge_reports([])


def _workload(warmup_s: float = 0.0, warmup_requests: int = 0) -> dict:
    return {"trace": "code", "workload_class": "normal", "interarrival_cov": 1.1, "requests": 4,
            "duration_s": 10.0, "functions": 1, "plan_options": {"seed": 0, "warmup_s": warmup_s},
            "warmup_s": warmup_s, "warmup_requests": warmup_requests,
            "warmup_functions_used": min(1, warmup_requests),
            "window": {"trace_s": [600.0, 612.5], "warmup_trace_s": [590.0, 600.0], "factor": 0.8},
            }  # fmt: skip


def test_a_warmed_run_says_so_in_its_tables_and_shows_the_warmup_apart() -> None:
    warm = [
        RequestResult(-1, "a/x", -2.0, -2.0, 200, True, "r", 7777, 8000, 10, 4, path="fresh", warmup=True)
    ]
    window = [RequestResult(i, "a/x", i, i, 200, False, "r", 120, 400, 10, 4) for i in range(4)]
    samples = [Sample(-2.0, []), Sample(0.0, [WorkerSample("w", "serving", "a/x", "g0", "bb", 100 * MiB)])]
    figures = config_figures(
        warm + window, samples, 10.0, {"a/x": 1000.0}, {"g0": 1000 * MiB}, {"bb": 100 * MiB}, True, 0, 3.6
    )
    run = {"config": "full", **figures}
    report = {"workload": _workload(10.0, 1), "configs": [run], "comparison": compare([run])}
    out = io.StringIO()
    render(report, Console(file=out, width=200))
    text = out.getvalue()
    assert "measured window 10 s after a 10 s warm-up" in text
    words = " ".join(text.split())  # the caption under the table wraps at its width
    assert "Warm-up before it: 10 s, 1 requests (trace 590-600 s)" in words
    (lat_warm, res_warm) = [line for line in text.splitlines() if "warm-up " in line and "│" in line]
    assert "7,777" in lat_warm and "100%" in lat_warm  # its TTFT, over the 1000 ms SLO
    cells = [c.strip() for c in res_warm.split("│")]
    # warm, unparked, join, standby, fresh, queued: one fresh
    assert cells[1:8] == ["warm-up", "0", "0", "0", "0", "1", "0"]
    # without a warm-up the tables say the window starts cold, and there is no warm-up row
    cold_run = {"config": "full", **config_figures(
        window, samples[1:], 10.0, {"a/x": 1000.0}, {"g0": 1000 * MiB}, {"bb": 100 * MiB}, True, 0, 3.6
    )}  # fmt: skip
    out = io.StringIO()
    render({"workload": _workload(), "configs": [cold_run], "comparison": compare([cold_run])},
           Console(file=out, width=200))  # fmt: skip
    text = out.getvalue()
    assert "from a cold start, no warm-up" in " ".join(text.split())
    assert not [line for line in text.splitlines() if "warm-up" in line and "│" in line]
    assert window_line({"duration_s": 60, "requests": 9}).startswith("Measured window: 60 s, 9 requests. No")


def test_merge_reads_a_report_older_than_warmups_as_one_without() -> None:
    old_workload = {k: v for k, v in _workload().items() if not k.startswith("warmup") and k != "window"}
    old_workload["plan_options"] = {"seed": 0}
    old = {"workload": old_workload, "usd_per_gpu_hour": 2.0, "configs": [{"config": "full"}]}
    new = {"workload": _workload(), "usd_per_gpu_hour": 2.0, "configs": [{"config": "always-on"}]}
    assert [c["config"] for c in merge_reports([old, new])["configs"]] == ["full", "always-on"]
    warmed = {**new, "workload": _workload(120.0, 480)}
    with pytest.raises(ValueError, match="workload differs"):
        merge_reports([old, warmed])


@pytest.mark.skipif(not OLD_REPORT.exists(), reason="the committed H100 report is absent")
def test_bench_report_merges_files_written_before_warmups(tmp_path: Path) -> None:
    old = json.loads(OLD_REPORT.read_text())
    assert "warmup_s" not in old["workload"] and all("warmup" not in c for c in old["configs"])
    files = []
    for c in old["configs"]:  # one file per configuration, as the device runs write them
        path = tmp_path / f"{c['config']}.json"
        path.write_text(json.dumps({**old, "configs": [c]}))
        files.append(str(path))
    done = CliRunner().invoke(app, ["report", *files, "--out", str(tmp_path / "merged")], terminal_width=200)
    assert done.exit_code == 0, done.output
    merged = json.loads((tmp_path / "merged" / "replay.json").read_text())
    assert [c["config"] for c in merged["configs"]] == [c["config"] for c in old["configs"]]
    # decode concurrency, absent from the old report, is computed from its request records on merging
    assert all("decode_concurrency" not in c for c in old["configs"])
    full = next(c for c in merged["configs"] if c["config"] == "full")
    assert full["decode_concurrency"]["ms_per_function"] > 0 and full["decode_concurrency"]["bins"]
    assert "TPOT per fn" in done.output
    assert "from a cold start, no warm-up" in " ".join(done.output.split())
    assert not [line for line in done.output.splitlines() if "warm-up" in line and "│" in line]
    assert (tmp_path / "merged" / "workers_memory.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.skipif(not OLD_REPORT.exists(), reason="the committed H100 report is absent")
def test_bench_report_renames_a_configuration_run_twice(tmp_path: Path) -> None:
    old = json.loads(OLD_REPORT.read_text())
    full = next(c for c in old["configs"] if c["config"] == "full")
    files = []
    for n in (1, 2):  # the same configuration in two files (two settings, say)
        path = tmp_path / f"run{n}.json"
        path.write_text(json.dumps({**old, "configs": [full]}))
        files.append(str(path))
    kept = CliRunner().invoke(
        app, ["report", *files, "--out", str(tmp_path / "a"), "--no-plots"], terminal_width=200
    )
    assert kept.exit_code == 0, kept.output
    assert "run2.json: configuration 'full' left out" in " ".join(kept.output.split())
    args = [
        "report",
        *files,
        "--out",
        str(tmp_path / "b"),
        "--no-plots",
        "--rename",
        "1:full=parked-function",
    ]
    both = CliRunner().invoke(app, args, terminal_width=200)
    assert both.exit_code == 0, both.output
    merged = json.loads((tmp_path / "b" / "replay.json").read_text())
    assert [c["config"] for c in merged["configs"]] == ["parked-function", "full"]
    assert "left out" not in both.output
    for bad in ("3:full=x", "1:full", "full=x", "x:full=y"):
        refused = CliRunner().invoke(app, ["report", *files, "--no-plots", "--rename", bad])
        assert refused.exit_code != 0 and "--rename" in refused.output, (bad, refused.output)


def test_the_workers_plot_marks_the_window_start_after_a_warmup() -> None:
    from lorafn.replay.plots import WINDOW_START_LABEL, workers_figure

    series = {"t_s": [-5.0, 0.0, 5.0], "bound": [3, 1, 1], "standby": [0, 1, 1], "held_mib": [900, 400, 400]}
    runs = [{"config": "full", "series": series}]
    for warmup_s, marked in ((5.0, True), (0.0, False)):
        fig = workers_figure({"workload": {"warmup_s": warmup_s}, "configs": runs})
        for ax in fig.axes:
            lines = [ln for ln in ax.get_lines() if ln.get_label() == WINDOW_START_LABEL]
            assert len(lines) == int(marked)
            if marked:
                assert list(lines[0].get_xdata()) == [0.0, 0.0]
