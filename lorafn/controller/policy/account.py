"""The memory account of each GPU: what the controller may still grant, and to whom it went.

capacity = total x utilization - reserve (the headroom keeps allocator fragmentation and CUDA's own
growth from turning into an OOM); used = resident backbones + other (measured, unexplained) + the
whole reservation of every worker on it, starting and draining ones included (their memory is held
until the process exits). free = capacity - used; it may be negative when the GPU is over-committed,
and then nothing new starts there.
"""

from __future__ import annotations

from dataclasses import dataclass

from lorafn.controller.policy.model import Snapshot


@dataclass(frozen=True)
class MemoryAccount:
    """One GPU's account before the plan, and its free bytes once the plan is applied."""

    gpu: str
    total_bytes: int
    capacity_bytes: int
    backbone_bytes: int
    other_bytes: int
    worker_bytes: int
    planned_free_bytes: int

    @property
    def used_bytes(self) -> int:
        return self.backbone_bytes + self.other_bytes + self.worker_bytes

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes


def capacity_bytes(total_bytes: int, reserve_bytes: int, utilization: float) -> int:
    return int(total_bytes * utilization) - reserve_bytes


def accounts(snapshot: Snapshot, utilization: float) -> dict[str, MemoryAccount]:
    """Each GPU's account from the snapshot (``planned_free_bytes`` = ``free_bytes``: no plan yet)."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"utilization must be in (0, 1], got {utilization!r}")
    worker_bytes = {g.id: 0 for g in snapshot.gpus}
    for w in snapshot.workers:
        worker_bytes[w.gpu] += w.mem_bytes
    out = {}
    for g in snapshot.gpus:
        cap = capacity_bytes(g.total_bytes, g.reserve_bytes, utilization)
        backbone = sum(g.backbones.values())
        used = backbone + g.other_bytes + worker_bytes[g.id]
        out[g.id] = MemoryAccount(
            g.id, g.total_bytes, cap, backbone, g.other_bytes, worker_bytes[g.id], cap - used
        )
    return out


class Ledger:
    """Free bytes per GPU while a plan is built: a Start takes, a Stop gives back."""

    def __init__(self, free: dict[str, int]) -> None:
        self.free = dict(free)

    def fits(self, gpu: str, size: int) -> bool:
        return self.free[gpu] >= size

    def take(self, gpu: str, size: int) -> None:
        if self.free[gpu] < size:
            raise ValueError(f"GPU {gpu}: {size} bytes do not fit in {self.free[gpu]} free")
        self.free[gpu] -= size

    def give(self, gpu: str, size: int) -> None:
        self.free[gpu] += size


def gib(size: float) -> str:
    """Bytes as GiB for messages people read (one decimal)."""
    return f"{size / 2**30:.1f} GiB"
