"""Weight sources: where an Engine gets its backbone tensors.

An Engine never opens model files itself; it asks a `WeightSource` for named tensors. Local files
(`SafetensorsWeightSource`, memory-mapped) and the shared backbone of the backbone server
(`lorafn.backbone_server.client`) both implement this protocol, so the model code is the same
whether the weights are private or mapped read-only from another process.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@runtime_checkable
class WeightSource(Protocol):
    """Named backbone tensors, as views (no copy per tensor where the storage allows it)."""

    def names(self) -> list[str]:
        """All tensor names, as the checkpoint spells them (`model.layers.0.self_attn.q_proj.weight`)."""
        ...

    def get(self, name: str, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
        """The tensor `name` on `device` in `dtype`. A view when the source already holds it there.

        Raises KeyError naming the tensor when it is absent.
        """
        ...

    def read_only(self) -> bool:
        """True when the returned tensors must never be written (a shared backbone)."""
        ...

    def close(self) -> None:
        """Release mappings and files. Tensors handed out before must not be used afterwards."""
        ...

    def __iter__(self) -> Iterator[str]: ...
