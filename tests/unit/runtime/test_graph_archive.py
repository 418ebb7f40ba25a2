"""The graph archive's pure parts (issue 11 item 2): key refusals name the field, the file round-trips and
a corrupted or foreign file is refused, topology and pointer checks."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from lorafn.runtime import graph_archive as ga


def _key(**changes: object) -> dict:
    key = {
        "format_version": ga.FORMAT_VERSION,
        "gpu": "NVIDIA H100 80GB HBM3",
        "capability": "9.0",
        "driver": 13000,
        "cuda": "13.0",
        "torch": "2.11.0+cu130",
        "triton": "3.6.0",
        "code": "c0de",
        "model_layout": "1a70",
        "dtype": "bfloat16",
        "adapter_shape": "q_proj:16,v_proj:16",
        "fused_decode": True,
        "lora_expand": "per_projection",
        "skinny_gemm_rows": 16,
        "decode_attention": "simt",
        "expand_in_gemm": True,
        "gemm_prologue_rows": 0,
        "lora_shrink": "cublas",
        "rope_in_attention": False,
        "buckets": [1, 2, 4],
        "max_blocks_per_seq": 64,
        "block_size": 16,
        "num_kv_blocks": 512,
        "arena_base": 0x2000_0000_0000,
        "arena_reserved": 64 << 30,
        "weights_in": "arena",
    }
    key.update(changes)
    return key


def _archive() -> ga.Archive:
    kernel = ga.KernelNode(
        func=("module", "k-1"),
        name="_rms_norm_kernel",
        grid=(4, 1, 1),
        block=(128, 1, 1),
        shared=0,
        params=[(0x2000_0000_0000).to_bytes(8, "little"), b"\x01\x00\x00\x00", b""],
        attrs={4: bytes([1, 0, 0, 0]) + bytes(60)},
    )
    lib = ga.KernelNode(
        func=("name", "_ZN2at6native18elementwise_kernelE"),
        name="_ZN2at6native18elementwise_kernelE",
        grid=(1, 1, 1),
        block=(64, 1, 1),
        shared=16,
        params=[bytes(range(40))],
    )
    graph = ga.GraphRecord.from_nodes(
        bucket=2,
        nodes=[
            kernel,
            ga.MemsetNode(0x2000_0000_1000, 0, 7, 4, 16, 1),
            lib,
            ga.MemcpyNode({"WidthInBytes": 64, "srcDevice": 1, "dstDevice": 2}),
            ga.EmptyNode(),
        ],
        deps=[[], [0], [0, 1], [2], [3]],
        output=ga.TensorRef(0x2000_0010_0000, (2, 1024), (1024, 1), "float32"),
        selfcheck="abc",
    )
    return ga.Archive(
        key=_key(),
        layout={"state_top": 4 << 20, "state_log": [[0, 2 << 20], [2 << 20, 2 << 20]], "high_water": 8 << 20},
        modules={"k-1": ga.ModuleImage("_rms_norm_kernel", b"\x7fELF" + bytes(100), {"X": 1})},
        graphs=[graph],
        lib_func_attrs={
            "_ZN2at6native18elementwise_kernelE": {"CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES": 0}
        },
        info={"counts": {"triton": 1}},
    )


def test_a_key_that_differs_is_refused_naming_each_field() -> None:
    ga.check_key(_key(), _key())
    ga.check_key(json.loads(json.dumps(_key())), _key(buckets=(1, 2, 4)))  # a tuple equals its JSON list
    with pytest.raises(ga.ArchiveMismatch, match=r"driver: 13000 in the archive, 13010 here") as err:
        ga.check_key(_key(), _key(driver=13010))
    assert "torch" not in str(err.value)
    with pytest.raises(
        ga.ArchiveMismatch, match=r"adapter_shape: .*; num_kv_blocks: 512 in the archive, 256"
    ):
        ga.check_key(_key(), _key(adapter_shape="q_proj:8", num_kv_blocks=256))
    archived = _key()
    del archived["gpu"]
    with pytest.raises(ga.ArchiveMismatch, match=r"gpu: '<absent>' in the archive"):
        ga.check_key(archived, _key())
    current = _key()
    del current["triton"]
    with pytest.raises(ValueError, match=r"current key: fields \['triton'\] missing"):
        ga.check_key(_key(), current)


def test_key_digest_names_the_file_and_follows_every_field(tmp_path: Path) -> None:
    assert ga.key_digest(_key()) == ga.key_digest(_key(buckets=(1, 2, 4)))
    digests = {ga.key_digest(_key(**{f: "other"})) for f in ga.KEY_FIELDS}
    assert len(digests) == len(ga.KEY_FIELDS) and ga.key_digest(_key()) not in digests
    assert ga.archive_path(tmp_path, _key()) == tmp_path / "graphs" / f"{ga.key_digest(_key())}.lfgraph"


def test_an_archive_round_trips_through_a_file(tmp_path: Path) -> None:
    original = _archive()
    path = ga.write_archive(tmp_path / "a" / "x.lfgraph", original)
    back = ga.read_archive(path)
    assert back == original
    assert back.library_names() == {"_ZN2at6native18elementwise_kernelE"}
    assert back.graph(2).nodes[0].params[2] == b""
    with pytest.raises(KeyError, match="bucket 8 is not in the archive"):
        back.graph(8)
    assert not list(path.parent.glob(".*tmp"))  # written through a temporary file, renamed
    assert path.stat().st_mode & 0o777 == 0o644  # other workers of the node read it


def test_concurrent_writers_of_one_archive_never_leave_a_torn_file(tmp_path: Path) -> None:
    # workers of several pods share a node's directory and may have equal pids: temporary names are unique
    import threading

    path = tmp_path / "graphs" / "k.lfgraph"
    original = _archive()
    errors: list[BaseException] = []

    def write() -> None:
        try:
            for _ in range(20):
                ga.write_archive(path, original)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert ga.read_archive(path) == original
    assert not list(path.parent.glob(".*tmp"))


def test_a_corrupted_truncated_or_foreign_file_is_refused(tmp_path: Path) -> None:
    data = ga.encode(_archive())
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x01
    with pytest.raises(ga.ArchiveCorrupt, match="checksum mismatch"):
        ga.decode(bytes(flipped))
    with pytest.raises(ga.ArchiveCorrupt, match="checksum mismatch"):
        ga.decode(data[:-5] + data[-4:])
    with pytest.raises(ga.ArchiveCorrupt, match="not a lorafn graph archive"):
        ga.decode(b"PK\x03\x04" + data[4:])
    with pytest.raises(ga.ArchiveError, match="cannot read"):
        ga.read_archive(tmp_path / "missing.lfgraph")


def test_another_format_version_is_refused_naming_it() -> None:
    data = ga.encode(_archive())
    (n,) = struct.unpack_from("<Q", data, len(ga.MAGIC))
    start = len(ga.MAGIC) + 8
    header = json.loads(data[start : start + n])
    header["format_version"] = ga.FORMAT_VERSION + 1
    head = json.dumps(header).encode()
    body = ga.MAGIC + struct.pack("<Q", len(head)) + head + data[start + n : -32]
    import hashlib

    forged = body + hashlib.blake2b(body, digest_size=32).digest()
    with pytest.raises(ga.ArchiveMismatch, match=r"format_version: 3 in the archive, 2 here"):
        ga.decode(forged)


def test_topological_order_and_reorder() -> None:
    assert ga.topological_order(4, [(3, 0), (0, 1), (2, 1)]) == [2, 3, 0, 1]
    nodes = [ga.EmptyNode(), ga.MemsetNode(1, 0, 0, 1, 1, 1), ga.EmptyNode()]
    ordered, deps = ga.reorder(nodes, [(2, 0), (1, 0), (2, 1)])
    assert ordered == [nodes[2], nodes[1], nodes[0]]
    assert deps == [[], [0], [0, 1]]
    with pytest.raises(ValueError, match="cycle"):
        ga.topological_order(2, [(0, 1), (1, 0)])
    with pytest.raises(ValueError, match=r"\(0, 5\) names a node outside 0..1"):
        ga.topological_order(2, [(0, 5)])


def test_foreign_pointers_finds_addresses_inside_foreign_ranges() -> None:
    ranges = [(0x7F00_0000_0000, 0x7F00_0010_0000), (0x7F10_0000_0000, 0x7F10_0000_1000)]
    data = (
        (0x2000_0000_0000).to_bytes(8, "little")  # arena: fine
        + (0x7F00_0000_0400).to_bytes(8, "little")  # inside the first range
        + (7).to_bytes(8, "little")
        + (0x7F10_0000_1000).to_bytes(8, "little")  # one past the second range's end: fine
        + (0x7F10_0000_0FF8).to_bytes(8, "little")
    )
    assert ga.foreign_pointers(data, ranges) == [(8, 0x7F00_0000_0400), (32, 0x7F10_0000_0FF8)]
    assert ga.foreign_pointers(data, []) == []
    assert ga.foreign_pointers(b"\x01\x02", ranges) == []


def test_check_layout_names_the_first_allocation_that_differs() -> None:
    layout = _archive().layout
    ga.check_layout(layout, 4 << 20, [(0, 2 << 20), (2 << 20, 2 << 20)])
    with pytest.raises(
        ga.ArchiveMismatch, match=r"state allocation #1 is \(offset, bytes\) \(2097152, 2097152\)"
    ):
        ga.check_layout(layout, 6 << 20, [(0, 2 << 20), (2 << 20, 4 << 20)])
    with pytest.raises(ga.ArchiveMismatch, match=r"state_top: 4194304 after 2 allocations in the archive"):
        ga.check_layout(layout, 6 << 20, [(0, 2 << 20), (2 << 20, 2 << 20), (4 << 20, 2 << 20)])


def test_fingerprints_follow_layout_not_values(tmp_path: Path) -> None:
    def model(values: bytes, shape: list[int]) -> Path:
        d = tmp_path / f"m{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        (d / "config.json").write_text('{"hidden_size": 4}')
        header = json.dumps(
            {"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, len(values)]}}
        ).encode()
        (d / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + values)
        return d

    a = ga.model_layout_fingerprint(model(bytes(16), [4]))
    b = ga.model_layout_fingerprint(model(bytes(range(16)), [4]))
    c = ga.model_layout_fingerprint(model(bytes(16), [2, 2]))
    assert a == b != c
    f1, f2 = tmp_path / "x.py", tmp_path / "y.py"
    f1.write_text("a")
    f2.write_text("b")
    before = ga.files_fingerprint([f1, f2])
    assert ga.files_fingerprint([f2, f1]) == before
    f2.write_text("c")
    assert ga.files_fingerprint([f1, f2]) != before


def test_trigger_buckets_cover_every_library_name_with_few_triggers() -> None:
    names = {1: {"gemv", "fill"}, 2: {"gemv"}, 4: {"gemv", "fill"}, 32: {"nvjet_a", "fill"}, 64: {"nvjet_b"}}
    assert ga.trigger_buckets(names) == [1, 32, 64]
    assert ga.trigger_buckets({1: set(), 2: set()}) == []
    assert ga.trigger_buckets({}) == []
    assert ga.trigger_buckets({8: {"a"}, 4: {"a"}}) == [4]  # a tie goes to the cheaper trigger
    assert ga.trigger_buckets({1: {"a"}, 2: {"a", "b", "c"}, 4: {"c", "d"}}) == [2, 4]


def test_a_graph_with_empty_tables_round_trips_and_a_bad_table_is_corrupt() -> None:
    lone = ga.GraphRecord.from_nodes(1, [ga.EmptyNode()], [[]], ga.TensorRef(1, (1,), (1,), "float32"))
    archive = ga.Archive(key=_key(), layout={}, modules={}, graphs=[lone])
    back = ga.decode(ga.encode(archive))
    assert back == archive and back.graphs[0].nodes == [ga.EmptyNode()] and back.library_names() == set()
    # a table whose dependency points forward is refused as corrupt (a checksum over a wrong table passes)
    original = _archive()
    table = original.graphs[0].table
    table.arrays["dep"] = table.arrays["dep"].copy()
    table.arrays["dep"][0] = 3
    with pytest.raises(ga.ArchiveCorrupt, match="bucket 2: dependencies are not in topological order"):
        ga.decode(ga.encode(original))
