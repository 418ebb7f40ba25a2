"""Parking in the policy simulator (issue 16): a parked worker holds its KV and graph pools less and is
charged what it holds; an unpark gives them back and serves after ``unpark_s``; a run with parking on parks,
unparks and answers every request without the processes ever holding more than the GPU. (The driver applies
parking: tests/unit/controller/test_park_driver.py.)"""

from __future__ import annotations

import dataclasses

import pytest

from lorafn.controller.policy import PolicyConfig
from lorafn.controller.policy.actions import Park, Unpark
from lorafn.controller.policy.charge import OVERHEAD_MARGIN_BYTES
from lorafn.controller.policy.simulate import SimSetup, Simulation, _Worker
from tests.unit.controller.test_simulate_sizes import ARRIVALS, MiB
from tests.unit.controller.test_simulate_sizes import SETUP as SIZED

# the sized setup of test_simulate_sizes (32 functions in turn on a 32 GiB GPU), charged by own size, with a
# park releasing KV + graphs (512 + 150 MiB) and unparks serving after 0.3 s
SETUP = dataclasses.replace(
    SIZED, charge="own", driver_guard=True, park_release_bytes=(512 + 150) * MiB, unpark_s=0.3
)
PARK = PolicyConfig(park_idle=True, unpark_s=0.3)


def _one_bound(setup: SimSetup = SETUP) -> tuple[Simulation, _Worker]:
    sim = Simulation(setup, PARK, [(0.0, 0)])
    sim.now = 100.0
    w = _Worker("w0", "gpu0", "bound", sim.names[0], started_at=0.0, ready_at=0.0, idle_since=50.0)
    w.overhead, w.settled_at = 817 * MiB, 0.0
    sim.workers[w.id] = w
    return sim, w


def test_a_parked_worker_holds_and_is_charged_its_kv_and_graphs_less_and_an_unpark_gives_them_back():
    sim, w = _one_bound()
    whole = SETUP.kv_lora_bytes + 817 * MiB
    assert sim.held_bytes(w) == whole
    before = sim.snapshot().workers[0]
    sim.apply([Park("w0", sim.names[0], "gpu0", before.release_bytes)])
    parked = sim.snapshot().workers[0]
    assert parked.parked and sim.held_bytes(w) == whole - SETUP.park_release_bytes
    assert parked.mem_bytes == whole - SETUP.park_release_bytes + OVERHEAD_MARGIN_BYTES
    assert before.mem_bytes - parked.mem_bytes == before.release_bytes  # what the policy was told
    fn_bytes = sim.snapshot().functions[0].mem_bytes
    assert parked.release_bytes == fn_bytes - parked.mem_bytes  # back as an unsettled worker
    sim.apply([Unpark("w0", sim.names[0], "gpu0", parked.release_bytes)])
    # its KV at once, its graph pools by the time it serves (re-captured during the unpark)
    assert not w.parked and w.ready_at == pytest.approx(100.3)
    assert sim.held_bytes(w) == whole - SETUP.graph_bytes
    sim.now = 100.3
    assert sim.held_bytes(w) == whole
    with pytest.raises(RuntimeError, match="not parked"):
        sim.apply([Unpark("w0", sim.names[0], "gpu0", 0)])
    w.running = [101.0]
    with pytest.raises(RuntimeError, match="not an idle bound worker"):
        sim.apply([Park("w0", sim.names[0], "gpu0", 0)])


def test_a_run_with_parking_parks_unparks_and_stays_within_the_gpu():
    off = Simulation(SETUP, PolicyConfig(), ARRIVALS).run(drain_s=20.0)
    on = Simulation(SETUP, PARK, ARRIVALS).run(drain_s=20.0)
    assert off.parks == off.unparks == 0 and off.paths.get("unpark", 0) == 0
    assert on.parks > 0 and on.unparks > 0 and on.paths.get("unpark", 0) > 0
    for r in (off, on):
        assert r.unanswered == 0 and r.over_gpu_ticks == 0
        assert len(r.ttft_s) == len(ARRIVALS)
    row = on.row()
    assert row["parks"] == on.parks and row["unparked"] == on.paths["unpark"]
    assert 0 < row["held_gpu_s"] <= 60 + 1  # at most one GPU over the 60 s window


def test_setup_checks_its_parking_fields():
    with pytest.raises(ValueError, match="park_release_bytes"):
        dataclasses.replace(SETUP, park_release_bytes=SETUP.worker_bytes)
    with pytest.raises(ValueError, match="unpark_s"):
        dataclasses.replace(SETUP, unpark_s=-1.0)
