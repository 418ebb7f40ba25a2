"""SafetensorsWeightSource: a model directory's *.safetensors, memory-mapped, handed out as views.

Each file is mapped once (`UntypedStorage.from_file(shared=False)`: a private, copy-on-write map, so
the file is never written) and every tensor is a view into that mapping: no copy per tensor on CPU
when the dtype matches. A different device or dtype costs exactly one copy (`Tensor.to`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from lorafn.api.safetensors import DTYPE_NAMES, read_header


def _torch_dtype(code: str, name: str, file: Path) -> torch.dtype:
    """The torch dtype of a (checked) safetensors dtype code; U16/U32/U64 need torch >= 2.3."""
    dtype = getattr(torch, DTYPE_NAMES[code], None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(
            f"model: tensor {name} in {file.name} has dtype {code}, which torch {torch.__version__} lacks"
        )
    return dtype


class SafetensorsWeightSource:
    """The WeightSource of a local model directory (or a single .safetensors file)."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"model: no *.safetensors files in {path}")
        self._tensors: dict[str, torch.Tensor] = {}
        for file in files:
            header = read_header(file)  # checked: offsets inside the file, sizes match the shapes
            storage = torch.UntypedStorage.from_file(str(file), shared=False, nbytes=header.file_size)
            raw = torch.empty(0, dtype=torch.uint8).set_(storage)
            for name, info in header.tensors.items():
                dtype = _torch_dtype(info.dtype, name, file)
                start = header.data_start + info.begin
                chunk = raw[start : header.data_start + info.end]
                if start % dtype.itemsize:  # misaligned: a view is impossible, copy once
                    chunk = chunk.clone()
                self._tensors[name] = chunk.view(dtype).view(info.shape)

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
