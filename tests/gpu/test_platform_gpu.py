"""The serverless core on a GPU, as real processes: `lorafn up --device cuda` with the llama-2-7b preset and
two functions on its one backbone, each with its own KV budget (`spec.resources`). Both serve; each worker's
KV cache is its budget (never the GPU's free memory: the bug that once gave one worker 52 GB); workers report
their whole process's GPU memory as the driver counts it, and the controller sizes new workers from it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import torch

from lorafn.runtime.config import ModelConfig
from lorafn.runtime.lora import write_random_adapter
from tests.integration.local.platform_helpers import invoke, lorafn, wait_for, workers

pytestmark = pytest.mark.gpu

MiB = 1 << 20
DEFAULT_STANDBY_KV_MIB = 256  # controller.snapshot.default_sizing("cuda").default_kv_bytes


def test_process_bytes_reads_this_process_from_the_driver() -> None:
    from lorafn.runtime.gpu_memory import process_bytes

    device = torch.device("cuda", torch.cuda.current_device())
    torch.zeros(1, device=device)
    # memory torch's allocator cached for earlier tests in this process would take the block without the
    # driver seeing a new allocation (it failed so after the whole GPU suite, seventh session)
    torch.cuda.empty_cache()
    before = process_bytes(device)
    assert before is not None and before > 0, "NVML does not list this process on its GPU"
    block = torch.empty(512 * MiB, dtype=torch.uint8, device=device)
    after = process_bytes(device)
    assert after is not None and after - before >= 500 * MiB
    del block


def test_two_7b_functions_on_one_gpu_each_within_its_budget(llama7b_dir: Path, tmp_path: Path) -> None:
    mc = ModelConfig.from_dir(llama7b_dir)
    adapters = [
        write_random_adapter(
            mc,
            tmp_path / f"a{i}",
            rank=r,
            lora_alpha=2 * r,
            target_modules=targets,
            dtype=torch.bfloat16,
            seed=i,
        )
        for i, (r, targets) in enumerate([(16, "all-linear"), (8, ["q_proj", "v_proj"])])
    ]
    budgets_mib = {"g/one": 256, "g/two": 128}
    state_dir = tmp_path / "state"
    config = tmp_path / "up.yaml"
    config.write_text("device: cuda\ngateway_port: 0\n")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    up = subprocess.Popen(
        [sys.executable, "-m", "lorafn.cli", "up", "--config", str(config), "--state-dir", str(state_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    try:
        wait_for("platform.json", lambda: (state_dir / "platform.json").exists(), 300, up)
        state = json.loads((state_dir / "platform.json").read_text())
        r = redis.Redis.from_url(state["redis_url"], decode_responses=True)
        docs = [
            "apiVersion: lorafn.io/v1alpha1\nkind: Backbone\nmetadata: {name: llama7b}\n"
            f"spec: {{model: {{uri: 'file://{llama7b_dir}'}}, dtype: bfloat16, "
            "warmPool: {minStandby: 1, maxStandby: 2}}\n"
        ]
        for (name, kv_mib), adapter in zip(budgets_mib.items(), adapters, strict=True):
            docs.append(
                "apiVersion: lorafn.io/v1alpha1\nkind: LoRAFunction\n"
                f"metadata: {{name: {name.split('/')[1]}, namespace: g}}\n"
                f"spec: {{backbone: llama7b, adapter: {{uri: 'file://{adapter}'}}, "
                f"resources: {{kvCacheMiB: {kv_mib}}}, scaling: {{keepAliveSeconds: 600}}}}\n"
            )
        for i, doc in enumerate(docs):
            manifest = tmp_path / f"doc{i}.yaml"
            manifest.write_text(doc)
            applied = lorafn(
                "apply", "-f", str(manifest), *(["--api-key", f"key-{i}"] if i else []), state_dir=state_dir
            )
            assert applied.returncode == 0, applied.stderr
        for i, name in enumerate(budgets_mib, start=1):
            done = invoke(state_dir, name, f"key-{i}")
            assert done.returncode == 0, done.stderr
            assert done.stdout.strip(), f"{name} answered with no text"
        bound = {h["function"]: h for h in workers(r).values() if h.get("state") == "serving"}
        assert set(budgets_mib) <= set(bound), bound
        free, total = torch.cuda.mem_get_info()
        for name, kv_mib in budgets_mib.items():
            h = bound[name]
            kv = int(h["kv_bytes"])
            # the KV cache is the function's budget, or the larger default one of the standby it was bound
            # to (the account charges what the worker holds), never sized from the GPU's free memory
            assert 0 < kv <= max(kv_mib, DEFAULT_STANDBY_KV_MIB) * MiB, (name, kv)
            assert h.get("mem_source") == "driver", h  # NVML saw the worker's own pid
            process = int(h["mem_bytes"])
            assert kv + int(h["lora_bytes"]) < process < 4096 * MiB, (name, process)
        assert free > total // 4, "two small-budget workers must leave most of the GPU free"
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=120)
        except subprocess.TimeoutExpired:
            up.kill()
            raise
        print(up.stdout.read() if up.stdout else "")
    assert up.returncode == 0
