"""Model directories (validation, no torch) and the manifest: where each tensor lives in the backbone.

The backbone is one contiguous byte range (W). Every tensor of the checkpoint gets an offset in W,
aligned to `ALIGNMENT` bytes, in file order (so loading reads each file sequentially). The manifest
maps tensor name -> (offset, shape, dtype, stride, nbytes) and carries what a worker must check
before trusting the bytes: the GPU UUID, a content hash and the software versions.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorafn.api import safetensors as st

ALIGNMENT = 256  # bytes; every tensor starts on a multiple (coalesced GPU loads, vectorized CPU reads)
MANIFEST_FORMAT = "lorafn-backbone-manifest"
MANIFEST_VERSION = 1
INDEX_NAME = "model.safetensors.index.json"


class ModelDirError(ValueError):
    """A model directory that cannot be served: the message names the file and what is wrong."""


@dataclass(frozen=True)
class FileTensor:
    """A tensor as a safetensors file stores it: bytes [data_start, data_end) of the file."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    data_start: int  # absolute offset in the file
    data_end: int

    @property
    def nbytes(self) -> int:
        return self.data_end - self.data_start


@dataclass(frozen=True)
class SafetensorsFile:
    """One checked safetensors file of a model directory (size and header bytes feed content_hash)."""

    file: Path
    size: int
    header_bytes: bytes
    tensors: list[FileTensor]


def read_safetensors_header(path: Path) -> SafetensorsFile:
    """Parse and check one safetensors file's header against its size. Raises ModelDirError naming it."""
    try:
        header = st.read_header(path)
    except st.SafetensorsError as exc:
        raise ModelDirError(str(exc)) from None
    base = header.data_start
    tensors = [
        FileTensor(name, path, t.dtype, t.shape, base + t.begin, base + t.end)
        for name, t in header.tensors.items()
    ]
    return SafetensorsFile(path, header.file_size, header.raw, tensors)


@dataclass
class ModelDir:
    """A checked model directory: config + every tensor of its safetensors file(s)."""

    path: Path
    config: dict[str, Any]
    config_bytes: bytes
    files: list[SafetensorsFile]
    tensors: list[FileTensor] = field(default_factory=list)  # in file order

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def open_model_dir(path: str | os.PathLike[str]) -> ModelDir:
    """Check a model directory before loading a byte of it. Raises ModelDirError naming the file."""
    root = Path(path)
    if not root.is_dir():
        raise ModelDirError(f"{root}: model directory does not exist")
    config_path = root / "config.json"
    if not config_path.is_file():
        raise ModelDirError(f"{config_path}: missing (a model directory holds config.json + safetensors)")
    try:
        config_bytes = config_path.read_bytes()
        config = json.loads(config_bytes)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelDirError(f"{config_path}: cannot be read as JSON: {exc}") from None
    index_path = root / INDEX_NAME
    weight_map: dict[str, str] | None = None
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_bytes())
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelDirError(f"{index_path}: not a valid safetensors index: {exc}") from None
        shard_names = sorted(set(weight_map.values()))
        for shard in shard_names:
            if not (root / shard).is_file():
                raise ModelDirError(f"{root / shard}: missing shard listed in {index_path.name}")
        file_paths = [root / s for s in shard_names]
    else:
        file_paths = sorted(root.glob("*.safetensors"))
        if not file_paths:
            raise ModelDirError(f"{root}: no *.safetensors file and no {INDEX_NAME}")
    files = [read_safetensors_header(p) for p in file_paths]
    tensors: list[FileTensor] = []
    seen: dict[str, Path] = {}
    for f in files:
        for t in sorted(f.tensors, key=lambda t: t.data_start):
            if t.name in seen:
                raise ModelDirError(f"{f.file}: tensor {t.name!r} also appears in {seen[t.name]}")
            seen[t.name] = f.file
            tensors.append(t)
    if weight_map is not None:
        for name, shard in weight_map.items():
            if name not in seen:
                raise ModelDirError(
                    f"{root / shard}: tensor {name!r} listed in {INDEX_NAME} is not in the shard"
                )
    if not tensors:
        raise ModelDirError(f"{root}: the safetensors files hold no tensor")
    return ModelDir(root, config, config_bytes, files, tensors)


def content_hash(model: ModelDir, full: bool = False, chunk: int = 16 << 20) -> str:
    """blake2b-256 over config.json, each file's name, size and header (and all its bytes when `full`)."""
    h = hashlib.blake2b(digest_size=32)
    h.update(model.config_bytes)
    for f in model.files:
        h.update(f.file.name.encode() + b"\0" + str(f.size).encode() + b"\0")
        h.update(f.header_bytes)
        if full:
            with open(f.file, "rb") as fh:
                while block := fh.read(chunk):
                    h.update(block)
    return ("blake2b-256-full:" if full else "blake2b-256-headers:") + h.hexdigest()


def contiguous_stride(shape: tuple[int, ...]) -> list[int]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(d, 1)
    return list(reversed(stride))


def align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Layout:
    """Offsets of every tensor in W, and W's size before and after rounding to allocation units."""

    offsets: dict[str, int]
    used_bytes: int


def plan_layout(model: ModelDir, alignment: int = ALIGNMENT) -> Layout:
    offsets: dict[str, int] = {}
    cursor = 0
    for t in model.tensors:
        cursor = align_up(cursor, alignment)
        offsets[t.name] = cursor
        cursor += t.nbytes
    return Layout(offsets, max(cursor, 1))


def split_segments(mapped_bytes: int, segment_bytes: int, granularity: int) -> list[int]:
    """Sizes of the physical allocations that back W: multiples of the granularity, at most
    `segment_bytes` each (0: one allocation)."""
    mapped_bytes = align_up(mapped_bytes, granularity)
    if segment_bytes <= 0:
        return [mapped_bytes]
    seg = max(granularity, segment_bytes // granularity * granularity)
    sizes = []
    left = mapped_bytes
    while left > 0:
        sizes.append(min(seg, left))
        left -= sizes[-1]
    return sizes


def build_manifest(
    model: ModelDir,
    layout: Layout,
    *,
    mode: str,
    segments: list[int],
    content: str,
    versions: dict[str, Any],
    gpu_uuid: str | None = None,
    device_name: str | None = None,
    w_addr: int | None = None,
    load: dict[str, Any] | None = None,
) -> dict[str, Any]:
    tensors = {
        t.name: {
            "offset": layout.offsets[t.name],
            "shape": list(t.shape),
            "dtype": t.dtype,
            "stride": contiguous_stride(t.shape),
            "nbytes": t.nbytes,
        }
        for t in model.tensors
    }
    return {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "mode": mode,
        "model_dir": str(model.path),
        "config": model.config,
        "alignment": ALIGNMENT,
        "total_bytes": layout.used_bytes,
        "mapped_bytes": sum(segments),
        "segments": segments,
        "w_addr": w_addr,
        "gpu_uuid": gpu_uuid,
        "device_name": device_name,
        "content_hash": content,
        "versions": versions,
        "load": load or {},
        "tensors": tensors,
    }
