"""The one reader of safetensors headers (no torch): what a file holds, checked against its size.

A safetensors file is an 8-byte little-endian length N, N bytes of JSON mapping each tensor name to
{dtype, shape, data_offsets: [begin, end]} (offsets relative to the data section, which starts at
byte 8 + N) plus an optional "__metadata__" object, then the data section.

`read_header` is used by the operator and `lorafn apply` (adapter checks, lorafn.api.adapters), the
backbone server (lorafn.backbone_server.manifest) and the runtime's local weight source
(lorafn.runtime.local_weights), so all of them refuse the same broken files with the same words.
Every problem is a `SafetensorsError` whose message starts with the file's path.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_HEADER_BYTES = 100 << 20  # safetensors itself refuses headers over 100 MB

# safetensors dtype code -> bytes per element
DTYPE_SIZES: dict[str, int] = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
}

# safetensors dtype code -> name of the torch dtype attribute (getattr(torch, name)); uint16/32/64
# exist from torch 2.3 on.
DTYPE_NAMES: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
}


class SafetensorsError(ValueError):
    """A safetensors file that cannot be read: the message names the file and what is wrong."""


@dataclass(frozen=True)
class TensorInfo:
    """One header entry: `begin`/`end` are relative to the data section (add `data_start`)."""

    dtype: str  # safetensors code, a key of DTYPE_SIZES
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    file_size: int
    data_start: int  # absolute offset of the data section: 8 + header length
    raw: bytes  # the header's JSON bytes as stored
    tensors: dict[str, TensorInfo]  # in header order
    metadata: dict[str, Any] = field(default_factory=dict)


def _short(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_header(path: str | Path) -> SafetensorsHeader:
    """Parse and check one safetensors file's header against the file's size.

    Checks: the length prefix is there, the header length is at least 2, at most MAX_HEADER_BYTES and
    inside the file; the header is UTF-8 JSON and an object; `__metadata__`, if any, is an object;
    every tensor entry is an object with a known dtype, a shape of non-negative integers and two
    integer data_offsets with 0 <= begin <= end <= data section size and end - begin equal to
    numel x itemsize. Raises SafetensorsError naming the file.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsError(f"{path}: truncated safetensors file ({size} bytes; no header length)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise SafetensorsError(
                    f"{path}: corrupt safetensors header: header length {n} is over the "
                    f"{MAX_HEADER_BYTES} byte limit (file of {size} bytes)"
                )
            if n < 2 or 8 + n > size:
                raise SafetensorsError(
                    f"{path}: corrupt safetensors header: "
                    f"header length {n} does not fit a file of {size} bytes"
                )
            raw = f.read(n)
    except OSError as exc:
        raise SafetensorsError(f"{path}: cannot read: {exc}") from None
    if len(raw) != n:  # the file shrank under us
        raise SafetensorsError(f"{path}: truncated safetensors file (header cut at {len(raw)} of {n} bytes)")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SafetensorsError(
            f"{path}: corrupt safetensors header: not JSON (or not UTF-8): {exc}"
        ) from None
    except RecursionError:  # thousands of nested [ or {: the parser's depth limit, not a traceback
        raise SafetensorsError(f"{path}: corrupt safetensors header: JSON nested too deeply") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: corrupt safetensors header: not a JSON object")
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict):
        raise SafetensorsError(f"{path}: corrupt safetensors header: __metadata__ is not an object")
    data_start = 8 + n
    data_size = size - data_start
    tensors: dict[str, TensorInfo] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        bad = f"{path}: tensor {name!r} has a bad entry"
        if not isinstance(info, dict):
            raise SafetensorsError(f"{bad}: {_short(info)} is not an object")
        dtype, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            raise SafetensorsError(f"{bad}: unsupported dtype {_short(dtype)}")
        if not (isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)):
            raise SafetensorsError(f"{bad}: shape {_short(shape)} is not a list of non-negative integers")
        if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(o) for o in offs)):
            raise SafetensorsError(f"{bad}: data_offsets {_short(offs)} are not two integers")
        begin, end = offs
        if not 0 <= begin <= end:
            raise SafetensorsError(f"{bad}: data_offsets {offs} are not 0 <= begin <= end")
        if end > data_size:
            raise SafetensorsError(
                f"{bad}: truncated: it needs data up to byte {data_start + end} but the file has {size} bytes"
            )
        expect = math.prod(shape) * DTYPE_SIZES[dtype]
        if end - begin != expect:
            raise SafetensorsError(
                f"{bad}: data_offsets {offs} do not hold {shape} x {dtype} ({expect} bytes)"
            )
        tensors[name] = TensorInfo(dtype, tuple(shape), begin, end)
    return SafetensorsHeader(path, size, data_start, raw, tensors, metadata)
