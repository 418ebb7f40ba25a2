"""Cross-function GPU admission as real processes: `lorafn up` on CPU (one simulated device), three warm
functions with different TTFT SLOs, the same burst of requests to all three over real HTTP, once with
admission and once without. Every request is answered (nothing lost, no entry left pending), the
device's prefill budget was granted to each function, every grant made while several workers waited
went to the smallest deadline margin, and shares were released right after their steps. The tight
function's TTFT p99 with and without admission is printed, not asserted (a timing: `bench/admission.py`
compares them)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import yaml

from lorafn.replay.driver import DriveOptions, Target, drive
from lorafn.replay.platform import ManagedPlatform, new_keys
from lorafn.replay.trace import PlannedRequest
from lorafn.store import admission as adm
from lorafn.store import streams
from tests.integration.runtime.engine_helpers import write_peft_adapter

pytestmark = pytest.mark.slow

SLOS = {"adm/tight": 100, "adm/mid": 1000, "adm/loose": 20_000}


def _manifest(model_dir: Path, adapters: list[Path], keys: dict[str, str]) -> str:
    docs: list[dict[str, Any]] = [
        {
            "apiVersion": "lorafn.io/v1alpha1", "kind": "Backbone", "metadata": {"name": "tiny"},
            "spec": {"model": {"uri": f"file://{model_dir}"}, "dtype": "float32",
                     "warmPool": {"minStandby": 0, "maxStandby": 0}},
        },
        {
            "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "keys", "namespace": "adm"},
            "stringData": {fn.split("/")[1]: key for fn, key in keys.items()},
        },
    ]  # fmt: skip
    for (fn, slo), adapter in zip(SLOS.items(), adapters, strict=True):
        name = fn.split("/")[1]
        docs.append(
            {
                "apiVersion": "lorafn.io/v1alpha1", "kind": "LoRAFunction",
                "metadata": {"name": name, "namespace": "adm"},
                "spec": {
                    "backbone": "tiny", "adapter": {"uri": f"file://{adapter}"}, "slo": {"ttftMs": slo},
                    "scaling": {"minReplicas": 1, "maxReplicas": 1, "keepAliveSeconds": 600},
                    "auth": {"apiKeySecretRef": {"name": "keys", "key": name}},
                },
            }
        )  # fmt: skip
    return yaml.safe_dump_all(docs, sort_keys=False)


def _burst(
    tiny_model_dir: Path, adapters: list[Path], workdir: Path, admission: bool
) -> tuple[list[Any], list[adm.Grant], list[adm.Release]]:
    """One `lorafn up` (admission on or off), the three functions warm, then the same burst of 24."""
    functions = list(SLOS)
    settings = {"device": "cpu", "devices": 1, "warm_pool": False, "gpu_admission": admission}
    # a budget of about one prompt: the burst's prefills take turns (2048, the default, would let them
    # all run at once on two cores, like no admission)
    platform = ManagedPlatform(workdir, settings, env={"LORAFN_GPU_PREFILL_TOKENS": "96"})
    keys = new_keys(functions)
    try:
        state = platform.start(timeout_s=180)
        platform.apply(_manifest(tiny_model_dir, adapters, keys))
        settled = platform.settle(functions, 1, want_standby=False, shared=True, timeout_s=240)
        assert settled.get("settled"), (settled, platform.log_tail())
        target = Target(state.gateway_url, keys, state.redis_url, state.key_prefix)
        options = DriveOptions(request_timeout_s=180, drain_timeout_s=180)
        warm = [PlannedRequest(i, 0.05 * i, fn, "Hello there.", 4, 4) for i, fn in enumerate(functions * 2)]
        assert all(r.ok for r in asyncio.run(drive(warm, target, options)).results)
        prompt = "The quick brown fox jumps over the lazy dog. " * 6
        burst = [PlannedRequest(i, 0.01 * i, functions[i % len(functions)], prompt, 60, 8) for i in range(24)]
        done = asyncio.run(drive(burst, target, options))
        assert platform.store is not None
        for fn in functions:  # nothing left pending
            assert platform.store.run(streams.pending(platform.keys, fn, 0)) == []
        grants = platform.store.run(adm.grants(platform.keys, "local/0"))
        releases = platform.store.run(adm.releases(platform.keys, "local/0"))
        return done.results, grants, releases
    finally:
        platform.stop()


def test_three_slos_under_a_burst_take_turns_by_margin_and_lose_nothing(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    functions = list(SLOS)
    adapters = [
        write_peft_adapter(
            tiny_model_dir, tmp_path / f"a{i}", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], seed=i
        )
        for i in range(len(functions))
    ]
    on, grants, releases = _burst(tiny_model_dir, adapters, tmp_path / "on", admission=True)
    off, no_grants, _ = _burst(tiny_model_dir, adapters, tmp_path / "off", admission=False)
    for results in (on, off):  # nothing lost: every request answered with tokens
        assert all(r.ok for r in results), [r.error for r in results if not r.ok]
        assert all(r.completion_tokens for r in results)
    assert no_grants == []  # switched off: nobody asked

    assert {g.function for g in grants} == set(functions)
    contested = [g for g in grants if g.runner_up_ms is not None]
    assert contested, "the burst never had two workers waiting for the budget at once"
    for g in contested:
        assert g.margin_ms <= g.runner_up_ms, g
    timed = [r for r in releases if r.late_ms is not None]  # (a share kept for the next step has none)
    assert timed and all(r.late_ms < 500 for r in timed)  # released right after its step

    def p99(results: list[Any], fn: str) -> float:
        ttfts = sorted(r.ttft_ms for r in results if r.function == fn)
        return ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))]

    # Shown, not asserted: which run's tight p99 is lower is a timing on a shared CI machine (it failed
    # there once, 5802 vs 1847 ms: the project keeps timed assertions out of tests); bench/admission.py
    # measures it side by side, and the ordering by margin above is what admission must guarantee.
    tight = "adm/tight"
    print(f"tight TTFT p99: {p99(on, tight):.0f} ms with admission, {p99(off, tight):.0f} ms without")
