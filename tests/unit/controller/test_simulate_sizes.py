"""The policy simulation with per-worker sizes (issue 16): its snapshot charges workers as the controller's
does (every one the largest report + margin, or settled ones their own size), its runs are seeded, and the
driver guard holds back memory that no report explains."""

from __future__ import annotations

import dataclasses

import pytest

from lorafn.controller.policy import PolicyConfig
from lorafn.controller.policy.simulate import GiB, SimSetup, Simulation, _Worker

MiB = 2**20
# 32 functions called in turn, every 0.25 s, for 60 s: more than the 32 GiB GPU holds bound at once
ARRIVALS = [(i * 0.25, i % 32) for i in range(240)]
SETUP = SimSetup(
    32,
    gpu_bytes=32 * GiB,
    worker_bytes=(512 + 1230) * MiB,
    overhead_quantiles=((0.0, 720 * MiB), (0.5, 817 * MiB), (0.9, 908 * MiB), (1.0, 1086 * MiB)),
    kv_lora_bytes=592 * MiB,
    settle_s=5.0,
    max_batch=4,
)


def run(**changes):
    return Simulation(dataclasses.replace(SETUP, **changes), PolicyConfig(), ARRIVALS).run(drain_s=20.0)


def _with_workers(setup: SimSetup, overheads_mib: list[int], now: float = 100.0) -> Simulation:
    """A simulation at ``now`` with one settled bound worker per overhead (function i), nothing else."""
    sim = Simulation(setup, PolicyConfig(), [(0.0, 0)])
    sim.now = now
    for i, mib in enumerate(overheads_mib):
        w = _Worker(f"w{i}", "gpu0", "bound", sim.names[i], started_at=0.0, ready_at=0.0, idle_since=now)
        w.overhead, w.settled_at = mib * MiB, 0.0
        sim.workers[w.id] = w
    return sim


def test_the_snapshot_charges_settled_workers_by_their_own_size():
    overheads = [720, 760, 800, 817, 830, 850, 870, 900, 908, 1086]
    learned = _with_workers(SETUP, overheads).snapshot()
    own = _with_workers(dataclasses.replace(SETUP, charge="own"), overheads).snapshot()
    kv_lora = SETUP.kv_lora_bytes
    # learned: every worker the largest overhead + 64 MiB
    assert {w.mem_bytes for w in learned.workers} == {kv_lora + (1086 + 64) * MiB}
    assert learned.functions[0].mem_bytes == kv_lora + (1086 + 64) * MiB  # what a start is granted
    # own: its report + 64 MiB, at least the p90 of settled overheads (908 MiB, the 9th of 10)
    charged = {w.id: w.mem_bytes for w in own.workers}
    assert charged["w0"] == kv_lora + 908 * MiB  # 720 + 64 is under the floor
    assert charged["w8"] == kv_lora + (908 + 64) * MiB
    assert charged["w9"] == kv_lora + (1086 + 64) * MiB  # the largest: its own + margin = the learned
    assert own.functions[0].mem_bytes == learned.functions[0].mem_bytes  # starts as before
    assert sum(charged.values()) < sum(w.mem_bytes for w in learned.workers)
    assert all(w.reported_bytes == kv_lora + o * MiB for w, o in zip(own.workers, overheads, strict=True))
    # with the guard: the device's free bytes = total - backbone - what the processes hold
    guarded = _with_workers(dataclasses.replace(SETUP, charge="own", driver_guard=True), overheads).snapshot()
    held = sum(kv_lora + o * MiB for o in overheads)
    assert guarded.gpus[0].driver_free_bytes == SETUP.gpu_bytes - SETUP.backbone_bytes - held


def test_a_fresh_worker_reports_its_graphs_pending_and_is_charged_the_learned_size():
    sim = _with_workers(dataclasses.replace(SETUP, charge="own"), [720, 800, 900])
    sim.workers["w0"].settled_at = sim.now + 1.0  # its lazy graphs are not captured yet
    snapshot = sim.snapshot()
    w0 = next(w for w in snapshot.workers if w.id == "w0")
    assert w0.reported_bytes == SETUP.kv_lora_bytes + (720 - 150) * MiB  # the graphs' pool is still to come
    assert w0.mem_bytes == snapshot.functions[0].mem_bytes  # the learned charge


def test_a_seeded_run_is_repeatable_and_stays_within_the_gpu():
    first = run(charge="own", driver_guard=True)
    assert first.row() == run(charge="own", driver_guard=True).row()
    assert first.over_gpu_ticks == 0 and first.peak_held_bytes <= SETUP.gpu_bytes


def test_the_driver_guard_keeps_unexplained_memory_off_the_gpu():
    # 300 MiB per process that no report explains: the own-size account alone over-commits the device
    unexplained = 300 * MiB
    alone = run(charge="own", unattributed_bytes=unexplained)
    guarded = run(charge="own", driver_guard=True, unattributed_bytes=unexplained)
    assert alone.over_gpu_ticks > 0
    assert guarded.over_gpu_ticks == 0
    assert guarded.peak_held_bytes < alone.peak_held_bytes


def test_sizes_need_quantiles_from_zero_to_one():
    with pytest.raises(ValueError, match="overhead_quantiles"):
        dataclasses.replace(SETUP, overhead_quantiles=((0.5, MiB), (1.0, 2 * MiB)))
    with pytest.raises(ValueError, match="charge"):
        dataclasses.replace(SETUP, charge="largest")
