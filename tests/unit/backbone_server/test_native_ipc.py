"""The native extension builds and imports without a GPU; without a driver it says why, clearly."""

from __future__ import annotations

import pytest


def test_extension_imports_and_reports_the_driver() -> None:
    ipc = pytest.importorskip("lorafn._ipc", reason="extension not built (pip install -e .)")
    assert issubclass(ipc.CudaError, RuntimeError)
    if ipc.available():
        assert ipc.driver_version() > 0
        assert ipc.device_uuid(0).startswith("GPU-")
    else:
        reason = ipc.unavailable_reason()
        assert "libcuda" in reason or "cuInit" in reason
        with pytest.raises(ipc.CudaError, match=r"libcuda|cuInit"):
            ipc.import_map(0, [3], [2 << 20], 0x1000_0000_0000)
        with pytest.raises(ipc.CudaError):
            ipc.create_exportable(0, [2 << 20])


def test_client_refuses_cuda_without_a_driver(tmp_path) -> None:
    ipc = pytest.importorskip("lorafn._ipc")
    if ipc.available():
        pytest.skip("a CUDA driver is present")
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    from lorafn.backbone_server.client import SharedWeightSource

    with pytest.raises(RuntimeError, match="CUDA driver is not usable"):
        SharedWeightSource(tmp_path / "none.sock", device="cuda:0", connect_timeout_s=0.1)
