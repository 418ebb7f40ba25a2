"""gpu_memory: a device resolves to its NVML UUID once, and every reading goes by that UUID."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lorafn.runtime import gpu_memory


def test_cuda_uuid_is_none_off_cuda_and_the_devices_uuid_on_it(monkeypatch) -> None:
    torch = pytest.importorskip("torch")
    asked: list[object] = []
    monkeypatch.setattr(gpu_memory, "device_uuid", lambda device: asked.append(device) or "GPU-7")
    assert gpu_memory.cuda_uuid(None) is None
    assert gpu_memory.cuda_uuid(torch.device("cpu")) is None
    assert asked == []  # a CPU device never asks torch for CUDA properties
    cuda = SimpleNamespace(type="cuda")
    assert gpu_memory.cuda_uuid(cuda) == "GPU-7" and asked == [cuda]


def test_device_readings_go_by_the_uuid_and_are_none_without_one(monkeypatch) -> None:
    monkeypatch.setattr(gpu_memory, "cuda_uuid", {"dev0": "GPU-0"}.get)
    monkeypatch.setattr(gpu_memory, "process_bytes_on", {"GPU-0": 123}.get)
    monkeypatch.setattr(gpu_memory, "device_free_bytes_on", {"GPU-0": 456}.get)
    assert gpu_memory.process_bytes("dev0") == 123
    assert gpu_memory.device_free_bytes("dev0") == 456
    assert gpu_memory.process_bytes("cpu") is None and gpu_memory.device_free_bytes("cpu") is None


def test_readings_by_uuid_are_none_without_nvml_or_device(monkeypatch) -> None:
    monkeypatch.setattr(gpu_memory, "_nvml", lambda: None)
    gpu_memory._handle.cache_clear()
    try:
        assert gpu_memory._nvml_device("GPU-0") is None
        assert gpu_memory.process_bytes_on("GPU-0") is None
        assert gpu_memory.device_free_bytes_on("GPU-0") is None
    finally:
        gpu_memory._handle.cache_clear()
