"""Shared parts of the controller tests around a real redis-server: an executor that only records what it
is asked, a queued request with its demand record, and the commands a worker was sent."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from lorafn.controller.policy.actions import Start
from lorafn.controller.policy.model import GPU
from lorafn.store import Keys, Store, streams, workers
from lorafn.store.backbones import BackboneRecord, put_backbone
from lorafn.store.protocol import RequestBody
from lorafn.store.registry import FunctionRecord, put_function
from tests.unit.operator._peft import write_adapter, write_backbone


class RecordingExecutor:
    """The controller's hands, recording starts; one 8 GiB GPU holding backbone "tiny" unless told."""

    def __init__(self, gpus: list[GPU] | None = None) -> None:
        self.started: list[Start] = []
        self._gpus = gpus if gpus is not None else [GPU("g0", "n", 8 << 30, {"tiny": 0})]

    def gpus(self) -> list[GPU]:
        return self._gpus

    def start(self, action: Start, worker_id: str) -> None:
        self.started.append(action)

    def stop(self, worker_id: str) -> None:
        pass

    def starting(self) -> list:
        return []

    def exits(self) -> list:
        return []


def queue_request(store: Store, keys: Keys, function: str, rid: str) -> None:
    """A request in ``function``'s stream and the demand record the gateway writes when no worker has it."""
    store.run(
        streams.admit(
            keys, function, rid, RequestBody(prompt="hi"), deadline_ms=0, now_s=time.time(),
            rate_limit_rps=0.0, rate_limit_burst=1, heartbeat_ttl_ms=5000,
        )
    )  # fmt: skip
    store.run(streams.record_demand(keys, function, "request", guard_ms=1))


def commands(store: Store, keys: Keys, worker_id: str) -> list[dict[str, str]]:
    """Every command on ``worker_id``'s control stream, oldest first."""
    return [body for _id, body in store.run(workers.read_control(keys, worker_id, "0-0"))]


def register_tiny(
    store: Store,
    keys: Keys,
    tmp_path: Path,
    functions: dict[str, dict[str, Any]],
    warm_pool: tuple[int, int] = (1, 2),
    weights_bytes: int = 8,
) -> Path:
    """Backbone "tiny" (a real config, a weights file of `weights_bytes`, sparse) with the warm pool
    (min, max), and each function of `functions` (name -> extra spec fields) with its own PEFT adapter;
    the model directory."""
    model = write_backbone(tmp_path / "tiny")
    with open(model / "model.safetensors", "wb") as f:
        f.truncate(weights_bytes)  # st_size is what the controller reads
    bb_spec = {
        "model": {"uri": f"file://{model}"},
        "warmPool": {"minStandby": warm_pool[0], "maxStandby": warm_pool[1]},
    }
    store.run(put_backbone(keys, BackboneRecord("tiny", str(model), "float32", bb_spec)))
    for name, extra in functions.items():
        adapter = write_adapter(tmp_path / name.replace("/", "-"))
        spec = {"backbone": "tiny", "adapter": {"uri": f"file://{adapter}"}, **extra}
        store.run(put_function(keys, FunctionRecord(name, spec, str(model), str(adapter))))
    return model


def tiny_controller(
    store: Store, keys: Keys, tmp_path: Path, function: str, spec: dict[str, Any], policy: Any, kv_bytes: int
) -> Any:
    """A controller deciding with ``policy`` (and no warm pool) over one 8 GiB GPU holding backbone "tiny" and
    one function of it (``spec``: extra spec fields), whose workers' KV budget is ``kv_bytes`` by default."""
    from lorafn.controller.driver import Controller, ControllerConfig
    from lorafn.controller.snapshot import SizingConfig

    register_tiny(store, keys, tmp_path, {function: spec}, warm_pool=(0, 0))
    executor = RecordingExecutor([GPU("g0", "n", 8 << 30, {"tiny": 0})])
    sizing = SizingConfig(worker_overhead_bytes=1 << 20, default_kv_bytes=kv_bytes)
    return Controller(store, keys, executor, sizing, ControllerConfig(holder="me", policy=policy))
