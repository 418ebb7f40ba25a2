"""GPU: one backbone on one GPU, mapped read-only at the fixed address W into eight worker processes.

Run on a machine with a CUDA GPU: `pytest -m gpu tests/gpu/test_backbone_ipc.py`.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.integration.backbone_server.helpers import Probe, ServerProc, file_digest, write_model

pytestmark = pytest.mark.gpu

W_ADDR = 0x1000_0000_0000
NUM_WORKERS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("gpu_model")
    # ~120 MB in 3 shards; 16 MiB segments force several VMM allocations (multi-segment import).
    write_model(d, layers=6, hidden=1024, vocab=8192, dtype="bfloat16", shards=3)
    return d


@pytest.fixture()
def server(model_dir: Path, tmp_path: Path):
    srv = ServerProc(model_dir, tmp_path / "bb.sock", "cuda:0", "--segment-mib", "16", "--http-port", "0")
    srv.wait_ready(180)
    yield srv
    srv.stop()


def _probes(sock: Path, n: int) -> list[Probe]:
    probes = [Probe(sock, "cuda:0", f"w{i}") for i in range(n)]
    for p in probes:
        p.wait_attached(180)
    return probes


def test_eight_workers_identical(server: ServerProc, model_dir: Path) -> None:
    want = file_digest(model_dir)
    probes = _probes(server.sock, NUM_WORKERS)
    try:
        digests = {p.ask("digest")["digest"] for p in probes}
        infos = [p.ask("info") for p in probes]
    finally:
        for p in probes:
            p.close()
    assert digests == {want}
    assert {i["w_addr"] for i in infos} == {W_ADDR}, "W must sit at the same fixed address in every worker"
    for i in infos:
        assert W_ADDR <= i["first_ptr"] < W_ADDR + (1 << 40)
        # the worker's own allocator holds no weight bytes (only the probe's small scratch)
        assert i["torch_allocated"] < 64 << 20, i


def test_write_into_w_faults_only_the_writer(server: ServerProc, model_dir: Path) -> None:
    want = file_digest(model_dir)
    probes = _probes(server.sock, NUM_WORKERS)
    try:
        writer, others = probes[0], probes[1:]
        assert writer.ask("write")["event"] == "writing"
        with pytest.raises(EOFError):
            writer.read(120)  # the writer dies; "wrote" must never come
        rc = writer.proc.wait(60)
        err = writer.stderr()
        assert rc != 0
        assert "illegal" in err.lower() or "CUDA error" in err, err[-2000:]
        for p in others:
            assert p.ask("digest")["digest"] == want
    finally:
        for p in probes:
            p.close()
    with socket.socket(socket.AF_UNIX) as s:  # the server is still up
        s.connect(str(server.sock))


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_server_exit_does_not_break_workers(model_dir: Path, tmp_path: Path, how: str) -> None:
    import signal

    want = file_digest(model_dir)
    srv = ServerProc(model_dir, tmp_path / "bb.sock", "cuda:0", "--segment-mib", "16")
    srv.wait_ready(180)
    probes = _probes(srv.sock, 3)
    try:
        srv.stop(getattr(signal, how))
        if how == "SIGTERM":
            assert not srv.sock.exists(), "the socket file must be removed on SIGTERM"
        for p in probes:
            assert p.ask("digest")["digest"] == want
        assert probes[0].ask("sleep 4")["event"] == "slept"  # heartbeats fail: still fine
        for p in probes:
            assert p.ask("digest")["digest"] == want
    finally:
        for p in probes:
            p.close()


def test_other_gpu_uuid_is_refused(server: ServerProc, monkeypatch: pytest.MonkeyPatch) -> None:
    from lorafn import _ipc
    from lorafn.backbone_server import protocol as proto
    from lorafn.backbone_server.client import SharedWeightSource

    fake = "GPU-00000000-1111-2222-3333-444444444444"
    # the raw protocol: the server checks the UUID the worker claims
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(server.sock))
        with pytest.raises(proto.RemoteError) as ei:
            proto.request(
                s, "attach", max_fds=proto.MAX_FDS, worker={"mode": "cuda", "gpu_uuid": fake, "pid": 1}
            )
    assert ei.value.code == "gpu_mismatch"
    assert fake in str(ei.value) and "GPU-" in ei.value.message
    # the real client on a (pretended) other GPU: a clear error, nothing mapped
    monkeypatch.setattr(_ipc, "device_uuid", lambda index: fake)
    with pytest.raises(proto.RemoteError, match="gpu_mismatch"):
        SharedWeightSource(server.sock, device="cuda:0")


def test_in_process_views_equal_the_files(server: ServerProc, model_dir: Path) -> None:
    import torch
    from safetensors.torch import load_file

    want: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        want.update(load_file(str(f)))
    from lorafn.backbone_server.client import SharedWeightSource

    src = SharedWeightSource(server.sock, device="cuda:0")
    try:
        assert src.read_only()
        assert src.map_seconds < 0.05, src.map_seconds
        assert sorted(src.names()) == sorted(want)
        for name, t in want.items():
            got = src.get(name, "cuda:0", t.dtype)
            assert got.is_cuda and W_ADDR <= got.data_ptr() < W_ADDR + src.manifest["mapped_bytes"]
            assert torch.equal(got.cpu(), t), name
        # a second mapping of W in the same process cannot take the same fixed address: loud error
        from lorafn._ipc import CudaError

        with pytest.raises(CudaError, match=r"fixed address|cuMemAddressReserve"):
            SharedWeightSource(server.sock, device="cuda:0")
        x = torch.randn(3, 1024, device="cuda:0", dtype=torch.bfloat16)
        y = x @ src.get("model.layers.0.self_attn.q_proj.weight", "cuda:0", torch.bfloat16).T
        ref = x @ want["model.layers.0.self_attn.q_proj.weight"].cuda().T
        assert torch.equal(y, ref)
    finally:
        src.close()


def test_eight_engines_on_one_backbone_give_identical_tokens(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Eight worker processes, each an Engine over the shared W; tokens equal an engine with its own copy."""
    import json

    from lorafn.runtime import Engine, EngineConfig, SamplingParams

    prompts = ["Hello, my name is", "The capital of France", "1 2 3 4"]
    own = Engine(
        EngineConfig(
            model=tiny_model_dir, device="cuda:0", dtype="float32", use_cuda_graphs=False, num_kv_blocks=64
        )
    )
    want = [list(o.token_ids) for o in own.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))]
    del own
    srv = ServerProc(tiny_model_dir, tmp_path / "bb.sock", "cuda:0")
    srv.wait_ready(180)
    probes = [Probe(srv.sock, "cuda:0", f"e{i}", "--engine", str(tiny_model_dir)) for i in range(NUM_WORKERS)]
    try:
        for p in probes:
            p.wait_attached(300)
        for p in probes:
            assert p.ask("generate " + json.dumps(prompts), 300)["tokens"] == want
        # one worker writes into W and dies; the other seven keep producing the same tokens
        probes[0].ask("write")
        with pytest.raises(EOFError):
            probes[0].read(120)
        for p in probes[1:]:
            assert p.ask("generate " + json.dumps(prompts), 300)["tokens"] == want
    finally:
        for p in probes:
            p.close()
        srv.stop()


@pytest.mark.parametrize("loader", ["hostreg", "staging"])
def test_both_gpu_loaders_give_the_file_bytes(model_dir: Path, tmp_path: Path, loader: str) -> None:
    srv = ServerProc(model_dir, tmp_path / "bb.sock", "cuda:0", "--loader", loader, "--chunk-mib", "8")
    srv.wait_ready(180)
    probes = _probes(srv.sock, 1)
    try:
        assert probes[0].ask("digest")["digest"] == file_digest(model_dir)
    finally:
        for p in probes:
            p.close()
        srv.stop()
    assert f"'loader': '{loader}'" in srv.output()
