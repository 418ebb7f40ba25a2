"""lorafn.api.safetensors: files written by safetensors itself read back; broken ones are refused."""

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from lorafn.api.safetensors import (
    DTYPE_NAMES,
    DTYPE_SIZES,
    MAX_HEADER_BYTES,
    SafetensorsError,
    read_header,
)

ARRAYS = {
    "a.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
    "b.bias": np.arange(5, dtype=np.float16),
    "c.ids": np.arange(6, dtype=np.int64).reshape(2, 1, 3),
    "d.mask": np.array([True, False, True]),
    "e.empty": np.zeros((0, 7), dtype=np.uint8),
    "f.scalar": np.array(2.5, dtype=np.float64),
}


@pytest.fixture
def real(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    save_file(ARRAYS, str(path), metadata={"format": "np"})
    return path


def test_reads_a_file_safetensors_wrote(real: Path) -> None:
    header = read_header(real)
    (n,) = struct.unpack("<Q", real.read_bytes()[:8])
    assert header.data_start == 8 + n
    assert header.file_size == real.stat().st_size
    assert header.raw == real.read_bytes()[8 : 8 + n]
    assert header.metadata == {"format": "np"}
    assert set(header.tensors) == set(ARRAYS)
    codes = {"a.weight": "F32", "b.bias": "F16", "c.ids": "I64", "d.mask": "BOOL", "e.empty": "U8"}
    data = real.read_bytes()
    for name, array in ARRAYS.items():
        info = header.tensors[name]
        assert info.dtype == codes.get(name, "F64")
        assert info.shape == array.shape
        assert info.nbytes == array.nbytes
        stored = data[header.data_start + info.begin : header.data_start + info.end]
        assert stored == array.tobytes()


def test_no_metadata_is_an_empty_dict(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    save_file({"x": np.ones(2, dtype=np.float32)}, str(path))
    assert read_header(path).metadata == {}


def test_dtype_tables_agree_with_safetensors_and_torch(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file as save_torch

    assert set(DTYPE_NAMES) == set(DTYPE_SIZES)
    for code, name in DTYPE_NAMES.items():
        dtype = getattr(torch, name)
        assert dtype.itemsize == DTYPE_SIZES[code], code
        path = tmp_path / f"{code}.safetensors"
        save_torch({"t": torch.zeros(2, 3).to(dtype)}, str(path))
        info = read_header(path).tensors["t"]
        assert (info.dtype, info.shape, info.nbytes) == (code, (2, 3), 6 * DTYPE_SIZES[code])


def _rewrite(path: Path, edit) -> None:
    """Apply `edit` to the header dict and write the file back with the same data section."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    edit(header)
    hb = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(hb)) + hb + data[8 + n :])


def _set(name: str, key: str, value):
    def edit(header: dict) -> None:
        header[name][key] = value

    return edit


def _raw_header(hb: bytes, data: bytes = b""):
    def damage(path: Path) -> None:
        path.write_bytes(struct.pack("<Q", len(hb)) + hb + data)

    return damage


CORRUPTIONS = {
    "short": (lambda p: p.write_bytes(p.read_bytes()[:5]), "no header length"),
    "empty": (lambda p: p.write_bytes(b""), "no header length"),
    "over_cap": (
        lambda p: p.write_bytes(struct.pack("<Q", MAX_HEADER_BYTES + 1) + p.read_bytes()[8:]),
        "over the",
    ),
    "past_end": (lambda p: p.write_bytes(struct.pack("<Q", 1 << 20) + p.read_bytes()[8:]), "does not fit"),
    "too_small": (lambda p: p.write_bytes(struct.pack("<Q", 1) + p.read_bytes()[8:]), "header length"),
    "not_json": (_raw_header(b"{nope"), "not JSON"),
    "not_utf8": (_raw_header(b'{"\xff": 1}'), "not UTF-8"),
    "not_object": (_raw_header(b"[1, 2]"), "not a JSON object"),
    "metadata": (lambda p: _rewrite(p, lambda h: h.update(__metadata__=[1])), "__metadata__"),
    "entry": (lambda p: _rewrite(p, lambda h: h.update({"a.weight": [1]})), "'a.weight' has a bad entry"),
    "dtype": (lambda p: _rewrite(p, _set("a.weight", "dtype", "C64")), "unsupported dtype 'C64'"),
    "no_dtype": (lambda p: _rewrite(p, lambda h: h["a.weight"].pop("dtype")), "unsupported dtype None"),
    "shape_neg": (lambda p: _rewrite(p, _set("a.weight", "shape", [-3, -4])), "shape"),
    "shape_bool": (lambda p: _rewrite(p, _set("a.weight", "shape", [True, 4])), "shape"),
    "shape_str": (lambda p: _rewrite(p, _set("a.weight", "shape", "3x4")), "shape"),
    "offs_three": (lambda p: _rewrite(p, _set("a.weight", "data_offsets", [0, 1, 2])), "two integers"),
    "offs_float": (lambda p: _rewrite(p, _set("a.weight", "data_offsets", [0.0, 48.0])), "two integers"),
    "offs_neg": (lambda p: _rewrite(p, _set("a.weight", "data_offsets", [-48, 0])), "begin <= end"),
    "offs_reversed": (lambda p: _rewrite(p, _set("a.weight", "data_offsets", [48, 0])), "begin <= end"),
    "offs_past_end": (
        lambda p: _rewrite(p, _set("a.weight", "data_offsets", [1 << 20, (1 << 20) + 48])),
        "truncated",
    ),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:-1]), "truncated"),
    "size_mismatch": (
        lambda p: _rewrite(p, _set("a.weight", "shape", [4, 4])),
        r"do not hold \[4, 4\] x F32",
    ),
}


@pytest.mark.parametrize("how", sorted(CORRUPTIONS))
def test_broken_files_are_refused_naming_file_and_problem(real: Path, how: str) -> None:
    damage, words = CORRUPTIONS[how]
    damage(real)
    with pytest.raises(SafetensorsError, match=words) as info:
        read_header(real)
    assert str(info.value).startswith(f"{real}: ")
    assert isinstance(info.value, ValueError)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SafetensorsError, match="cannot read"):
        read_header(tmp_path / "nowhere.safetensors")


def test_callers_wrap_the_error(real: Path, tmp_path: Path) -> None:
    """The adapter check and the model-directory check give their own error types, same words."""
    from lorafn.api.adapters import REASON_WEIGHTS_INVALID, AdapterProblem
    from lorafn.api.adapters import read_safetensors_header as adapter_header

    real.write_bytes(real.read_bytes()[:-1])
    with pytest.raises(AdapterProblem, match="truncated") as info:
        adapter_header(real)
    assert info.value.reason == REASON_WEIGHTS_INVALID and str(real) in info.value.message
    from lorafn.backbone_server import manifest

    with pytest.raises(manifest.ModelDirError, match="truncated"):
        manifest.read_safetensors_header(real)


def test_local_weight_source_refuses_a_broken_file(real: Path) -> None:
    pytest.importorskip("torch")
    from lorafn.runtime.local_weights import SafetensorsWeightSource

    src = SafetensorsWeightSource(real)
    assert src.get("a.weight", "cpu", src._tensors["a.weight"].dtype).tolist() == ARRAYS["a.weight"].tolist()
    real.write_bytes(real.read_bytes()[:-1])
    with pytest.raises(SafetensorsError, match="truncated"):
        SafetensorsWeightSource(real)
