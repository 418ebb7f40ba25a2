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
    assert acc.planned_free_bytes == acc.free_bytes


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


def test_driver_guard_caps_free_at_the_devices_free_less_promised_and_headroom():
    # the account would grant 72 - 13 - 3 - 2 - 4 = 50 GiB; the driver shows 20 GiB free, of which the
    # bound worker's unreported 0.5 GiB (its margin) and the starting worker's whole 4 GiB are promised
    g = GPU("g0", "n0", 80 * GiB, {"llama": 13 * GiB}, driver_free_bytes=20 * GiB)
    workers = [
        bound("b1", "g0", "ns/a", mem_gib=3, reported_bytes=int(2.5 * GiB)),
        standby("s1", "g0", mem_gib=2, reported_bytes=2 * GiB),
        Worker("st", "g0", "llama", "starting", "r16", "ns/b", 4 * GiB),
    ]
    acc = accounts(snap([g], workers=workers), utilization=0.9, driver_headroom=0.05)["g0"]
    guard = 20 * GiB - int(0.5 * GiB) - 4 * GiB - int(80 * GiB * 0.05)
    assert acc.driver_guard_bytes == guard
    assert acc.free_bytes == guard < acc.capacity_bytes - acc.used_bytes
    assert acc.planned_free_bytes == guard
    # a device with more free than the account grants: the account decides
    roomy = GPU("g0", "n0", 80 * GiB, {"llama": 13 * GiB}, driver_free_bytes=70 * GiB)
    acc = accounts(snap([roomy], workers=workers), utilization=0.9, driver_headroom=0.05)["g0"]
    assert acc.free_bytes == acc.capacity_bytes - acc.used_bytes == acc.planned_free_bytes
    # no reading (CPU, no NVML): no guard
    plain = accounts(snap([gpu_without_reading()], workers=workers), utilization=0.9, driver_headroom=0.05)
    assert plain["g0"].driver_guard_bytes is None
    assert (
        plain["g0"].planned_free_bytes
        == plain["g0"].free_bytes
        == plain["g0"].capacity_bytes - plain["g0"].used_bytes
    )


def gpu_without_reading() -> GPU:
    return GPU("g0", "n0", 80 * GiB, {"llama": 13 * GiB})


def test_driver_headroom_out_of_range_is_refused():
    with pytest.raises(ValueError, match="driver_headroom"):
        accounts(snap([]), utilization=0.9, driver_headroom=1.0)


def test_ledger_takes_nothing_from_an_over_committed_gpu():
    ledger = Ledger({"g0": -5})
    ledger.take("g0", 0)  # a Wait for exiting memory that covers the whole need takes nothing
    assert ledger.free["g0"] == -5
    with pytest.raises(ValueError, match="do not fit"):
        ledger.take("g0", 1)
