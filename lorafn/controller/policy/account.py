"""The memory account of each GPU: what the controller may still grant, and to whom it went.

capacity = total x utilization - reserve (the headroom keeps allocator fragmentation and CUDA's own
growth from turning into an OOM); used = resident backbones + other (measured, unexplained) + the
whole reservation of every worker on it, starting and draining ones included (their memory is held
until the process exits). free = capacity - used; it may be negative when the GPU is over-committed,
and then nothing new starts there.

A second guard where the driver's count of the device is known (`GPU.driver_free_bytes`, from a worker's
heartbeat): free is at most the driver's free bytes, less what the account promised workers that they do
not hold yet (each worker's ``mem_bytes - reported_bytes``: a starting worker's whole size, a settled one's
growth margin), less ``driver_headroom`` x total. The account charges settled workers by their own reports
(`charge`), which is optimistic where the driver counts memory that no process report explains (a backbone
server's context, processes still exiting, another tenant); this guard keeps such an account from
starting a worker the device cannot hold.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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
    # the driver's free bytes less promised and headroom (None: no driver reading): `free_bytes`' cap
    driver_guard_bytes: int | None = None

    @property
    def used_bytes(self) -> int:
        return self.backbone_bytes + self.other_bytes + self.worker_bytes

    @property
    def free_bytes(self) -> int:
        free = self.capacity_bytes - self.used_bytes
        return free if self.driver_guard_bytes is None else min(free, self.driver_guard_bytes)


def capacity_bytes(total_bytes: int, reserve_bytes: int, utilization: float) -> int:
    return int(total_bytes * utilization) - reserve_bytes


def driver_guard_bytes(
    driver_free_bytes: int | None, promised_bytes: int, total_bytes: int, headroom: float
) -> int | None:
    """The driver's free bytes less memory promised to workers but not yet held by them and less
    ``headroom`` x total (None without a driver reading)."""
    if driver_free_bytes is None:
        return None
    return driver_free_bytes - promised_bytes - int(total_bytes * headroom)


def accounts(
    snapshot: Snapshot, utilization: float, driver_headroom: float = 0.0
) -> dict[str, MemoryAccount]:
    """Each GPU's account from the snapshot (``planned_free_bytes`` = ``free_bytes``: no plan yet)."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"utilization must be in (0, 1], got {utilization!r}")
    if not 0.0 <= driver_headroom < 1.0:
        raise ValueError(f"driver_headroom must be in [0, 1), got {driver_headroom!r}")
    worker_bytes = {g.id: 0 for g in snapshot.gpus}
    promised = {g.id: 0 for g in snapshot.gpus}
    for w in snapshot.workers:
        worker_bytes[w.gpu] += w.mem_bytes
        promised[w.gpu] += max(0, w.mem_bytes - w.reported_bytes)
    out = {}
    for g in snapshot.gpus:
        cap = capacity_bytes(g.total_bytes, g.reserve_bytes, utilization)
        backbone = sum(g.backbones.values())
        guard = driver_guard_bytes(g.driver_free_bytes, promised[g.id], g.total_bytes, driver_headroom)
        account = MemoryAccount(
            g.id, g.total_bytes, cap, backbone, g.other_bytes, worker_bytes[g.id], 0, driver_guard_bytes=guard
        )
        out[g.id] = replace(account, planned_free_bytes=account.free_bytes)  # no plan yet: free now
    return out


class Ledger:
    """Free bytes per GPU while a plan is built: a Start takes, a Stop gives back."""

    def __init__(self, free: dict[str, int]) -> None:
        self.free = dict(free)

    def fits(self, gpu: str, size: int) -> bool:
        return self.free[gpu] >= size

    def take(self, gpu: str, size: int) -> None:
        if size > 0 and self.free[gpu] < size:  # nothing always fits (free may be negative: over-committed)
            raise ValueError(f"GPU {gpu}: {size} bytes do not fit in {self.free[gpu]} free")
        self.free[gpu] -= size

    def give(self, gpu: str, size: int) -> None:
        self.free[gpu] += size


def gib(size: float) -> str:
    """Bytes as GiB for messages people read (one decimal)."""
    return f"{size / 2**30:.1f} GiB"
