"""Cross-function GPU admission as real processes: `lorafn up` on CPU (one simulated device), three warm
functions with different TTFT SLOs, a burst of requests to all three over real HTTP. Every request is
answered (nothing lost, no entry left pending), the device's prefill slot was granted to each function,
and every grant made while several workers waited went to the smallest deadline margin. (Whether the
tight function's TTFT gets better is a timing question: `bench/admission.py` measures it.)"""

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
    settings = {"device": "cpu", "devices": 1, "warm_pool": False, "gpu_admission": True}
    platform = ManagedPlatform(tmp_path / "up", settings)
    keys = new_keys(functions)
    try:
        state = platform.start(timeout_s=180)
        platform.apply(_manifest(tiny_model_dir, adapters, keys))
        settled = platform.settle(functions, 1, want_standby=False, shared=True, timeout_s=240)
        assert settled.get("settled"), (settled, platform.log_tail())
        target = Target(state.gateway_url, keys, state.redis_url, state.key_prefix)
        options = DriveOptions(request_timeout_s=180, drain_timeout_s=180)
        prompt = "The quick brown fox jumps over the lazy dog. " * 6
        burst = [PlannedRequest(i, 0.01 * i, functions[i % len(functions)], prompt, 60, 8) for i in range(24)]
        done = asyncio.run(drive(burst, target, options))
        assert all(r.ok for r in done.results), [r.error for r in done.results if not r.ok]
        assert all(r.completion_tokens for r in done.results)

        assert platform.store is not None
        grants = platform.store.run(adm.grants(platform.keys, "local/0"))
        assert {g.function for g in grants} == set(functions)
        contested = [g for g in grants if g.runner_up_ms is not None]
        assert contested, "the burst never had two workers waiting for the slot at once"
        for g in contested:
            assert g.margin_ms <= g.runner_up_ms, g
        for fn in functions:
            assert platform.store.run(streams.pending(platform.keys, fn, 0)) == []
    finally:
        platform.stop()
