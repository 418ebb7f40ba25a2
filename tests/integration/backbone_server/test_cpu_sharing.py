"""CPU mode, real processes: one backbone server, three probe workers mapping its sealed memfd PROT_READ."""

from __future__ import annotations

import json
import signal
import socket
import struct
import time
import urllib.request
from pathlib import Path

import pytest

from lorafn.backbone_server import protocol as proto
from tests.integration.backbone_server.helpers import Probe, ServerProc, file_digest, write_model

NUM_WORKERS = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # ~24 MB float32 in 2 shards: large enough that the weights dominate the workers' shared memory
    d = tmp_path_factory.mktemp("cpu_model")
    write_model(d, layers=4, hidden=512, vocab=4096, dtype="float32", shards=2)
    return d


@pytest.fixture()
def server(model_dir: Path, tmp_path: Path):
    srv = ServerProc(
        model_dir,
        tmp_path / "bb.sock",
        "cpu",
        "--http-port",
        "0",
        "--lease-ttl",
        "5",
        "--heartbeat-interval",
        "1",
    )
    srv.wait_ready(120)
    yield srv
    srv.stop()


def _probes(sock: Path, n: int = NUM_WORKERS) -> list[Probe]:
    probes = [Probe(sock, "cpu", f"w{i}") for i in range(n)]
    for p in probes:
        p.wait_attached(120)
    return probes


def _http_port(srv: ServerProc) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for line in srv.output().splitlines():
            if "health endpoint on http://" in line:
                return int(line.rsplit(":", 1)[1].split()[0])
        time.sleep(0.05)
    raise AssertionError(srv.output())


def _backbone_mapping_kib(pid: int) -> dict[str, int]:
    """Rss/Pss (KiB) of the backbone memfd mapping in process `pid`, from /proc/pid/smaps."""
    out = {"Rss": 0, "Pss": 0, "mappings": 0}
    inside = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                inside = "lorafn-backbone" in line
                out["mappings"] += inside
            elif inside and head and head[0] in ("Rss:", "Pss:"):
                out[head[0][:-1]] += int(head[1])
    return out


def test_three_workers_see_the_file_contents(server: ServerProc, model_dir: Path) -> None:
    want = file_digest(model_dir)
    probes = _probes(server.sock)
    try:
        assert {p.ask("digest")["digest"] for p in probes} == {want}
    finally:
        for p in probes:
            p.close()


def test_in_process_source_equals_safetensors(server: ServerProc, model_dir: Path) -> None:
    import torch
    from safetensors.torch import load_file

    from lorafn.backbone_server.client import SharedWeightSource
    from lorafn.runtime.weights import WeightSource

    want: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        want.update(load_file(str(f)))
    with SharedWeightSource(server.sock, device="cpu") as src:
        assert isinstance(src, WeightSource)
        assert src.read_only()
        assert sorted(src.names()) == sorted(want) == sorted(src)
        for name, t in want.items():
            got = src.get(name, "cpu", t.dtype)
            assert torch.equal(got, t), name
            assert got.data_ptr() % 256 == 0
        # no copy: two gets are the same memory
        n = "lm_head.weight"
        assert src.get(n, "cpu", torch.float32).data_ptr() == src.get(n, "cpu", torch.float32).data_ptr()
        # another dtype is a private converted copy
        assert src.get(n, "cpu", torch.float64).dtype == torch.float64
        with pytest.raises(KeyError, match="nope"):
            src.get("nope", "cpu", torch.float32)


def test_write_kills_only_the_writer(server: ServerProc, model_dir: Path) -> None:
    want = file_digest(model_dir)
    probes = _probes(server.sock)
    try:
        writer = probes[0]
        assert writer.ask("write model.norm.weight")["event"] == "writing"
        with pytest.raises(EOFError):
            writer.read(60)
        assert writer.proc.wait(30) == -signal.SIGSEGV
        for p in probes[1:]:
            assert p.ask("digest")["digest"] == want
        extra = _probes(server.sock, 1)[0]  # the server still serves
        assert extra.ask("digest")["digest"] == want
        extra.close()
    finally:
        for p in probes:
            p.close()


