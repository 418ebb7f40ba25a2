"""The heartbeat fields a worker places by, as the controller's snapshot reads them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lorafn.runtime.worker import WorkerSettings, placement_fields

MiB = 1 << 20


def test_a_worker_started_with_a_kv_budget_reports_the_grant_beside_its_cache() -> None:
    # the cache is whole KV blocks and comes out a little under the grant; the snapshot takes the larger
    runner = SimpleNamespace(memory_parts=lambda: (94 * MiB, 3 * MiB), device=None)
    engine = SimpleNamespace(lora_shape_key="q_proj:8", runner=runner)
    fields = placement_fields(WorkerSettings(gpu="g0", backbone="tiny", kv_budget_mib=96), engine)
    assert fields["kv_bytes"] == 94 * MiB and fields["kv_budget_bytes"] == 96 * MiB
    assert fields["shape"] == "q_proj:8" and fields["gpu"] == "g0"


def test_without_a_budget_no_grant_is_reported() -> None:
    engine = SimpleNamespace(lora_shape_key=None)
    assert "kv_budget_bytes" not in placement_fields(WorkerSettings(gpu="g0", backbone="tiny"), engine)


def test_a_driver_counted_worker_says_whether_graphs_are_pending_and_the_devices_free(monkeypatch) -> None:
    # what NVML would say (no GPU here): the process's bytes and the device's free bytes, both read by the
    # device's UUID, resolved once per heartbeat
    from lorafn.runtime import gpu_memory

    resolved: list[object] = []

    def cuda_uuid(device: object) -> str:
        resolved.append(device)
        return "GPU-0"

    monkeypatch.setattr(gpu_memory, "cuda_uuid", cuda_uuid)
    monkeypatch.setattr(gpu_memory, "process_bytes_on", {"GPU-0": 1409 * MiB}.get)
    monkeypatch.setattr(gpu_memory, "device_free_bytes_on", {"GPU-0": 17 << 30}.get)
    settings = WorkerSettings(gpu="g0", backbone="tiny", kv_budget_mib=512)
    for pending in (True, False):
        runner = SimpleNamespace(
            memory_parts=lambda: (504 * MiB, 80 * MiB), device="cuda:0", graphs_pending=pending
        )
        resolved.clear()
        fields = placement_fields(settings, SimpleNamespace(lora_shape_key="r16", runner=runner))
        assert resolved == ["cuda:0"]
        assert fields["mem_bytes"] == 1409 * MiB and fields["mem_source"] == "driver"
        assert fields["graphs_pending"] == int(pending)
        assert fields["device_free_bytes"] == 17 << 30
    # no driver figure (NVML cannot read the device; a CPU: no UUID, NVML not asked): neither field, the
    # controller keeps its learned charge and no guard
    monkeypatch.setattr(gpu_memory, "process_bytes_on", {}.get)
    monkeypatch.setattr(gpu_memory, "device_free_bytes_on", {}.get)
    fields = placement_fields(settings, SimpleNamespace(lora_shape_key="r16", runner=runner))
    assert not {"mem_source", "graphs_pending", "device_free_bytes"} & set(fields)
    monkeypatch.setattr(gpu_memory, "cuda_uuid", lambda device: None)
    monkeypatch.setattr(gpu_memory, "process_bytes_on", lambda uuid: pytest.fail("NVML read without a UUID"))
    monkeypatch.setattr(
        gpu_memory, "device_free_bytes_on", lambda uuid: pytest.fail("NVML read without a UUID")
    )
    fields = placement_fields(settings, SimpleNamespace(lora_shape_key="r16", runner=runner))
    assert not {"mem_source", "graphs_pending", "device_free_bytes"} & set(fields)


def test_a_worker_started_for_a_function_heartbeats_its_registered_backbone() -> None:
    from lorafn.runtime.worker import with_registered_backbone
    from lorafn.store.registry import FunctionRecord

    record = FunctionRecord("ns/f", {"backbone": "llama-2-7b"})
    fresh = with_registered_backbone(WorkerSettings(function="ns/f"), record)
    assert fresh.backbone == "llama-2-7b"
    assert (
        placement_fields(fresh, SimpleNamespace(lora_shape_key=None), memory=False)["backbone"]
        == "llama-2-7b"
    )
    named = WorkerSettings(function="ns/f", backbone="llama-2-7b")
    assert with_registered_backbone(named, record) is named
    # no registration (the worker then fails on its own terms) or none named in it: unchanged
    assert with_registered_backbone(WorkerSettings(function="ns/f"), None).backbone is None
    assert (
        with_registered_backbone(WorkerSettings(function="ns/f"), FunctionRecord("ns/f", {})).backbone is None
    )
    with pytest.raises(ValueError, match="registered on backbone 'llama-2-7b'"):
        with_registered_backbone(WorkerSettings(function="ns/f", backbone="other"), record)
