"""The policy simulation's start-up model (issue 16, third round): a fresh worker's start-up time depends on
the GPU's state (requests running there, other starts under way), as the H100 replays measured, and the
fixed model stays what it was."""

from __future__ import annotations

import dataclasses

import pytest

from lorafn.controller.policy import PolicyConfig
from lorafn.controller.policy.actions import Start
from lorafn.controller.policy.simulate import (
    BACKBONE,
    SHAPE,
    STARTUP_MODELS,
    GiB,
    SimSetup,
    Simulation,
    StartupModel,
    _Worker,
)

MODEL = StartupModel("test", base_s=0.3, per_running_s=0.05, per_start_s=0.2, fixed_s=1.0)
SETUP = SimSetup(8, startup=MODEL, settle_s=0.0, tick_s=0.05)


def test_the_model_is_linear_in_running_requests_and_other_starts():
    assert MODEL.pre_runner_s(0, 0) == pytest.approx(0.3)
    assert MODEL.pre_runner_s(10, 0) == pytest.approx(0.8)
    assert MODEL.pre_runner_s(0, 3) == pytest.approx(0.9)
    assert MODEL.pre_runner_s(10, 3) == pytest.approx(1.4)
    assert MODEL.start_s(10, 3) == pytest.approx(2.4)
    assert MODEL.pre_runner_s(-1, -2) == pytest.approx(0.3)  # nothing below the quiet GPU


@pytest.mark.parametrize(
    "field,value", [("base_s", 0.0), ("base_s", -1.0), ("per_running_s", -0.1), ("per_start_s", -0.1)]
)
def test_the_model_rejects_impossible_coefficients(field, value):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(MODEL, **{field: value})


def test_the_h100_fits_are_slower_with_the_drivers_default_connections_at_every_state():
    conn1, default = STARTUP_MODELS["h100-conn1"], STARTUP_MODELS["h100-default"]
    for running in (0, 3, 8, 15, 30):
        for others in (0, 2, 4, 8):
            assert default.pre_runner_s(running, others) > conn1.pre_runner_s(running, others)
            # both grow with the GPU's load
            assert conn1.pre_runner_s(running + 1, others) > conn1.pre_runner_s(running, others)
            assert conn1.pre_runner_s(running, others + 1) > conn1.pre_runner_s(running, others)
    # the quiet GPU: ~0.27 s (one connection) and ~2.3 s (default) measured with 0-2 requests running
    assert 0.15 <= conn1.pre_runner_s(1, 0) <= 0.45
    assert 1.5 <= default.pre_runner_s(1, 0) <= 3.0


def _sim(setup: SimSetup, running: int) -> Simulation:
    """A simulation at t=10 with one bound worker (function 7) serving ``running`` requests until t=1000."""
    sim = Simulation(setup, PolicyConfig(), [(0.0, 0)])
    sim.now = 10.0
    w = _Worker("busy", "gpu0", "bound", sim.names[7], started_at=0.0, ready_at=0.0)
    w.running = [1000.0] * running
    sim.workers[w.id] = w
    return sim


def _start(sim: Simulation, function: int) -> None:
    sim.apply([Start("gpu0", BACKBONE, SHAPE, sim.names[function], GiB, "test")])


def _until_up(sim: Simulation, limit_s: float = 60.0) -> None:
    """Tick the starts (only the clock: no rounds, no arrivals) until none is starting."""
    stop = sim.now + limit_s
    while any(w.state == "starting" for w in sim.workers.values()):
        assert sim.now < stop, "a start never finished"
        sim._progress()
        sim.now = round(sim.now + sim.setup.tick_s, 9)
        sim._finish_starts()


@pytest.mark.parametrize("running", [0, 4, 20])
def test_a_start_takes_its_stage_at_the_gpus_running_requests_then_the_fixed_part(running):
    sim = _sim(SETUP, running)
    _start(sim, 0)
    _until_up(sim)
    (started,) = [w for w in sim.workers.values() if w.fresh_for == sim.names[0]]
    expected = MODEL.pre_runner_s(running, 0)
    assert started.pre_s == pytest.approx(expected, abs=SETUP.tick_s + 1e-9)
    assert started.running_sum / started.pre_ticks == running
    # the whole start: pre_runner + fixed, to a tick or two (the stages end on ticks)
    assert sim.measured[-1] == pytest.approx(expected + MODEL.fixed_s, abs=2 * SETUP.tick_s + 1e-9)
    assert sim.start_records == [(running, 1, started.pre_s)]


def test_starts_under_way_on_one_gpu_slow_each_other():
    sim = _sim(SETUP, 0)
    for f in range(3):
        _start(sim, f)
    _until_up(sim)
    started = sorted((w for w in sim.workers.values() if w.fresh_for), key=lambda w: w.id)
    assert [w.starts_at_decision for w in started] == [1, 2, 3]
    for w in started:  # all three under way together for the whole stage: base + 2 others each
        assert w.pre_s == pytest.approx(MODEL.pre_runner_s(0, 2), abs=SETUP.tick_s + 1e-9)
    alone = _sim(SETUP, 0)
    _start(alone, 0)
    _until_up(alone)
    assert alone.measured[-1] < min(sim.measured)


def test_the_fixed_model_ignores_the_gpus_load():
    fixed = dataclasses.replace(SETUP, startup=None, fresh_start_s=2.0, start_parallelism=10.0)
    quiet, busy = _sim(fixed, 0), _sim(fixed, 20)
    for sim in (quiet, busy):
        _start(sim, 0)
        _until_up(sim)
    assert quiet.measured[-1] == busy.measured[-1] == pytest.approx(2.0, abs=fixed.tick_s + 1e-9)
    assert quiet.start_records == busy.start_records == []


def test_a_run_with_the_model_records_its_fresh_starts_and_the_pools_empty_time():
    # 16 functions called in turn every 0.2 s for 30 s: fresh starts and binds on one GPU
    arrivals = [(i * 0.2, i % 16) for i in range(150)]
    setup = dataclasses.replace(SETUP, num_functions=16, settle_s=5.0)
    result = Simulation(setup, PolicyConfig(), arrivals).run(drain_s=10.0)
    assert result.fresh_starts >= 1
    assert len(result.start_records) <= result.fresh_starts  # bound starts that came up in the window
    assert all(p >= MODEL.base_s - setup.tick_s for _, _, p in result.start_records)
    assert all(n >= 1 for _, n, _ in result.start_records)
    assert result.measured_ticks > 0
    assert 0.0 <= result.row()["pool_empty_pct"] <= 100.0
    again = Simulation(setup, PolicyConfig(), arrivals).run(drain_s=10.0)
    assert again.row() == result.row()  # deterministic
