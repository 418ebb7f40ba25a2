"""`lorafn bench replay` for real on CPU: `lorafn up` per configuration (real processes, real redis-server),
the tiny random model, 3 functions, a few seconds of the code trace (after a warm-up of the trace before it)
through the real gateway over HTTP. Every planned request ends as an answer or an explicit error, the
warm-up's apart from the window's; the JSON and the plots are written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lorafn.replay.cli import default_data_dir
from lorafn.replay.stats import PATHS

pytestmark = pytest.mark.slow

DATA = default_data_dir()


def _piped_env() -> dict[str, str]:
    """This environment less COLUMNS, as a device run's script has it (pytest's children inherit
    COLUMNS=80): output to a pipe then gets tables wide enough to keep every column."""
    return {k: v for k, v in os.environ.items() if k != "COLUMNS"}


@pytest.mark.skipif(not (DATA / "azure_llm_2023_code.csv").exists(), reason="no shared trace data")
def test_replay_on_cpu_accounts_for_every_request(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run(
        [
            sys.executable, "-m", "lorafn.cli", "bench", "replay", "--device", "cpu",
            "--model", str(tiny_model_dir), "--functions", "3", "--rate", "2", "--duration", "4",
            # from 300 s: 8 requests over 0.6 s of trace (×6.3), and before them 4 in the 3 s of warm-up
            "--trace-start", "300", "--warmup-s", "3", "--max-prompt-tokens", "16",
            "--max-output-tokens", "4", "--configs", "full,no-warm-pool", "--adapters", "2",
            "--settle-timeout", "120",
            # a relative --out, as a user types it: the adapters' file:// URIs under it must come out absolute
            "--drain-timeout", "120", "--sample-interval", "0.25", "--out", "out",
        ],
        capture_output=True, text=True, timeout=500, env=_piped_env(), cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # 3 functions over 2 adapters, each in a directory of its own: no shared-adapter warning
    assert "can read the other's adapter" not in done.stdout + done.stderr
    report = json.loads((out / "replay.json").read_text())
    for name in ("ttft_cdf.png", "workers_memory.png", "slo_violations.png"):
        png = out / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert report["workload"]["requests"] == 8
    num_warmup = report["workload"]["warmup_requests"]
    assert num_warmup == 4 and report["workload"]["warmup_s"] == 3
    assert [c["config"] for c in report["configs"]] == ["full", "no-warm-pool"]
    for run in report["configs"]:
        assert not run.get("unavailable"), run
        requests = run["requests"]
        assert sorted(r["index"] for r in requests) == list(range(8))
        for r in requests:
            assert r["e2e_ms"] is not None and r["sent_s"] is not None
            if r["error"] is None:  # an answer: status 200, a first token, usage counted
                assert r["status"] == 200 and r["ttft_ms"] is not None and r["completion_tokens"] >= 1
            else:
                assert r["error"].strip()
            assert r["path"] in PATHS
        overall = run["summary"]["overall"]
        assert overall["answered"] + overall["errors"] == 8
        assert overall["answered"] >= 1, overall  # the platform served
        assert run["gpu_seconds"] > 0 and run["series"]["t_s"]
        # the warm-up: sent before the window (negative times), each ended, none in the window's figures
        warmup = run["warmup_requests"]
        assert sorted(r["index"] for r in warmup) == list(range(-num_warmup, 0))
        assert all(r["warmup"] and r["scheduled_s"] < 0 and r["e2e_ms"] is not None for r in warmup)
        assert all(not r["warmup"] for r in requests)
        assert run["warmup"]["summary"]["overall"]["requests"] == num_warmup
        assert min(run["series"]["t_s"]) < 0 <= max(run["series"]["t_s"])
    # the runs differ where they should: without a warm pool no cold start binds a standby
    no_pool = report["configs"][1]["summary"]["overall"]["paths"]
    assert "standby" not in no_pool, no_pool
    assert "Latency per configuration" in done.stdout and "ServerlessLoRA Table 3" in done.stdout
    assert "after a 3 s warm-up" in " ".join(done.stdout.split())
    # a warm-up row under each configuration in both tables, whole (not cut at 80 columns)
    rows = [line for line in done.stdout.splitlines() if "│" in line and "warm-up" in line]
    assert len(rows) == 4 and all("%" in row for row in rows[:2]), rows


@pytest.mark.skipif(not (DATA / "azure_llm_2023_code.csv").exists(), reason="no shared trace data")
def test_replay_drives_a_running_platform_by_url(tiny_model_dir: Path, tmp_path: Path) -> None:
    """--gateway-url + --keys + --redis-url: one row, SLOs read from the registry, workers sampled."""
    from lorafn.replay.configs import CONFIGS
    from lorafn.replay.platform import FunctionSetup, ManagedPlatform, manifest, new_keys, prepare_adapters

    functions = ["replay/f000", "replay/f001"]
    adapters = prepare_adapters(tiny_model_dir, tmp_path / "adapters", 1, 4, ["q_proj", "v_proj"])
    keys = new_keys(functions)
    platform = ManagedPlatform(tmp_path / "platform", {"device": "cpu"})
    try:
        state = platform.start()
        platform.apply(
            manifest(tiny_model_dir, "float32", functions, adapters, keys, FunctionSetup(777, 60, 2),
                     CONFIGS["full"], False)
        )  # fmt: skip
        (tmp_path / "keys.json").write_text(json.dumps(keys))
        out = tmp_path / "out"
        done = subprocess.run(
            [
                sys.executable, "-m", "lorafn.cli", "bench", "replay", "--gateway-url", state.gateway_url,
                "--keys", str(tmp_path / "keys.json"), "--redis-url", state.redis_url,
                "--functions", "2", "--rate", "1", "--duration", "3", "--max-prompt-tokens", "16",
                "--max-output-tokens", "4", "--drain-timeout", "120", "--no-plots", "--out", str(out),
            ],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    finally:
        platform.stop()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "replay.json").read_text())
    (run,) = report["configs"]
    assert run["config"] == "external"
    assert len(run["requests"]) == 3
    assert all(r["error"] is None or r["error"].strip() for r in run["requests"])
    assert run["summary"]["overall"]["answered"] >= 1
    # each function's own spec.slo.ttftMs (777), not --slo-ms's default
    assert {f["slo_ttft_ms"] for f in run["summary"]["functions"].values()} == {777.0}
    assert run["series"]["t_s"] and not list(out.glob("*.png"))
