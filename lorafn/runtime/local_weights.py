"""SafetensorsWeightSource: a model directory's *.safetensors, memory-mapped, handed out as views.

Each file is mapped once (`UntypedStorage.from_file(shared=False)`: a private, copy-on-write map, so
the file is never written) and every tensor is a view into that mapping: no copy per tensor on CPU
when the dtype matches. A different device or dtype costs exactly one copy (`Tensor.to`).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import torch

_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read_safetensors_header(path: Path) -> tuple[int, dict]:
    """(byte offset of the data section, header dict without __metadata__) of one .safetensors file."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    return 8 + header_len, header


class SafetensorsWeightSource:
    """The WeightSource of a local model directory (or a single .safetensors file)."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"model: no *.safetensors files in {path}")
        self._tensors: dict[str, torch.Tensor] = {}
        for file in files:
            data_start, header = read_safetensors_header(file)
            nbytes = file.stat().st_size
            raw = torch.tensor([], dtype=torch.uint8)
            if nbytes:
                storage = torch.UntypedStorage.from_file(str(file), shared=False, nbytes=nbytes)
                raw = torch.empty(0, dtype=torch.uint8).set_(storage)
            for name, info in header.items():
                dtype = _ST_DTYPES.get(info["dtype"])
                if dtype is None:
                    raise ValueError(
                        f"model: tensor {name} in {file.name} has unsupported dtype {info['dtype']}"
                    )
                begin, end = info["data_offsets"]
                chunk = raw[data_start + begin : data_start + end]
                if (data_start + begin) % dtype.itemsize:  # misaligned: a view is impossible, copy once
                    chunk = chunk.clone()
                self._tensors[name] = chunk.view(dtype).view(info["shape"])

    def names(self) -> list[str]:
        return list(self._tensors)

    def get(self, name: str, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
        try:
            tensor = self._tensors[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in the model's safetensors") from None
        return tensor.to(device=device, dtype=dtype)

    def read_only(self) -> bool:
        return False

    def close(self) -> None:
        self._tensors.clear()

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)