def test_weights_are_in_memory_once(server: ServerProc, model_dir: Path) -> None:
    probes = _probes(server.sock)
    try:
        for p in probes:
            p.ask("digest")  # touch every page of W
        info = [p.ask("info") for p in probes]
        size_kib = sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) // 1024
        maps = [_backbone_mapping_kib(i["pid"]) for i in info]
        for m in maps:
            assert m["mappings"] == 1
            assert m["Rss"] >= 0.95 * size_kib  # each worker sees all of W ...
        total_pss = sum(m["Pss"] for m in maps)
        # ... but the three together are charged for one copy (Pss splits shared pages among mappers)
        assert 0.9 * size_kib <= total_pss <= 1.1 * size_kib, (maps, size_kib)
        # smaps_rollup agrees: each worker's Pss_Shmem is about a third of W
        for i in info:
            assert i["mem_kib"].get("Pss_Shmem", 0) <= 0.5 * size_kib
        # the server no longer maps W at all (sealed memfd; workers hold the only mappings)
        assert _backbone_mapping_kib(server.proc.pid)["mappings"] == 0
    finally:
        for p in probes:
            p.close()


def test_server_exit_keeps_workers_and_removes_socket(model_dir: Path, tmp_path: Path) -> None:
    want = file_digest(model_dir)
    srv = ServerProc(model_dir, tmp_path / "bb.sock", "cpu", "--heartbeat-interval", "0.5")
    srv.wait_ready(120)
    probes = _probes(srv.sock, 2)
    try:
        assert srv.stop(signal.SIGTERM) == 0
        assert not srv.sock.exists()
        assert "shutting down" in srv.output()
        for p in probes:
            assert p.ask("sleep 1.5")["event"] == "slept"  # heartbeats fail meanwhile
            assert p.ask("digest")["digest"] == want
    finally:
        for p in probes:
            p.close()


def test_metrics_health_and_leases(server: ServerProc) -> None:
    port = _http_port(server)
    base = f"http://127.0.0.1:{port}"
    assert urllib.request.urlopen(base + "/healthz").status == 200
    ready = json.loads(urllib.request.urlopen(base + "/readyz").read())
    assert ready["ready"] is True and ready["mode"] == "cpu"
    probes = _probes(server.sock, 2)
    try:
        time.sleep(2.5)  # a couple of heartbeats
        text = urllib.request.urlopen(base + "/metrics").read().decode()
        assert "lorafn_backbone_attached_workers 2.0" in text
        assert "lorafn_backbone_attaches_total 2.0" in text
        assert "lorafn_backbone_bytes_loaded" in text and "lorafn_backbone_load_seconds" in text
        assert "lorafn_backbone_heartbeats_total" in text
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(server.sock))
            stats = proto.request(s, "stats")[0]["stats"]
        assert {lease["pid"] for lease in stats["leases"]} == {p.proc.pid for p in probes}
        assert all(lease["since_heartbeat_s"] < 2.5 for lease in stats["leases"])
    finally:
        probes[0].proc.kill()  # a crash: its lease ends when its socket closes
        probes[0].proc.wait()
        probes[0].close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        text = urllib.request.urlopen(base + "/metrics").read().decode()
        if "lorafn_backbone_attached_workers 1.0" in text:
            break
        time.sleep(0.1)
    assert "lorafn_backbone_attached_workers 1.0" in text
    assert 'lorafn_backbone_detaches_total{reason="disconnected"} 1.0' in text
    probes[1].close()


def test_lease_expires_without_heartbeats(server: ServerProc) -> None:
    """A worker that hangs (no heartbeat within the 5 s TTL) loses its lease; its mapping is unaffected."""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(server.sock))
        reply, fds = proto.request(s, "attach", max_fds=8, worker={"mode": "cpu", "pid": 1, "name": "hung"})
        for fd in fds:
            import os

            os.close(fd)
        assert reply["lease_ttl_s"] == 5
        time.sleep(6.0)
        with socket.socket(socket.AF_UNIX) as s2:
            s2.connect(str(server.sock))
            assert proto.request(s2, "stats")[0]["stats"]["leases"] == []
    assert "expired" in server.output()


