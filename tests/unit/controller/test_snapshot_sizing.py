"""A worker's overhead is learned from what live workers report (the driver's count of their process),
and function sizes follow it; real Redis, heartbeats written as workers write them."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from lorafn.api.sizing import MiB
from lorafn.controller.policy.model import GPU
from lorafn.controller.snapshot import OVERHEAD_MARGIN_BYTES, SizingConfig, SnapshotReader, learned_overhead
from lorafn.store import Keys, Store, workers


def test_learned_overhead_is_the_largest_report_plus_a_margin():
    assert learned_overhead([], 560 * MiB) == 560 * MiB  # nobody reports: the configured figure
    assert learned_overhead([0, -5], 560 * MiB) == 560 * MiB  # nonsense reports are not learned from
    assert learned_overhead([300 * MiB, 420 * MiB], 560 * MiB) == 420 * MiB + OVERHEAD_MARGIN_BYTES
    assert learned_overhead([900 * MiB], 560 * MiB, margin_bytes=0) == 900 * MiB  # up as well as down


@pytest.fixture
def reader(redis_server: str):
    store = Store(redis_server)
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    yield SnapshotReader(
        store, keys, SizingConfig(worker_overhead_bytes=560 * MiB, default_kv_bytes=64 * MiB), 5.0
    )
    store.close()


def _beat(reader: SnapshotReader, wid: str, state: str, function: str | None, **fields) -> None:
    base = {"gpu": "g0", "backbone": "llama", "state": state, "started": 1}
    reader.store.run(workers.heartbeat(reader.keys, wid, function, 5000, {**base, **fields}))


def test_driver_reports_replace_the_configured_overhead(reader: SnapshotReader, tmp_path: Path) -> None:
    gpus = [GPU("g0", "n", 80 << 30)]
    reader.read(gpus, [])
    assert reader.overhead_bytes == 560 * MiB
    # an allocator-only report (no NVML) teaches nothing; a starting worker's figure is not final yet
    _beat(reader, "w-alloc", "serving", "ns/a", mem_bytes=200 * MiB, kv_bytes=64 * MiB, lora_bytes=40 * MiB)
    _beat(
        reader,
        "w-new",
        "starting",
        "ns/b",
        mem_bytes=999 * MiB,
        kv_bytes=0,
        lora_bytes=0,
        mem_source="driver",
    )
    reader.read(gpus, [])
    assert reader.overhead_bytes == 560 * MiB
    # a standby and a bound worker as the driver counts them: the larger one's overhead, plus the margin
    _beat(
        reader,
        "w-s",
        "standby",
        None,
        mem_bytes=450 * MiB,
        kv_bytes=64 * MiB,
        lora_bytes=0,
        mem_source="driver",
    )
    _beat(
        reader, "w-b", "serving", "ns/a",
        mem_bytes=520 * MiB, kv_bytes=64 * MiB, lora_bytes=40 * MiB, mem_source="driver",
    )  # fmt: skip
    snapshot = reader.read(gpus, [])
    assert reader.overhead_bytes == (520 - 64 - 40) * MiB + OVERHEAD_MARGIN_BYTES
    # the standby costs the learned overhead + the default KV budget (no shape: no LoRA buffers)
    assert snapshot.costs.default_standby_bytes == reader.overhead_bytes + 64 * MiB
