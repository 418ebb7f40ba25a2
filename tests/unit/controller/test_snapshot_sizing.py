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


def test_settled_bound_workers_are_charged_their_own_size(reader: SnapshotReader, tmp_path: Path) -> None:
    """A bound GPU worker whose decode graphs are captured pays its own driver-counted size + the margin
    (never below its peers' settled floor); one with graphs pending, or an older runtime that does not say,
    pays the learned overhead as before; the device's free memory of the latest heartbeat reaches the GPU."""
    from tests.unit.controller.redis_world import register_tiny

    register_tiny(reader.store, reader.keys, tmp_path, {"ns/a": {}, "ns/b": {}, "ns/c": {}}, warm_pool=(0, 0))
    kv, lora = 64 * MiB, 0  # the sizes the reports claim (the tiny adapter's own LoRA is not needed here)
    big = kv + lora + 900 * MiB  # the largest: learned overhead = 900 MiB + margin

    def beat(wid: str, fn: str, whole: int, pending: str | None, free: int, at: int) -> None:
        extra = {"graphs_pending": pending} if pending is not None else {}
        _beat(
            reader, wid, "serving", fn, mem_bytes=whole, kv_bytes=kv, lora_bytes=lora, mem_source="driver",
            device_free_bytes=free, heartbeat=at, **extra,
        )  # fmt: skip

    now_ms = reader.store.run(workers.server_time_ms())
    beat("w-settled", "ns/a", kv + 600 * MiB, "0", 30 << 30, now_ms - 500)
    beat("w-pending", "ns/b", kv + 500 * MiB, "1", 31 << 30, now_ms - 200)  # the latest reading
    beat("w-old", "ns/c", big, None, 29 << 30, now_ms - 900)
    # on g1 a worker the driver does not count (a container hiding host pids): no guard there
    _beat(
        reader, "w-hidden", "serving", "ns/a", gpu="g1", mem_bytes=kv, kv_bytes=kv, lora_bytes=lora,
        device_free_bytes=9 << 30,
    )  # fmt: skip
    snapshot = reader.read([GPU("g0", "n", 80 << 30, {"tiny": 0}), GPU("g1", "n", 80 << 30, {"tiny": 0})], [])
    assert snapshot.gpus[1].driver_free_bytes is None
    learned = 900 * MiB + OVERHEAD_MARGIN_BYTES
    assert reader.overhead_bytes == learned
    # one settled report (fewer than a quantile needs): the floor is its own overhead
    assert reader.floor_overhead_bytes == 600 * MiB
    by_id = {w.id: w for w in snapshot.workers}
    size_a = reader.sizes["ns/a"]
    assert size_a.overhead_bytes == learned
    assert by_id["w-settled"].mem_bytes == kv + 600 * MiB + OVERHEAD_MARGIN_BYTES < size_a.mem_bytes
    assert by_id["w-pending"].mem_bytes == reader.sizes["ns/b"].mem_bytes  # the learned charge
    assert by_id["w-old"].mem_bytes == max(big, reader.sizes["ns/c"].mem_bytes)
    assert by_id["w-settled"].reported_bytes == kv + 600 * MiB
    assert snapshot.gpus[0].driver_free_bytes == 31 << 30


def test_long_arrival_rate_counts_ten_minutes_of_buckets(reader: SnapshotReader, tmp_path: Path) -> None:
    import time

    from lorafn.controller.snapshot import LONG_ARRIVAL_WINDOW_S
    from lorafn.store.stats import ARRIVALS_BUCKET_S
    from tests.unit.controller.redis_world import register_tiny

    register_tiny(reader.store, reader.keys, tmp_path, {"ns/a": {}}, warm_pool=(0, 0))
    last = int(time.time() // ARRIVALS_BUCKET_S)
    # 3 arrivals now, 12 five minutes ago, 100 eleven minutes ago (beyond the horizon)
    for bucket, count in ((last, 3), (last - 30, 12), (last - 66, 100)):
        reader.store.client.set(reader.keys.arrivals("ns/a", bucket), count)
    # (a bucket that begins before the read shifts every window by one: the same counts fall inside)
    (f,) = reader.read([GPU("g0", "n", 80 << 30, {"tiny": 0})], []).functions
    assert f.arrival_rate == pytest.approx(3 / 60)
    assert f.long_arrival_rate == pytest.approx(15 / LONG_ARRIVAL_WINDOW_S)