def test_garbage_and_dying_clients_do_not_hurt_the_server(server: ServerProc, model_dir: Path) -> None:
    def raw(data: bytes, read: bool = True) -> dict | None:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(str(server.sock))
            s.sendall(data)
            if not read:
                return None
            return proto.recv_message(s, proto.MAX_REPLY_BYTES)[0]

    assert raw(struct.pack(">I", 0xFFFFFFFF))["error"]["code"] == "message_too_large"
    assert raw(struct.pack(">I", 5) + b"\xff\xfe{]x")["error"]["code"] == "bad_json"
    assert (
        raw(proto.encode({"v": 99, "op": "hello"})[:4] + proto.encode({"v": 99, "op": "hello"})[4:])["error"][
            "code"
        ]
        == "protocol_version"
    )
    assert raw(proto.encode({"v": 1, "op": "launch"}))["error"]["code"] == "unknown_op"
    assert raw(proto.encode({"v": 1, "op": "attach"}))["error"]["code"] == "bad_request"
    assert (
        raw(proto.encode({"v": 1, "op": "attach", "worker": {"mode": "cuda", "gpu_uuid": "GPU-x"}}))["error"][
            "code"
        ]
        == "mode_mismatch"
    )
    assert raw(proto.encode({"v": 1, "op": "heartbeat", "lease_id": "x"}))["error"]["code"] == "unknown_lease"
    assert raw(b"[1,2,3]"[:0] + struct.pack(">I", 7) + b"[1,2,3]")["error"]["code"] == "bad_message"
    raw(b"\x00\x00", read=False)  # dies mid-header
    raw(struct.pack(">I", 100) + b'{"v":1,', read=False)  # dies mid-message
    raw(proto.encode({"v": 1, "op": "attach", "worker": {"mode": "cpu"}}), read=False)  # dies mid-handshake
    raw(bytes(range(256)) * 64, read=False)  # noise
    # and a real worker still gets the right bytes; no stale lease is left behind
    p = _probes(server.sock, 1)[0]
    try:
        assert p.ask("digest")["digest"] == file_digest(model_dir)
        time.sleep(0.5)
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(server.sock))
            leases = proto.request(s, "stats")[0]["stats"]["leases"]
        assert [lease["pid"] for lease in leases] == [p.proc.pid]
    finally:
        p.close()
    assert server.proc.poll() is None


@pytest.mark.parametrize("damage", ["missing_dir", "truncated", "bad_header", "missing_shard"])
def test_server_refuses_bad_model_dirs(tmp_path: Path, damage: str) -> None:
    d = tmp_path / "m"
    write_model(d, layers=1, hidden=32, vocab=64, dtype="float32", shards=2)
    shard = d / "model-00002-of-00002.safetensors"
    if damage == "missing_dir":
        d = tmp_path / "nowhere"
        expect = "nowhere"
    elif damage == "truncated":
        data = shard.read_bytes()
        shard.write_bytes(data[: len(data) - 100])
        expect = shard.name
    elif damage == "bad_header":
        data = bytearray(shard.read_bytes())
        data[8:12] = b"\x00\x01\x02\x03"
        shard.write_bytes(bytes(data))
        expect = shard.name
    else:
        shard.unlink()
        expect = shard.name
    srv = ServerProc(d, tmp_path / "bb.sock", "cpu")
    with pytest.raises(RuntimeError) as ei:
        srv.wait_ready(60)
    srv.stop()
    assert "server exited with 2" in str(ei.value) and "error: cannot serve" in str(ei.value)
    assert expect in str(ei.value)
    assert not (tmp_path / "bb.sock").exists()


def test_tokens_equal_an_engine_with_its_own_copy(tiny_model_dir: Path, tmp_path: Path) -> None:
    from lorafn.backbone_server.client import SharedWeightSource
    from lorafn.runtime import Engine, EngineConfig, SamplingParams

    srv = ServerProc(tiny_model_dir, tmp_path / "bb.sock", "cpu")
    srv.wait_ready(120)
    try:
        prompts = ["Hello, my name is", "The capital of France", "1 2 3 4"]
        params = SamplingParams(max_tokens=12, temperature=0.0)
        own = Engine(EngineConfig(model=tiny_model_dir, device="cpu", dtype="float32"))
        want = [o.token_ids for o in own.generate(prompts, params)]
        src = SharedWeightSource(srv.sock, device="cpu")
        shared = Engine(EngineConfig(model=tiny_model_dir, device="cpu", dtype="float32", weight_source=src))
        got = [o.token_ids for o in shared.generate(prompts, params)]
        assert got == want
        src.close()
    finally:
        srv.stop()
