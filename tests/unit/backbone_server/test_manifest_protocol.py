"""Unit tests: model-directory checks, layout, content hash, wire protocol (no server process)."""

from __future__ import annotations

import json
import os
import socket
import struct
from pathlib import Path

import pytest

from lorafn.backbone_server import protocol as proto
from lorafn.backbone_server.manifest import (
    ALIGNMENT,
    ModelDirError,
    content_hash,
    contiguous_stride,
    open_model_dir,
    plan_layout,
    split_segments,
)
from tests.integration.backbone_server.helpers import write_model


@pytest.fixture()
def model(tmp_path: Path) -> Path:
    write_model(tmp_path / "m", layers=1, hidden=32, vocab=64, dtype="bfloat16", shards=2)
    return tmp_path / "m"


def test_open_model_dir_reads_every_tensor(model: Path) -> None:
    m = open_model_dir(model)
    assert len(m.files) == 2
    names = [t.name for t in m.tensors]
    assert len(names) == len(set(names)) == 12
    assert m.total_bytes == sum(t.nbytes for t in m.tensors)


def test_layout_is_aligned_and_disjoint(model: Path) -> None:
    m = open_model_dir(model)
    lay = plan_layout(m)
    spans = sorted((lay.offsets[t.name], lay.offsets[t.name] + t.nbytes) for t in m.tensors)
    assert all(a % ALIGNMENT == 0 for a, _ in spans)
    assert all(spans[i][1] <= spans[i + 1][0] for i in range(len(spans) - 1))
    assert lay.used_bytes == spans[-1][1]


def test_split_segments() -> None:
    g = 2 << 20
    assert split_segments(1, 0, g) == [g]
    assert split_segments(5 * g + 1, 2 * g, g) == [2 * g, 2 * g, 2 * g]
    assert split_segments(4 * g, 3 * g + 5, g) == [3 * g, g]
    assert contiguous_stride((2, 3, 4)) == [12, 4, 1] and contiguous_stride(()) == []


def test_content_hash_covers_headers_and_config(model: Path) -> None:
    h1 = content_hash(open_model_dir(model))
    assert h1.startswith("blake2b-256-headers:")
    assert content_hash(open_model_dir(model)) == h1
    cfg = json.loads((model / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-6
    (model / "config.json").write_text(json.dumps(cfg))
    assert content_hash(open_model_dir(model)) != h1
    assert content_hash(open_model_dir(model), full=True).startswith("blake2b-256-full:")


def _corrupt(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "short":
        path.write_bytes(bytes(data[:5]))
    elif how == "huge_header_len":
        path.write_bytes(struct.pack("<Q", 1 << 40) + bytes(data[8:]))
    elif how == "not_json":
        data[8] = ord("x")
        path.write_bytes(bytes(data))
    elif how == "truncated":
        path.write_bytes(bytes(data[:-7]))
    elif how == "bad_offsets":
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n])
        name = next(k for k in header if k != "__metadata__")
        header[name]["data_offsets"][1] += 2
        hb = json.dumps(header).encode()
        path.write_bytes(struct.pack("<Q", len(hb)) + hb + bytes(data[8 + n :]))
    elif how == "bad_dtype":
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n])
        name = next(k for k in header if k != "__metadata__")
        header[name]["dtype"] = "C64"
        hb = json.dumps(header).encode()
        path.write_bytes(struct.pack("<Q", len(hb)) + hb + bytes(data[8 + n :]))


@pytest.mark.parametrize(
    "how", ["short", "huge_header_len", "not_json", "truncated", "bad_offsets", "bad_dtype"]
)
def test_corrupt_files_are_refused_naming_the_file(model: Path, how: str) -> None:
    shard = model / "model-00001-of-00002.safetensors"
    _corrupt(shard, how)
    with pytest.raises(ModelDirError, match=r"model-00001-of-00002\.safetensors"):
        open_model_dir(model)


def test_directory_level_errors(model: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelDirError, match="does not exist"):
        open_model_dir(tmp_path / "none")
    (model / "config.json").rename(model / "config.bak")
    with pytest.raises(ModelDirError, match=r"config\.json: missing"):
        open_model_dir(model)
    (model / "config.bak").rename(model / "config.json")
    index = json.loads((model / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.ghost.weight"] = "model-00001-of-00002.safetensors"
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelDirError, match=r"model\.ghost\.weight"):
        open_model_dir(model)
    (model / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelDirError, match="missing shard"):
        open_model_dir(model)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(ModelDirError, match=r"no \*\.safetensors"):
        open_model_dir(empty)


def test_protocol_round_trip_with_fds() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    r, w = os.pipe()
    try:
        import threading

        big = {"x": "y" * (3 << 20)}  # larger than one sendmsg: the rest follows the fds
        sender = threading.Thread(
            target=proto.send_message, args=(a, proto.ok(**big)), kwargs={"fds": [r, w]}
        )
        sender.start()
        msg, fds = proto.recv_message(b, proto.MAX_REPLY_BYTES, max_fds=4)
        sender.join()
        assert msg["ok"] and msg["x"] == big["x"] and len(fds) == 2
        os.write(fds[1], b"hi")
        assert os.read(r, 2) == b"hi"
        for fd in fds:
            os.close(fd)
        # fds beyond what the receiver accepts: refused, and none leaks
        proto.send_message(a, proto.ok(), fds=[r, w, r])
        with pytest.raises(proto.ProtocolError, match="too_many_fds"):
            proto.recv_message(b, proto.MAX_REPLY_BYTES, max_fds=1)
    finally:
        for fd in (r, w):
            os.close(fd)
        a.close()
        b.close()


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (struct.pack(">I", proto.MAX_REQUEST_BYTES + 1), "message_too_large"),
        (struct.pack(">I", 0), "bad_message"),
        (struct.pack(">I", 3) + b"\xff\xff\xff", "bad_json"),
        (struct.pack(">I", 2) + b"[]", "bad_message"),
        (proto.encode({"v": 2, "op": "hello"}), "protocol_version"),
    ],
)
def test_protocol_rejects_bad_messages(data: bytes, code: str) -> None:
    a, b = socket.socketpair()
    try:
        a.sendall(data)
        with pytest.raises(proto.ProtocolError) as ei:
            proto.recv_message(b)
        assert ei.value.code == code
    finally:
        a.close()
        b.close()


def test_peer_closing_mid_message() -> None:
    a, b = socket.socketpair()
    a.sendall(struct.pack(">I", 10) + b"{")
    a.close()
    with pytest.raises(proto.PeerClosed, match="mid-message"):
        proto.recv_message(b)
    b.close()
