"""The memory account: capacity = total x utilization - reserve; every worker's reservation counts."""

from __future__ import annotations

import pytest

from lorafn.controller.policy import GPU, Worker
from lorafn.controller.policy.account import Ledger, accounts

from .helpers import GiB, bound, snap, standby


def test_account_counts_backbones_other_and_every_worker_state():
    g = GPU(
        "g0", "n0", 80 * GiB, {"llama": 13 * GiB, "mistral": 14 * GiB}, other_bytes=GiB, reserve_bytes=2 * GiB
    )
    workers = [
        bound("b1", "g0", "ns/a", mem_gib=3),
        standby("s1", "g0", mem_gib=2),
        Worker("st", "g0", "llama", "starting", "r16", "ns/b", 4 * GiB),
        Worker("dr", "g0", "llama", "draining", "r16", "ns/c", 5 * GiB),
    ]
    acc = accounts(snap([g], workers=workers), utilization=0.9)["g0"]
    assert acc.capacity_bytes == int(80 * GiB * 0.9) - 2 * GiB
    assert acc.backbone_bytes == 27 * GiB
    assert acc.worker_bytes == 14 * GiB
    assert acc.used_bytes == 27 * GiB + GiB + 14 * GiB
    assert acc.free_bytes == acc.capacity_bytes - acc.used_bytes
    assert acc.planned_free_bytes == acc.free_bytes


def test_over_committed_gpu_has_negative_free():
    g = GPU("g0", "n0", 16 * GiB, {"llama": 13 * GiB})
    acc = accounts(snap([g], workers=[standby("s1", "g0", mem_gib=3)]), utilization=0.9)["g0"]
    assert acc.free_bytes < 0


def test_utilization_out_of_range_is_refused():
    with pytest.raises(ValueError, match="utilization"):
        accounts(snap([]), utilization=1.5)


def test_ledger_never_grants_more_than_free():
    ledger = Ledger({"g0": 10})
    ledger.take("g0", 6)
    assert not ledger.fits("g0", 5)
    with pytest.raises(ValueError, match="do not fit"):
        ledger.take("g0", 5)
    ledger.give("g0", 1)
    ledger.take("g0", 5)
    assert ledger.free["g0"] == 0
