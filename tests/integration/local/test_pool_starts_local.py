"""`lorafn up` on CPU, real processes: the warm pool's standbys warm up one at a time (what the host's cores
warm at once), never beside a request waiting for its function's first worker, and every process that
computes runs with OpenMP's passive wait. The README demo on the 2-core VM had four standbys warming at
once, with demo/french's fresh worker started beside them: its first token after 16.7 s (docs/benchmarks.md,
"The README demo"). Asserted on the order of the starts in the logs, not on times."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.integration.local.platform_helpers import check_start_order, invoke, local_platform, zygote_environ
from tests.integration.runtime.engine_helpers import write_peft_adapter

pytestmark = pytest.mark.slow

# room for every standby the pool may want (the backbone's maxStandby, 4) and both functions' workers:
# memory must not be what limits the starts here
ROOMY_CPU = "device: cpu\ndevices: 1\ndevice_memory_mib: 2048\nworker_overhead_mib: 64\ndefault_kv_mib: 16\n"


def test_cold_requests_go_first_and_standbys_warm_one_at_a_time(tiny_model_dir: Path, tmp_path: Path) -> None:
    small = write_peft_adapter(
        tiny_model_dir, tmp_path / "a", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]
    )
    wide = write_peft_adapter(tiny_model_dir, tmp_path / "b", r=8, lora_alpha=16, target_modules="all-linear")
    with local_platform(tmp_path, ROOMY_CPU + "gateway_port: 0\n", cold_start_timeout_s=60) as platform:
        if "OMP_WAIT_POLICY" not in os.environ:
            assert zygote_environ(platform.state_dir).get("OMP_WAIT_POLICY") == "PASSIVE"
        # the backbone's default warm pool (minStandby 1, maxStandby 4) and the default cold prior: with the
        # limits off, a standby of each shape started at once, and more once a request arrived
        docs = [
            "apiVersion: lorafn.io/v1alpha1\nkind: Backbone\nmetadata: {name: tiny}\n"
            f"spec: {{model: {{uri: 'file://{tiny_model_dir}'}}, dtype: float32}}\n"
        ]
        for name, adapter in (("fa", small), ("fb", wide)):
            docs.append(
                "apiVersion: lorafn.io/v1alpha1\nkind: LoRAFunction\n"
                f"metadata: {{name: {name}, namespace: t}}\n"
                f"spec: {{backbone: tiny, adapter: {{uri: 'file://{adapter}'}}, "
                "scaling: {keepAliveSeconds: 300}, slo: {ttftMs: 2000}}\n"
            )
        platform.apply(docs, [None, "key-fa", "key-fb"], tmp_path)
        # at once, as the demo does: the pool is starting its first standby
        for name in ("t/fa", "t/fa", "t/fb", "t/fb"):
            done = invoke(platform.state_dir, name, f"key-{name[2:]}")
            assert done.returncode == 0, done.stderr
            assert "total " in done.stderr, f"{name} did not complete: {done.stderr!r}"
    check_start_order(platform.log, platform.state_dir / "logs")
